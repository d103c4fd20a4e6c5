"""`actmem plan --explain CONFIG`: one configuration, as the plan prints it, in full."""

import re

import pandas as pd

from actmem.errors import SpecError
from actmem.memory.pipeline import split_text, stage_split
from actmem.model.recompute import RecomputePolicy
from actmem.memory.techniques import PLAN_BLOCK, PLAN_RECOMPUTE, sweep_name
from actmem.model.recompute import Recompute

#: What a config string may leave out, when the preset's run does not say either.
DEFAULT_RUN = {"tensor_parallel": 1, "context_parallel": 1, "pipeline_parallel": 1, "interleave": 1,
               "micro_batch": 1, "sequence_parallel": False, "recompute": "none", "distributed_optimizer": False,
               "expert_parallel": 1, "expert_tensor_parallel": None, "fsdp": False}
_KEYS = {"t": "tensor_parallel", "c": "context_parallel", "p": "pipeline_parallel", "m": "interleave",
         "b": "micro_batch", "ep": "expert_parallel", "etp": "expert_tensor_parallel"}
#: an uneven pipeline's split, which a preset's p brings along and a p of the text's own drops
_SPLIT = ("first_stage_layers", "last_stage_layers")
#: p as an uneven pipeline's layers, as config_label writes it: first + between x stages + last
#: ('7+8x14+7': p = 16), or with no stage between, first + last
_SPLIT_FORM = re.compile(r"(\d+)\+(\d+)x(\d+)\+(\d+)|(\d+)\+(\d+)")
_WORDS = {"sp": ("sequence_parallel", True), "nosp": ("sequence_parallel", False),
          "selective": ("recompute", "selective"),
          **{choice.word: ("recompute", name) for name, choice in PLAN_RECOMPUTE.items()},
          "dopt": ("distributed_optimizer", True), "nodopt": ("distributed_optimizer", False),
          "fsdp": ("fsdp", True), "nofsdp": ("fsdp", False)}


def parse_config(text: str, defaults: dict | None = None, layers: int | None = None) -> dict:
    """'t=8 p=8 m=3 b=1 sp sel dopt' (commas or spaces; 'fsdp' for FSDP2; sel+mlp and mlp for --recompute-modules
    core_attn mlp and mlp; block=N for --recompute-method block --recompute-num-layers N;
    'p=7+8x14+7' for an uneven pipeline, whose layers must add up to
    ``layers`` where given) -> run values (actmem.model.spec.Run's). What the text leaves out comes
    from ``defaults`` (the preset's run; its uneven split only where the text names no p; m = 1
    where the text gives a split), else t = p = m = b = 1, no SP, no recompute, no distributed
    optimizer. A setting given twice is an error."""
    given: dict = {}
    for token in text.replace(",", " ").split():
        key, _, value = token.partition("=")
        if key == "p" and _SPLIT_FORM.fullmatch(value) and value.isascii():
            settings = _split(value, layers, text)
        elif key in _KEYS and value.isdecimal() and value.isascii():
            settings = {_KEYS[key]: int(value)}
        elif key == "block" and value.isdecimal() and value.isascii():     # full recompute of N a chunk
            settings = {"recompute": f"full:block={int(value)}"}
        elif token in _WORDS:
            settings = dict([_WORDS[token]])
        else:
            raise SpecError(f"--explain: cannot read {token!r} in {text!r}; write it as the plan "
                            f"prints it, e.g. 't=8 p=8 m=3 b=1 sp sel' or 't=8 p=7+8x14+7 b=1 sp sel'")
        for setting, parsed in settings.items():
            if setting in given:
                raise SpecError(f"--explain: {setting} is given twice in {text!r}")
            given[setting] = parsed
    if not given:
        raise SpecError("--explain needs a configuration, e.g. 't=8 p=8 m=3 b=1 sp sel'")
    base = DEFAULT_RUN | {k: v for k, v in (defaults or {}).items() if k in DEFAULT_RUN}
    if "recompute" in (defaults or {}) and "recompute" not in given:   # the preset's, as a sweep's name
        preset = RecomputePolicy.of_run(base["recompute"], modules=defaults.get("recompute_modules"))
        base["recompute"] = sweep_name(preset)
        if base["recompute"] is None:
            raise SpecError(f"--explain: the preset's recompute modules ({', '.join(defaults['recompute_modules'])}) "
                            f"are not among the plan's choices; name one in {text!r}: none, sel, sel+mlp, mlp "
                            f"or full")
    if "pipeline_parallel" not in given:
        base |= {key: defaults[key] for key in _SPLIT if (defaults or {}).get(key) is not None}
    if _SPLIT[0] in given:
        base["interleave"] = 1                       # an uneven pipeline is not interleaved
    run = base | given
    return run | RecomputePolicy.parse(run["recompute"]).run_values


