"""The allocator's peak on the first stage, from below: what is certainly live at one moment.

The paper counts the activations saved for backward. A run dies at the allocator's peak,
which holds more. This module names the rows that are all live at one and the same moment
of the first stage's schedule, so their sum is a floor under the peak, not a guess:

- the model state: 16-bit weights, fp32 main gradients (Megatron's DDP allocates its grad
  buffer once, before the first step: param_and_grad_buffer.py) and the optimizer state;
- the saved activations of every microbatch in flight (the paper's count, section 4.4);
- under recompute, what the backward of the stage's last layer rematerialises while all of
  the above is held. Full recompute reruns the layer (or the checkpointed group of N layers)
  from its checkpoint: everything the same layer keeps without recompute, less the input,
  which is the checkpoint's own storage (CheckpointFunction.backward detaches it, a view).
  Selective recompute reruns the attention core: the rows it dropped.

The moment is in the first backward after the pipeline has filled (the oldest microbatch's
last layer, every microbatch of the stage held): its start, or its rerun done, whichever
holds more (``peak_floor``). The transients of
that backward (gradient tensors, gathered inputs, the cross entropy's 16-bit logits
gradient) come on top and are not modelled yet: the harness measures them, and the floor's
gap to its measured peak is reported, not hidden.
"""

from dataclasses import dataclass

from actmem import engine
from actmem.techniques import Technique
from actmem.terms import TERMS, Recompute, Scope


@dataclass(frozen=True)
class PeakRow:
    name: str
    bytes: int
    source: str


@dataclass(frozen=True)
class PeakFloor:
    """Rows live together at one moment of the first stage's schedule."""

    rows: tuple
    moment: str

    @property
    def total_bytes(self) -> int:
        return sum(row.bytes for row in self.rows)

    def bytes_of(self, *names) -> int:
        return sum(row.bytes for row in self.rows if row.name in names)


def peak_floor(est) -> PeakFloor:
    """The first stage's floor for an Estimate's run: the larger of two moments of the first
    backward after the pipeline fills. At its start every microbatch's activations are held.
    Under recompute, when the rerun is done, some of them are already freed: with p = 1 the
    output layer's rows (the loss's backward runs first); under selective recompute the last
    layer's rows after its attention core (its MLP and projection have run backward)."""
    params = est.parameters
    state = (
        PeakRow("weights", params.weights_bytes, "16-bit weights of the stage"),
        PeakRow("main_gradients", params.gradients_bytes,
                "fp32 main gradients: one buffer, allocated before the first step (Megatron's DDP)"),
        PeakRow("optimizer_state", params.optimizer_bytes,
                "fp32 master weights and Adam's two moments (or this rank's shard of them)"),
    )
    held = PeakRow("activations_in_flight", est.activations_bytes,
                   "the saved activations of every microbatch in flight (sections 4.4, 4.5)")
    start = PeakFloor(state + (held,), "the first backward's start, every microbatch held")
    rerun = rematerialised_bytes(est.spec, est.run.technique)
    if not rerun:
        return start
    freed = _freed_before_rerun(est)
    rerun_moment = PeakFloor(state + (
        PeakRow("activations_in_flight", est.activations_bytes - freed,
                "the saved activations in flight, less what the backward freed before the rerun"),
        PeakRow("rematerialised", rerun, _rematerialised_source(est.run.technique))),
        "the first backward, its recompute done")
    return max(start, rerun_moment, key=lambda floor: floor.total_bytes)


def _freed_before_rerun(est) -> int:
    """Rows the first backward frees before it reruns anything: the output layer's (p = 1);
    under selective recompute, the last layer's rows after its attention core."""
    freed = sum(row.total_bytes for row in est.run_terms if row.term.scope is Scope.OUTPUT)
    if est.run.technique.recompute is Recompute.SELECTIVE:
        core_end = next(i for i, term in enumerate(TERMS) if term.name == "projection_input")
        after_core = TERMS[core_end:]
        freed += sum(row.bytes_each for row in est.run_terms
                     if row.term in after_core and row.term.scope is Scope.LAYER)
    return freed


def rematerialised_bytes(spec, technique: Technique) -> int:
    """What the backward of the stage's last layer recomputes, held beside everything else:
    full, the layer (or group of N layers) without recompute less its input (the checkpoint's
    storage); selective, the attention core's rows; none, nothing."""
    if technique.recompute is Recompute.NONE:
        return 0
    arch, bindings = spec.architecture, spec.bindings()
    layer = engine.exact(engine.per_layer_bytes(technique.whole(), arch), bindings)
    if technique.recompute is Recompute.SELECTIVE:
        return layer - engine.exact(engine.per_layer_bytes(technique, arch), bindings)
    group = _group_layers(spec, technique)
    checkpoint = engine.exact(engine.per_layer_bytes(technique, arch), bindings)
    return group * layer - checkpoint if group else 0


def _group_layers(spec, technique: Technique) -> int:
    """Layers the first backward reruns at once: N under 'uniform' (the chunk's last group
    may be shorter, and it is the first rerun: the chunk's tail); 1 under 'block' when every
    layer of the chunk is checkpointed, else 0: its last layers are kept whole, so the first
    rerun comes after their activations are freed, a moment this floor does not take."""
    if not technique.partial:
        return 1
    if technique.recompute_method == "block":
        return int(technique.recompute_layers >= spec.chunk_layers)
    n = technique.recompute_layers
    tail = spec.chunk_layers % n
    return tail or n


def _rematerialised_source(technique: Technique) -> str:
    if technique.recompute is Recompute.SELECTIVE:
        return "selective recompute reruns the last layer's attention core: the rows it dropped"
    if technique.partial and technique.recompute_method == "uniform":
        return ("full recompute reruns the last checkpointed group of the chunk: its layers as kept "
                "without recompute, less the group's input (the checkpoint)")
    return ("full recompute reruns the last layer from its checkpoint: the layer as kept without "
            "recompute, less its input (the checkpoint's own storage)")
