"""The table of saved tensors: what the backward pass keeps, op by op.

One row per tensor of section 4.1 (one transformer layer) and section 4.5 (the
embedding and output layer), sized in bytes with no parallelism: 16-bit
activations (2 bytes an element), 1-byte dropout masks, fp32 logits. Every
equation of the paper is a composition of this table (see ``engine``).
"""

from dataclasses import dataclass, replace
from enum import Enum
from typing import Callable

import sympy

from actmem.model.architecture import PAPER, always, grouped_mm_experts, grouped_mm_renormalised, megatron_moe, counts_norm_statistics, dataloader_mask, dense_mlp, eager, \
    eager_keeping_16bit_softmax, eager_or_flash_grouped_value, eager_softmax_fp32, eager_with_attention_dropout, \
    flash, flash_attn, flash_grouped_key_value, flash_repeated_key_value, gelu, gelu_keeping_tanh_intermediates, \
    flash_heads, hidden_dropout, keeps_norm_input, latent, latent_norms, latent_query, latent_query_norm, moe, mtp, moe_aux_loss, moe_pre_softmax, moe_sigmoid, moe_sigmoid_aux_loss, \
    moe_group_mask, moe_sigmoid_normalised, moe_topk_softmax, norm_keeps_fp32_copy, shared_experts, shared_experts_gate, \
    shared_experts_overlap, qk_norm, qk_norm_keeping_fp32_copy, \
    qk_norm_keeping_input, rotary_tables, swiglu, swiglu_keeping_silu_output, te_flash_core, te_flash_core_heads, te_layer_spec, \
    squared_relu, torch_softmax, torch_softmax_16bit, torch_softmax_fp32, torch_softmax_making_mask, unfused_rope, \
    unfused_weight_gradients
from actmem.model.recompute import Recompute
from actmem.model import symbols
from actmem.model.symbols import a, b, c, e, h, r, s, t, v
from actmem.model.fp8 import BLOCK_RECIPES, SCALE_INV_BYTES
from actmem.model.widths import ACTIVATION_BYTES as A16, INDEX_BYTES as I64, LOGITS_BYTES as F32, MASK_BYTES as MASK, \
    OFFSET_BYTES as I32


class Region(Enum):
    """Where a tensor lives relative to the tensor-parallel blocks (Figures 4 and 5)."""

    BLOCK = "block"
    """Inside an attention or MLP block: split across heads or the 4h/vocab dim, so it divides by t."""
    BOUNDARY = "boundary"
    """On a block boundary (layer norms, dropouts, block inputs): replicated under
    plain tensor parallelism, split along the sequence under sequence parallelism."""
    REPLICATED = "replicated"
    """The same on every tensor-parallel rank, SP or not: divides by nothing (the unfused
    rope's cos and sin, made for the whole sequence the attention sees)."""


class Scope(Enum):
    """What a term is counted per, on the first pipeline stage (sections 4.4, 4.5)."""

    LAYER = "layer"
    """Once per layer per microbatch in flight."""
    EMBEDDING = "embedding"
    """Once per microbatch in flight (the input embedding sits on the first stage)."""
    OUTPUT = "output"
    """Once, and only when the first stage is also the last (p = 1)."""
    BATCH = "batch"
    """Once per microbatch in flight on the stages that receive the batch: the first (as
    EMBEDDING counts them) and the last (one, as OUTPUT); none in between."""



_STORED = frozenset({Recompute.NONE, Recompute.SELECTIVE})
_ALWAYS = frozenset(Recompute)
_CHECKPOINT = frozenset({Recompute.FULL})
_CHECKPOINTED = frozenset({Recompute.SELECTIVE})    # kept only by a module's checkpoint (Term.kept_by)


@dataclass(frozen=True)
class Term:
    name: str
    bytes: object
    """Size in bytes of one instance with no parallelism: a sympy expression, or a function
    of the architecture that returns one (the MLP's rows depend on its width f)."""
    region: Region
    kept_under: frozenset
    """The recompute modes under which the forward pass keeps it."""
    scope: Scope
    source: str
    """What it is, and where the paper counts it."""
    present: Callable = always
    """architecture -> whether the layer has this tensor at all (dropout 0 keeps no mask)."""
    module: object = None
    """The recompute module whose checkpoint drops it under selective recompute, or a function
    of the architecture that returns it: 'core_attn' (attention.py,
    _checkpointed_attention_forward: tensor_parallel.checkpoint of the core attention, keeping
    q, k and v) or 'mlp' (transformer_layer.py, _forward_mlp: tensor_parallel.checkpoint(self.mlp,
    False, pre_mlp_layernorm_output), keeping its input). None: no module drops it."""
    kept_by: str | None = None
    """The recompute module whose checkpoint alone keeps it under selective recompute (the QKV
    output that core_attn's checkpoint keeps through its view v): kept there only when that
    module is recomputed."""
    kept_under_torch_softmax: frozenset | None = None
    """Where it differs, the recompute modes under which the forward keeps it when Megatron's
    local core runs torch's softmax (architecture.torch_softmax), whichever module is recomputed:
    the dataloader's mask, which every layer's masked_fill_ keeps there (utils.py,
    attention_mask_func), not only the recompute checkpoints. None: as under the fused kernel."""
    fixed: object = 0
    """Bytes of one instance that no parallelism splits, beside ``bytes`` (a number, or a function of the
    architecture): an FP8 tensor's fp32 scale_inv (actmem.model.fp8)."""

    def size(self, arch=PAPER) -> sympy.Expr:
        """Bytes of one instance with no parallelism, for this architecture."""
        return self.bytes(arch) if callable(self.bytes) else self.bytes

    def fixed_bytes(self, arch=PAPER):
        return self.fixed(arch) if callable(self.fixed) else self.fixed

    def module_of(self, arch=PAPER) -> str | None:
        """The recompute module that drops it in this architecture."""
        return self.module(arch) if callable(self.module) else self.module

    def kept_under_for(self, arch=PAPER) -> frozenset:
        """The recompute modes under which this architecture's forward keeps it."""
        return self.kept_under_torch_softmax if self._kept_by_torch_softmax(arch) else self.kept_under

    def kept_by_for(self, arch=PAPER) -> str | None:
        """The module whose checkpoint alone keeps it in this architecture (None: kept whichever is
        recomputed)."""
        return None if self._kept_by_torch_softmax(arch) else self.kept_by

    def _kept_by_torch_softmax(self, arch) -> bool:
        return self.kept_under_torch_softmax is not None and torch_softmax(arch)


