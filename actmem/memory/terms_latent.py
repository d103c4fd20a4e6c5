"""The multi-head latent attention and multi-token prediction rows of the table of saved tensors
(actmem.memory.terms composes them into TERMS): megatron-core 0.16.1's MLASelfAttention in TE's layer spec
(MLA_TERMS) and its MultiTokenPredictionLayer (MTP_TERMS)."""

import sympy

from actmem.memory.term import ALWAYS as _ALWAYS, CHECKPOINTED as _CHECKPOINTED, STORED as _STORED, Region, Scope, \
    Term, block_scales, fp8_scale_inv, gemm_input_bytes, norm_statistics, SBH as _sbh
from actmem.model import symbols
from actmem.model.architecture import hidden_dropout, latent, latent_norms, latent_query, latent_query_norm, mtp
from actmem.model.symbols import a, b, h, s, t
from actmem.model.widths import ACTIVATION_BYTES as A16, INDEX_BYTES as I64, LOGITS_BYTES as F32, MASK_BYTES as MASK


def _latent_query(arch):
    return arch.q_lora_rank if latent_query(arch) else symbols.q_r


def _latent_kv(arch):
    return arch.kv_lora_rank if latent(arch) else symbols.kv_r


def _latent_heads(arch):
    """a·(d_qk + d_rope): MLA's q and k, each head's rope part appended (latent.query_width)."""
    from actmem.model.latent import query_width

    return query_width(arch, a) if latent(arch) else a * (symbols.d_qk + symbols.d_rope)


def _rope_dim(arch):
    return arch.qk_pos_emb_head_dim if latent(arch) else symbols.d_rope


def _latent_values(arch):
    return a * arch.v_head_dim if latent(arch) else a * symbols.d_v


def _q_latent_fp8(arch) -> bool:
    """FP8 multi-latent attention with a q latent and no latent norms: the q up projection keeps the latent's FP8
    copy, and the mla_up_proj checkpoint its 16-bit self"""
    return latent_query(arch) and bool(arch.fp8) and not arch.qk_norm


def _q_latent_16bit(arch) -> bool:
    """the q latent kept in 16 bits: by the up projection (its input, or the fused norm's), whatever is recomputed"""
    return latent_query(arch) and not _q_latent_fp8(arch)


def _kv_latent_bytes(arch) -> int:
    """The kv latent as the kv up projection keeps it: its FP8 copy without latent norms, else 16-bit."""
    return 1 if arch.fp8 and not arch.qk_norm else A16


def _kv_latent_scale(arch):
    return fp8_scale_inv(arch) if not arch.qk_norm else 0


def _block_fp8(present):
    """A latent's block scales: where ``present`` and the recipe is block-scaled."""
    def block_and(arch) -> bool:
        from actmem.model.fp8 import BLOCK_RECIPES

        return present(arch) and arch.fp8 in BLOCK_RECIPES

    block_and.__doc__ = f"{present.__doc__}, under a block-scaled FP8 recipe"
    return block_and


def _no_query_latent_fp8(arch) -> bool:
    """FP8 multi-latent attention without a q latent, whose mla_up_proj checkpoint keeps the norm's 16-bit output"""
    return latent(arch) and not latent_query(arch) and bool(arch.fp8)


