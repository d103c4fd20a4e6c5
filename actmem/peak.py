"""The allocator's peak on a pipeline stage, from below: what is certainly live at one moment.

The paper counts the activations saved for backward. A run dies at the allocator's peak,
which holds more. This module names the rows that are all live at one and the same moment
of a stage's schedule, so their sum is a floor under the peak, not a guess:

- the model state: 16-bit weights, fp32 main gradients (Megatron's DDP allocates its grad
  buffer once, before the first step: param_and_grad_buffer.py), the optimizer state, and
  the dummy 16-bit weight gradients TE caches, one a weight shape (parameters.py);
- the saved activations of every microbatch in flight (the paper's count, section 4.4);
- under recompute, what the backward of the stage's last layer rematerialises while all of
  the above is held (``engine.rematerialised_bytes``), less what that backward freed before
  it (``engine.freed_before_rerun``);
- on the stage with the output layer, the loss's 16-bit logits gradient, made while all of
  the above is held (``engine.loss_backward_bytes``);
- inside the last layer's backward (``actmem.backward``), at its first MLP linear (fc1), at
  the eager core's softmax or dropout, and, where Megatron runs torch's fallback softmax, at
  that softmax's own backward: the op's gradients and gathered input, less the rows the
  backward has freed by then; Megatron's layer, kept whole or rerun alone (under the block
  method, a chunk's last layer is kept whole).

The moment is in the stage's first backward after the pipeline has filled (the oldest
microbatch's last layer, every microbatch of the stage held): its start, its rerun done,
the loss's backward, fc1's or the core's, whichever holds more. The other transients of that
backward (the flash core's, the other linears', a recomputed MLP's) come on top and are not
modelled yet: the harness measures them, and the floor's gap to its measured peak is
reported, not hidden.
"""

from dataclasses import dataclass

from actmem.techniques import Technique
from actmem.terms import TRANSIENT_TERMS, Recompute


DUMMY_WGRADS_SOURCE = ("16-bit tensors of the linears' weight shapes, one per distinct shape, that Megatron's "
                       "fused-wgrad linears return uncomputed and TE's get_dummy_wgrad caches for the process "
                       "(transformer_engine/pytorch/module/base.py): QKV, projection, fc1, fc2, the output layer")


@dataclass(frozen=True)
class PeakRow:
    name: str
    bytes: int
    source: str


@dataclass(frozen=True)
class PeakFloor:
    """Rows live together at one moment of a stage's schedule."""

    rows: tuple
    moment: str

    @property
    def total_bytes(self) -> int:
        return sum(row.bytes for row in self.rows)

    def bytes_of(self, *names) -> int:
        return sum(row.bytes for row in self.rows if row.name in names)


def peak_floor(row) -> PeakFloor:
    """The floor for one technique on one stage (an estimate.TechniqueRow): the largest of
    the moments of its first backward after the pipeline fills. At its start every
    microbatch's activations are held. On the stage with the output layer, the loss's
    backward adds its 16-bit logits gradient to all of them. Under recompute, when the rerun
    is done, some of them are already freed (the output layer's on the last stage; under
    selective recompute the last layer's rows after its attention core) and the rerun's are
    live. Inside the last layer's backward (actmem.backward), at fc1's or the eager core's
    softmax's, the rows after the op are freed and its gradients live.
    The first of equal moments is taken."""
    params = row.parameters
    state = (
        PeakRow("weights", params.weights_bytes, "16-bit weights of the stage"),
        PeakRow("main_gradients", params.gradients_bytes,
                "fp32 main gradients: one buffer, allocated before the first step (Megatron's DDP)"),
        PeakRow("optimizer_state", params.optimizer_bytes,
                "fp32 master weights and Adam's two moments (or this rank's shard of them)"),
    ) + ((PeakRow("dummy_weight_gradients", params.dummy_wgrads_bytes, DUMMY_WGRADS_SOURCE),)
         if params.dummy_wgrads_bytes else ())
    held = PeakRow("activations_in_flight", row.first_stage_bytes,
                   "the saved activations of every microbatch in flight (sections 4.4, 4.5)")
    moments = [PeakFloor(state + (held,), "the first backward's start, every microbatch held")]
    if row.loss_bytes:
        moments.append(PeakFloor(state + (held, PeakRow("logits_gradient_16bit", row.loss_bytes,
                                                        TRANSIENT_TERMS[0].source)),
                                 "the loss's backward, every microbatch held"))
    if row.rematerialised_bytes > row.freed_bytes:
        moments.append(PeakFloor(state + (
            PeakRow("activations_in_flight", row.first_stage_bytes - row.freed_bytes,
                    "the saved activations in flight, less what the backward freed before the rerun"),
            PeakRow("rematerialised", row.rematerialised_bytes, _rematerialised_source(row.technique))),
            "the first backward, its recompute done"))
    moments += [_layer_moment(name, moment, row, state) for name, moment in row.moments]
    return max(moments, key=lambda floor: floor.total_bytes)


#: each moment of the last layer's backward (actmem.backward): when, and what its row holds
_MOMENTS = {
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
}


def _layer_moment(name: str, moment, row, state: tuple) -> PeakFloor:
    """A moment inside the last layer's backward: the rows after the op freed (and the output
    layer's), what the backward has rerun by then, the op's gradients."""
    when, label, source = _MOMENTS[name]
    rerun = ()
    if moment.rerun:
        rerun = (PeakRow("rematerialised", moment.rerun - moment.freed_rerun,
                         _rematerialised_source(row.technique) + ", less its rows after this op, already freed"),)
    return PeakFloor(state + (
        PeakRow("activations_in_flight", row.first_stage_bytes - moment.freed_held,
                "the saved activations in flight, less what the backward freed before this op: the output "
                "layer's where the stage has it, the last layer's rows after the op"),
        *rerun,
        PeakRow(label, moment.transient, source)), when)


def _rematerialised_source(technique: Technique) -> str:
    if technique.recompute is Recompute.SELECTIVE and technique.modules == ("core_attn",):
        return "selective recompute reruns the last layer's attention core: the rows it dropped"
    if technique.recompute is Recompute.SELECTIVE:
        return (f"selective recompute reruns the last layer's modules ({', '.join(technique.modules)}) one at "
                "a time in the backward's order, each with the rows after it freed (the MLP with all but the "
                "mask after it held, the attention core after the MLP and the projection are done): the rows "
                "each dropped, at the rerun that holds the most")
    if technique.partial and technique.recompute_method == "uniform":
        return ("full recompute reruns a checkpointed group of the chunk, its tail or the group of N "
                "before it (with the tail's checkpoint freed), whichever holds more: its layers as "
                "kept without recompute, less the group's input (the checkpoint)")
    return ("full recompute reruns the last layer from its checkpoint: the layer as kept without "
            "recompute, less its input (the checkpoint's own storage)")