_sbh = s * b * h


def _gemm_input(arch) -> int:
    """Bytes an element of a saved GEMM input TE quantizes: one under FP8 (actmem.model.fp8), else 16-bit."""
    return 1 if arch.fp8 else A16


def _fp8_scale(arch) -> int:
    """An FP8 tensor's fp32 scale_inv, [1], kept beside it (actmem.model.fp8); the block-scaled recipes keep
    block scales instead (_block_scales)."""
    return SCALE_INV_BYTES if arch.fp8 and arch.fp8 not in BLOCK_RECIPES else 0


def _roundup(x, n):
    return n * sympy.ceiling(x / n)


def _block_scales(rows, cols, gathered: bool):
    """The block scales of a saved input's columnwise copy, [rows, cols] (quantizer.cpp, get_scale_shape): MXFP8
    [roundup(rows/32, 4), roundup(cols, 128)] of E8M0 bytes; blockwise fp32 [ceil(rows/128), cols] in the
    gatherable COMPACT layout (the norms' outputs under SP), [ceil(rows/128), roundup(cols, 4)] GEMM_READY."""
    def scales(arch):
        if arch.fp8 == "mxfp8":
            return _roundup(rows / 32, 4) * _roundup(cols, 128)
        return SCALE_INV_BYTES * sympy.ceiling(rows / 128) * (cols if gathered else _roundup(cols, 4))
    return scales


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


def _norm_statistics(norms: int):
    """fp32 statistics of ``norms`` norms, one value each a token: mu and rsigma for
    LayerNorm, rsigma for RMSNorm (TE's normalization.cpp: at::empty({N}, at::kFloat))."""
    return lambda arch: norms * F32 * arch.norm_statistics * s * b


def _mlp_with_fused_norm(arch):
    """'mlp' where the MLP's norm is fused into linear_fc1, inside the MLP's checkpoint (TE's
    layer spec: the checkpoint keeps the norm's input); under Megatron's local spec (the eager
    core) the norm is a module of its own, outside, and the checkpoint keeps its output. A MoE
    layer's pre-MLP norm is a TENorm of its own, and 'mlp' leaves a MoE layer whole
    (transformer_layer.py: recompute_mlp only where not is_moe_layer): 'layernorm', which reruns that
    norm (CheckpointWithoutOutput) and frees its output once the MoE layer has run."""
    if moe(arch):      # its pre-MLP norm: a TENorm of its own, which --recompute-modules layernorm reruns
        return "layernorm"
    return "mlp" if te_layer_spec(arch) else None


def _latent_input_norm(arch):
    """'layernorm' where the input norm is a TENorm of its own (multi-latent attention's layer spec), which
    --recompute-modules layernorm reruns (transformer_layer.py: CheckpointWithoutOutput, its output
    discarded once the attention has run); None where TE fuses it into the QKV linear (IdentityOp)."""
    return "layernorm" if latent(arch) else None


def _sbf(width: int):
    """An sb x (width·f) 16-bit tensor; f is the architecture's MLP size (4h by default)."""
    return lambda arch: A16 * width * s * b * arch.ffn(h)


def _dense(present):
    """The dense MLP's row: present where ``present`` says and the MLP is not a mixture of experts."""
    def dense_and(arch):
        return dense_mlp(arch) and present(arch)

    dense_and.__doc__ = f"{present.__doc__} (a dense MLP)"
    return dense_and


def _experts(arch):
    """E: the architecture's, or the symbol where it has none (the formulas view's rows)."""
    return arch.num_experts if arch.moe else symbols.E


def _topk(arch):
    return arch.moe_topk if arch.moe else symbols.k


def _gathered(arch):
    """ETP where the allgather dispatcher gathers the tokens over the ETP·EP ranks and keeps its E/EP
    local experts' columns (E/EP·N·ETP·EP = E·N·ETP); 1 under alltoall."""
    return e if arch.moe and arch.moe_dispatcher == "allgather" else 1


def _shared_ffn(arch):
    return arch.moe_shared_ffn if arch.moe and arch.moe_shared_ffn is not None else symbols.f_s


def _expert_ffn(arch):
    return arch.expert_ffn(h) if arch.moe else symbols.f_e


