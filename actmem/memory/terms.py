"""The table of saved tensors: what the backward pass keeps, op by op.

One row per tensor of section 4.1 (one transformer layer) and section 4.5 (the
embedding and output layer), sized in bytes with no parallelism: 16-bit
activations (2 bytes an element), 1-byte dropout masks, fp32 logits. Every
equation of the paper is a composition of this table (see ``engine``); the
mixture-of-experts rows are actmem.memory.terms_experts'.
"""

import sympy

from actmem.model.architecture import PAPER, checkpoint_causal_mask, checkpoint_position_ids, counts_norm_statistics, \
    dataloader_mask, dense_mlp, eager, \
    eager_keeping_16bit_softmax, eager_or_flash_grouped_value, eager_softmax_fp32, eager_with_attention_dropout, \
    flash, flash_attn, flash_grouped_key_value, flash_repeated_key_value, gelu, gelu_keeping_tanh_intermediates, \
    flash_heads, hidden_dropout, keeps_norm_input, op_checkpointing, latent, latent_query, loss_in_fp32_gradients, moe, \
    norm_keeps_fp32_copy, qk_norm, qk_norm_keeping_fp32_copy, \
    qk_norm_keeping_input, rotary_tables, swiglu, swiglu_keeping_silu_output, te_flash_core, te_flash_core_heads, te_layer_spec, \
    squared_relu, torch_softmax_16bit, torch_softmax_fp32, torch_softmax_making_mask, unfused_rope, \
    unfused_weight_gradients
from actmem.model.recompute import Recompute
from actmem.model.symbols import a, b, c, h, s, t, v
from actmem.model.fp8 import BLOCK_RECIPES
from actmem.model.widths import ACTIVATION_BYTES as A16, INDEX_BYTES as INDEX, LOGITS_BYTES as F32, \
    MASK_BYTES as MASK
from actmem.memory.terms_experts import HF_MOE_TERMS, MOE_TERMS
from actmem.memory.terms_latent import MLA_TERMS, MTP_TERMS
from actmem.memory.term import block_scales as _block_scales, fp8_scale_inv, gemm_input_bytes, \
    ALWAYS as _ALWAYS, CHECKPOINT as _CHECKPOINT, CHECKPOINTED as _CHECKPOINTED, \
    SBH as _sbh, STORED as _STORED, Region, Scope, Term, norm_statistics  # noqa: F401 (Region, Scope, Term: API)






def _block_recipe(arch) -> bool:
    """a block-scaled FP8 recipe (mxfp8, blockwise), whose saved inputs keep block scales"""
    return arch.fp8 in BLOCK_RECIPES


def _projection_input(arch):
    """The projection's 16-bit input: under FP8 delayed scaling only where it is the core's own output (flash-attn
    hands the projection a copy at b > 1, which nothing keeps then)."""
    whole = _sb_attention(1)(arch)
    return whole * (1 - sympy.Min(b - 1, 1)) if arch.fp8 == "delayed" and arch.attention_core == "flash-attn" else whole


def _core_attn_under_delayed_fp8(arch):
    """Under FP8 delayed scaling the core's checkpoint is all that would keep its output: core_attn drops it."""
    return "core_attn" if arch.fp8 == "delayed" else None


def _fp8_delayed(arch) -> bool:
    """FP8 delayed scaling, where proj keeps its input quantized beside the 16-bit one (actmem.model.fp8)"""
    return arch.fp8 == "delayed"


def _sb_attention(width: int):
    """An sb x (width·a·d) 16-bit tensor: a·d is h unless the head dim d is given."""
    return lambda arch: A16 * width * s * b * arch.attention_width(h, a)


def _sb_keys(arch):
    """k (or v) under flash: 2sb·gd, g groups not expanded to a heads."""
    return A16 * s * b * arch.kv_width(h, a)


def _sb_keys_values(arch):
    """k and v under flash: 2 x 2sb·gd."""
    return 2 * _sb_keys(arch)


def _value(arch):
    """V as ·V keeps it: expanded to a heads under the eager core (2sb·ad), g groups wide under flash."""
    return _sb_attention(1)(arch) if eager(arch) else _sb_keys(arch)


def _te_value_copy(arch):
    """'core_attn' where V is TE's contiguous copy, made inside the core attention (flash under
    Megatron); under the eager core V is kept by the checkpoint too: no module drops it."""
    return "core_attn" if te_flash_core(arch) else None


def _sb_qkv_output(arch):
    """The QKV linear's whole output: q, k and v side by side, 2sb·(ad + 2gd)."""
    return A16 * s * b * (arch.attention_width(h, a) + 2 * arch.kv_width(h, a))


def _sb_queries_keys(arch):
    """q and k side by side: 2sb·(ad + gd)."""
    return A16 * s * b * (arch.attention_width(h, a) + arch.kv_width(h, a))


def _repeated_keys_values(arch):
    """k and v after torchtitan's repeat_kv (2 x 2sb·ad), unsharded size: unsqueeze, expand
    and reshape copy them to a heads, except where the reshape is a view: no query groups
    (n_rep = 1) or one group a rank (t = g: the expanded dim merges with a dim of size 1), and
    then the g/t-wide rope and wv outputs themselves are kept (2 x 2sb·gd)."""
    grouped = _sb_keys_values(arch)
    if arch.query_groups is None:
        return grouped
    return sympy.Piecewise((grouped, sympy.Eq(t, arch.query_groups)), (_sb_attention(2)(arch), True))