def _name_the_split(run, layers: int) -> None:
    """A p that does not divide the layers, with no split given: say the one the plan sweeps."""
    p = run.pipeline_parallel
    split = stage_split(layers, p)
    if run.first_stage_layers is None and run.last_stage_layers is None and layers % p and split:
        raise SpecError(f"--explain: p ({p}) does not divide the {layers} layers; the plan splits them "
                        f"as p={split_text(*split, p)} (first + between x stages + last): write that")


def _block_layers(run, per_chunk: int) -> int:
    """The plan's recompute_layers: N of the block method where some chunk keeps layers whole
    (a PLAN_BLOCK row), else 0 (N as large as every chunk is plain full recompute)."""
    if run.recompute_method == "block" and run.recompute_layers < per_chunk:
        return run.recompute_layers
    return 0


def _split(value: str, layers: int | None, text: str) -> dict:
    """'7+8x14+7' -> p = 16, first 7, last 7; the stages between must hold what they say."""
    groups = _SPLIT_FORM.fullmatch(value).groups()
    if groups[0] is not None:
        first, between, stages, last = map(int, groups[:4])
    else:
        (first, last), between, stages = map(int, groups[4:]), 0, 0
    if groups[0] is not None and stages == 0:
        raise SpecError(f"--explain: {value!r} in {text!r} has no stage between the first and last; "
                        f"write it {first}+{last}")
    total = first + between * stages + last
    if layers is not None and total != layers:
        raise SpecError(f"--explain: the pipeline p={value} holds {total} layers, the model {layers}")
    return {"pipeline_parallel": stages + 2, "first_stage_layers": first, "last_stage_layers": last}


#: the parts of the modelled iteration, (column, what it is), in the order --explain shows them
TIME_PARTS = (("compute_s", "compute (hardware FLOPs)"), ("tensor_parallel_s", "tensor-parallel communication"),
              ("context_parallel_s", "context-parallel ring (k, v and their gradients)"),
              ("expert_parallel_s", "the MoE token dispatcher (dispatch and combine)"),
              ("pipeline_p2p_s", "pipeline point-to-point communication"), ("bubble_s", "pipeline bubble"),
              ("data_parallel_s", "data-parallel communication (what overlap leaves)"), ("iteration_s", "iteration"))


def time_parts(row) -> dict:
    """{column: seconds} of TIME_PARTS for a plan row, the bubble as the seconds it adds."""
    before = sum(getattr(row, column) for column, _ in TIME_PARTS[:5])
    return {column: before * (row.bubble - 1) if column == "bubble_s" else getattr(row, column)
            for column, _ in TIME_PARTS}


def ranking(req, row) -> dict:
    """Where an explained configuration stands in the plan's sweep: its rank among those that fit
    (None where it is not among them: it does not fit, or the plan does not sweep it), how many fit,
    whether it fits, and the first pick (a plan row), so --explain can set them side by side part by
    part; None where the sweep itself is refused."""
    from actmem.planner.plan import config_label, plan

    try:
        fitting = plan(req).fitting
    except SpecError:               # the sweep refused (too many rows, no d divides the batch): no standing
        return None
    labels = [config_label(other) for other in fitting.itertuples()]
    label = config_label(row)
    rank = labels.index(label) + 1 if label in labels else None
    return {"rank": rank, "fitting": len(fitting), "first": fitting.iloc[0] if len(fitting) else None,
            "first_label": labels[0] if labels else None, "fits": bool(row.fits)}


