"""How much the first pipeline stage holds at its peak (section 4.4).

The first stage runs L/p layers and, to keep the pipeline busy, holds the
activations of several microbatches at once; it also hosts the input embedding.
"""

from dataclasses import dataclass


def chunks_in_flight(p, m, interleaved: bool):
    """Model chunks of L/(p·m) layers each held by the first stage with the pipeline full.

    1F1B (PipeDream-Flush): p microbatches, so p·(L/p) = L layers whatever p is (Eq 5).
    Megatron's interleaved schedule: on rank 0 the warm-up runs 2(p-1) + (m-1)p chunk
    forwards and the steady state one more before the first backward, pm + p - 1 in all,
    so L/(pm)·(pm + p - 1) = L·(1 + (p-1)/(pm)) layers: the paper's interleave factor.
    Works on ints and on sympy symbols alike.
    """
    return p * m + p - 1 if interleaved else p


@dataclass(frozen=True)
class StageOccupancy:
    """What the first stage holds at its peak, in units the term table multiplies."""

    layer_activations: int
    """Layers x microbatches held (Eq 5: L; interleaved: L·(1 + (p-1)/(pm)))."""
    microbatches: int
    """Microbatches whose embedding dropout mask is held (1F1B: p, as section 4.5 counts;
    interleaved: 2p at the peak)."""
    holds_output_layer: bool
    """The first stage is also the last (p = 1): it keeps the output-layer terms."""
    explanation: str


def _minimum(x, y):
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


def held_counts(layers, p, m, n, stage_layers=None):
    """(layer activations, microbatches) the first stage holds at its peak, for n
    microbatches per iteration: the schedule's warm-up stops when the microbatches run out.
    stage_layers: the first stage's layers (an uneven pipeline's own count); L/p if None.
    Arithmetic only: runs on ints and on numpy integer arrays (the planner's sweep)."""
    full_chunks = _by_schedule(chunks_in_flight, p, m)
    per_chunk = (layers // p if stage_layers is None else stage_layers) // m
    return per_chunk * _minimum(full_chunks, n * m), _minimum(_by_schedule(embedding_microbatches, p, m), n)


def _by_schedule(count, p, m):
    """count(p, m, interleaved) with interleaved = m > 1, elementwise on numpy arrays too."""
    return count(p, m, True) * (m > 1) + count(p, m, False) * (m == 1)


def first_stage_occupancy(layers: int, p: int, m: int, microbatches_per_iteration: int | None,
                          stage_layers: int | None = None) -> StageOccupancy:
    """The first stage's peak; fewer microbatches than the schedule wants hold less.
    stage_layers: the first stage's own layer count in an uneven pipeline (m = 1)."""
    n = microbatches_per_iteration
    # Unknown n: 2p microbatches fill either schedule (2pm >= pm + p - 1, and 2p masks).
    layer_activations, microbatches = held_counts(layers, p, m, 2 * p if n is None else n, stage_layers)
    per_chunk = (layers // p if stage_layers is None else stage_layers) // m
    explanation = _explain(p, m, n, layer_activations // per_chunk, _by_schedule(chunks_in_flight, p, m),
                           per_chunk)
    return StageOccupancy(layer_activations, microbatches, p == 1, explanation)


def _explain(p, m, n, chunks, full_chunks, layers_per_chunk) -> str:
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