def _mlp_with_fused_norm(arch):
    """'mlp' where the MLP's norm is fused into linear_fc1, inside the MLP's checkpoint (TE's
    layer spec: the checkpoint keeps the norm's input); under Megatron's local spec (the eager
    core) the norm is a module of its own, outside, and the checkpoint keeps its output. A MoE
    layer's pre-MLP norm is a TENorm of its own, and 'mlp' leaves a MoE layer whole
    (transformer_layer.py: recompute_mlp only where not is_moe_layer): 'pre_mlp_layernorm', the part of
    --recompute-modules layernorm that reruns that norm (CheckpointWithoutOutput) and frees its output once the
    MoE layer has run."""
    if moe(arch):      # its pre-MLP norm: a TENorm of its own, which --recompute-modules layernorm reruns
        return "pre_mlp_layernorm"
    return "mlp" if te_layer_spec(arch) else None


def _latent_input_norm(arch):
    """'input_layernorm' where the input norm is a TENorm of its own (multi-latent attention's layer spec), the
    part of --recompute-modules layernorm that reruns it (transformer_layer.py: CheckpointWithoutOutput, its output
    discarded once the attention has run); None where TE fuses it into the QKV linear (IdentityOp)."""
    return "input_layernorm" if latent(arch) else None


def _latent_fp8(arch) -> bool:
    """multi-latent attention under FP8, where its q and kv linears on the norm's output keep a copy each"""
    return latent(arch) and bool(arch.fp8)


def _latent_block_fp8(arch) -> bool:
    """multi-latent attention under a block-scaled FP8 recipe"""
    return latent(arch) and arch.fp8 in BLOCK_RECIPES


def _q_copy_module(arch):
    """What drops the q linear's FP8 copy of the norm's output: the q down projection runs outside the
    mla_up_proj checkpoint, before it (its input norm's, as qkv_input), the q projection without a latent
    inside it (multi_latent_attention.py, qkv_up_proj_and_rope_apply under CheckpointWithoutOutput)."""
    return "mla_up_proj" if not latent_query(arch) else _latent_input_norm(arch)


def _layernorm_rerun_none(arch):
    """What the input norm's rerun (--recompute-modules layernorm) makes of the q linear's FP8 copy of its output:
    nothing, as of each copy but the one qkv_input's remade stands for, the norm's 16-bit output restored in place
    (random.py, CheckpointWithoutOutput), which the down projections saved under FP8 in place of their copies
    (multi_latent_attention.py, set_for_recompute_input_layernorm: set_save_original_input). None (the row itself)
    where the copy is the q projection's, which the mla_up_proj rerun remakes."""
    return 0 if latent_query(arch) else None


def _sbf(width: int):
    """An sb x (width·f) 16-bit tensor; f is the architecture's MLP size (4h by default)."""
    return lambda arch: A16 * width * s * b * arch.ffn(h)


def _dense(present):
    """The dense MLP's row: present where ``present`` says and the MLP is not a mixture of experts."""
    def dense_and(arch):
        return dense_mlp(arch) and present(arch)

    dense_and.__doc__ = f"{present.__doc__} (a dense MLP)"
    return dense_and


#: torchtitan's per-op selective checkpointing (activation_checkpoint.mode "selective", selective_ac_option "op";
#: distributed/activation_checkpoint.py @018740b7, _apply_op_sac; the list: models/llama3/infra/parallelize.py,
#: _op_sac_save_list): each block is checkpointed (non-reentrant, keeping its input: layer_input_checkpoint), and
#: the checkpoint caches the outputs of the listed ops it runs, besides SDPA's (projection_input, softmax_lse):
#: aten.mm's, but every second one (its policy counts the block's matmuls and recomputes the even ones: of wq, wk,
#: wv, wo, w1, w3, w2, the 1st, 3rd, 5th and 7th), and _c10d_functional.reduce_scatter_tensor's. Nothing else
#: of the block is kept; its backward reruns the block, taking the cached outputs back
OP_CHECKPOINT_TERMS = (
    Term("query_projection_output", _sb_attention(1), Region.BLOCK, frozenset(), Scope.LAYER,
         "per-op checkpointing caches wq's matmul output, the block's first (2sb·ad), which rope then copies",
         op_checkpointing, op_saved=True),
    Term("value_projection_output", _sb_keys, Region.BLOCK, frozenset(), Scope.LAYER,
         "... wv's, the third (2sb·gd, g groups wide: repeat_kv copies it or views it)", op_checkpointing,
         op_saved=True),
    Term("gate_projection_output", _sbf(1), Region.BLOCK, frozenset(), Scope.LAYER,
         "... w1's, the fifth (2sbf): silu's input, half of the swiglu_input row",
         op_checkpointing, op_saved=True),
    Term("fc2_partial_output", A16 * _sbh, Region.REPLICATED, frozenset(), Scope.LAYER,
         "... w2's, the seventh (2sbh): under tensor parallelism its partial sums, before the reduce-scatter (or "
         "all-reduce) that RowwiseParallel makes after it, so whole on every rank, divided by nothing",
         op_checkpointing, op_saved=True),
    Term("reduce_scatter_outputs", 2 * A16 * _sbh, Region.BOUNDARY, frozenset(), Scope.LAYER,
         "... and under sequence parallelism the reduce-scatters' outputs, wo's and w2's, each the rank's s/t "
         "rows (2 x 2sbh/t); without it RowwiseParallel all-reduces, which the list does not name",
         op_checkpointing, op_saved=True, only_under_sp=True),
)


