"""The mixture-of-experts rows of the table of saved tensors (actmem.memory.terms composes them into TERMS):
megatron-core 0.16.1's MoELayer (MOE_TERMS) and transformers 5.23's sparse MoE block (HF_MOE_TERMS), with the
sizes they share: T, the rows the busiest rank's experts receive (expert_rows), and C, an expert's capacity."""

from dataclasses import replace

import sympy

from actmem.memory.term import SBH as _sbh, STORED as _STORED, Region, Scope, Term, block_scales, \
    fp8_scale_inv, gemm_input_bytes, roundup
from actmem.model import symbols
from actmem.model.architecture import grouped_mm_experts, grouped_mm_renormalised, megatron_moe, moe, moe_aux_loss, \
    moe_group_mask, moe_pre_softmax, moe_sigmoid, moe_sigmoid_aux_loss, moe_sigmoid_normalised, moe_topk_softmax, \
    shared_experts, shared_experts_gate, shared_experts_keeping_silu_output, shared_experts_overlap
from actmem.model.symbols import b, e, h, r, s, t

from actmem.model.widths import ACTIVATION_BYTES as A16, INDEX_BYTES as I64, LOGITS_BYTES as F32, MASK_BYTES as MASK, \
    OFFSET_BYTES as I32

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


def padded_rows(arch):
    """T_pad: under FP8, and in a bf16 layer of an FP8 run, the rows the rank's experts compute, each expert's padded
    to a multiple of a (TEGroupedMLP.forward: quantization_padding; actmem.model.fp8.row_padding),
    a·floor((T + P)/a) with P bound to the most padding can add (actmem.model.fp8.expert_padding_rows); T
    otherwise."""
    from actmem.model.fp8 import row_padding

    align = row_padding(arch) if arch.moe else None
    if align is None:
        return expert_rows(arch)
    return align * sympy.floor((expert_rows(arch) + symbols.P) / align)


def _fp8_experts(arch) -> bool:
    return bool(arch.moe and arch.fp8)


def _scale_blocks(arch):
    """B: the 128-row scale blocks of the experts' padded rows under a block-scaled recipe, Σ ceil(M_i/128), at
    most floor((T_pad + Q)/128) (actmem.model.fp8.expert_block_rows; the harness binds Q to what routing made)."""
    from actmem.model.fp8 import BLOCK_ROWS

    return sympy.floor((padded_rows(arch) + symbols.Q) / BLOCK_ROWS)


def _group_scales(arch, cols):
    """The scales of the G = E/EP local experts' quantized [M_i, cols] inputs under FP8: delayed and tensorwise, an
    fp32 scale_inv [1] an expert (grouped_linear.py: split_quantize, a quantizer an expert, each its own tensor:
    cast.cpp, create_tensor); the block recipes, the columnwise scales in split_quantize's one bulk buffer (cast.cpp,
    bulk_allocate_*: data regions 256-byte aligned, scales 16, which padded rows fill exactly), an expert's MXFP8
    [roundup(M_i/32, 4), roundup(cols, 128)] E8M0 bytes, 4·ceil(M_i/128) rows of them, or blockwise fp32
    GEMM_READY [ceil(M_i/128), roundup(cols, 4)] (quantizer.cpp, get_scale_shape): 4·B·roundup(cols, 128) or
    4·B·roundup(cols, 4); 0 in 16 bits."""
    from actmem.model.fp8 import SCALE_INV_BYTES

    if not _fp8_experts(arch):
        return 0
    if arch.fp8 == "mxfp8":
        return 4 * _scale_blocks(arch) * roundup(cols, 128)
    if arch.fp8 == "blockwise":
        return SCALE_INV_BYTES * _scale_blocks(arch) * roundup(cols, 4)
    return SCALE_INV_BYTES * _experts(arch) / symbols.ep


def _shared_block_scales(arch) -> bool:
    """the shared experts under a block-scaled FP8 recipe (mxfp8, blockwise)"""
    from actmem.model.fp8 import BLOCK_RECIPES

    return shared_experts(arch) and arch.fp8 in BLOCK_RECIPES


def _shared_fc1_fp8(overlap: bool):
    """Under FP8 delayed scaling the shared experts' fc1 keeps its input quantized (a TE Linear: Megatron hands it
    save_original_input under every other recipe, the router's own input then: shared_experts.py, __init__);
    ``overlap``: the input it all-gathered ahead, or the rank's shard (under SP) it gathers itself."""
    def present(arch) -> bool:
        return shared_experts(arch) and (arch.fp8 == "delayed" if overlap else bool(arch.fp8)) \
            and arch.moe_shared_overlap == overlap

    present.__doc__ = (f"FP8 delayed scaling, where the shared experts' fc1 quantizes its input "
                       f"({'overlapping' if overlap else 'not overlapping'} the dispatcher)"
                       + ("" if overlap else "; under the other recipes a row of 0 bytes, which their rerun remakes"))
    return present


