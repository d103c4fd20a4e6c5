"""How much each pipeline stage holds at its peak (section 4.4).

The first stage runs L/p layers and, to keep the pipeline busy, holds the
activations of several microbatches at once; it also hosts the input embedding.
Stage i starts its backwards 2i chunk forwards sooner (i under 1F1B), so it holds
fewer; the last stage hosts the output layer.
"""

from dataclasses import dataclass


def chunks_in_flight(p, m, interleaved: bool, stage=0):
    """Model chunks of L/(p·m) layers each held by a stage with the pipeline full.

    1F1B (PipeDream-Flush): rank i warms up with p - i - 1 forwards and runs one more
    before its first backward: p - i microbatches; on the first stage p·(L/p) = L layers
    whatever p is (Eq 5). Megatron's interleaved schedule (schedules.py,
    num_warmup_microbatches): rank i warms up with 2(p - i - 1) + (m-1)p chunk forwards and
    the steady state runs one more, pm + p - 1 - 2i in all; on the first stage
    L/(pm)·(pm + p - 1) = L·(1 + (p-1)/(pm)) layers: the paper's interleave factor.
    Works on ints, numpy arrays and sympy symbols alike.
    """
    return p * m + p - 1 - 2 * stage if interleaved else p - stage


@dataclass(frozen=True)
class StageOccupancy:
    """What the first stage holds at its peak, in units the term table multiplies."""

    layer_activations: int
    """Layers x microbatches held (Eq 5: L; interleaved: L·(1 + (p-1)/(pm)))."""
    microbatches: int
    """Microbatches whose embedding dropout mask is held (1F1B: p, as section 4.5 counts;
    interleaved: 2p at the peak); 0 on a stage after the first, which has no embedding."""
    holds_output_layer: bool
    """The stage is the last (the first too when p = 1): it keeps the output-layer terms,
    of one microbatch (its first backward follows its forward)."""
    explanation: str
    stage: int = 0
    chunk_layers: int = 0
    """Layers in one model chunk of this stage: its layers / m."""


def minimum(x, y):
    """min(x, y) of integers that works elementwise on numpy arrays too."""
    return (x + y - abs(x - y)) // 2


def embedding_microbatches(p, m, interleaved: bool):
    """Microbatches whose chunk-0 forward (with the embedding) the first stage holds at its
    peak, pipeline full. 1F1B: p, as section 4.5 counts. Megatron's interleaved schedule:
    2p. After forward k of the steady state, with y = k - (pm + p - 2), the chunk-0
    forwards run minus the chunk-0 backwards run is p + f(y + p - 1) - g(y), where f(x)
    counts k' < x with k' mod pm < p and g(y) counts j' < y with j' mod pm >= (m-1)p; that
    is 2p whenever y mod pm lies in [1, (m-1)p], which happens with pm + p - 1 chunks held
    as soon as n >= 2p. (With n = p every forward runs first: p.) The harness measures it."""
    return 2 * p if interleaved else p


def held_counts(layers, p, m, n, stage_layers=None, stage=0):
    """(layer activations, microbatches) a stage holds at its peak, for n microbatches per
    iteration: the schedule's warm-up stops when the microbatches run out. stage_layers:
    the stage's layers (an uneven pipeline's own count); L/p if None. Microbatches count
    embedding masks, so they are 0 after the first stage. Arithmetic only: runs on ints and
    on numpy integer arrays (the planner's sweep)."""
    per_chunk = (layers // p if stage_layers is None else stage_layers) // m
    embedding = minimum(_by_schedule(embedding_microbatches, p, m), n) * (stage == 0)
    return per_chunk * chunks_held(p, m, n, stage), embedding


def chunks_held(p, m, n, stage):
    """Chunk forwards in flight at the stage's first backward: the warm-up and one more, or
    all n·m when the warm-up would take them all (schedules.py, get_pp_rank_microbatches:
    are_all_microbatches_in_warmup). Older Megatron also ran every forward first on every
    rank when n = p; current Megatron-Core does not, and neither does this count."""
    return minimum(_by_schedule(chunks_in_flight, p, m, stage), n * m)


def _by_schedule(count, p, m, *stage):
    """count(p, m, interleaved) with interleaved = m > 1, elementwise on numpy arrays too."""
    return count(p, m, True, *stage) * (m > 1) + count(p, m, False, *stage) * (m == 1)


def stage_split(layers: int, p: int) -> tuple[int, int, int] | None:
    """(first, between, last): the layers of the first stage, of each stage between and of the
    last, in the pipelines the planner sweeps. Even where p divides L (L/p each). Otherwise,
    for p >= 3, Llama 3's shape (section 3.3.2: 126 layers on 16 stages as 7 + 8 x 14 + 7):
    each stage between takes k = ⌈L/p⌉ layers, the fewest the slowest stage can have, and the
    first and last share the rest, r = L - (p-2)·k, the first the smaller half; at least a
    layer each, so r >= 2 (r <= 2k holds as L <= p·k). None where no such split exists
    (p = 2 with L odd; k so large that r < 2). Megatron's --decoder-first/last-pipeline-num-layers
    take it as given (the stages between share the rest evenly)."""
    if layers % p == 0:
        return layers // p, layers // p, layers // p
    if p < 3:
        return None
    between = -(-layers // p)
    rest = layers - (p - 2) * between
    if rest < 2:
        return None
    return rest // 2, between, rest - rest // 2


def split_text(first: int, between: int, last: int, p: int) -> str:
    """An uneven pipeline's layers as the Llama 3 paper counts them: '7+8x14+7' (first, each
    stage between x their count, last); '60+66' with no stage between."""
    return f"{first}+{between}x{p - 2}+{last}" if p > 2 else f"{first}+{last}"


def stage_occupancy(layers: int, p: int, m: int, microbatches_per_iteration: int | None,
                    stage_layers: int | None = None, stage: int = 0) -> StageOccupancy:
    """A stage's peak; fewer microbatches than the schedule wants hold less.
    stage_layers: the stage's own layer count in an uneven pipeline (m = 1)."""
    n = microbatches_per_iteration
    # Unknown n: 2p microbatches fill either schedule (2pm >= pm + p - 1, and 2p masks).
    layer_activations, microbatches = held_counts(layers, p, m, 2 * p if n is None else n, stage_layers,
                                                  stage)
    per_chunk = (layers // p if stage_layers is None else stage_layers) // m
    explanation = _explain(p, m, n, layer_activations // per_chunk,
                           _by_schedule(chunks_in_flight, p, m, stage), per_chunk)
    return StageOccupancy(layer_activations, microbatches, stage == p - 1, explanation, stage, per_chunk)


def _explain(p, m, n, chunks, full_chunks, layers_per_chunk) -> str:
    if p == 1:          # no pipeline: one microbatch's activations at a time, whatever the step accumulates
        return (f"one microbatch in flight"
                + (f" of {n} a step (gradient accumulation)" if n and n > 1 else "")
                + f", {layers_per_chunk * chunks} layer activations")
    if m > 1:
        schedule, unit = f"interleaved schedule (m={m})", "chunks"
    else:
        schedule, unit = "1F1B schedule", "microbatches"
    held = f"{chunks} {unit} x {layers_per_chunk} layers = {chunks * layers_per_chunk} layer activations"
    if n is None:
        return f"{schedule}, microbatches per iteration unknown, pipeline assumed full: {held}"
    if chunks < full_chunks:
        return (f"{schedule}, only {n} microbatches per iteration (a full pipeline holds "
                f"{full_chunks} {unit}): {held}")
    return f"{schedule}, {n} microbatches per iteration: {held}"