TERMS = (
    # -- attention block, section 4.1: 11sbh + 5as²b ----------------------------------
    Term("attention_layernorm_input", A16 * _sbh, Region.BOUNDARY, _STORED, Scope.LAYER,
         "layer norm before attention keeps its input (4.1, layer norm 2sbh)", keeps_norm_input),
    # the norms' statistics: TE's fused norms keep them (layernorm_linear.py, _LayerNormLinear:
    # mu, rsigma); the paper leaves them out, and so does its eager path
    Term("attention_norm_statistics", norm_statistics(1), Region.BOUNDARY, _STORED, Scope.LAYER,
         "the norm before attention keeps fp32 statistics, 8 B a token for LayerNorm (mu, rsigma) and "
         "4 B for RMSNorm (rsigma); counted on the flash path, beside TE's kernels, and under every "
         "other code", counts_norm_statistics, module=_latent_input_norm),
    Term("qkv_input", lambda arch: gemm_input_bytes(arch) * _sbh, Region.BOUNDARY, _STORED, Scope.LAYER,
         "Q, K, V matmuls keep their shared input (4.1, 2sbh); under multi-latent attention the q and kv down "
         "projections keep it, one storage (TELinear: saved_inputmat = inputmat), which --recompute-modules "
         "layernorm frees once the attention has run; under FP8 TE's LayerNormLinear keeps the norm's output "
         "quantized, one byte an element, with its 4-byte scale_inv (layernorm_linear.py: ln_out)",
         module=_latent_input_norm, fixed=fp8_scale_inv, remade=lambda arch: A16 * _sbh),
    Term("qkv_input_scales", _block_scales(s * b / t, h, gathered=True), Region.REPLICATED, _STORED, Scope.LAYER,
         "under a block-scaled FP8 recipe the norm's output keeps its block scales beside it, of the rank's s·b/t "
         "rows under SP (MXFP8: E8M0 a 32 elements; blockwise: fp32 a 128)", _block_recipe, module=_latent_input_norm,
         remade=lambda arch: 0),
    # under FP8 multi-latent attention's two linears on the input norm's output keep a copy each (the kv down
    # projection's is qkv_input above)
    Term("qkv_input_q_fp8", _sbh, Region.BOUNDARY, _STORED, Scope.LAYER,
         "under FP8 multi-latent attention's q down projection (TELinear, duplicated), or without a q latent its "
         "q projection (TEColumnParallelLinear, the rank's shard under SP), keeps its own copy of the norm's "
         "output, one byte an element, with its scale_inv (linear.py: each module quantizes its input; the "
         "16-bit output is then kept by neither; sbh + 4)", _latent_fp8, module=_q_copy_module, fixed=fp8_scale_inv,
         remade=_layernorm_rerun_none),
    Term("qkv_input_q_scales", _block_scales(s * b / t, h, gathered=True), Region.REPLICATED, _STORED, Scope.LAYER,
         "... under a block-scaled recipe, that copy's block scales", _latent_block_fp8, module=_q_copy_module,
         remade=_layernorm_rerun_none),
    *MLA_TERMS,
    # q_layernorm and k_layernorm (--qk-layernorm; attention.py, get_query_key_value_tensors: after
    # the split, before rope): TENorm is TE's op-based RMSNorm or LayerNorm, whose op_forward
    # (ops/basic/rmsnorm.py, layer_norm.py) saves x = input_.contiguous() and fp32 rstdevs (and
    # means), one a head a token
    Term("qk_norm_input", _sb_queries_keys, Region.BLOCK, _STORED, Scope.LAYER,
         "the q and k norms keep their inputs made contiguous (2sb·(a + g)d): q is copied out of the QKV "
         "output's groups by its reshape, k is a strided view of it that TE's norm copies", qk_norm_keeping_input),
    Term("qk_norm_input_fp32", lambda arch: 2 * _sb_queries_keys(arch), Region.BLOCK, _STORED, Scope.LAYER,
         "transformers' Qwen3RMSNorm on q and k (modeling_qwen3.py, as LlamaRMSNorm) keeps an fp32 copy of its "
         "input, not the input (4sb·(a + g)d)", qk_norm_keeping_fp32_copy),
    Term("qk_norm_normalized", _sb_queries_keys, Region.BLOCK, _STORED, Scope.LAYER,
         "and its 16-bit normalized tensor, the weight's other factor (2sb·(a + g)d)", qk_norm_keeping_fp32_copy),
    Term("qk_norm_statistics", lambda arch: F32 * arch.norm_statistics * s * b * (a + arch.query_groups_or(a)),
         Region.BLOCK, _STORED, Scope.LAYER,
         "the q and k norms keep fp32 statistics, one (RMSNorm) or two (LayerNorm) a head a token: "
         "4sb·(a + g) for RMSNorm (Qwen3RMSNorm's rsqrt, the same)", qk_norm),
    Term("rope_cos_sin", lambda arch: 4 * A16 * s * arch.rotary_dim(h, a), Region.REPLICATED, _STORED,
         Scope.LAYER,
         "Megatron's unfused rope (--no-rope-fusion; rope_utils.py, _apply_rotary_pos_emb_bshd) makes "
         "cos_ = cos(freqs).to(t.dtype) and sin_ at each call, for q and again for k, and t * cos_ and "
         "rotate_half(t) * sin_ keep them: 4 x 2sd, the whole sequence the attention sees (s/c under "
         "context parallelism), on every rank; d is the rotated dims, int(d·percent) under --rotary-percent",
         unfused_rope),
    # the eager core (the paper's, Megatron-Core's local DotProductAttention)
    Term("query_key", _sb_attention(2), Region.BLOCK, _STORED, Scope.LAYER,
         "QKᵀ keeps Q and K (4.1, 4sbh; 4sb·ad with head dim d). With query groups Megatron's "
         "local attention expands K to a heads first (dot_product_attention.py: repeat_interleave, "
         "a copy), so K is as wide as Q", eager),
    Term("softmax_output", A16 * a * s**2 * b, Region.BLOCK, _STORED, Scope.LAYER,
         "softmax keeps its output (4.1, 2as²b): Megatron's fused kernel its 16-bit probabilities, as torch's "
         "fallback softmax does in 16 bits; after an fp32 softmax, the 16-bit copy ·V keeps, none where attention "
         "dropout comes between (the dropout keeps its mask, ·V the dropout output)",
         eager_keeping_16bit_softmax, module="core_attn"),
    Term("softmax_output_fp32", F32 * a * s**2 * b, Region.BLOCK, _STORED, Scope.LAYER,
         "an fp32 softmax keeps its output (4as²b): transformers' Llama eager attention beside the 16-bit "
         "copy ·V keeps (modeling_llama.py, eager_attention_forward: softmax(..., dtype=torch.float32)"
         ".to(query.dtype)); Megatron's torch fallback under --attention-softmax-in-fp32 (fused_softmax.py, "
         "forward_torch_softmax: input.float(), torch.nn.Softmax, then .bfloat16(), which keeps nothing)",
         eager_softmax_fp32, module="core_attn"),
    # Megatron's local core where its fused kernel does not run: forward_torch_softmax makes the
    # causal mask when handed none, and attention_mask_func fills the scores with it in place
    # (masked_fill_ keeps the mask for its backward)
    Term("softmax_causal_mask", MASK * s**2, Region.REPLICATED, _STORED, Scope.LAYER,
         "torch's fallback softmax, handed no mask, makes the causal mask at each call (utils.py, "
         "get_default_causal_mask: triu(ones(s, s)).bool(), not cached: s² bytes of bool a layer) and "
         "masked_fill_ keeps it (attention_mask_func), whole on every rank", torch_softmax_making_mask,
         module="core_attn"),
    Term("softmax_dropout_mask", MASK * a * s**2 * b, Region.BLOCK, _STORED, Scope.LAYER,
         "attention dropout keeps its 1-byte mask (4.1, as²b)", eager_with_attention_dropout, module="core_attn"),
    Term("softmax_dropout_output", A16 * a * s**2 * b, Region.BLOCK, _STORED, Scope.LAYER,
         "attention over V keeps the dropout output (4.1, 2as²b); with no attention dropout "
         "it keeps the softmax output, counted once above", eager_with_attention_dropout, module="core_attn"),
    # the flash core: TE's cuDNN fused attention (FusedAttnFunc: save_for_backward of q, k, v,
    # out and aux_ctx_tensors = softmax stats, rng state) and flash-attn
    # (flash_attn_interface.py, FlashAttnFunc: q, k, v, out, softmax_lse, rng_state)
    Term("query", _sb_attention(1), Region.BLOCK, _STORED, Scope.LAYER,
         "flash attention keeps q (2sb·ad): after rope, a tensor of its own", flash_heads),
    Term("key", _sb_keys, Region.BLOCK, _STORED, Scope.LAYER,
         "flash attention keeps k, g groups wide, never expanded to a heads (2sb·gd): after rope (or the "
         "k norm), a tensor of its own", flash_grouped_key_value),
    Term("value", _value, Region.BLOCK, _STORED, Scope.LAYER,
         "attention over V keeps V (4.1, 2sbh): under the eager core expanded to a heads as K is (2sb·ad); "
         "under flash g groups wide (2sb·gd), TE's contiguous copy of the QKV output's v view, which "
         "Megatron's core_attn checkpoint drops", eager_or_flash_grouped_value, module=_te_value_copy),
    # Megatron's core_attn checkpoint (attention.py, _checkpointed_attention_forward:
    # tensor_parallel.checkpoint(custom_forward, False, query, key, value, ...), whose
    # CheckpointFunction saves its inputs) keeps the rotated q and k, the rows above, and v,
    # a view of the QKV output (get_query_key_value_tensors: SplitAlongDim), so that whole
    # storage; TE's copy of v, the log-sum-exp and the output are made again in the backward
    Term("qkv_output", _sb_qkv_output, Region.BLOCK, _CHECKPOINTED, Scope.LAYER,
         "the core_attn checkpoint keeps v as the QKV linear made it, a view of that output, so the whole "
         "output (2sb·(a + 2g)d) stays: kept only under selective recompute of the attention core",
         te_flash_core_heads, kept_by="core_attn"),
    Term("repeated_key_value", _repeated_keys_values, Region.BLOCK, _STORED, Scope.LAYER,
         "flash attention keeps k and v expanded to a heads (2 x 2sb·ad): torchtitan's Attention "
         "calls repeat_kv (expand, then reshape: a copy) before F.scaled_dot_product_attention "
         "(llama3/model/model.py @018740b7); g groups wide where that reshape is a view (g = t, "
         "or no query groups). torchtitan's newer GQAttention (common/attention.py) passes "
         "enable_gqa instead and keeps g groups always: not modelled", flash_repeated_key_value),
    Term("softmax_lse", F32 * b * a * s, Region.BLOCK, _STORED, Scope.LAYER,
         "flash attention keeps the softmax's fp32 log-sum-exp, one a query row (4bas); with "
         "dropout it keeps the RNG state (16 B) and regenerates the mask, keeping none; torchtitan's per-op "
         "checkpointing caches it, an output of SDPA's kernel (in its _op_sac_save_list)", flash,
         module="core_attn", op_saved=True),
    Term("flash_output", lambda arch: _sb_attention(1)(arch) * sympy.Min(b - 1, 1), Region.BLOCK,
         _STORED, Scope.LAYER,
         "flash-attn keeps its output in its own bshd layout; TE's FlashAttention.forward hands the "
         "projection output.view(b, s, -1).transpose(0, 1).contiguous(), a second copy when b > 1 "
         "(2sb·ad, none at b = 1)", flash_attn, module="core_attn"),
    Term("projection_input", _projection_input, Region.BLOCK, _STORED, Scope.LAYER,
         "output projection keeps its input (4.1, 2sbh; 2sb·ad); under flash this is the "
         "kernel's own output, one storage: TE's sbhd layout makes the reshape a view; under FP8 delayed "
         "scaling the projection keeps only its quantized copy (below), so this is the core's own output alone: "
         "not kept where the core is recomputed, nor flash-attn's copy for the projection at b > 1; torchtitan's "
         "per-op checkpointing caches it, SDPA's output",
         module=_core_attn_under_delayed_fp8, op_saved=True),
    Term("projection_input_fp8", lambda arch: s * b * arch.attention_width(h, a), Region.BLOCK, _STORED, Scope.LAYER,
         "under FP8 delayed scaling the projection keeps its input quantized, its transposed (columnwise) copy, "
         "one byte an element, with its 4-byte scale_inv, and not the 16-bit input (linear.py: "
         "update_usage(rowwise_usage=False); TE refuses save_original_input there, which Megatron sets under "
         "every other recipe to keep the 16-bit input alone: attention.py)", _fp8_delayed, fixed=fp8_scale_inv),
    Term("attention_dropout_mask", MASK * _sbh, Region.BOUNDARY, _STORED, Scope.LAYER,
         "dropout after the projection keeps its 1-byte mask (4.1, sbh)", hidden_dropout),
    # -- MLP block, section 4.1: 19sbh ------------------------------------------------
    Term("mlp_layernorm_input", A16 * _sbh, Region.BOUNDARY, _STORED, Scope.LAYER,
         "layer norm before the MLP keeps its input (4.1, layer norm 2sbh); with the MLP recomputed "
         "under TE's spec it is what the MLP's checkpoint keeps, one storage", keeps_norm_input),
    Term("mlp_norm_statistics", norm_statistics(1), Region.BOUNDARY, _STORED, Scope.LAYER,
         "the norm before the MLP keeps fp32 statistics (as attention_norm_statistics); TE fuses it "
         "into linear_fc1, inside the MLP's checkpoint (a MoE layer's is a TENorm of its own)", counts_norm_statistics, module=_mlp_with_fused_norm),
    Term("fc1_input", lambda arch: gemm_input_bytes(arch) * _sbh, Region.BOUNDARY, _STORED, Scope.LAYER,
         "h→4h linear keeps its input (4.1, 2sbh); with the MLP recomputed under Megatron's local spec "
         "(the eager core) it is what the MLP's checkpoint keeps; under FP8 the norm's output quantized, one "
         "byte an element, with its 4-byte scale_inv", dense_mlp, module=_mlp_with_fused_norm, fixed=fp8_scale_inv),
    Term("fc1_input_scales", _block_scales(s * b / t, h, gathered=True), Region.REPLICATED, _STORED, Scope.LAYER,
         "... and under a block-scaled recipe its block scales, as the QKV's", _dense(_block_recipe),
         module=_mlp_with_fused_norm),
    *MOE_TERMS,
    *HF_MOE_TERMS,
    Term("gelu_input", _sbf(1), Region.BLOCK, _STORED, Scope.LAYER,
         "GeLU keeps its input (4.1, 8sbh; 2sbf for an MLP of size f); Megatron's fused "
         "bias-GeLU saves its input and the bias, a parameter", _dense(gelu), module="mlp"),
    Term("gelu_tanh_intermediates", _sbf(3), Region.BLOCK, _STORED, Scope.LAYER,
         "GeLU's tanh form written in Python keeps three more f-wide tensors (3 x 2sbf): transformers' "
         "gelu_new (activations.py, NewGELUActivation: 0.5 * x * (1 + tanh(√(2/π)(x + 0.044715x³)))) "
         "keeps tanh's output (tanh saves its result) and both factors of the last product, 0.5x and "
         "1 + tanh; pow keeps x, the GeLU input above", _dense(gelu_keeping_tanh_intermediates), module="mlp"),
    Term("swiglu_input", _sbf(2), Region.BLOCK, _STORED, Scope.LAYER,
         "SwiGLU keeps only its 2f-wide input (Megatron's fused_bias_swiglu.py: SwiGLUFunction "
         "saves input_for_backward; 4sbf); unfused (torchtitan), the same bytes as two f-wide "
         "tensors, w1 x (silu's input) and w3 x (the product's other factor)", _dense(swiglu), module="mlp"),
    Term("silu_output", _sbf(1), Region.BLOCK, _STORED, Scope.LAYER,
         "an unfused SwiGLU keeps silu's output too (2sbf): silu(w1 x) * w3 x saves both factors "
         "of the product, and silu its input (torchtitan's FeedForward.forward)", _dense(swiglu_keeping_silu_output),
         module="mlp"),
    # megatron/core/activations.py: squared_relu(x) = torch.pow(F.relu(x), 2), which mlp.py calls
    # unfused (Megatron refuses bias_activation_fusion for it: transformer_config.py)
    Term("squared_relu_output", _sbf(1), Region.BLOCK, _STORED, Scope.LAYER,
         "the squared ReLU keeps one f-wide tensor (2sbf): eager, relu saves its output and pow saves "
         "the same tensor as its input; under Megatron's jit_fuser (torch.compile) the partitioner "
         "saves one tensor of that shape, relu's input or output (its backward needs one of them); "
         "the bias, when there is one, is added before it and keeps nothing", _dense(squared_relu), module="mlp"),
    Term("fc2_input", lambda arch: gemm_input_bytes(arch) * s * b * arch.ffn(h), Region.BLOCK, _STORED, Scope.LAYER,
         "f→h linear keeps its input, the activation's output (4.1, 8sbh; 2sbf); under FP8 its columnwise copy "
         "(on Hopper the transpose), one byte an element, with its 4-byte scale_inv (linear.py: "
         "update_usage(rowwise_usage=False))", dense_mlp, module="mlp", fixed=fp8_scale_inv),
    Term("fc2_input_scales", lambda arch: _block_scales(s * b, arch.ffn(h) / t, gathered=False)(arch),
         Region.REPLICATED, _STORED, Scope.LAYER,
         "... and under a block-scaled recipe the block scales of its columnwise copy [s·b, f/t]", _dense(_block_recipe),
         module="mlp"),
    Term("mlp_dropout_mask", MASK * _sbh, Region.BOUNDARY, _STORED, Scope.LAYER,
         "dropout after the MLP keeps its 1-byte mask (4.1, sbh)", hidden_dropout),
    # -- transformers' LlamaRMSNorm (modeling_llama.py, LlamaRMSNorm.forward): x.to(float32),
    # pow(2) and the mul by rsqrt keep that fp32 copy; weight * x.to(input_dtype) keeps the
    # 16-bit normalized tensor; the 16-bit input itself is kept by nothing
    Term("norm_input_fp32", 2 * F32 * _sbh, Region.BOUNDARY, _STORED, Scope.LAYER,
         "the two norms keep an fp32 copy of their input (2 x 4sbh; LlamaRMSNorm upcasts)", norm_keeps_fp32_copy),
    Term("norm_normalized", 2 * A16 * _sbh, Region.BOUNDARY, _STORED, Scope.LAYER,
         "the two norms keep their 16-bit normalized tensor, the weight's other factor (2 x 2sbh)",
         norm_keeps_fp32_copy),
    # -- full recompute, section 5: only the layer input is checkpointed ---------------
    Term("layer_input_checkpoint", A16 * _sbh, Region.BOUNDARY, _CHECKPOINT, Scope.LAYER,
         "full recompute keeps the layer input (5, 2sbh; 2sbh/t when already split by SP)"),
    *OP_CHECKPOINT_TERMS,
    # -- first and last stage, section 4.5 ---------------------------------------------
    Term("embedding_dropout_mask", MASK * _sbh, Region.BOUNDARY, _ALWAYS, Scope.EMBEDDING,
         "dropout after the input embedding keeps its 1-byte mask (4.5, sbhp/t under SP)",
         hidden_dropout),
    Term("rotary_tables", lambda arch: 2 * A16 * s * arch.head_dim_or(h, a), Region.BOUNDARY, _ALWAYS,
         Scope.EMBEDDING, "the rotary cos and sin, 16-bit (1, s, d) each, made once a forward and kept by "
         "every layer's q·cos and rotate_half(q)·sin (transformers' LlamaRotaryEmbedding; 4sd)", rotary_tables),
    # transformers' GradientCheckpointingLayer (modeling_layers.py, forward_with_checkpointing) checkpoints
    # partial(forward, self, **kwargs) on the hidden states: torch's non-reentrant checkpoint (the default of
    # modeling_utils.py, _activation_checkpointing_enable: use_reentrant False) keeps that partial, and with it
    # every keyword the layer is given, until the layer's backward; one tensor for all layers
    Term("checkpoint_position_ids", INDEX * s, Region.REPLICATED, _CHECKPOINT, Scope.EMBEDDING,
         "full recompute: every layer's checkpoint holds the int64 position ids, (1, s), that LlamaModel.forward "
         "hands each layer beside the rotary tables (8s)", checkpoint_position_ids),
    Term("checkpoint_causal_mask", A16 * b * s * s, Region.REPLICATED, _CHECKPOINT, Scope.EMBEDDING,
         "full recompute: every layer's checkpoint holds the eager core's 16-bit additive causal mask, "
         "(b, 1, s, s), made once a forward (masking_utils.eager_mask; 2bs²)", checkpoint_causal_mask),
    # Megatron's dataloader mask (gpt_dataset.py, _get_ltor_masks_and_position_ids: [1, s, s] bool,
    # batched to [b, 1, s, s]; utils.py, get_batch_on_this_tp_rank: on the GPU of every tensor-
    # parallel rank of the first and last stages): every layer's core_attn checkpoint, and full
    # recompute's, takes it as an argument, and CheckpointFunction saves its arguments. Under
    # context parallelism get_batch_on_this_cp_rank keeps a rank's s/c rows (index_select: a
    # copy) of all s columns; s binds to s/c, so the whole sequence is c·s
    Term("attention_mask", MASK * b * s * (c * s), Region.REPLICATED, frozenset({Recompute.SELECTIVE, Recompute.FULL}),
         Scope.BATCH, "the dataloader's causal mask, b·s² bytes of bool (b·(s/c)·s under context parallelism), "
         "whole on every tensor-parallel rank: kept by the recompute checkpoints (core_attn's and full "
         "recompute's) while its microbatch is in flight; the causal kernels never read it. Torch's fallback "
         "softmax fills the scores with it (attention_mask_func: masked_fill_ keeps it) in every layer, so there "
         "it is kept under every recompute mode", dataloader_mask, kept_by="core_attn",
         kept_under_torch_softmax=_ALWAYS),
    Term("final_layernorm_input", A16 * _sbh, Region.BOUNDARY, _ALWAYS, Scope.OUTPUT,
         "final layer norm keeps its input (4.5, 2sbh/t under SP)", keeps_norm_input),
    Term("final_norm_input_fp32", F32 * _sbh, Region.BOUNDARY, _ALWAYS, Scope.OUTPUT,
         "the final LlamaRMSNorm keeps an fp32 copy of its input (4sbh)", norm_keeps_fp32_copy),
    Term("final_norm_normalized", A16 * _sbh, Region.BOUNDARY, _ALWAYS, Scope.OUTPUT,
         "the final LlamaRMSNorm keeps its 16-bit normalized tensor (2sbh)", norm_keeps_fp32_copy),
    Term("final_norm_statistics", norm_statistics(1), Region.BOUNDARY, _ALWAYS, Scope.OUTPUT,
         "the final norm's fp32 statistics (as attention_norm_statistics)", counts_norm_statistics),
    Term("output_layer_input", lambda arch: A16 * _sbh * (1 + arch.mtp_layers), Region.BOUNDARY, _ALWAYS,
         Scope.OUTPUT, "output layer keeps its input (4.5, 2sbh/t under SP); with D multi-token-prediction layers "
         "the main and the D predictions' hidden states are one tensor, torch.cat along the sequence "
         "(multi_token_prediction.py, MultiTokenPredictionBlock.forward), whose chunks the D + 1 output layers "
         "keep: (1 + D)·2sbh/t"),
    Term("logits_fp32", lambda arch: F32 * s * b * v * (1 + arch.mtp_layers), Region.BLOCK, _ALWAYS, Scope.OUTPUT,
         "cross entropy keeps fp32 logits, split over the vocabulary (4.5, 4sbv/t); with D multi-token-prediction "
         "layers D more, one a prediction (gpt_model.py, _postprocess: output_layer and "
         "compute_language_model_loss a depth)"),
    *MTP_TERMS,
)

