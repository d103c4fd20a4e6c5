"""A Megatron-LM launch script's arguments, pasted whole (`--megatron-args "$(cat args.txt)"`
or `--megatron-args @args.txt`), sorted into what actmem uses, what cannot change memory,
and what it refuses.

- Used: every argument actmem has a flag for (its Megatron spelling), parsed by the same
  click options as the flags themselves, so a pasted value that disagrees with a flag given
  beside it is an error like any two spellings that disagree.
- Ignored: arguments that cannot change memory (learning rate, paths, logging, ...), listed
  in the estimate's assumptions.
- Refused, all in one message: arguments that change memory and are not modelled yet, and
  arguments actmem does not know. Nothing is dropped without a word.
"""

import shlex

from actmem.errors import SpecError

#: The Megatron spellings actmem reads; inside a paste its own spellings (--tp, --hidden,
#: --gpu-memory) are not Megatron's and are refused as unknown.
MEGATRON_NAMES = frozenset({
    "--num-attention-heads", "--hidden-size", "--num-layers", "--vocab-size", "--seq-length",
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
    "--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage",
    "--micro-batch-size", "--global-batch-size", "--sequence-parallel", "--use-distributed-optimizer",
    "--recompute-granularity", "--recompute-activations", "--make-vocab-size-divisible-by",
    "--attention-dropout", "--hidden-dropout", "--ffn-hidden-size", "--swiglu", "--normalization",
    "--disable-bias-linear", "--add-bias-linear", "--untie-embeddings-and-output-weights",
    "--num-query-groups", "--kv-channels", "--use-flash-attn", "--add-qkv-bias",
    "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers", "--recompute-method",
    "--recompute-num-layers", "--context-parallel-size", "--position-embedding-type",
    "--use-rotary-position-embeddings", "--no-rope-fusion", "--qk-layernorm",
    "--no-create-attention-mask-in-dataloader",
})
MANY = "many"
#: Megatron's switch off its fused softmax: nothing under TE's kernels, torch's softmax under
#: the local core (refused there)
NO_SOFTMAX_FUSION = "--no-masked-softmax-fusion"
#: Megatron arguments that cannot change the memory of a training step, and how many values
#: each takes (1, 0, or MANY: up to the next argument). Numerics of the optimizer, the
#: schedule, data, checkpoints, logging. (--rotary-percent changes no byte of TE's fused rope;
#: beside --no-rope-fusion it is refused in _problems.)
IGNORED = {
    **dict.fromkeys(("--lr", "--min-lr", "--lr-decay-style", "--lr-warmup-iters", "--lr-warmup-fraction",
                     "--lr-decay-iters", "--lr-decay-samples", "--lr-warmup-samples", "--train-iters",
                     "--train-samples", "--weight-decay", "--clip-grad", "--adam-beta1", "--adam-beta2",
                     "--adam-eps", "--init-method-std", "--seed", "--save", "--load",
                     "--vocab-file", "--merge-file", "--tokenizer-type", "--tokenizer-model",
                     "--log-interval", "--save-interval", "--eval-interval", "--eval-iters",
                     "--tensorboard-dir", "--tensorboard-log-interval", "--wandb-project",
                     "--wandb-exp-name", "--split", "--distributed-backend",
                     "--distributed-timeout-minutes", "--data-cache-path", "--num-workers",
                     "--exit-interval", "--exit-duration-in-mins", "--norm-epsilon", "--rotary-base",
                     "--rotary-percent", "--rotary-seq-len-interpolation-factor", "--rope-scaling-factor"), 1),
    **dict.fromkeys(("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"), MANY),
    **dict.fromkeys(("--use-mcore-models", "--no-load-optim", "--no-load-rng", "--log-throughput",
                     "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard",
                     "--no-async-tensor-model-parallel-allreduce", "--use-checkpoint-args",
                     "--no-save-optim", "--no-save-rng", "--use-rope-scaling"), 0),
    # softmax switches: TE's attention kernels take their softmax inside and keep no copy of it
    # (TE's TransformerLayer marks attention_softmax_in_fp32 unused); the local core's fused
    # kernel runs in 16 bits whatever softmax_in_fp32 says (fused_softmax.py,
    # forward_fused_softmax). Turning the fusion off under the local core is refused in _problems.
    **dict.fromkeys(("--attention-softmax-in-fp32", NO_SOFTMAX_FUSION), 0),
}
#: 16-bit training, which actmem assumes: used as a check, never ignored
PRECISION = ("--bf16", "--fp16")
#: Megatron reads --num-query-groups only with this switch; alone it means g = 1
GQA_SWITCH = "--group-query-attention"
#: the learned position embedding's size; actmem sizes it at s and needs them equal
MAX_POSITIONS = "--max-position-embeddings"
#: what decides the attention core (Megatron's defaults: auto, transformer_engine)
ATTENTION = ("--attention-backend", "--transformer-impl")
#: --attention-backend -> actmem's core: fused is TE's cuDNN kernel, flash the flash-attn
#: package (a copy of its output at b > 1), auto what TE picks on Hopper and newer: cuDNN
#: (dot_product_attention/utils.py prefers FusedAttention there; on Ampere it picks
#: flash-attn: give --attention-backend flash)
BACKEND_CORES = {"local": "eager", "flash": "flash-attn", "fused": "flash", "auto": "flash"}
#: how context parallelism communicates; actmem models Megatron's default, the p2p ring
CP_COMM = "--cp-comm-type"
#: Megatron's switch for no learned position table (with rope, or with no positions at all)
NO_POSITION_TABLE = "--no-position-embedding"
#: Megatron's dataloader makes a causal attention mask unless told not to (arguments.py:
#: create_attention_mask_in_dataloader, store_false)
NO_MASK = "--no-create-attention-mask-in-dataloader"
#: what selective recompute recomputes (TransformerConfig.recompute_modules, read only under
#: --recompute-granularity selective): up to the next argument, handed on as actmem's flag
RECOMPUTE_MODULES = "--recompute-modules"


