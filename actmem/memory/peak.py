"""The allocator's peak on a pipeline stage, from below: what is certainly live at one moment.

The paper counts the activations saved for backward. A run dies at the allocator's peak,
which holds more. This module names the rows that are all live at one and the same moment
of a stage's schedule, so their sum is a floor under the peak, not a guess:

- the model state: 16-bit weights, fp32 main gradients (Megatron's DDP allocates its grad
  buffer once, before the first step: param_and_grad_buffer.py), the optimizer state, and
  the dummy 16-bit weight gradients TE caches, one a weight shape (parameters.py);
- the saved activations of every microbatch in flight (the paper's count, section 4.4);
- at the largest moment of the stage's first backward after the pipeline has filled
  (actmem.memory.stage_model, which `plan` evaluates too): its start, the loss's backward (the
  16-bit logits gradient), its rerun done (what the last layer's backward rematerialises,
  less what it freed before), or inside the last layer's backward (actmem.memory.backward) at fc1's,
  the eager core's, torch's fallback softmax's or transformers' SwiGLU product's, whichever holds
  more. The other transients of that
backward (the flash core's, the other linears', a recomputed MLP's) come on top and are not
modelled yet: the harness measures them, and the floor's gap to its measured peak is
reported, not hidden.
"""

from dataclasses import dataclass


DUMMY_WGRADS_SOURCE = ("16-bit tensors of the linears' weight shapes, one per distinct shape, that Megatron's "
                       "fused-wgrad linears return uncomputed and TE's get_dummy_wgrad caches for the process "
                       "(transformer_engine/pytorch/module/base.py): QKV, projection, fc1, fc2, the output layer")
FP8_SOURCE = ("what TE keeps for FP8 training: the linears' weights cached in FP8 for the iteration's microbatches "
              "(base.py, get_weight_workspace; on Hopper with their transposes), or with --fp8-param-gather the "
              "FP8 weights' Hopper transposes; each weight's scale_inv and delayed scaling's amax history "
              "(actmem.model.fp8)")


GATHERED_SOURCE = ("16-bit weights outside Megatron-FSDP's units (the embedding, the output layer, the final norm), "
                   "all-gathered into a bucket of their own in the forward and kept until the backward's end "
                   "(megatron_fsdp.py, _root_pre_backward: only the units' buckets are released), their bucket padded")
DOUBLE_BUFFER_SOURCE = ("Megatron-FSDP's fixed pools under --fsdp-double-buffer: min(L, 2) buffers of a unit's "
                        "padded bucket for the gathered weights where they are sharded, and as many for the "
                        "gradient buckets where they are, allocated once and never freed (param_and_grad_buffer.py, "
                        "FixedPoolAllocator)")


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


def _fsdp_state(params) -> tuple:
    """The model state FSDP2 holds at every moment (actmem.memory.fsdp): its gradients are the moments' rows."""
    return (PeakRow("weights", params.weights_bytes, "fp32 sharded weights, d padded shards (FSDP2's, rank 0's)"),
            PeakRow("optimizer_state", params.optimizer_bytes,
                    "AdamW's exp_avg and exp_avg_sq of the shard, fp32, and a 0-dim fp32 step a parameter tensor"))


def _zero_state(params) -> tuple:
    """The model state ZeRO holds at every moment (actmem.memory.zero): at stages 1 and 2 its gradients are the
    moments' rows; stage 3 keeps its gradient partition and bucket throughout."""
    return (PeakRow("weights", params.weights_bytes, "bf16 weights: the whole flat buffer (stages 1 and 2) or the "
                                                     "partition and the persistent weights (stage 3)"),) + (
        (PeakRow("gradient_buffers", params.gradients_bytes, "the bf16 gradient partition and reduce bucket, kept "
                                                             "for the whole run (stage3.py)"),)
        if params.zero == 3 else ()) + (
        PeakRow("optimizer_state", params.optimizer_bytes, "the fp32 master weights and AdamW's two moments of the "
                                                           "partition, the step counters and the gradient norm"),)


def _megatron_fsdp_sources(strategy: str) -> tuple:
    """The sources of the state rows under Megatron-FSDP (actmem.memory.megatron_fsdp): what its strategy shards."""
    from actmem.model.implementation import MEGATRON_FSDP_STRATEGIES

    weights, gradients, optimizer = ("the rank's shard of" if sharded else "the whole"
                                     for sharded in MEGATRON_FSDP_STRATEGIES[strategy])
    return (f"16-bit weights: {weights} model weights (Megatron-FSDP, {strategy}; the units gathered to compute are "
            f"the last layer's backward moments' rows)",
            f"main gradients: {gradients} gradient buffer, allocated once (Megatron-FSDP, {strategy})",
            f"fp32 main weights and Adam's two moments: {optimizer} main-weight buffer's (Megatron-FSDP, {strategy})")


def peak_floor(row) -> PeakFloor:
    """The floor for one technique on one stage (an estimate.TechniqueRow): its model state and
    the largest of the moments of its first backward after the pipeline fills
    (actmem.memory.stage_model: the start, the loss's backward, the rerun, the last layer's backward's
    moments), the first of equals."""
    params = row.parameters
    if params.fsdp:
        return PeakFloor(_fsdp_state(params) + row.peak_moment.parts, row.peak_moment.when)
    if params.zero:
        return PeakFloor(_zero_state(params) + row.peak_moment.parts, row.peak_moment.when)
    sources = (_megatron_fsdp_sources(params.megatron_fsdp) if params.megatron_fsdp else
               ("16-bit weights of the stage", "fp32 main gradients: one buffer, allocated before the first step "
                "(Megatron's DDP)", "fp32 master weights and Adam's two moments (or this rank's shard of them)"))
    state = tuple(PeakRow(name, value, source) for name, value, source in zip(
        ("weights", "main_gradients", "optimizer_state"),
        (params.weights_bytes, params.gradients_bytes, params.optimizer_bytes), sources))
    extra = (("dummy_weight_gradients", params.dummy_wgrads_bytes, DUMMY_WGRADS_SOURCE),
             ("fp8_weight_state", params.fp8_bytes, FP8_SOURCE),
             ("gathered_weights", params.gathered_bytes, GATHERED_SOURCE),
             ("double_buffers", params.double_buffer_bytes, DOUBLE_BUFFER_SOURCE))
    state += tuple(PeakRow(name, value, source) for name, value, source in extra if value)
    moment = row.peak_moment
    return PeakFloor(state + moment.parts, moment.when)