def layer_terms(arch) -> tuple:
    """The rows of one layer of this architecture."""
    return tuple(term for term in TERMS if term.scope is Scope.LAYER and term.present(arch))


LAYER_TERMS = layer_terms(PAPER)
"""The rows of the paper's layer (section 4.1)."""
STAGE_TERMS = tuple(term for term in TERMS if term.scope is not Scope.LAYER)

LAYER_OUTPUT_GRADIENT = Term(
    "layer_output_gradient", A16 * _sbh, Region.BOUNDARY, _ALWAYS, Scope.LAYER,
    "the gradient on the layer's residual stream (received from the next stage, or the final norm's), "
    "held for the residual branch until the block's own gradient is added (2sbh/t under SP)")

#: The backward of the MLP's first linear (fc1), the transients live beside the saved rows it
#: has not freed yet (actmem.memory.backward's fc1 moment). TE's _LayerNormLinear.backward
#: (layernorm_linear.py) all-gathers the saved input shard under SP for the weight gradient,
#: makes the input gradient of the whole sequence (dgrad) and allocates its reduce-scatter's
#: shard: when that shard is allocated, all of them and the output gradient are live (the
#: wgrad GEMM follows; TE may release dgrad's storage to the collective's stream before it).
#: Megatron's LinearWithGradAccumulationAndAsyncCommunication (tensor_parallel/layers.py, the
#: local spec) holds them through its wgrad. Without SP nothing is gathered and dgrad is
#: all-reduced in place: the two SP_ONLY rows are 0, and at t = 1 too.
MLP_BACKWARD_TERMS = (
    Term("fc1_output_gradient", lambda arch: A16 * arch.fc1_width * s * b * arch.ffn(h), Region.BLOCK, _ALWAYS,
         Scope.LAYER, "the gradient fc1's backward starts from: the activation's input gradient (2sbf/t; "
         "4sbf/t for SwiGLU's 2f-wide input)"),
    Term("fc1_input_gathered", lambda arch: gemm_input_bytes(arch) * _sbh, Region.REPLICATED, _ALWAYS, Scope.LAYER,
         "under SP, fc1's saved input shard all-gathered again for its weight gradient (2sbh; under FP8 the "
         "quantized shard, one byte an element: on Hopper its transpose is made beside it, not counted, a floor)"),
    Term("fc1_input_gradient", A16 * _sbh, Region.REPLICATED, _ALWAYS, Scope.LAYER,
         "fc1's input gradient for the whole sequence (dgrad, 2sbh), before its reduce-scatter (SP) or "
         "all-reduce (in place)"),
    Term("fc1_input_gradient_shard", A16 * _sbh, Region.BOUNDARY, _ALWAYS, Scope.LAYER,
         "under SP, the reduce-scatter's output, this rank's shard of that gradient (2sbh/t)"),
    Term("fc1_weight_gradient", lambda arch: A16 * arch.fc1_width * arch.ffn(h) * h, Region.BLOCK, _ALWAYS,
         Scope.LAYER, "without gradient accumulation fusion, fc1's 16-bit weight gradient, made by the wgrad GEMM "
         "while its input is gathered and its input gradient's reduce-scatter is in flight (TE linear.py), before "
         "DDP's hook adds it to main_grad (2·fc1 width·f·h/t)", unfused_weight_gradients),
    LAYER_OUTPUT_GRADIENT,
)
#: The backward of an unfused SwiGLU's product, act_fn(gate_proj(x)) * up_proj(x) (transformers' LlamaMLP;
#: torchtitan's FeedForward, silu(w1 x) * w3 x, each f-wide tensor a rank's f/t),
#: at the second of mul's two gradients: down_proj's input gradient (the product's), and the gradients of
#: silu's output and of up_proj's output made from it, live beside the layer's output gradient; the product
#: itself (down_proj's saved input) already freed, mul's saved factors not yet (actmem.memory.backward's
#: swiglu moment). Measured at that op (validate's zero.py).
SWIGLU_BACKWARD_TERMS = (
    Term("swiglu_product_gradient", lambda arch: A16 * s * b * arch.ffn(h), Region.BLOCK, _ALWAYS, Scope.LAYER,
         "down_proj's input gradient, the product's (2sbf/t)"),
    Term("swiglu_factor_gradients", lambda arch: 2 * A16 * s * b * arch.ffn(h), Region.BLOCK, _ALWAYS, Scope.LAYER,
         "mul's backward: the gradients of silu's output and of up_proj's output (2 x 2sbf/t)"),
    LAYER_OUTPUT_GRADIENT,
)