def expert_rows(arch):
    """T: the token rows the busiest rank's experts receive, ⌈r·k·N·ETP⌉ with N = s·b/t tokens a
    rank (under sequence parallelism, which Megatron's MoE layer needs at t > 1: moe_layer.py,
    MoELayer.forward). The alltoall dispatcher sends each of a rank's N·k routed copies to the
    expert's EP rank and all-gathers them over the expert-tensor-parallel group
    (token_dispatcher.py, MoEAlltoAllTokenDispatcher.token_dispatch); balanced, each rank
    receives k·N·ETP, and r >= 1 scales it on the busiest. Under a capacity factor each expert takes at
    most C = ⌈k·N/E·factor⌉ tokens from each of the EP·ETP ranks that send to it, and no more than N
    (moe_utils.py, get_capacity, apply_router_token_dropping), so a rank's E/EP experts at most
    E·min(C, N)·ETP rows whatever the imbalance; padded to capacity (--moe-pad-expert-input-to-capacity) they
    receive exactly that: every expert's column of the map holds C tokens, those not routed to it at
    probability 0 (final_map = capacity_mask; the alltoall dispatcher's tokens per expert C·ETP·EP:
    token_dispatcher.py, preprocess)."""
    if not (arch.moe and arch.moe_capacity_factor is not None):
        return sympy.ceiling(r * _topk(arch) * s * b * e / t)
    full = arch.num_experts * sympy.Min(capacity(arch), s * b / t) * e
    return full if arch.moe_pad_to_capacity else sympy.Min(sympy.ceiling(r * _topk(arch) * s * b * e / t), full)


def capacity(arch):
    """C: each expert's capacity, ⌈k·N/E·factor⌉ of a rank's N = s·b/t tokens (moe_utils.py, get_capacity,
    called with num_tokens = N·k: apply_router_token_dropping), a symbol the spec binds to the integer Megatron
    computes in floating point (actmem.model.experts.capacity)."""
    return symbols.C


def _routed_copies(arch):
    """The routed copies of a rank's N = s·b/t tokens it permutes, k·N, or under a capacity factor those each
    expert keeps, at most E·C (the source side of expert_rows: no imbalance there); padded, exactly E·C."""
    copies = _topk(arch) * s * b / t
    if not (arch.moe and arch.moe_capacity_factor is not None):
        return copies
    padded = arch.num_experts * capacity(arch)
    return padded if arch.moe_pad_to_capacity else sympy.Min(copies, padded)


def _masked_select_maps(arch) -> bool:
    """the allgather dispatcher, or the alltoall one's own permutation unpadded"""
    return moe(arch) and (arch.moe_dispatcher == "allgather" or not (arch.moe_pad_to_capacity or
                                                                       arch.moe_permute_fusion))


def _alltoall_unfused(arch) -> bool:
    """the alltoall dispatcher's own permutation (not --moe-permute-fusion)"""
    return moe(arch) and arch.moe_dispatcher == "alltoall" and not arch.moe_permute_fusion


def _fused(arch) -> bool:
    """--moe-permute-fusion (TE's kernels)"""
    return moe(arch) and arch.moe_permute_fusion


def _padded_alltoall_unfused(arch) -> bool:
    """padded to capacity (--moe-pad-expert-input-to-capacity) under the alltoall dispatcher's own permutation"""
    return _alltoall_unfused(arch) and arch.moe_pad_to_capacity


def _fused_alltoall_sorting(arch) -> bool:
    """--moe-permute-fusion under the alltoall dispatcher, not padded to capacity"""
    return _fused(arch) and arch.moe_dispatcher == "alltoall" and not arch.moe_pad_to_capacity


def _row_id_map(arch):
    """TE's fused permutation map, int32 [tokens, 2·experts + 1] (triton/permutation.py, make_row_id_map): of
    the rank's N tokens over E experts (alltoall), or of the N·ETP·EP gathered tokens over its E/EP local
    experts (allgather)."""
    if arch.moe_dispatcher == "allgather":
        return I32 * s * b / t * e * symbols.ep * (2 * _experts(arch) / symbols.ep + 1)
    return I32 * s * b / t * (2 * _experts(arch) + 1)


def _chunk_maps(arch):
    """TE's chunk sorts (moe_sort_chunks_by_index[_with_probs]) each keep an int32 [T] map, one before the
    experts and one after, where the alltoall dispatcher sorts by local expert: E/EP > 1, and not padded to
    capacity, where it reorders by transpose().contiguous(), which saves nothing (token_dispatcher.py,
    dispatch_postprocess, combine_preprocess)."""
    several = sympy.Min(1, _experts(arch) / symbols.ep - 1)
    return 0 if arch.moe_pad_to_capacity else 2 * I32 * expert_rows(arch) * several


def _experts_input(arch):
    return A16 * h * expert_rows(arch)


def _experts_fc1_output(arch):
    return A16 * 2 * _expert_ffn(arch) / e * expert_rows(arch)


def _experts_fc2_input(arch):
    return A16 * _expert_ffn(arch) / e * expert_rows(arch)


def _router_bytes(arch) -> int:
    """Bytes of a routing probability: the logits' dtype (--moe-router-dtype; 16-bit by default)."""
    from actmem.model.experts import ROUTER_BYTES

    return ROUTER_BYTES[arch.moe_router_dtype] if arch.moe else A16


def _aux_bytes(arch) -> int:
    """Bytes of an aux-loss score: the softmax's fp32, or the sigmoid's logits' dtype."""
    return _router_bytes(arch) if arch.moe and arch.moe_score_function == "sigmoid" else F32


def _sequence_aux(arch) -> bool:
    return arch.moe and arch.moe_load_balancing == "seq_aux_loss"


def _experts_probs(arch):
    return _router_bytes(arch) * expert_rows(arch)


def _megatron(present):
    """A row of Megatron's MoELayer: present where ``present`` says and the code is Megatron-Core's."""
    def megatron_and(arch):
        return megatron_moe(arch) and present(arch)

    megatron_and.__doc__ = f"{present.__doc__} (Megatron-Core's MoELayer)"
    return megatron_and


