"""Bytes an element of each kind of tensor: the one place these widths are written.

The paper's section 4 counts 16-bit activations, 1-byte dropout masks and fp32 logits;
Megatron's mixed-precision Adam keeps 16-bit weights, fp32 main gradients and fp32 master
weights plus two moments.
"""

ACTIVATION_BYTES = 2   # bf16/fp16 activations (section 4)
MASK_BYTES = 1         # dropout masks, one byte an element (section 4.1)
LOGITS_BYTES = 4       # the cross entropy's fp32 logits (section 4.5)
INDEX_BYTES = 8        # int64 indices (a MoE router's top-k choice, a permutation's token indices)
OFFSET_BYTES = 4       # int32 group offsets and row maps (transformers' grouped_mm; TE's fused MoE permutation)

WEIGHT_BYTES = 2       # bf16/fp16 weights
FP8_BYTES = 1          # an FP8 weight's element (uint8 buffers under --fp8-param-gather) and its Hopper transpose's
GRADIENT_BYTES = 4     # fp32 main gradients: Megatron accumulates and reduces them in fp32
#: main gradients by their dtype: fp32 (bf16 training's default), or the parameters' 16 bits
#: (fp16 training without --accumulate-allreduce-grads-in-fp32; --grad-reduce-in-bf16)
GRADIENT_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
OPTIMIZER_BYTES = 12   # fp32 master weight + Adam's first and second moments
# 2 + 4 + 12 = 18 bytes a parameter; the distributed optimizer shards the 12 over d.