def explain(req, config: str, name: str = "custom", defaults: dict | None = None):
    """One configuration in full: the exact estimate (against the budget, the GPU less the
    reserve) and its time breakdown."""
    from actmem.memory.estimate import estimate
    from actmem.planner.plan import config_label, evaluate
    from actmem.model.spec import Run, Spec
    from actmem.memory.stages import stage_layers

    run = parse_config(config, defaults, req.model.layers)
    taken = _taken_from_the_preset(config, run, req.model.layers)
    run = Run(**run | {"recompute": Recompute(run["recompute"]), "gpus": req.gpus, "global_batch": req.global_batch})
    if run.tensor_parallel > req.gpus_per_node:
        raise SpecError(f"--explain: t ({run.tensor_parallel}) is above --gpus-per-node "
                        f"({req.gpus_per_node}), which the plan keeps tensor parallelism within")
    if run.micro_batch > req.max_micro_batch:
        raise SpecError(f"--explain: b ({run.micro_batch}) is above --max-micro-batch ({req.max_micro_batch})")
    _name_the_split(run, req.model.layers)
    probe = Spec(req.model, run, vocab_divisible_by=req.vocab_divisible_by, gpu_name=req.gpu.name,
                 gpu_fp8=req.gpu.fp8, architecture=req.architecture)          # checks the rules, gives d and n
    layers = stage_layers(probe)
    between = layers[1] if len(layers) >= 3 else layers[0]      # with no stage between, the first's
    block = _block_layers(run, max(layers) // run.interleave)      # the largest chunk: N short of it
    row = pd.DataFrame([{"t": run.tensor_parallel, "c": run.context_parallel, "p": run.pipeline_parallel,
                         "first_stage_layers": layers[0], "stage_layers": between,
                         "last_stage_layers": layers[-1],
                         "d": probe.data_parallel, "ep": run.expert_parallel, "etp": run.etp,
                         "b": run.micro_batch, "n": probe.microbatches, "m": run.interleave,
                         "sequence_parallel": run.sequence_parallel,
                         "recompute": PLAN_BLOCK if block else sweep_name(run.policy),
                         "recompute_layers": block,
                         "distributed_optimizer": run.distributed_optimizer, "fsdp": run.fsdp}])
    evaluated = evaluate(req, row).iloc[0]
    spec = Spec(req.model, run, name=f"{name} · {config_label(evaluated)}",
                gpu_memory_bytes=req.gpu_memory_bytes, gpu_name=req.gpu.name, gpu_fp8=req.gpu.fp8,
                reserve_bytes=req.reserve_bytes,
                gradient_bytes=req.gradient_bytes, optimizer=req.optimizer,
                vocab_divisible_by=req.vocab_divisible_by,
                architecture=req.architecture, notes=taken)
    return estimate(spec), evaluated


def _taken_from_the_preset(config: str, run: dict, layers: int) -> tuple:
    """A note naming, in --explain's own words, what the explained run took from the preset's run because the
    text left it out (a plan's label writes no 'nodopt': under a preset with the distributed optimizer it
    explains the dopt twin)."""
    bare = parse_config(config, None, layers)
    taken = [f"{word}={run[key]}" for word, key in _KEYS.items()
             if key != "pipeline_parallel" and run.get(key) != bare.get(key)]
    if any(run.get(key) != bare.get(key) for key in ("pipeline_parallel",) + _SPLIT):
        p, first, last = run["pipeline_parallel"], run.get(_SPLIT[0]), run.get(_SPLIT[1])
        if first is None and last is None:
            taken.append(f"p={p}")
        else:                                   # the split as --explain reads it back
            first, last = first or (layers - last) // (p - 1), last or (layers - first) // (p - 1)
            taken.append(f"p={split_text(first, (layers - first - last) // max(p - 2, 1), last, p)}")
    if run["sequence_parallel"] != bare["sequence_parallel"]:
        taken.append("sp" if run["sequence_parallel"] else "nosp")
    policy, bare_policy = (_policy(values) for values in (run, bare))
    if policy != bare_policy:
        taken.append(policy.word)
    dopt = run["distributed_optimizer"] != bare["distributed_optimizer"]
    if dopt:
        taken.append("dopt" if run["distributed_optimizer"] else "nodopt")
    if not taken:
        return ()
    return (f"--explain took from the preset's run what {config!r} leaves out: {', '.join(taken)} (name a setting "
            f"to change it" + ("; nodopt for a run without the distributed optimizer, which a plan's label leaves "
                               "unsaid" if dopt else "") + ")",)


def _policy(run: dict) -> RecomputePolicy:
    """The recompute policy of parsed run values."""
    return RecomputePolicy.of_run(Recompute(run["recompute"]), run.get("recompute_method"), run.get("recompute_layers"),
                                  run.get("recompute_modules"), run.get("selective_ac_option"))