#: the MLP_BACKWARD_TERMS that exist only under sequence parallelism
SP_ONLY = frozenset({"fc1_input_gathered", "fc1_input_gradient_shard"})

#: the core's backward moments share these (CORE_BACKWARD_TERMS, SOFTMAX_BACKWARD_TERMS)
VALUE_GRADIENT = Term("value_gradient", _sb_attention(1), Region.BLOCK, _ALWAYS, Scope.LAYER,
                      "·V's backward: v's gradient, a heads wide as ·V saw it (2sb·ad/t)", eager)
CORE_OUTPUT_GRADIENT = Term(
    "core_output_gradient", _sb_attention(1), Region.BLOCK, frozenset({Recompute.SELECTIVE}), Scope.LAYER,
    "the gradient of the core's output, held by the core's checkpoint while it runs backward (2sb·ad/t)",
    eager, kept_by="core_attn")

#: The eager core's backward at its softmax's (Megatron's fused kernel works in place on its
#: input gradient) or, with attention dropout, at the dropout's: the gradient ·V's backward
#: made for the probabilities it saw, and the dropout's input gradient made from it, live
#: beside the softmax output and the mask the core keeps, while ·V's saved dropout output is
#: freed (its backward has run), and with query groups v's repeat_interleave copy too (without
#: them v is a view the q and k views hold); v's gradient from ·V's backward waits for q's and k's, and
#: the residual stream's gradient for the block's. Under the core's checkpoint (selective
#: recompute) CheckpointFunction.backward also holds the gradient it was handed, the core
#: output's.
CORE_BACKWARD_TERMS = (
    Term("probabilities_gradient", A16 * a * s**2 * b, Region.BLOCK, _ALWAYS, Scope.LAYER,
         "·V's backward: the gradient of the probabilities it multiplied (2as²b/t)", eager),
    Term("softmax_output_gradient", A16 * a * s**2 * b, Region.BLOCK, _ALWAYS, Scope.LAYER,
         "the attention dropout's backward: the softmax output's gradient, a new tensor (2as²b/t)",
         eager_with_attention_dropout),
    VALUE_GRADIENT,
    CORE_OUTPUT_GRADIENT,
    LAYER_OUTPUT_GRADIENT,
)