#: megatron-core 0.16.1's MoE layer (the local spec's SequentialMLP, as the harness runs it; TE's
#: grouped GEMM keeps the same tensors): what each of its steps saves, in the order they run. Under
#: --recompute-modules moe its checkpoint (moe_layer.py, forward: tensor_parallel.checkpoint of the whole
#: layer) keeps only its input, the router's input; under shared_experts the shared experts' checkpoint
#: keeps that same input and drops their rows.
#: N = s·b (over t under SP) tokens a rank, k = top-k, E = experts; the T rows are the busiest
#: rank's expert rows (expert_rows), whole on the rank (REPLICATED: the t is inside T).
MOE_TERMS = tuple(replace(term, present=_megatron(term.present)) for term in (
    Term("router_input", A16 * _sbh, Region.BOUNDARY, _STORED, Scope.LAYER,
         "the router's gating linear keeps its input, the pre-MLP norm's output (moe_utils.py, "
         "RouterGatingLinearFunction.forward: save_for_backward(inp, weight, bias); 2sbh), which "
         "--recompute-modules layernorm frees once the MoE layer has run (transformer_layer.py, "
         "_forward_post_mlp: discard_output_and_register_recompute)", moe, module="layernorm"),
    Term("router_topk_indices", lambda arch: I64 * _topk(arch) * s * b, Region.BOUNDARY, _STORED, Scope.LAYER,
         "the router's top-k expert indices, int64 [N, k] (moe_utils.py, topk_routing_with_score_function: "
         "torch.topk's indices, which its backward and the scatter into routing_probs save; 8sbk)", moe, module="moe"),
    Term("router_topk_probs", lambda arch: F32 * _topk(arch) * s * b, Region.BOUNDARY, _STORED, Scope.LAYER,
         "the softmax over the top-k scores keeps its fp32 output (softmax(scores, dtype=float32); 4sbk)",
         moe_topk_softmax, module="moe"),
    Term("router_softmax_probs", lambda arch: F32 * _experts(arch) * s * b, Region.BOUNDARY, _STORED, Scope.LAYER,
         "with --moe-router-pre-softmax the softmax runs over every expert before the top-k and keeps its fp32 "
         "output, [N, E] (moe_utils.py, topk_routing_with_score_function: use_pre_softmax; 4sbE)", moe_pre_softmax, module="moe"),
    Term("router_capacity_map", lambda arch: MASK * _experts(arch) * s * b, Region.BOUNDARY, _STORED, Scope.LAYER,
         "under a capacity factor the probabilities are masked to the tokens each expert keeps (moe_utils.py, "
         "apply_router_token_dropping: routing_probs * final_map saves the bool map, [N, E]; sbE); the top-k over "
         "each expert's tokens that chooses them saves nothing held (its values discarded)",
         lambda arch: moe(arch) and arch.moe_capacity_factor is not None, module="moe"),
    Term("router_group_mask", lambda arch: MASK * _experts(arch) * s * b, Region.BOUNDARY, _STORED, Scope.LAYER,
         "group-limited routing masks the experts of the groups not chosen: masked_fill keeps its bool mask, "
         "[N, E], where the top-k's values become the probabilities (moe_utils.py, group_limited_topk; sbE); "
         "the expert bias's choice discards them, and the mask with them", moe_group_mask, module="moe"),
    # the sigmoid router (topk_routing_with_score_function, score_function "sigmoid"): sigmoid(logits.float(), module="moe"),
    # cast back to the logits' dtype; with the expert bias the top-k chooses on scores + bias and gathers the
    # scores; for k > 1 the chosen scores are divided by their sum
    Term("router_sigmoid", lambda arch: F32 * _experts(arch) * s * b, Region.BOUNDARY, _STORED, Scope.LAYER,
         "the sigmoid router keeps sigmoid's fp32 output, [N, E] (sigmoid(logits.float()); 4sbE)", moe_sigmoid, module="moe"),
    Term("router_sigmoid_scores", lambda arch: (_router_bytes(arch) if _router_bytes(arch) != F32 else 0)
         * _experts(arch) * s * b, Region.BOUNDARY, _STORED, Scope.LAYER,
         "with the expert bias, gather keeps the scores it picks from, [N, E] in the logits' dtype (none under "
         "--moe-router-dtype fp32: the same storage as sigmoid's output)",
         lambda arch: moe_sigmoid(arch) and arch.moe_expert_bias, module="moe"),
    Term("router_score_sum", lambda arch: _router_bytes(arch) * s * b, Region.BOUNDARY, _STORED, Scope.LAYER,
         "for k > 1 the sigmoid router divides the chosen scores by their sum: the division keeps the sum, [N, 1]",
         moe_sigmoid_normalised, module="moe"),
    Term("router_topk_scores", lambda arch: _router_bytes(arch) * _topk(arch) * s * b, Region.BOUNDARY, _STORED,
         Scope.LAYER, "... and the chosen scores, [N, k] in the logits' dtype", moe_sigmoid_normalised, module="moe"),
    Term("aux_loss_scores", lambda arch: _aux_bytes(arch) * _experts(arch) * s * b, Region.BOUNDARY, _STORED,
         Scope.LAYER,
         "the aux loss's scores over every expert, [N, E] (moe_utils.py, compute_routing_scores_for_aux_loss): "
         "the softmax's fp32 output (4sbE), or the sigmoid's in the logits' dtype, which its normalisation "
         "keeps", moe_aux_loss, module="moe"),
    Term("aux_loss_score_sum", lambda arch: _router_bytes(arch) * s * b, Region.BOUNDARY, _STORED, Scope.LAYER,
         "... and, under the sigmoid, the sum it divides by, [N, 1]", moe_sigmoid_aux_loss, module="moe"),
    # its own top-k (torch.topk(scores)) saves indices too, but its values are discarded (`_, top_indices =`, module="moe"),
    # so autograd frees that node, and the indices with it, before the forward ends: measured, not held
    Term("aux_loss_tokens_per_expert", lambda arch: I64 * _experts(arch) * (b if _sequence_aux(arch) else 1),
         Region.REPLICATED, _STORED, Scope.LAYER,
         "switch_load_balancing_loss_func keeps tokens_per_expert, int64 [E] (8E); the sequence-wise aux loss "
         "(seq_aux_loss) counts them a sequence, the routing map viewed [s, b·E] (router.py, _apply_seq_aux_loss): "
         "int64 [b·E] (8bE)", moe_aux_loss, module="moe"),
    Term("aux_loss_value", lambda arch: sympy.Integer(_aux_bytes(arch)), Region.REPLICATED, _STORED, Scope.LAYER,
         "MoEAuxLossAutoScaler keeps the aux loss (save_for_backward(aux_loss)): fp32 from the softmax's scores "
         "(4 B), the logits' dtype from the sigmoid's", moe_aux_loss, module="moe"),
    Term("permute_routing_map", lambda arch: MASK * _experts(arch) * s * b * _gathered(arch), Region.BOUNDARY,
         _STORED, Scope.LAYER,
         "permute's masked_select keeps the routing map transposed, bool [E, N] (moe_utils.py, permute: "
         "routing_map.bool().T.contiguous(); sbE); the allgather dispatcher's is its local experts' map of the "
         "tokens gathered over ETP·EP ranks, [E/EP, N·ETP·EP] (token_dispatcher.py, MoEAllGatherTokenDispatcher."
         "dispatch_postprocess: local_map; sbE·ETP)", _masked_select_maps, module="moe"),
    Term("permute_probs", lambda arch: _router_bytes(arch) * _experts(arch) * s * b * _gathered(arch), Region.BOUNDARY,
         _STORED, Scope.LAYER,
         "... and the probabilities it selects from, transposed, in the logits' dtype (probs.T.contiguous()"
         ".masked_select(routing_map) saves its input; 2sbE in 16 bits, 4sbE under --moe-router-dtype fp32; the "
         "allgather dispatcher's local_probs x ETP)", _masked_select_maps, module="moe"),
    Term("permute_sorted_indices", lambda arch: I64 * _routed_copies(arch), Region.REPLICATED, _STORED, Scope.LAYER,
         "the permutation's token indices, int64 [N·k], which index_select saves (and unpermute's scatter "
         "its expanded view; 8sbk/t, N = sb/t under SP); under a capacity factor only the copies kept, at most "
         "E·C, padded to capacity exactly E·C (the first C of each expert's argsorted column)",
         _alltoall_unfused, module="moe"),
    Term("permute_probs_indices", lambda arch: I64 * _experts(arch) * symbols.C, Region.REPLICATED, _STORED, Scope.LAYER,
         "padded to capacity, the alltoall dispatcher's permute selects the probabilities by their flat index, "
         "int64 [E·C], which index_select saves (moe_utils.py, permute: probs_T_1D.index_select(0, indices_1D); "
         "8E·C)", _padded_alltoall_unfused, module="moe"),
    Term("permute_local_indices", lambda arch: I64 * expert_rows(arch), Region.REPLICATED, _STORED, Scope.LAYER,
         "the allgather dispatcher permutes the gathered tokens its experts receive: their indices, int64 [T], "
         "which index_select saves (8T)",
         lambda arch: moe(arch) and arch.moe_dispatcher == "allgather" and not arch.moe_permute_fusion, module="moe"),
    Term("permute_row_id_map", _row_id_map, Region.REPLICATED, _STORED, Scope.LAYER,
         "under --moe-permute-fusion TE's permute keeps its row map alone, int32 [N, 2E+1], and unpermute the "
         "same map (permutation.py at TE 2.9-2.11, the releases megatron-core 0.16.1 takes: _moe_permute_mask_map"
         ".forward, save_for_backward(row_id_map); 4N(2E+1)); the allgather dispatcher's of the N·ETP·EP tokens "
         "it gathered over its E/EP experts (4N·ETP·(2E + EP))", _fused, module="moe"),
    Term("permute_chunk_maps", _chunk_maps, Region.REPLICATED, _STORED, Scope.LAYER,
         "... and where the alltoall dispatcher sorts the received rows by local expert (E/EP > 1, unpadded), "
         "each of TE's two chunk sorts an int32 [T] map (_moe_chunk_sort.forward; 8T)",
         _fused_alltoall_sorting, module="moe"),
    Term("experts_input", _experts_input, Region.REPLICATED, _STORED, Scope.LAYER,
         "the experts' fc1 keeps the rows the rank's experts receive, [T, h] (2hT): the dispatcher's output, "
         "one storage that each expert's input is a view of", moe, module="moe"),
    Term("experts_fc1_output", _experts_fc1_output, Region.REPLICATED, _STORED, Scope.LAYER,
         "the weighted SwiGLU keeps its input, fc1's output [T, 2f_e/ETP] (fused_bias_swiglu.py, "
         "WeightedSwiGLUFunction: save_for_backward(input, weights); 4f_e·T/ETP)", moe, module="moe"),
    Term("experts_probs", _experts_probs, Region.REPLICATED, _STORED, Scope.LAYER,
         "... and the routing probabilities it scales by, [T, 1] in the logits' dtype (2T in 16 bits, 4T in fp32)",
         moe, module="moe"),
    Term("experts_fc2_input", _experts_fc2_input, Region.REPLICATED, _STORED, Scope.LAYER,
         "the experts' fc2 keeps its input, the activation's output [T, f_e/ETP] (2f_e·T/ETP; TE's GroupedLinear: "
         "split views of one storage); --recompute-modules moe_act frees it once fc2 has run and makes it again "
         "in fc2's backward (experts.py, TEGroupedMLP: CheckpointWithoutOutput, discard_output_and_register_recompute)",
         moe, module="moe_act"),
    # the shared experts (shared_experts.py, SharedExpertMLP): one tensor-parallel MLP of f_s that every
    # token passes, its fc1 keeping the router's input (the same storage, module="moe") unless it overlaps
    Term("shared_experts_fc1_input_gathered", lambda arch: sympy.Piecewise((0, sympy.Eq(t, 1)), (A16 * _sbh, True)),
         Region.REPLICATED, _STORED, Scope.LAYER,
         "overlapping the dispatcher (--moe-shared-expert-overlap), the shared experts' fc1 keeps the input it "
         "all-gathers ahead (shared_experts.py, pre_forward_comm: cached_fc1_input; 2sbh at t > 1; at t = 1 the "
         "router's input itself)", shared_experts_overlap, module="moe"),
    Term("shared_experts_swiglu_input", lambda arch: A16 * 2 * _shared_ffn(arch) * s * b, Region.BLOCK, _STORED,
         Scope.LAYER, "the shared experts' SwiGLU keeps its input, fc1's output (fused_bias_swiglu.py, "
         "SwiGLUFunction; 4sbf_s)", shared_experts, module="shared_experts"),
    Term("shared_experts_fc2_input", lambda arch: A16 * _shared_ffn(arch) * s * b, Region.BLOCK, _STORED, Scope.LAYER,
         "the shared experts' fc2 keeps its input (2sbf_s)", shared_experts, module="shared_experts"),
    Term("shared_experts_gate_score", A16 * s * b, Region.BOUNDARY, _STORED, Scope.LAYER,
         "the shared experts' gate keeps its sigmoid output, [N, 1], which the product saves too "
         "(shared_experts.py: sigmoid(linear(x, gate_weight)); 2sb)", shared_experts_gate, module="shared_experts"),
    Term("shared_experts_output", A16 * _sbh, Region.BOUNDARY, _STORED, Scope.LAYER,
         "... and the shared experts' output it scales (2sbh)", shared_experts_gate, module="shared_experts"),
))