def split(text: str) -> list[str]:
    """Shell words of the pasted text, or of the file named after '@'; backslash line ends
    and '#' comments as a shell reads them."""
    if text.startswith("@"):
        try:
            with open(text[1:], encoding="utf-8") as file:
                text = file.read()
        except OSError as error:
            raise SpecError(f"--megatron-args {text}: cannot read it ({error.strerror})")
        except UnicodeDecodeError:
            raise SpecError(f"--megatron-args {text}: not UTF-8 text")
    try:
        return shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as error:
        raise SpecError(f"--megatron-args: not shell words ({error})")


def _values(words: list[str], i: int, count) -> tuple[list[str], int]:
    """The values after argument i: one, none, or all up to the next argument."""
    if count == MANY:
        j = i + 1
        while j < len(words) and not words[j].startswith("--"):
            j += 1
        return words[i + 1:j], j
    return words[i + 1:i + 1 + count], i + 1 + count


def sort(words: list[str], takes_value: dict, not_modelled) -> tuple[list[str], list[str], dict]:
    """(words actmem parses, ignored argument names, {'--seq-length': ...} checks to make).
    takes_value: each Megatron argument actmem reads -> whether it takes a value."""
    used, ignored, unknown, refused, missing, settings = [], [], [], [], [], {}
    words = [part for word in words for part in (word.split("=", 1) if word.startswith("--") else [word])]
    i = 0
    while i < len(words):
        name = words[i]
        count = _value_count(name, takes_value)
        values, after = _values(words, i, count)
        if not name.startswith("--"):
            unknown.append(name)
            after = i + 1
        elif count and (not values or any(v.startswith("--") for v in values[:1])):
            missing.append(name)
            after = i + 1
        elif name in takes_value:
            used += [name, *values]
        elif name in IGNORED:
            ignored.append(name)
        elif name == RECOMPUTE_MODULES:
            settings[name] = tuple(values)
        elif name in (*PRECISION, GQA_SWITCH, MAX_POSITIONS, NO_POSITION_TABLE, CP_COMM, *ATTENTION):
            settings.setdefault(name, values[0] if values else True)
        else:
            (refused if name in not_modelled else unknown).append(name)
            after = i + 1 if i + 1 >= len(words) or words[i + 1].startswith("--") else i + 2
        i = after
    used += _implied(words, settings)
    problems = _problems(words, settings, refused, unknown, missing)
    if problems:
        raise SpecError(f"--megatron-args: {'; '.join(problems)}")
    return used, ignored, settings


def _value_count(name: str, takes_value: dict):
    """How many values follow a known argument: 1, 0 or MANY (0 for one actmem does not know)."""
    if name in takes_value:
        return int(takes_value[name])
    if name in IGNORED:
        return IGNORED[name]
    if name == RECOMPUTE_MODULES:
        return MANY
    return 1 if name in (MAX_POSITIONS, CP_COMM, *ATTENTION) else 0


