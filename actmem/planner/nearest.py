"""When nothing fits: why the shape of the cluster allows so little, and which GPU counts
near the one asked for do fit."""

from dataclasses import dataclass, replace

from actmem.errors import SpecError


@dataclass(frozen=True)
class NothingFits:
    usable_t: list
    usable_p: list
    """The sizes the GPU count allows at all (t·c·p must divide it, d = gpus/(t·c·p) the batch)."""
    all_p: list
    """The pipeline sizes the model allows: those that split its layers (plan.pipeline_sizes)."""
    nearest: list
    """(gpus, label of the fastest configuration that fits there): the nearest count below
    and the nearest above that fit, where the search found them, nearest first."""


def nothing_fits(plan, searched: int = 24) -> NothingFits:
    """Explain an empty plan: the parallel sizes this GPU count allows, and the nearest GPU
    counts (below and above) where a configuration fits, trying at most ``searched``."""
    from actmem.planner.plan import candidates, config_label, pipeline_sizes, plan as run_plan

    req = plan.request
    frame = candidates(req)
    found: dict = {}                      # "below" / "above" -> (gpus, label), nearest first
    for gpus in _nearby_counts(req)[:searched]:
        side = "below" if gpus < req.gpus else "above"
        if side in found:
            continue
        try:
            other = run_plan(replace(req, gpus=gpus))
        except SpecError:
            continue
        if not other.fitting.empty:
            found[side] = (gpus, config_label(other.fitting.iloc[0]))
            if len(found) == 2:
                break
    nearest = sorted(found.values(), key=lambda item: abs(item[0] - req.gpus))
    return NothingFits(sorted(set(frame.t)), sorted(set(frame.p)), pipeline_sizes(req), nearest)


def _nearby_counts(req) -> list[int]:
    """GPU counts t·p·d the model and batch allow where the parameters alone could fit,
    nearest to the request first."""
    from actmem.planner.plan import LIMITS, divisors, pipeline_sizes, tensor_parallel_sizes

    counts: dict = {}
    sizes = pipeline_sizes(req)
    for t in tensor_parallel_sizes(req):
        for p in sizes:
            for d in divisors(req.global_batch):
                if t * p * d <= LIMITS["gpus"] and _parameters_could_fit(req, t, p, d):
                    counts[t * p * d] = True
    return sorted((n for n in counts if n != req.gpus), key=lambda n: (abs(n - req.gpus), n))


def _parameters_could_fit(req, t: int, p: int, d: int) -> bool:
    """A lower bound: the weights, gradients and (sharded, where d > 1) optimizer state of
    the first stage, and of stage 1 (in an uneven split it has the most layers,
    pipeline.stage_split), alone fit; or, where the implementation runs FSDP2 and d > 1, its fp32
    shards and AdamW's state, 12 B a parameter over d, which every moment holds (actmem.memory.fsdp)."""
    from actmem.memory.parameters import parameter_bytes, stage_parameters
    from actmem.memory.pipeline import stage_split
    from actmem.model.spec import padded_vocab

    model = req.model
    first, between, _ = stage_split(model.layers, p)
    vocab = padded_vocab(model.vocab, t, req.vocab_divisible_by)
    count = max(stage_parameters(model.hidden, model.layers, p, t, vocab, model.seq_len, req.architecture,
                                 model.heads, stage_layers=layers, stage=stage)
                for stage, layers in ((0, first), (min(1, p - 1), between)))
    if "fsdp" in req.architecture.code.runs:          # every row FSDP2's (plan._switches)
        return d > 1 and 12 * count // d <= req.budget_bytes
    return parameter_bytes(count, d, d > 1).total_bytes <= req.budget_bytes
