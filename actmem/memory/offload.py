"""Megatron's whole-layer CPU offloading (--cpu-offloading-num-layers N): what stays on the GPU,
what goes to host memory.

Read at megatron-core 0.16.1 and Transformer Engine v2.11 (v2.10 is the same), whose new
cpu_offload.py runs unless NVTE_CPU_OFFLOAD_V1=1:

- Megatron enters TE's offload context around each layer of the block (transformer_block.py,
  forward: ``with self.offload_context``), with model_layers = L; the embedding, the final norm,
  the output layer, the loss and the multi-token-prediction layers run outside it.
- Inside it a saved_tensors_hooks pair takes every tensor autograd saves (cpu_offload.py,
  push_tensor), TE's, Megatron's fused ops' and torch's alike, and offloads each that is a CUDA
  tensor, contiguous, not a Parameter and not marked _TE_do_not_offload (the weight workspaces):
  on Megatron's default dense layer with TE's attention, all of a layer's saved tensors
  (TE marks q, k, v to offload their base; its v is a contiguous copy). No minimum size in v2.11.
- The first N layers are offloaded (DefaultOffloadSynchronizer.__init__: layer_id < N). Layer i's
  copy to the host starts as layer i + 1 begins, and its GPU tensors are released only as layer
  L - N + i begins (finish_offload_map): the GPU holds the saved activations of L - N layers from
  layer L - N - 1 on, through the end of the forward and the loss ("peak memory usage of saving
  activations is (num_layers - num_offloaded_layers) * T", its docstring).
- In the backward, layer i comes back as layer L - 1 - N + i's backward begins, after the layer
  before is released (bwd_step): never more than L - N layers at once. No layer is reloaded while
  the last layer's backward runs, the moments the peak floor takes.
- v2.11 files every layer's saved tensors, offloaded or not, in that layer's state and frees them
  only as the next layer's backward begins (release_all_memory): a layer frees none of its own
  rows inside its backward. v2.12 returns the non-offloaded layers' tensors to autograd.
- GPTModel.forward keeps the embedding's output (decoder_input, layer 0's input) alive to its
  end (gpt_model.py): offloaded with layer 0, it is freed on the GPU only when the forward
  returns, after the loss.
- Host memory: one pinned buffer a tensor an offload, freed as the layer's backward passes
  (release_all_memory): at most the N layers of one microbatch, p = 1 running them one after
  another. Tensors shared by the layers (fused rope's freqs) are copied once a layer.
  PyTorch's caching host allocator rounds each pinned block up to a power of two and keeps it,
  so the host may reserve up to twice this.

Not counted: TE's cuDNN attention also saves its 16-byte RNG state and cu_seqlens, views of one
cached int32 [b + 1] tensor: an offloaded layer copies 16 + 4(b + 1) bytes more to the host; and a
reloaded layer's copies of the shared freqs and cu_seqlens are new GPU tensors, so the backward of
layer L - 2, where layer N - 1 comes back, holds 4s·d_rope + 4(b + 1) bytes more than the last
layer's (a moment the floor does not take; the loss's backward is larger wherever v > h).
"""

import sympy

from actmem.memory import engine
from actmem.memory.term import ALWAYS, SBH, Region, Scope, Term
from actmem.model.symbols import a, h, s
from actmem.model.widths import ACTIVATION_BYTES as A16, LOGITS_BYTES as F32

EMBEDDING_OUTPUT = Term(
    "embedding_output", A16 * SBH, Region.BOUNDARY, ALWAYS, Scope.EMBEDDING,
    "GPTModel.forward keeps the embedding's output (layer 0's input, 2sbh; 2sbh/t under SP) until it returns: "
    "offloaded with layer 0, it is freed on the GPU only after the loss (gpt_model.py, decoder_input)")

ROPE_FREQS = Term(
    "rope_freqs_copy", lambda arch: F32 * s * arch.rotary_dim(h, a), Region.REPLICATED, ALWAYS, Scope.LAYER,
    "TE's fused rope saves Megatron's fp32 freqs [s, 1, 1, d_rope], one tensor the layers share "
    "(rope.py, FusedRoPEFunc: save_for_backward(freqs, ...)); each offloaded layer copies it to the host",
    lambda arch: arch.position_embedding == "rope" and arch.rope_fusion)


def embedding_output_bytes(technique, arch) -> sympy.Expr:
    """The embedding's output, which the GPU keeps to the forward's end although layer 0 is offloaded."""
    return engine.term_bytes(EMBEDDING_OUTPUT, technique, arch)


def host_bytes_per_layer(technique, arch) -> sympy.Expr:
    """What one offloaded layer copies to the host for one microbatch: its saved activations and its
    copy of the rope freqs."""
    return engine.per_layer_bytes(technique, arch) + engine.term_bytes(ROPE_FREQS, technique, arch)
