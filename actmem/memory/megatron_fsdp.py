"""megatron-core's own FSDP (Megatron-FSDP: --use-megatron-fsdp): the model state a rank keeps, as its
--data-parallel-sharding-strategy shards it over the d·c data-parallel ranks (context parallelism holds the same
weights: mcore_fsdp_adapter.py, the data-parallel group with context parallelism).

megatron-core 0.16.1, distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py ("pgb"), and Megatron-LM
d98e8a64's arguments for the defaults:
- the 16-bit weights: the model-weight buffer, sharded under optim_grads_params (is_model_weight_buffer_distributed);
  under the other strategies no buffer of its own, the module's weights whole (pgb, _init_each_parameter_group_buffers);
- the main gradients: the gradient buffer, sharded under optim_grads and optim_grads_params, in
  --megatron-fsdp-main-grads-dtype (auto, the default: the parameters' dtype, 2 B under bf16; fp32: 4 B), as
  Megatron-LM d98e8a64 (core 0.20) makes it (_resolve_group_grad_dtype); megatron-core 0.16.1 had no such flag
  and made it fp32 unless --grad-reduce-in-bf16 (give --megatron-fsdp-main-grads-dtype fp32 to price that);
- the fp32 main weights (--megatron-fsdp-main-params-dtype fp32, the default: preserve_fp32_weights) and Adam's two
  moments, on the main weights' shard under every strategy but no_shard (the optimizer steps on that buffer's
  shards: 12 B a parameter, over d·c);
- the buffers are allocated once, at wrapping, and kept: every byte here is held at every moment of the step.
Under optim_grads_params the weights outside its units (TransformerLayer: the embedding, the output layer, the
final norm) are all-gathered into a bucket of their own in the forward (pgb, DataParallelBuffer.fetch_bucket: a new
unsharded tensor beside the shard) and kept until the backward's end: only the units' buckets are marked
releasable (megatron_fsdp.py, _root_pre_backward), the rest freed by synchronize_param_gather after the backward.
Not counted (named in the output): each bucket's padding to a multiple of d·c times the lcm of its parameters' row
sizes (pgb: 0.01% of Llama 3 8B at d = 8), and the other transients of the step: the units all-gathered to compute
(and the prefetch window), the gradients awaiting their reduce-scatter.
Arithmetic only, as parameters.parameter_bytes.
"""

from actmem.model.implementation import MEGATRON_FSDP_STRATEGIES
from actmem.model.widths import WEIGHT_BYTES


def gathered_outside_units(outside, strategy: str):
    """The 16-bit weights of ``outside`` parameters (those of no unit) held gathered through the first backward:
    under optim_grads_params, a whole bucket beside their shards (unpadded: a floor); else 0, the weights whole
    already."""
    return WEIGHT_BYTES * outside if MEGATRON_FSDP_STRATEGIES[strategy][0] else 0


def state_bytes(count, shards, strategy: str, gradient_bytes, optimizer_bytes) -> tuple:
    """(weights, main gradients, optimizer state) of ``count`` parameters on a rank under ``strategy`` over
    ``shards`` ranks (d·c), each sharded part the largest shard (rounded up)."""
    weights, gradients, optimizer = MEGATRON_FSDP_STRATEGIES[strategy]

    def part(width, sharded):
        return -(-width * count // shards) if sharded else width * count

    return part(WEIGHT_BYTES, weights), part(gradient_bytes, gradients), part(optimizer_bytes, optimizer)
