"""A pipeline stage's activations and the moments of its first backward, built once.

The first backward after the pipeline fills runs the stage's last layer backward with every
microbatch of the stage held (section 4.4). Its moments, each what the activations hold
there above the model state (actmem.memory.peak adds the state and takes the largest):

- ``start``: every microbatch's saved activations;
- ``loss``: on the stage with the output layer, the loss's backward and its 16-bit logits
  gradient (engine.loss_backward_bytes);
- ``forward_end``: under CPU offloading, the forward's end, with the embedding's output that
  GPTModel.forward keeps though layer 0 is offloaded (actmem.memory.offload);
- ``rerun``: under recompute, what the backward reruns less what it freed before
  (engine.rematerialised_bytes, engine.freed_before_rerun): one module at a time under
  selective recompute, a layer or a group of them under full recompute;
- ``fc1``, ``core``, ``softmax``, ``swiglu``: inside the last layer's backward
  (actmem.memory.backward).

Written once as arithmetic over quantities (the engine's expressions, evaluated) and counts
that may be Python ints or numpy arrays: ``estimate`` evaluates the expressions exactly and
gets whole bytes, ``plan`` lambdifies them over its sweep and gets a column a configuration.
Partial full recompute (Megatron's --recompute-method) is counts, checkpoints and whole
layers a chunk and the layers a rerun makes, not a path of its own: a moment that holds only
under a condition of the counts carries it (``present``: a bool, or a boolean array).
"""

from dataclasses import dataclass, fields, replace
from typing import Callable

from actmem.memory import backward, engine, offload
from actmem.memory.peak import PeakRow
from actmem.memory.pipeline import minimum
from actmem.memory.techniques import Technique
from actmem.memory.terms import TRANSIENT_TERMS
from actmem.model.recompute import Recompute, rerun_units


@dataclass(frozen=True)
class StageMoment:
    """What a stage's activations hold at one moment of its first backward."""

    name: str
    when: str
    parts: tuple
    present: object = True
    """Whether the moment happens (a bool, or a boolean array over a sweep)."""
    detail: object = None
    """For a moment of the last layer's backward, its backward.Moment, evaluated."""

    @property
    def bytes(self):
        return sum(part.bytes for part in self.parts)


@dataclass(frozen=True)
class StageCounts:
    """How the stage holds its layers: ints for one stage, arrays over a sweep."""

    per_chunk: object
    """Layers in one model chunk of the stage (its layers / m)."""
    chunks: object
    """Model chunks in flight at the first backward (pipeline.chunks_held)."""
    recompute_layers: object = None
    """N of partial full recompute where it varies over a sweep; the technique's otherwise."""
    offloaded: object = 0
    """Layers whose saved activations are on the host at the peak (actmem.memory.offload; p = 1)."""


@dataclass(frozen=True)
class StageActivations:
    layers_bytes: object
    """The layers' saved activations in flight (Eq 5, with the interleave factor)."""
    extra_bytes: object
    """Section 4.5: the embedding's and the output layer's terms."""
    moments: tuple
    last_checkpointed: object = True
    """Whether the stage's last layer is checkpointed under full recompute, so the first backward reruns it with
    every activation held (False where a partial recompute keeps it whole; a bool, or a boolean array)."""

    @property
    def held_bytes(self):
        return self.layers_bytes + self.extra_bytes


HELD = "the saved activations of every microbatch in flight (sections 4.4, 4.5)"