#: megatron-core 0.16.1's MLASelfAttention in TE's layer spec (multi_latent_attention.py,
#: get_query_key_value_tensors; gpt_layer_specs.py: the down projections TELinear, replicated over t;
#: the up projections TEColumnParallelLinear, or TELayerNormColumnParallelLinear under --qk-layernorm),
#: with Megatron's fused YaRN rope (fused_mla_yarn_rope_apply.py), between the down projections' input
#: (qkv_input) and TE's fused attention (softmax_lse, projection_input at a·d_v): what each step keeps.
MLA_TERMS = (
    Term("mla_q_latent", lambda arch: A16 * _latent_query(arch) * s * b, Region.BOUNDARY, _STORED, Scope.LAYER,
         "the q up projection keeps its input, the q latent [N, q_r] (2sb·q_r): TE's column-parallel linear "
         "(saved_inputmat, its own shard of the sequence under SP), or with --qk-layernorm the fused norm's "
         "input (layernorm_linear.py, _LayerNormLinear: inputmat)", _q_latent_16bit),
    Term("mla_q_latent_fp8", lambda arch: _latent_query(arch) * s * b, Region.BOUNDARY, _STORED, Scope.LAYER,
         "under FP8, without --qk-layernorm, the q up projection keeps the q latent quantized instead, one byte an "
         "element (the rank's rowwise shard under SP, columnwise at t = 1) with its scale_inv (linear.py; "
         "sb·q_r + 4)", _q_latent_fp8, module="mla_up_proj", fixed=fp8_scale_inv),
    Term("mla_q_latent_checkpointed", lambda arch: A16 * _latent_query(arch) * s * b, Region.BOUNDARY, _CHECKPOINTED,
         Scope.LAYER, "... and the mla_up_proj checkpoint, which runs the up projections without grad, keeps the "
         "16-bit q latent, its argument (2sb·q_r)", _q_latent_fp8, kept_by="mla_up_proj"),
    Term("mla_q_latent_scales", lambda arch: block_scales(s * b / t, _latent_query(arch), gathered=True)(arch),
         Region.REPLICATED, _STORED, Scope.LAYER,
         "under a block-scaled FP8 recipe, the q latent's quantized copy keeps its block scales (the fused norm's "
         "output under --qk-layernorm)", _block_fp8(latent_query), module="mla_up_proj"),
    Term("mla_q_latent_statistics", norm_statistics(1), Region.BOUNDARY, _STORED, Scope.LAYER,
         "... the q latent's norm keeps fp32 statistics (rsigma, 4sb for RMSNorm)", latent_query_norm, module="mla_up_proj"),
    Term("mla_q_latent_normed", lambda arch: gemm_input_bytes(arch) * _latent_query(arch) * s * b, Region.BOUNDARY,
         _STORED, Scope.LAYER, "... and its output, which the up projection's GEMM reads (ln_out, saved before SP's "
         "gather; 2sb·q_r; under FP8 quantized, sb·q_r + 4)", latent_query_norm, module="mla_up_proj",
         fixed=fp8_scale_inv),
    Term("mla_kv_latent", lambda arch: _kv_latent_bytes(arch) * _latent_kv(arch) * s * b, Region.BOUNDARY, _STORED,
         Scope.LAYER,
         "the kv up projection keeps its input, the kv latent [N, kv_r] (2sb·kv_r): a strided view of the kv down "
         "projection's [N, kv_r + d_rope] output (torch.split), which TE copies contiguous first (base.py, "
         "prepare_forward: allow_non_contiguous=False) and keeps; the down projection's output is then freed; under "
         "FP8 without --qk-layernorm its quantized copy instead (sb·kv_r + 4)", latent, module="mla_up_proj",
         fixed=_kv_latent_scale),
    Term("mla_kv_latent_scales", lambda arch: block_scales(s * b / t, _latent_kv(arch), gathered=True)(arch),
         Region.REPLICATED, _STORED, Scope.LAYER,
         "under a block-scaled FP8 recipe, the kv latent's quantized copy keeps its block scales (the fused norm's "
         "output under --qk-layernorm)", _block_fp8(latent), module="mla_up_proj"),
    Term("mla_kv_latent_statistics", norm_statistics(1), Region.BOUNDARY, _STORED, Scope.LAYER,
         "... the kv latent's norm keeps fp32 statistics (4sb for RMSNorm)", latent_norms, module="mla_up_proj"),
    Term("mla_kv_latent_normed", lambda arch: gemm_input_bytes(arch) * _latent_kv(arch) * s * b, Region.BOUNDARY,
         _STORED, Scope.LAYER, "... and its output (ln_out; 2sb·kv_r; under FP8 quantized, sb·kv_r + 4)",
         latent_norms, module="mla_up_proj", fixed=fp8_scale_inv),
    Term("mla_query", lambda arch: A16 * _latent_heads(arch) * s * b, Region.BLOCK, _STORED, Scope.LAYER,
         "the attention core keeps q, the q up projection's output [s, b, a/t, d_qk + d_rope], whose rope part the "
         "fused YaRN kernel rotates in place (ApplyMLARotaryEmbQ: saves only the cached cos and sin; 2sb·a(d_qk + "
         "d_rope))", latent, module="mla_up_proj"),
    Term("mla_key", lambda arch: A16 * _latent_heads(arch) * s * b, Region.BLOCK, _STORED, Scope.LAYER,
         "... k, which the fused kernel writes new from the kv up projection's output and the shared rope key "
         "(ApplyMLARotaryEmbKV: o_key, [s·b, a/t, d_qk + d_rope]; the kv up output is then freed)", latent, module="mla_up_proj"),
    Term("mla_value", lambda arch: A16 * _latent_values(arch) * s * b, Region.BLOCK, _STORED, Scope.LAYER,
         "... and v, which it writes new too (o_value, [s·b, a/t, d_v]; 2sb·a·d_v); TE's fused attention takes the "
         "three as they are (qkv_layout sbhd_sbhd_sbhd) and keeps its output, a·d_v wide (projection_input)", latent, module="mla_up_proj"),
    # --recompute-modules mla_up_proj (multi_latent_attention.py, qkv_up_checkpoint: CheckpointWithoutOutput of
    # qkv_up_proj_and_rope_apply, under no_grad, its outputs q, k and v discarded once the core has run):
    # ctx.save_for_backward of its arguments, the q latent (the row above), the kv latent, a view of the kv
    # down projection's whole output, and the rope key
    Term("mla_kv_down_output", lambda arch: A16 * (_latent_kv(arch) + _rope_dim(arch)) * s * b, Region.BOUNDARY,
         _CHECKPOINTED, Scope.LAYER,
         "the mla_up_proj checkpoint keeps the kv latent as it gets it, a view of the kv down projection's "
         "output, so that whole output, [N, kv_r + d_rope] (2sb·(kv_r + d_rope))", latent, kept_by="mla_up_proj"),
    Term("mla_rope_key_gathered", lambda arch: A16 * _rope_dim(arch) * s * b * sympy.Piecewise((0, sympy.Eq(t, 1)),
                                                                                               (1, True)),
         Region.REPLICATED, _CHECKPOINTED, Scope.LAYER,
         "... and the rope key, which under SP at t > 1 is all-gathered over the sequence first "
         "(gather_from_sequence_parallel_region: [s, b, d_rope], 2sb·d_rope whole on every rank; at t = 1 a view "
         "of the same output)", latent, kept_by="mla_up_proj"),
    Term("mla_norm_output_checkpointed", A16 * _sbh, Region.BOUNDARY, _CHECKPOINTED, Scope.LAYER,
         "without a q latent the mla_up_proj checkpoint keeps the input norm's output as its q argument (2sbh): "
         "in 16 bits the kv down projection's own input, under FP8 a tensor of its own beside that projection's "
         "quantized copy", _no_query_latent_fp8, kept_by="mla_up_proj"),
)