def _hf_copies(arch):
    """k·N: the routed copies of the N = s·b tokens, every expert on the one device (any routing)."""
    return _topk(arch) * s * b


def _hf_routing_weight_bytes(arch) -> int:
    """Mixtral's router hands the experts its fp32 top-k values; Qwen3-MoE's casts them to the logits' 16 bits."""
    return F32 if "fp32_routing_weights" in arch.keeps else A16


#: transformers 5.23.0's sparse MoE block (MixtralSparseMoeBlock, Qwen3MoeSparseMoeBlock) with its default
#: experts implementation, grouped_mm (integrations/moe.py, grouped_mm_experts_forward), on one device: what
#: each step saves, read off the source and measured (validate/actmem_validate/hf.py). N = s·b tokens, k the
#: top-k, E the experts; every expert is on the device, so the rows are k·N whatever the routing.
HF_MOE_TERMS = (
    Term("gate_input", A16 * _sbh, Region.BOUNDARY, _STORED, Scope.LAYER,
         "the router's F.linear keeps its input, the post-attention norm's output (MixtralTopKRouter, "
         "Qwen3MoeTopKRouter; 2sbh)", grouped_mm_experts),
    Term("gate_softmax_fp32", lambda arch: F32 * _experts(arch) * s * b, Region.BOUNDARY, _STORED, Scope.LAYER,
         "softmax(router_logits, dtype=float32) over every expert keeps its fp32 output, [N, E] (4sbE)",
         grouped_mm_experts),
    Term("gate_topk_indices", lambda arch: I64 * _hf_copies(arch), Region.BOUNDARY, _STORED, Scope.LAYER,
         "torch.topk keeps its int64 indices, [N, k] (8sbk)", grouped_mm_experts),
    Term("gate_topk_values_fp32", lambda arch: F32 * _hf_copies(arch), Region.BOUNDARY, _STORED, Scope.LAYER,
         "router_top_value /= its sum, in place, keeps the fp32 top-k values as they were (autograd's copy of "
         "div_'s self), [N, k] (4sbk)", grouped_mm_renormalised),
    Term("gate_topk_sum", F32 * s * b, Region.BOUNDARY, _STORED, Scope.LAYER,
         "... and their sum, fp32 [N, 1] (4sb)", grouped_mm_renormalised),
    Term("experts_token_indices", lambda arch: I64 * _hf_copies(arch), Region.BOUNDARY, _STORED, Scope.LAYER,
         "hidden_states[perm // k] keeps its int64 indices, the token of each routed copy in expert order, "
         "[N·k] (8sbk)", grouped_mm_experts),
    Term("experts_sort_permutation", lambda arch: I64 * _hf_copies(arch), Region.BOUNDARY, _STORED, Scope.LAYER,
         "sample_weights[perm] keeps the sort's int64 permutation, [N·k] (8sbk)", grouped_mm_experts),
    Term("experts_offsets", lambda arch: I32 * _experts(arch), Region.REPLICATED, _STORED, Scope.LAYER,
         "both grouped_mm keep the int32 offsets where each expert's rows end (cumsum of histc), [E] (4E)",
         grouped_mm_experts),
    Term("experts_gathered_input", lambda arch: A16 * h * _hf_copies(arch), Region.BOUNDARY, _STORED, Scope.LAYER,
         "the gate_up grouped_mm keeps its input, the token rows in expert order, [N·k, h] (2sbkh)",
         grouped_mm_experts),
    Term("experts_gate_up_output", lambda arch: A16 * 2 * _expert_ffn(arch) * _hf_copies(arch), Region.BOUNDARY,
         _STORED, Scope.LAYER, "the gate_up grouped_mm's output, [N·k, 2f_e], which silu (its gate half) and the "
         "product (its up half) keep as views (4sbkf_e)", grouped_mm_experts),
    Term("experts_silu_output", lambda arch: A16 * _expert_ffn(arch) * _hf_copies(arch), Region.BOUNDARY, _STORED,
         Scope.LAYER, "the product act_fn(gate) * up keeps silu's output, [N·k, f_e] (2sbkf_e)", grouped_mm_experts),
    Term("experts_down_input", lambda arch: A16 * _expert_ffn(arch) * _hf_copies(arch), Region.BOUNDARY, _STORED,
         Scope.LAYER, "the down grouped_mm keeps its input, the product, [N·k, f_e] (2sbkf_e)", grouped_mm_experts),
    Term("experts_down_output", lambda arch: A16 * h * _hf_copies(arch), Region.BOUNDARY, _STORED, Scope.LAYER,
         "proj_out * sample_weights_g keeps the down grouped_mm's output, [N·k, h] (2sbkh)", grouped_mm_experts),
    Term("experts_routing_weights", lambda arch: _hf_routing_weight_bytes(arch) * _hf_copies(arch), Region.BOUNDARY,
         _STORED, Scope.LAYER, "... and the routing weights in expert order, [N·k, 1]: Qwen3-MoE's 16-bit "
         "(router_top_value.to(router_logits.dtype)), Mixtral's fp32 (its router returns the softmax's values; "
         "2sbk or 4sbk)", grouped_mm_experts),
    Term("experts_inverse_permutation", lambda arch: I64 * _hf_copies(arch), Region.BOUNDARY, _STORED, Scope.LAYER,
         "weighted_out[inv_perm] keeps the inverse permutation, int64 [N·k] (8sbk)", grouped_mm_experts),
)

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