def stage_activations(technique: Technique, arch, value: Callable, counts: StageCounts,
                      others: tuple = ()) -> StageActivations:
    """The stage's saved activations and the moments of its first backward. ``value`` evaluates
    an engine expression (exactly, or over a sweep); ``technique`` is the stage's recompute.
    ``arch`` is the stage's last layer's, ``counts.per_chunk`` the layers of its kind; ``others``:
    (architecture, layers a chunk) of the stage's layers of another kind (a MoE model's dense
    layers, or its MoE layers where the last is dense), held as every layer is, never last."""
    n = technique.policy.layers if counts.recompute_layers is None else counts.recompute_layers
    per_layer = value(engine.per_layer_bytes(technique, arch))
    checkpoints, whole = chunk_layers(technique, counts.per_chunk, n)
    layers = counts.chunks * (checkpoints - counts.offloaded) * per_layer
    if technique.partial:
        if others:
            raise ValueError("layers of two kinds are held whole or checkpointed alone (a rule)")
        layers = layers + counts.chunks * whole * value(engine.per_layer_bytes(technique.whole(), arch))
    for other, other_layers in others:
        layers = layers + counts.chunks * other_layers * value(engine.per_layer_bytes(technique, other))
    extra = value(engine.extra_bytes(technique, engine.microbatches_held, engine.holds_output, arch))
    held = layers + extra
    moments = (StageMoment("start", "the first backward's start, every microbatch held", (PeakRow(
        "activations_in_flight", held, HELD),)),)
    loss = value(engine.loss_backward_bytes(technique, arch))
    moments += (StageMoment("loss", "the loss's backward, every microbatch held", (
        PeakRow("activations_in_flight", held, HELD),
        PeakRow(_loss_term(arch)[0], loss, _loss_term(arch)[1])),
        loss > 0),)
    if counts.offloaded:
        moments += (StageMoment("forward_end", "the forward's end, the loss made", (
            PeakRow("activations_in_flight", held, HELD),
            PeakRow("embedding_output", value(offload.embedding_output_bytes(technique, arch)),
                    offload.EMBEDDING_OUTPUT.source))),)
    moments += _reruns(technique, arch, value, counts, n, held, per_layer)
    moments += _layer_moments(technique, arch, value, counts, n, held)
    return StageActivations(layers, extra, moments, last_checkpointed(technique, counts.per_chunk, n)[0])


def _loss_term(arch) -> tuple:
    """(name, source) of the loss's backward's row: the transient term this code's loss makes."""
    term = next(term for term in TRANSIENT_TERMS if term.present(arch))
    return term.name, term.source