#: Torch's fallback softmax's backward (actmem.memory.backward's 'softmax' moment), where it holds the
#: most: in 16 bits at masked_fill_'s backward, which ran in place on the [b, a/t, s, s] view of
#: the scores (utils.py, attention_mask_func), so that autograd runs it inside CopySlices
#: (torch/csrc/autograd/functions/tensor.cpp, CopySlices::apply_impl), the softmax's output
#: freed by then; in fp32 at the softmax's own backward (_softmax_backward_data, not in place),
#: its fp32 output still held. The dropout's mask and output, and ·V's 16-bit probabilities,
#: are freed by then. Live beside them: v's gradient, the residual stream's and, under the
#: core's checkpoint, its output's.
SOFTMAX_BACKWARD_TERMS = (
    Term("masked_scores_gradient", A16 * a * s**2 * b, Region.BLOCK, _ALWAYS, Scope.LAYER,
         "the softmax backward's output, the masked scores' gradient, handed to the scores by the view's "
         "backward as a new tensor of their shape (AsStridedBackward: grad.new_zeros) (2as²b/t)", torch_softmax_16bit),
    Term("copy_slices_copies", 2 * A16 * a * s**2 * b, Region.BLOCK, _ALWAYS, Scope.LAYER,
         "CopySlices copies that gradient to its base's shape (new_empty_strided, copy_) and clones the view's "
         "slice for masked_fill_'s backward (2 x 2as²b/t)", torch_softmax_16bit),
    Term("scores_gradient", A16 * a * s**2 * b, Region.BLOCK, _ALWAYS, Scope.LAYER,
         "masked_fill_'s backward makes the scores' gradient, grad.masked_fill(mask, 0), a new tensor "
         "(2as²b/t), where Megatron's fused kernel works in place", torch_softmax_16bit),
    Term("softmax_output_gradient_fp32", F32 * a * s**2 * b, Region.BLOCK, _ALWAYS, Scope.LAYER,
         "in fp32, the gradient the softmax backward reads, of its output, made fp32 by the backward of the cast "
         "to 16 bits (ToCopyBackward) (4as²b/t)", torch_softmax_fp32),
    Term("scores_gradient_fp32", F32 * a * s**2 * b, Region.BLOCK, _ALWAYS, Scope.LAYER,
         "in fp32, the softmax backward's output, the masked scores' gradient, a new tensor (4as²b/t); "
         "masked_fill_'s backward follows on a tensor of its own (the upcast's), no CopySlices", torch_softmax_fp32),
    VALUE_GRADIENT,
    CORE_OUTPUT_GRADIENT,
    LAYER_OUTPUT_GRADIENT,
)

