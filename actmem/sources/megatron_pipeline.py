"""Megatron's other ways of laying the layers over the pipeline, read as actmem's uneven
pipeline (Megatron's --decoder-first/last-pipeline-num-layers) where they come to one, and
refused, with what they would change, where they do not.

- --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split count
  the embedding and the loss as a layer each: N = L + e + l layers over p stages, and the
  first stage builds N/p - e transformer layers, the last N/p - l
  (megatron/core/transformer/transformer_block.py, get_num_layers_to_build).
- --pipeline-model-parallel-layout spells each stage out ("Et*3|(tt|)*29,m|L"): stage i is
  rank i mod p's virtual stage i div p, and builds its 't' layers
  (megatron/core/transformer/pipeline_parallel_layer_layout.py).
- --microbatch-group-size-per-virtual-pipeline-stage g: the interleaved schedule's first
  stage runs 2(p-1) + (m-1)g warm-up forwards (schedules.py, get_pp_rank_microbatches);
  actmem models Megatron's default g = p.
- --defer-embedding-wgrad-compute keeps every microbatch's output-layer input and logits
  gradient on the last stage until the step's end (tensor_parallel/layers.py): not modelled.
"""

import re

from actmem.errors import SpecError

ACCOUNT = ("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split")
LAYOUT = "--pipeline-model-parallel-layout"
GROUP = "--microbatch-group-size-per-virtual-pipeline-stage"
DEFER = "--defer-embedding-wgrad-compute"
NAMES = (*ACCOUNT, LAYOUT, GROUP, DEFER)
FIRST, LAST = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
_CHUNKS = ("--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage")


def read(words: list[str], settings: dict) -> tuple[list[str], list[str], list[str]]:
    """(words for actmem's parser, notes, problems) of the pipeline arguments in ``settings``."""
    implied, notes, problems = [], [], []
    given = [name for name in NAMES if name in settings]
    if not given:
        return implied, notes, problems
    try:
        if DEFER in settings:
            problems.append(f"{DEFER} is not modelled: the last stage keeps every microbatch's output-layer input "
                            "and its logits' 16-bit gradient until the step's end (tensor_parallel/layers.py: "
                            "embedding_activation_buffer, grad_output_buffer), about n·(s/c)·b·(h/t + v/t)·2 B")
        if any(name in settings for name in ACCOUNT) or LAYOUT in settings:
            first, last, chunks, note = _split(words, settings)
            implied += [FIRST, str(first)] if first is not None else []
            implied += [LAST, str(last)] if last is not None else []
            implied += [_CHUNKS[0], str(chunks)] if chunks > 1 else []
            notes.append(note)
        if GROUP in settings:
            notes += _group(words, settings[GROUP])
    except SpecError as error:
        problems.append(str(error))
    return implied, notes, problems


def _int_after(words: list[str], name: str, default=None):
    value = next((words[i + 1] for i in range(len(words) - 1) if words[i] == name), None)
    if value is None:
        return default
    if not value.isdigit():
        raise SpecError(f"{name} {value} is not a count")
    return int(value)


def _interleave(words: list[str], layers: int | None, p: int) -> int:
    m = _int_after(words, _CHUNKS[0])
    per_chunk = _int_after(words, _CHUNKS[1])
    if per_chunk and layers is not None:
        return layers // p // per_chunk
    return m or 1


def _split(words: list[str], settings: dict) -> tuple:
    """(first, last, virtual stages a rank, note): the first and last stages' layers an uneven
    pipeline gives (None where a stage has the even share)."""
    layers, p = _int_after(words, "--num-layers"), _int_after(words, "--pipeline-model-parallel-size", 1)
    named = [name for name in (*ACCOUNT, LAYOUT) if name in settings]
    clash = [name for name in (FIRST, LAST) if name in words]
    if clash:
        raise SpecError(f"Megatron refuses {' and '.join(named)} beside {' and '.join(clash)} (transformer_config.py: "
                        "they cannot be set at the same time)")
    if LAYOUT in settings and len(named) > 1:
        raise SpecError(f"Megatron refuses {LAYOUT} beside the other layout arguments (transformer_config.py)")
    if layers is None:
        raise SpecError(f"{' and '.join(named)} need --num-layers in the arguments")
    if LAYOUT in settings:
        if any(name in words for name in _CHUNKS):
            raise SpecError(f"Megatron refuses {LAYOUT} beside {' or '.join(_CHUNKS)} (arguments.py: no more than one)")
        counts, chunks = layout_counts(settings[LAYOUT], layers, p, _int_after(words, "--mtp-num-layers", 0))
        if chunks > 1:
            if len(set(stage_counts(settings[LAYOUT]))) > 1:
                raise SpecError(f"{LAYOUT} with {chunks} virtual stages a rank of different layers is not modelled: "
                                "actmem models an interleaved pipeline with every chunk alike")
            return None, None, chunks, (f"{LAYOUT} read: {chunks} virtual stages a rank of "
                                        f"{layers // (p * chunks)} layers each (interleaved)")
        note = f"{LAYOUT} read: {'+'.join(map(str, counts))} layers over the {p} stages"
    else:
        embedding, loss = (int(name in settings) for name in ACCOUNT)
        if _interleave(words, layers, p) > 1 and p > 1:
            raise SpecError(f"{' and '.join(named)} with interleaving is not modelled: the first (last) virtual stage "
                            "builds one layer fewer than the other chunks (transformer_block.py)")
        counts = account_counts(layers, p, embedding, loss)
        note = (f"{' and '.join(named)} read: {layers} + {embedding + loss} = {layers + embedding + loss} layers over "
                f"{p} stages, the first building {counts[0]} transformer layers and the last {counts[-1]} "
                "(transformer_block.py, get_num_layers_to_build)")
    return _first_and_last(counts) + (1, note)