#: megatron-core 0.16.1's MLASelfAttention in TE's layer spec (multi_latent_attention.py,
#: get_query_key_value_tensors; gpt_layer_specs.py: the down projections TELinear, replicated over t;
#: the up projections TEColumnParallelLinear, or TELayerNormColumnParallelLinear under --qk-layernorm),
#: with Megatron's fused YaRN rope (fused_mla_yarn_rope_apply.py), between the down projections' input
#: (qkv_input) and TE's fused attention (softmax_lse, projection_input at a·d_v): what each step keeps.
MLA_TERMS = (
    Term("mla_q_latent", lambda arch: A16 * _latent_query(arch) * s * b, Region.BOUNDARY, _STORED, Scope.LAYER,
         "the q up projection keeps its input, the q latent [N, q_r] (2sb·q_r): TE's column-parallel linear "
         "(saved_inputmat, its own shard of the sequence under SP), or with --qk-layernorm the fused norm's "
         "input (layernorm_linear.py, _LayerNormLinear: inputmat)", latent_query),
    Term("mla_q_latent_statistics", _norm_statistics(1), Region.BOUNDARY, _STORED, Scope.LAYER,
         "... the q latent's norm keeps fp32 statistics (rsigma, 4sb for RMSNorm)", latent_query_norm, module="mla_up_proj"),
    Term("mla_q_latent_normed", lambda arch: A16 * _latent_query(arch) * s * b, Region.BOUNDARY, _STORED,
         Scope.LAYER, "... and its output, which the up projection's GEMM reads (ln_out, saved before SP's gather; "
         "2sb·q_r)", latent_query_norm, module="mla_up_proj"),
    Term("mla_kv_latent", lambda arch: A16 * _latent_kv(arch) * s * b, Region.BOUNDARY, _STORED, Scope.LAYER,
         "the kv up projection keeps its input, the kv latent [N, kv_r] (2sb·kv_r): a strided view of the kv down "
         "projection's [N, kv_r + d_rope] output (torch.split), which TE copies contiguous first (base.py, "
         "prepare_forward: allow_non_contiguous=False) and keeps; the down projection's output is then freed", latent, module="mla_up_proj"),
    Term("mla_kv_latent_statistics", _norm_statistics(1), Region.BOUNDARY, _STORED, Scope.LAYER,
         "... the kv latent's norm keeps fp32 statistics (4sb for RMSNorm)", latent_norms, module="mla_up_proj"),
    Term("mla_kv_latent_normed", lambda arch: A16 * _latent_kv(arch) * s * b, Region.BOUNDARY, _STORED,
         Scope.LAYER, "... and its output (ln_out; 2sb·kv_r)", latent_norms, module="mla_up_proj"),
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
)