#: A layer rerun from its checkpoint makes its output again: CheckpointFunction.backward
#: (tensor_parallel/random.py) holds the rerun's outputs while it runs backward from them.
RERUN_OUTPUT = Term("layer_rerun_output", A16 * _sbh, Region.BOUNDARY, _ALWAYS, Scope.LAYER,
                    "full recompute's rerun makes the layer's output again (2sbh/t under SP), held while "
                    "the backward runs from it")

#: Tensors the backward allocates, not saved by the forward: each is live at one moment of
#: a stage's peak (actmem.memory.peak), never in the saved-activation count.
TRANSIENT_TERMS = (
    Term("logits_gradient_16bit", A16 * s * b * v, Region.BLOCK, _ALWAYS, Scope.OUTPUT,
         "the loss's gradient cast back to the 16-bit logits' dtype (2sbv/t), made while its fp32 "
         "gradient, the saved softmax updated in place, is still live: Megatron's "
         "VocabParallelCrossEntropy casts the logits to fp32 inside its forward and its backward "
         "returns fp32, so autograd copies it to the input's dtype (cross_entropy.py)",
         lambda arch: not loss_in_fp32_gradients(arch)),
    Term("cross_entropy_fp32_gradients", F32 * s * b * v * sympy.Piecewise((2, sympy.Eq(t, 1)), (3, True)),
         Region.BLOCK, _ALWAYS, Scope.OUTPUT,
         "PyTorch's cross entropy on the fp32 logits, its backward at its largest: at t = 1 nll_loss's fp32 "
         "gradient of the log-probabilities and log_softmax's of the logits (8sbv); under loss_parallel "
         "(t > 1) its handler's zeros_like(x), exp(x) and their sum, then the sum's product with the output "
         "gradient (12sbv/t: torch 2.13, distributed/tensor/parallel/loss.py, "
         "_nll_loss_and_log_softmax_backward); the 16-bit copy after them is smaller",
         loss_in_fp32_gradients),
)