def chunk_layers(technique: Technique, per_chunk, n=None) -> tuple:
    """(layers kept as the technique keeps them, layers kept whole) a chunk: under block, the
    first N of each chunk are checkpointed; under uniform, each group of N keeps one checkpoint;
    under every (torchtitan's layer option), the N-th, 2N-th, ... layers are checkpointed alone.
    N: the technique's unless given (a sweep's column)."""
    n = technique.policy.layers if n is None else n
    if not technique.partial:
        return per_chunk, 0
    if technique.policy.method == "block":
        checkpoints = minimum(n, per_chunk)
        return checkpoints, per_chunk - checkpoints
    if technique.policy.method == "every":
        # torchtitan's _apply_layer_sac counts the blocks from 1 and checkpoints those the count divides by N
        checkpoints = per_chunk // n
        return checkpoints, per_chunk - checkpoints
    return -(-per_chunk // n), 0


def last_checkpointed(technique: Technique, per_chunk, n) -> tuple:
    """(whether a chunk's last layer is checkpointed alone, whether it is kept whole) where a partial recompute keeps
    some layers whole: block's last layers are whole unless N covers the chunk; every's last is checkpointed where N
    divides the chunk's layers. Elsewhere checkpointed (or, with nothing recomputed, neither matters: True, False)."""
    if technique.partial and technique.policy.method == "block":
        return n >= per_chunk, n < per_chunk
    if technique.partial and technique.policy.method == "every":
        return per_chunk % n == 0, per_chunk % n != 0
    return True, False


def _reruns(technique, arch, value, counts, n, held, per_layer) -> tuple:
    """The rerun moments: each module of a selective recompute (with one chunk in flight, what the token dispatcher
    still holds of the rows freed before it); under full recompute the
    first rerun of the chunk's backward, 1 layer, or under 'uniform' the chunk's tail group
    (its last, perhaps shorter than N) and, where the tail is shorter, the next group of N
    with the tail's checkpoint freed; under 'block' 1 layer where every layer of the chunk is
    checkpointed, else none: its last layers are kept whole, so the first rerun comes after
    their activations are freed, a moment the floor does not take; under 'every' 1 layer where N
    divides the chunk (its last layer checkpointed), else none, as under block."""
    if technique.recompute is Recompute.SELECTIVE:
        # the layer's last forward was this microbatch's (engine.DISPATCHER_KEEPS): one chunk in flight, or the stage
        # with the output layer, whose first backward follows its last chunk's forward of that microbatch
        latest = (counts.chunks == 1) | (value(engine.holds_output) == 1)
        return tuple(_rerun(held, value(engine.rematerialised_bytes(technique, arch, module=module)),
                            value(engine.freed_before_rerun(technique, arch, module))
                            - latest * value(engine.dispatcher_kept(technique, arch, module)), technique, unit=module)
                     for module in rerun_units(technique.modules))
    if technique.recompute is not Recompute.FULL:
        return ()
    one = value(engine.rematerialised_bytes(technique, arch))
    layer = value(engine.per_layer_bytes(technique.whole(), arch))
    freed = value(engine.freed_before_rerun(technique, arch))
    if technique.partial and technique.policy.method in ("block", "every"):
        return (_rerun(held, one, freed, technique, last_checkpointed(technique, counts.per_chunk, n)[0]),)
    tail = (counts.per_chunk - 1) % n + 1
    return (_rerun(held, one + (tail - 1) * layer, freed, technique),
            _rerun(held, one + (n - 1) * layer, freed + per_layer, technique, tail < n))


#: a selective rerun's unit, as the moment's name says it
_RERUN_WORDS = {"core_attn": "the attention core's", "mla_up_proj": "the up projections' (mla_up_proj)",
                "input_layernorm": "the input norm's (layernorm)", "pre_mlp_layernorm": "the pre-MLP norm's (layernorm)",
                "mlp": "the MLP's", "moe": "the MoE layer's (moe)", "moe_act": "the experts' activation's (moe_act)",
                "shared_experts": "the shared experts' (shared_experts)"}


def _rerun(held, rematerialised, freed, technique, when=True, unit=None) -> StageMoment:
    done = f"{_RERUN_WORDS.get(unit, unit)} rerun done" if unit else "its recompute done"
    return StageMoment("rerun", f"the first backward, {done}", (
        PeakRow("activations_in_flight", held - freed,
             "the saved activations in flight, less what the backward freed before the rerun"),
        PeakRow("rematerialised", rematerialised, rematerialised_source(technique))),
        _and(when, rematerialised > freed))


def _layer_moments(technique, arch, value, counts, n, held) -> tuple:
    """The moments of the last layer's backward, that layer kept as a chunk's last is: as
    every layer is; under 'block' whole where N is short of the chunk, else checkpointed alone (under 'every'
    checkpointed alone where N divides the chunk, else whole);
    none inside uniform groups of N > 1 (not modelled)."""
    if not technique.partial:
        lasts = ((technique, True),)
    elif technique.policy.method in ("block", "every"):
        alone = replace(technique, policy=replace(technique.policy, method="uniform", layers=1))
        checkpointed, whole = last_checkpointed(technique, counts.per_chunk, n)
        lasts = ((technique.whole(), whole), (alone, checkpointed))
    else:
        lasts = ()
    return tuple(_layer_moment(name, last, arch, value, held, _and(when, counts.per_chunk > 0), bool(counts.offloaded))
                 for last, when in lasts for name in backward.MOMENTS if backward.modelled(name, last, arch))


#: each moment of the last layer's backward (actmem.memory.backward): when, and what its row holds
LAYER_MOMENTS = {
    "fc1": ("the last layer's fc1 backward", "fc1_backward",
            "fc1's backward (TE's _LayerNormLinear.backward, Megatron's "
            "LinearWithGradAccumulationAndAsyncCommunication): its output gradient, its input gradient for "
            "the whole sequence, under SP the input all-gathered again and the gradient's reduce-scattered "
            "shard, and the gradient on the residual stream"),
    "core": ("the last layer's attention core backward", "core_backward",
             "the eager core's backward at its softmax's (or dropout's): the gradient of the probabilities "
             "·V saw and, with dropout, the softmax output's, v's gradient, the gradient on the residual "
             "stream and, under the core's checkpoint, its output's"),
    "softmax": ("the last layer's attention core backward, at torch's softmax", "core_backward",
                "torch's fallback softmax's backward (Megatron's local core where its fused kernel does not run: "
                "fused_softmax.py, forward_torch_softmax): the gradient of its output and the scores' gradient it "
                "makes (fp32 under --attention-softmax-in-fp32), v's gradient, the gradient on the residual stream "
                "and, under the core's checkpoint, its output's; the dropout's mask already freed"),
    "swiglu": ("the last layer's SwiGLU backward", "swiglu_backward",
               "the unfused SwiGLU's product's backward (transformers' LlamaMLP, torchtitan's FeedForward): the "
               "second linear's input gradient, the gradients of silu's output and of the up projection's made "
               "from it, and the gradient on the residual stream"),
}


#: the row each of those moments adds: the op's own gradients
LAYER_MOMENT_ROWS = tuple(dict.fromkeys(label for _, label, _ in LAYER_MOMENTS.values()))


def _layer_moment(name: str, last: Technique, arch, value, held, when, offloading: bool = False) -> StageMoment:
    """A moment inside the last layer's backward: the rows after the op freed (and the output
    layer's), what the backward has rerun by then, the op's gradients. ``offloading``: the layer
    frees none of its own rows before its backward ends (actmem.memory.offload), only the output
    layer's."""
    symbolic = backward.moment_bytes(name, last, arch)
    if offloading:
        symbolic = replace(symbolic, freed_held=engine.output_rows(last, arch))
    moment = backward.Moment(*(value(getattr(symbolic, field.name)) for field in fields(symbolic)))
    when_text, label, source = LAYER_MOMENTS[name]
    rerun = () if symbolic.rerun == 0 or (isinstance(moment.rerun, int) and not moment.rerun) else (PeakRow(
        "rematerialised", moment.rerun - moment.freed_rerun,
        rematerialised_source(last) + ", less its rows after this op, already freed"),)
    return StageMoment(name, when_text, (
        PeakRow("activations_in_flight", held - moment.freed_held,
             "the saved activations in flight, less what the backward freed before this op: the output "
             "layer's where the stage has it, the last layer's rows after the op"),
        *rerun,
        PeakRow(label, moment.transient, source)), when, moment)


def rematerialised_source(technique: Technique) -> str:
    if technique.recompute is Recompute.SELECTIVE and technique.modules == ("core_attn",):
        return "selective recompute reruns the last layer's attention core: the rows it dropped"
    if technique.recompute is Recompute.SELECTIVE:
        return (f"selective recompute reruns the last layer's modules ({', '.join(technique.modules)}) one at "
                "a time in the backward's order (layernorm's two norms apart), each with the rows after it freed "
                "(the MLP with all but the mask after it held, the attention core after the MLP and the projection "
                "are done): the rows each dropped, and where Megatron's CheckpointWithoutOutput reruns it (moe_act, "
                "mla_up_proj, each norm) its outputs twice, a norm's through its block's reruns; at the rerun that "
                "holds the most")
    if technique.partial and technique.policy.method == "uniform":
        return ("full recompute reruns a checkpointed group of the chunk, its tail or the group of N "
                "before it (with the tail's checkpoint freed), whichever holds more: its layers as "
                "kept without recompute, less the group's input (the checkpoint)")
    return ("full recompute reruns the last layer from its checkpoint: the layer as kept without "
            "recompute, less its input where its norm keeps it (the checkpoint's own storage)")


def _and(x, y):
    """x and y, for plain booleans or numpy arrays alike."""
    if isinstance(x, bool) and isinstance(y, bool):
        return x and y
    import numpy as np

    return np.logical_and(x, y)


def largest_bytes(activations: StageActivations):
    """The largest of the moments that happen, elementwise over a sweep: the stage's
    activations at their peak (its start's at least)."""
    import numpy as np

    held = activations.held_bytes
    return np.maximum.reduce([np.where(moment.present, moment.bytes, held) for moment in activations.moments])


def held_rows(*rows) -> tuple:
    """The rows that hold bytes (anywhere over a sweep)."""
    return tuple(row for row in rows if _any(row.bytes))


def _any(value) -> bool:
    """A count, or a numpy array of them over a sweep, that is not zero everywhere."""
    return bool(value.any()) if hasattr(value, "any") else bool(value)


def with_rows(moment: StageMoment, rows: tuple) -> StageMoment:
    """The moment with a sharding's rows beside its own (FSDP2's, ZeRO's), those that hold bytes."""
    return replace(moment, parts=moment.parts + held_rows(*rows)) if rows else moment