def _mtp(arch):
    return arch.mtp_layers


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
    Term("mtp_eh_proj_input", lambda arch: A16 * 2 * _sbh * _mtp(arch), Region.BOUNDARY, _STORED, Scope.OUTPUT,
         "eh_proj (TEColumnParallelLinear, [h/t, 2h]) keeps its input, the two norms' outputs side by side "
         "(torch.cat: [s/t, b, 2h], 4sbh/t)", mtp),
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


TERMS = (
    # -- attention block, section 4.1: 11sbh + 5as²b ----------------------------------
    Term("attention_layernorm_input", A16 * _sbh, Region.BOUNDARY, _STORED, Scope.LAYER,
         "layer norm before attention keeps its input (4.1, layer norm 2sbh)", keeps_norm_input),
    # the norms' statistics: TE's fused norms keep them (layernorm_linear.py, _LayerNormLinear:
    # mu, rsigma); the paper leaves them out, and so does its eager path
    Term("attention_norm_statistics", _norm_statistics(1), Region.BOUNDARY, _STORED, Scope.LAYER,
         "the norm before attention keeps fp32 statistics, 8 B a token for LayerNorm (mu, rsigma) and "
         "4 B for RMSNorm (rsigma); counted on the flash path, beside TE's kernels, and under every "
         "other code", counts_norm_statistics, module=_latent_input_norm),
    Term("qkv_input", lambda arch: _gemm_input(arch) * _sbh, Region.BOUNDARY, _STORED, Scope.LAYER,
         "Q, K, V matmuls keep their shared input (4.1, 2sbh); under multi-latent attention the q and kv down "
         "projections keep it, one storage (TELinear: saved_inputmat = inputmat), which --recompute-modules "
         "layernorm frees once the attention has run; under FP8 TE's LayerNormLinear keeps the norm's output "
         "quantized, one byte an element, with its 4-byte scale_inv (layernorm_linear.py: ln_out)",
         module=_latent_input_norm, fixed=_fp8_scale),
    Term("qkv_input_scales", _block_scales(s * b / t, h, gathered=True), Region.REPLICATED, _STORED, Scope.LAYER,
         "under a block-scaled FP8 recipe the norm's output keeps its block scales beside it, of the rank's s·b/t "
         "rows under SP (MXFP8: E8M0 a 32 elements; blockwise: fp32 a 128)", _block_recipe, module=_latent_input_norm),
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
         "dropout it keeps the RNG state (16 B) and regenerates the mask, keeping none", flash,
         module="core_attn"),
    Term("flash_output", lambda arch: _sb_attention(1)(arch) * sympy.Min(b - 1, 1), Region.BLOCK,
         _STORED, Scope.LAYER,
         "flash-attn keeps its output in its own bshd layout; TE's FlashAttention.forward hands the "
         "projection output.view(b, s, -1).transpose(0, 1).contiguous(), a second copy when b > 1 "
         "(2sb·ad, none at b = 1)", flash_attn, module="core_attn"),
    Term("projection_input", _projection_input, Region.BLOCK, _STORED, Scope.LAYER,
         "output projection keeps its input (4.1, 2sbh; 2sb·ad); under flash this is the "
         "kernel's own output, one storage: TE's sbhd layout makes the reshape a view; under FP8 delayed "
         "scaling the projection keeps only its quantized copy (below), so this is the core's own output alone: "
         "not kept where the core is recomputed, nor flash-attn's copy for the projection at b > 1",
         module=_core_attn_under_delayed_fp8),
    Term("projection_input_fp8", lambda arch: s * b * arch.attention_width(h, a), Region.BLOCK, _STORED, Scope.LAYER,
         "under FP8 delayed scaling the projection keeps its input quantized, its transposed (columnwise) copy, "
         "one byte an element, with its 4-byte scale_inv, and not the 16-bit input (linear.py: "
         "update_usage(rowwise_usage=False); TE refuses save_original_input there, which Megatron sets under "
         "every other recipe to keep the 16-bit input alone: attention.py)", _fp8_delayed, fixed=_fp8_scale),
    Term("attention_dropout_mask", MASK * _sbh, Region.BOUNDARY, _STORED, Scope.LAYER,
         "dropout after the projection keeps its 1-byte mask (4.1, sbh)", hidden_dropout),
    # -- MLP block, section 4.1: 19sbh ------------------------------------------------
    Term("mlp_layernorm_input", A16 * _sbh, Region.BOUNDARY, _STORED, Scope.LAYER,
         "layer norm before the MLP keeps its input (4.1, layer norm 2sbh); with the MLP recomputed "
         "under TE's spec it is what the MLP's checkpoint keeps, one storage", keeps_norm_input),
    Term("mlp_norm_statistics", _norm_statistics(1), Region.BOUNDARY, _STORED, Scope.LAYER,
         "the norm before the MLP keeps fp32 statistics (as attention_norm_statistics); TE fuses it "
         "into linear_fc1, inside the MLP's checkpoint (a MoE layer's is a TENorm of its own)", counts_norm_statistics, module=_mlp_with_fused_norm),
    Term("fc1_input", lambda arch: _gemm_input(arch) * _sbh, Region.BOUNDARY, _STORED, Scope.LAYER,
         "h→4h linear keeps its input (4.1, 2sbh); with the MLP recomputed under Megatron's local spec "
         "(the eager core) it is what the MLP's checkpoint keeps; under FP8 the norm's output quantized, one "
         "byte an element, with its 4-byte scale_inv", dense_mlp, module=_mlp_with_fused_norm, fixed=_fp8_scale),
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
    Term("fc2_input", lambda arch: _gemm_input(arch) * s * b * arch.ffn(h), Region.BLOCK, _STORED, Scope.LAYER,
         "f→h linear keeps its input, the activation's output (4.1, 8sbh; 2sbf); under FP8 its columnwise copy "
         "(on Hopper the transpose), one byte an element, with its 4-byte scale_inv (linear.py: "
         "update_usage(rowwise_usage=False))", dense_mlp, module="mlp", fixed=_fp8_scale),
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
    # -- first and last stage, section 4.5 ---------------------------------------------
    Term("embedding_dropout_mask", MASK * _sbh, Region.BOUNDARY, _ALWAYS, Scope.EMBEDDING,
         "dropout after the input embedding keeps its 1-byte mask (4.5, sbhp/t under SP)",
         hidden_dropout),
    Term("rotary_tables", lambda arch: 2 * A16 * s * arch.head_dim_or(h, a), Region.BOUNDARY, _ALWAYS,
         Scope.EMBEDDING, "the rotary cos and sin, 16-bit (1, s, d) each, made once a forward and kept by "
         "every layer's q·cos and rotate_half(q)·sin (transformers' LlamaRotaryEmbedding; 4sd)", rotary_tables),
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
    Term("final_norm_statistics", _norm_statistics(1), Region.BOUNDARY, _ALWAYS, Scope.OUTPUT,
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
    Term("fc1_input_gathered", lambda arch: _gemm_input(arch) * _sbh, Region.REPLICATED, _ALWAYS, Scope.LAYER,
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
         "returns fp32, so autograd copies it to the input's dtype (cross_entropy.py)"),
)