def _shared_fc1_rerun_scales(arch):
    """The scales of the copy the shared experts' fc1 quantizes in their rerun (no save_original_input under
    --recompute-modules shared_experts): a per-tensor recipe's scale_inv; a block recipe's of the rank's shard,
    [sb/t, h], in the layout TE gathers under SP (COMPACT) and GEMM_READY at t = 1 (block_scales)."""
    from actmem.model.fp8 import BLOCK_RECIPES

    if arch.fp8 not in BLOCK_RECIPES:
        return fp8_scale_inv(arch)
    return sympy.Piecewise((block_scales(s * b / t, h, gathered=True)(arch), t > 1),
                           (block_scales(s * b, h, gathered=False)(arch), True))


def _shared_fc1_gathered(arch) -> bool:
    """the shared experts overlap the dispatcher (their fc1 keeping its gathered 16-bit input), not under FP8
    delayed scaling (which keeps it quantized)"""
    return shared_experts_overlap(arch) and arch.fp8 != "delayed"


def _experts_input(arch):
    return gemm_input_bytes(arch) * h * padded_rows(arch) + _group_scales(arch, h)


def _experts_fc1_output(arch):
    return A16 * 2 * _expert_ffn(arch) / e * padded_rows(arch)


def _activation_output(arch):
    """The weighted SwiGLU's 16-bit output, fc2's input [T_pad, f_e/ETP] (T rows in 16 bits)."""
    return A16 * _expert_ffn(arch) / e * padded_rows(arch)