def account_counts(layers: int, p: int, embedding: int, loss: int) -> list[int]:
    """Transformer layers each stage builds with the embedding and/or the loss counted as a layer."""
    n = layers + embedding + loss
    if n % p:
        raise SpecError(f"Megatron refuses it: num_layers {n} after the account-for-*-in-pipeline-split arguments "
                        f"must be divisible by pipeline_model_parallel_size {p} (transformer_config.py)")
    counts = [n // p] * p
    counts[0] -= embedding
    counts[-1] -= loss
    return counts


def layout_counts(text, layers: int, p: int, mtp: int = 0) -> tuple[list[int], int]:
    """(transformer layers of each pipeline rank, virtual stages a rank) of a layout string, with
    the checks Megatron makes (pipeline_parallel_layer_layout.py: parse_str_to_list,
    validate_layer_layout); its 'm' (multi-token prediction) layers must be --mtp-num-layers (``mtp``)
    and, as actmem models them, on the last stage (Megatron's placement without a layout)."""
    text = text[0] if isinstance(text, tuple) else text
    spelled = _spelled_out(text)
    stages = spelled.split("|")
    wrong = sorted(set(spelled) - set("ELtm|"))
    if wrong:
        raise SpecError(f"{LAYOUT} {text}: Megatron reads only E, L, t and m in it (not {', '.join(wrong)})")
    if spelled.count("m") != mtp:
        raise SpecError(f"{LAYOUT} {text}: its {spelled.count('m')} 'm' (multi-token prediction) layers must be "
                        f"--mtp-num-layers ({mtp}) (Megatron asserts: pipeline_parallel_layer_layout.py)")
    if "m" in spelled and "m" in "".join(stages[:-1]):
        raise SpecError(f"{LAYOUT} {text}: multi-token prediction layers on a stage before the last are not modelled "
                        "(actmem places them on the last stage, as Megatron does without a layout)")
    if len(stages) % p:
        raise SpecError(f"{LAYOUT} {text}: Megatron requires its {len(stages)} stages to be a multiple of the "
                        f"pipeline size {p}")
    if spelled.count("E") != 1 or not stages[0].startswith("E") or spelled.count("L") != 1 \
            or not stages[-1].endswith("L"):
        raise SpecError(f"{LAYOUT} {text}: Megatron requires one E, first, and one L, last")
    if spelled.count("t") != layers:
        raise SpecError(f"{LAYOUT} {text}: it has {spelled.count('t')} layers (t), and --num-layers is {layers}")
    chunks = len(stages) // p
    return [sum(stages[v * p + r].count("t") for v in range(chunks)) for r in range(p)], chunks


def _spelled_out(text) -> str:
    """'Et*3|(tt|)*2,L' -> 'Ettt|tt|tt|L': commas dropped, (group)*k and x*k repeated."""
    text = text[0] if isinstance(text, tuple) else text
    spelled = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), str(text).replace(",", ""))
    return re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), spelled)


def stage_counts(text) -> list[int]:
    """Transformer layers of each stage of a layout, in its order."""
    return [stage.count("t") for stage in _spelled_out(text).split("|")]


def _first_and_last(counts: list[int]) -> tuple:
    """(first, last) for actmem's uneven pipeline: the stages between must share alike."""
    if min(counts) == 0:
        raise SpecError(f"a pipeline stage with no transformer layer ({'+'.join(map(str, counts))}) is not modelled")
    if len(counts) <= 2:                 # two stages: name the first, and the last takes the rest
        return (None, None) if len(set(counts)) == 1 else (counts[0], None)
    between = set(counts[1:-1])
    if len(between) > 1:
        raise SpecError(f"stages between the first and last with different layers ({'+'.join(map(str, counts))}) "
                        "are not modelled: actmem's uneven pipeline shares them alike")
    share = between.pop()
    return (None if counts[0] == share else counts[0]), (None if counts[-1] == share else counts[-1])


def _group(words: list[str], value) -> list[str]:
    """g = p is Megatron's default and what actmem models; without interleaving g is unused."""
    value = value[0] if isinstance(value, tuple) else value
    if not str(value).isdigit():
        raise SpecError(f"{GROUP} {value} is not a count")
    g, layers = int(value), _int_after(words, "--num-layers")
    p = _int_after(words, "--pipeline-model-parallel-size", 1)
    m = _interleave(words, layers, p)
    if m == 1:
        return [f"{GROUP} {g}: only the interleaved schedule reads it, and this run is not interleaved"]
    if g != p:
        raise SpecError(f"{GROUP} {g} is not modelled: the first stage then runs 2(p-1) + (m-1)·g = "
                        f"{2 * (p - 1) + (m - 1) * g} warm-up chunk forwards, not Megatron's default 2(p-1) + "
                        f"(m-1)·p = {2 * (p - 1) + (m - 1) * p} (schedules.py), and keeps g - p + 1 receive buffers "
                        "under overlapped p2p; actmem models g = p")
    return [f"{GROUP} {g}: Megatron's default (g = p), the schedule actmem models"]