def _mtp(arch):
    return arch.mtp_layers


def _mtp_block_fp8(arch) -> bool:
    """multi-token prediction under a block-scaled FP8 recipe"""
    from actmem.model.fp8 import BLOCK_RECIPES

    return mtp(arch) and arch.fp8 in BLOCK_RECIPES


#: megatron-core 0.16.1's multi-token prediction (transformer/multi_token_prediction.py,
#: MultiTokenPredictionLayer), D layers on the stage with the output layer, each around a transformer
#: layer of the model's last kind (counted as a layer of the stage): what the rest of each keeps, a
#: microbatch, all D together (the factor D in each row). Under full recompute Megatron checkpoints
#: _proj_and_transformer_layer whole, keeping its arguments, the embedding's output and the hidden states.
MTP_TERMS = (
    Term("mtp_token_ids", lambda arch: I64 * b * s * _mtp(arch), Region.REPLICATED, _ALWAYS, Scope.OUTPUT,
         "each prediction embeds the tokens rolled one further (roll_tensor: a new int64 [b, s]), and the "
         "embedding keeps the indices it looked up (VocabParallelEmbedding: F.embedding saves them; at t > 1 the "
         "masked copy), whole on every rank (8bs)", mtp),
    Term("mtp_token_mask", lambda arch: MASK * b * s * _mtp(arch) * sympy.Piecewise((0, sympy.Eq(t, 1)), (1, True)),
         Region.REPLICATED, _ALWAYS, Scope.OUTPUT,
         "... at t > 1 its mask of the tokens outside the rank's vocabulary, which the masked write keeps "
         "(output_parallel[input_mask, :] = 0.0: bool [b, s], bs)", mtp),
    Term("mtp_embedding_dropout_mask", lambda arch: MASK * _sbh * _mtp(arch), Region.BOUNDARY, _ALWAYS, Scope.OUTPUT,
         "the embedding's dropout keeps its 1-byte mask, as the main embedding's does (language_model_embedding.py: "
         "embedding_dropout, outside full recompute's checkpoint; sbh/t under SP); read from the source, the harness "
         "runs at dropout 0", lambda arch: mtp(arch) and hidden_dropout(arch)),
    Term("mtp_embedding_output", lambda arch: A16 * _sbh * _mtp(arch), Region.BOUNDARY, _ALWAYS, Scope.OUTPUT,
         "enorm keeps its input, the embedding's output (2sbh/t: TENorm; under full recompute the checkpoint's "
         "argument, the same storage)", mtp),
    Term("mtp_embedding_norm_statistics", lambda arch: F32 * arch.norm_statistics * s * b * _mtp(arch),
         Region.BOUNDARY, _STORED, Scope.OUTPUT, "... and its fp32 statistics (4sb for RMSNorm)", mtp),
    Term("mtp_hidden_input", lambda arch: A16 * _sbh * _mtp(arch), Region.BOUNDARY, _ALWAYS, Scope.OUTPUT,
         "hnorm keeps its input, the hidden states of the depth before (the main model's final norm's output for "
         "the first; 2sbh/t; under full recompute the checkpoint's argument)", mtp),
    Term("mtp_hidden_norm_statistics", lambda arch: F32 * arch.norm_statistics * s * b * _mtp(arch),
         Region.BOUNDARY, _STORED, Scope.OUTPUT, "... and its fp32 statistics", mtp),
    Term("mtp_eh_proj_input", lambda arch: gemm_input_bytes(arch) * 2 * _sbh * _mtp(arch), Region.BOUNDARY,
         _STORED, Scope.OUTPUT,
         "eh_proj (TEColumnParallelLinear, [h/t, 2h]) keeps its input, the two norms' outputs side by side "
         "(torch.cat: [s/t, b, 2h], 4sbh/t); under FP8 (multi_token_prediction.py: get_fp8_context without a "
         "layer number, always FP8) its quantized copy, the rank's shard, one byte an element, with its scale_inv "
         "(2sbh/t + 4)", mtp, fixed=lambda arch: fp8_scale_inv(arch) * _mtp(arch)),
    Term("mtp_eh_proj_input_scales", lambda arch: block_scales(s * b / t, 2 * h, gathered=True)(arch) * _mtp(arch),
         Region.REPLICATED, _STORED, Scope.OUTPUT,
         "... under a block-scaled FP8 recipe, that copy's block scales", _mtp_block_fp8),
    Term("mtp_layer_input_gathered", lambda arch: A16 * s * b * h * (t - 1) / t * _mtp(arch), Region.REPLICATED,
         _STORED, Scope.OUTPUT,
         "under SP the projection's output is gathered whole ([s, b, h]: gather_from_tensor_model_parallel_region) "
         "and scattered again as a view of it (_split_along_first_dim: input_[...].contiguous(), no copy), which "
         "the transformer layer's first norm keeps: the whole 2sbh, not the layer's own 2sbh/t, so 2sbh(t - 1)/t "
         "more", mtp),
    Term("mtp_final_norm_input", lambda arch: A16 * _sbh * _mtp(arch), Region.BOUNDARY, _STORED, Scope.OUTPUT,
         "the prediction's final norm keeps its input, the layer's output (2sbh/t)", mtp),
    Term("mtp_final_norm_statistics", lambda arch: F32 * arch.norm_statistics * s * b * _mtp(arch),
         Region.BOUNDARY, _STORED, Scope.OUTPUT, "... and its fp32 statistics", mtp),
)