def _experts_fc2_input(arch):
    if not _fp8_experts(arch):
        return _activation_output(arch)
    return _expert_ffn(arch) / e * padded_rows(arch) + _group_scales(arch, _expert_ffn(arch) / e)


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
    return _router_bytes(arch) * padded_rows(arch)


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
_MEGATRON_MOE_TERMS = tuple(replace(term, present=_megatron(term.present)) for term in (
    Term("router_input", A16 * _sbh, Region.BOUNDARY, _STORED, Scope.LAYER,
         "the router's gating linear keeps its input, the pre-MLP norm's output (moe_utils.py, "
         "RouterGatingLinearFunction.forward: save_for_backward(inp, weight, bias); 2sbh), which "
         "--recompute-modules layernorm frees once the MoE layer has run (transformer_layer.py, "
         "_forward_post_mlp: discard_output_and_register_recompute)", moe, module="pre_mlp_layernorm"),
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
         "one storage that each expert's input is a view of; under FP8 TE's GroupedLinear keeps instead each "
         "expert's rows, padded to a multiple of 16, quantized: its columnwise copy, one byte an element, with "
         "an fp32 scale_inv [1] an expert (grouped_linear.py, _GroupedLinear.forward: split_quantize, "
         "update_usage(rowwise_usage=False); h·T_pad + 4E/EP), under the block recipes all experts' copies and "
         "block scales in one buffer (h·T_pad + 4B·roundup(h, 128) under MXFP8, rows padded to 32; "
         "+ 4B·roundup(h, 4) blockwise; B the 128-row blocks)", moe, module="moe"),
    Term("experts_fc1_output", _experts_fc1_output, Region.REPLICATED, _STORED, Scope.LAYER,
         "the weighted SwiGLU keeps its input, fc1's output [T, 2f_e/ETP] (fused_bias_swiglu.py, "
         "WeightedSwiGLUFunction: save_for_backward(input, weights); 4f_e·T/ETP), under FP8 of the padded "
         "T_pad rows", moe, module="moe"),
    Term("experts_probs", _experts_probs, Region.REPLICATED, _STORED, Scope.LAYER,
         "... and the routing probabilities it scales by, [T, 1] in the logits' dtype (2T in 16 bits, 4T in fp32; "
         "under FP8 padded too: [T_pad, 1])",
         moe, module="moe"),
    Term("experts_fc2_input", _experts_fc2_input, Region.REPLICATED, _STORED, Scope.LAYER,
         "the experts' fc2 keeps its input, the activation's output [T, f_e/ETP] (2f_e·T/ETP; TE's GroupedLinear: "
         "split views of one storage); under FP8 each expert's columnwise copy, one byte an element, with its "
         "fp32 scale_inv (f_e·T_pad/ETP + 4E/EP); --recompute-modules moe_act frees it once fc2 has run and makes "
         "it again in fc2's backward (experts.py, TEGroupedMLP: CheckpointWithoutOutput, "
         "discard_output_and_register_recompute; under FP8 fc2 then saves its original input: "
         "set_save_original_input), so under FP8 the rerun remakes its 16-bit input (2f_e·T_pad/ETP)",
         moe, module="moe_act", remade=_activation_output),
))
#: the shared experts (Megatron's shared_experts.py, SharedExpertMLP: one tensor-parallel MLP of f_s that every
#: token passes, its fc1 keeping the router's input, the same storage, module="moe", unless it overlaps; and
#: transformers' Qwen2MoeMLP, the same rows and silu's output, unfused)
SHARED_EXPERT_TERMS = (
    Term("shared_experts_fc1_input_gathered", lambda arch: sympy.Piecewise((0, sympy.Eq(t, 1)), (A16 * _sbh, True)),
         Region.REPLICATED, _STORED, Scope.LAYER,
         "overlapping the dispatcher (--moe-shared-expert-overlap), the shared experts' fc1 keeps the input it "
         "all-gathers ahead (shared_experts.py, pre_forward_comm: cached_fc1_input; 2sbh at t > 1; at t = 1 the "
         "router's input itself)", _shared_fc1_gathered, module="moe"),
    Term("shared_experts_fc1_input_gathered_fp8", _sbh, Region.REPLICATED, _STORED, Scope.LAYER,
         "... under FP8 delayed scaling fc1 (parallel_mode None when overlapping) keeps that input's columnwise "
         "copy instead, one byte an element, with its fp32 scale_inv (sbh + 4; at t = 1 too), and the 16-bit "
         "rows it gathered are freed (linear_fc1_forward_and_act: cached_fc1_input = None)", _shared_fc1_fp8(True),
         module="moe", fixed=fp8_scale_inv),
    Term("shared_experts_fc1_input_fp8", lambda arch: _sbh * int(arch.fp8 == "delayed"), Region.BOUNDARY, _STORED,
         Scope.LAYER,
         "under FP8 delayed scaling the shared experts' fc1 keeps its input quantized, the rank's shard under SP "
         "(TE's Linear quantizes it rowwise before its all-gather and keeps that: linear.py), one byte an "
         "element, with its fp32 scale_inv (sbh + 4); under the other recipes Megatron has it keep its original "
         "input, the router's (shared_experts.py: set_save_original_input), but not under --recompute-modules "
         "shared_experts, whose rerun then keeps its quantized copy with its scales (sbh + 4; a block recipe's "
         "block scales of the rank's [sb/t, h], source read only)",
         _shared_fc1_fp8(False), module="shared_experts", fixed=lambda arch: fp8_scale_inv(arch) * int(arch.fp8 == "delayed"),
         remade=lambda arch: None if arch.fp8 == "delayed" else _sbh, remade_fixed=_shared_fc1_rerun_scales),
    Term("shared_experts_swiglu_input", lambda arch: A16 * 2 * _shared_ffn(arch) * s * b, Region.BLOCK, _STORED,
         Scope.LAYER, "the shared experts' SwiGLU keeps its input, fc1's output (fused_bias_swiglu.py, "
         "SwiGLUFunction; 4sbf_s); unfused (transformers' Qwen2MoeMLP), the same bytes as gate_proj's and "
         "up_proj's outputs", shared_experts, module="shared_experts"),
    Term("shared_experts_fc2_input", lambda arch: gemm_input_bytes(arch) * _shared_ffn(arch) * s * b, Region.BLOCK,
         _STORED, Scope.LAYER,
         "the shared experts' fc2 keeps its input (2sbf_s); under FP8 (TE's Linear) its columnwise copy, one byte "
         "an element, with its fp32 scale_inv (sbf_s + 4)", shared_experts, module="shared_experts",
         fixed=fp8_scale_inv),
    Term("shared_experts_fc2_input_scales", lambda arch: block_scales(s * b, _shared_ffn(arch) / t, gathered=False)(arch),
         Region.REPLICATED, _STORED, Scope.LAYER,
         "... under a block-scaled recipe, its columnwise copy's block scales, [s·b, f_s/t] (quantizer.cpp, "
         "get_scale_shape: MXFP8 E8M0 [roundup(sb/32, 4), roundup(f_s/t, 128)]; blockwise fp32 GEMM_READY "
         "[ceil(sb/128), roundup(f_s/t, 4)])", _shared_block_scales, module="shared_experts"),
    Term("shared_experts_gate_score", A16 * s * b, Region.BOUNDARY, _STORED, Scope.LAYER,
         "the shared experts' gate keeps its sigmoid output, [N, 1], which the product saves too "
         "(shared_experts.py: sigmoid(linear(x, gate_weight)); 2sb)", shared_experts_gate, module="shared_experts"),
    Term("shared_experts_output", A16 * _sbh, Region.BOUNDARY, _STORED, Scope.LAYER,
         "... and the shared experts' output it scales (2sbh)", shared_experts_gate, module="shared_experts"),
)
MOE_TERMS = _MEGATRON_MOE_TERMS + SHARED_EXPERT_TERMS


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
    # Qwen2-MoE's shared expert: Megatron's shared-expert rows (SHARED_EXPERT_TERMS) and, unfused, silu's output
    Term("shared_experts_silu_output", lambda arch: A16 * _shared_ffn(arch) * s * b, Region.BLOCK, _STORED,
         Scope.LAYER, "an unfused shared expert keeps silu's output too (transformers' Qwen2MoeMLP: "
         "act_fn(gate_proj(x)) * up_proj(x) saves both factors, silu its input: gate_proj's and up_proj's outputs, "
         "the bytes the fused SwiGLU keeps as one; 2sbf_s)", shared_experts_keeping_silu_output,
         module="shared_experts"),
)