def _implied(words, settings) -> list[str]:
    """What Megatron makes of the settings: --group-query-attention alone means g = 1; the
    attention backend and implementation choose the core; the dataloader makes an attention
    mask unless told not to."""
    implied = []
    if GQA_SWITCH in settings and "--num-query-groups" not in words:
        implied += ["--num-query-groups", "1"]
    core = attention_core(settings)
    legacy_switch = "--use-flash-attn" in words and "--attention-backend" not in settings
    if core is not None and not legacy_switch:      # --use-flash-attn alone: Megatron's flash backend
        implied += ["--attention-core", core]
    if settings.get(RECOMPUTE_MODULES):
        implied += [RECOMPUTE_MODULES, ",".join(settings[RECOMPUTE_MODULES])]
    if NO_MASK not in words:                         # Megatron's dataloader makes one by default
        implied += ["--attention-mask"]
    return implied


def _value_after(words, name):
    return next((words[i + 1] for i, word in enumerate(words[:-1]) if word == name), None)


def attention_core(settings) -> str | None:
    """'eager' or 'flash' from --transformer-impl and --attention-backend (None for a
    combination actmem does not model; _problems names it)."""
    impl = settings.get("--transformer-impl", "transformer_engine")
    backend = settings.get("--attention-backend", "auto")
    if impl == "local":
        return "eager" if backend in ("local", "auto") else None
    return BACKEND_CORES.get(backend) if impl == "transformer_engine" else None


def _recompute_modules(settings) -> list[str]:
    """Megatron takes the modules as words of their own (nargs='*'): 'core_attn,mlp' would be
    one unknown module to it."""
    joined = [module for module in settings.get(RECOMPUTE_MODULES) or () if "," in module]
    if joined:
        return [f"{RECOMPUTE_MODULES} {' '.join(joined)}: Megatron takes the modules as separate words "
                f"({RECOMPUTE_MODULES} {' '.join(m for word in joined for m in word.split(',') if m)})"]
    return []


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def _problems(words, settings, refused, unknown, missing) -> list[str]:
    problems = []
    if refused:
        problems.append(f"changes memory and is not modelled yet: {', '.join(refused)}")
    if unknown:
        problems.append(f"unknown to actmem: {', '.join(unknown)}")
    if missing:
        problems.append(f"expects a value: {', '.join(missing)}")
    if "--num-query-groups" in words and GQA_SWITCH not in settings:
        problems.append("Megatron ignores --num-query-groups without --group-query-attention")
    precision = [name for name in PRECISION if name in settings]
    if len(precision) != 1:
        problems.append("give one of --bf16 or --fp16: actmem counts 16-bit activations" if precision else
                        "neither --bf16 nor --fp16: Megatron would train in fp32, and actmem counts "
                        "16-bit activations")
    rope = "--use-rotary-position-embeddings" in words or _value_after(words, "--position-embedding-type") == "rope"
    if NO_POSITION_TABLE in settings and not rope:
        problems.append("Megatron refuses --no-position-embedding unless the positions are rotary "
                        "(--position-embedding-type rope); for none, give --position-embedding-type none")
    problems += _recompute_modules(settings)
    percent = _value_after(words, "--rotary-percent")
    if "--no-rope-fusion" in words and percent is not None and _number(percent) != 1:
        problems.append(f"--rotary-percent {percent} with --no-rope-fusion is not modelled: the unfused rope's cos "
                        "and sin are as wide as the rotated part of each head, and actmem counts whole heads")
    if settings.get(CP_COMM, "p2p") != "p2p":
        problems.append(f"{CP_COMM} {settings[CP_COMM]} is not modelled: actmem counts the p2p ring, Megatron's "
                        "default")
    if NO_SOFTMAX_FUSION in words and attention_core(settings) == "eager":
        problems.append(f"{NO_SOFTMAX_FUSION} under Megatron's local attention core runs torch's softmax, which "
                        "keeps other tensors than the fused kernel actmem counts: not modelled")
    if "--use-flash-attn" in words and settings.get("--transformer-impl") == "local":
        problems.append("--use-flash-attn with --transformer-impl local is not modelled: the local spec's core is "
                        "Megatron's own DotProductAttention, and actmem reads --use-flash-attn as TE's flash-attn")
    elif attention_core(settings) is None:
        problems.append(f"--transformer-impl {settings.get('--transformer-impl', 'transformer_engine')} with "
                        f"--attention-backend {settings.get('--attention-backend', 'auto')} is not modelled: "
                        "actmem models local (eager), flash, fused and auto (TE's flash or cuDNN kernels) "
                        "under transformer_engine, and local under the local implementation")
    return problems
