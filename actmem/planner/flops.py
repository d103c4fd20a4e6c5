"""FLOPs per iteration (the paper's appendix) and the utilisations they give.

Arithmetic only, so it runs on ints, floats and numpy arrays alike.
"""

from actmem.model.architecture import PAPER
from actmem.memory.techniques import PLAN_RECOMPUTE
from actmem.model.recompute import DEFAULT_MODULES, Recompute


def matmul_weights(h, arch=PAPER, heads=None):
    """W: the weights one token multiplies in a layer's linears: the attention's (attention_weights)
    and the MLP's (mlp_weights). The paper's: 12h²."""
    return attention_weights(h, arch, heads) + mlp_weights(h, arch)


def attention_weights(h, arch=PAPER, heads=None):
    """QKV h·(ad + 2gd) and the projection ad·h (4h² with ad = h, g = a); under multi-latent attention
    its projections (actmem.model.latent): q down h·q_r and up q_r·a(d_qk + d_r) (or h·a(d_qk + d_r)
    without a q latent), kv down h·(kv_r + d_r) and up kv_r·a(d_qk + d_v), and the projection a·d_v·h:
    the sum over attention_linears."""
    return sum(inputs * outputs for inputs, outputs, _, _ in attention_linears(h, arch, heads))


#: how tensor parallelism splits a linear: its outputs ('column'), its inputs ('row'), or neither
#: ('whole': each rank runs it whole on its own tokens, as multi-latent attention's down projections)
SPLITS = ("column", "row", "whole")


def attention_linears(h, arch=PAPER, heads=None) -> list:
    """The attention's linears a token goes through, (inputs, outputs, split: SPLITS, expert: False)."""
    from actmem.memory.parameters import qkv_width

    output = (arch.attention_width(h, heads), h, "row", False)
    if not arch.multi_latent_attention:
        return [(h, qkv_width(h, arch, heads), "column", False), output]
    from actmem.model.latent import query_width

    q, q_rank, kv_rank = query_width(arch, heads), arch.q_lora_rank, arch.kv_lora_rank
    query = ([(h, q, "column", False)] if q_rank is None
             else [(h, q_rank, "whole", False), (q_rank, q, "column", False)])
    return [*query, (h, kv_rank + arch.qk_pos_emb_head_dim, "whole", False),
            (kv_rank, heads * (arch.qk_head_dim + arch.v_head_dim), "column", False), output]


def score_width(h, arch=PAPER, heads=None):
    """The widths the attention scores multiply over, QKᵀ's and ·V's: 2ad (2h), or under multi-latent
    attention a(d_qk + d_r) + a·d_v."""
    if not arch.multi_latent_attention:
        return 2 * arch.attention_width(h, heads)
    from actmem.model.latent import query_width

    return query_width(arch, heads) + arch.attention_width(h, heads)


def mlp_weights(h, arch=PAPER):
    """The MLP's weights a token multiplies: (1 + fc1 width)·h·f; in a mixture of experts the router's
    E·h, the k experts it is routed to, (1 + fc1 width)·h·f_e each, and the shared experts' 3h·f_s
    (the FLOPs of the rows the experts really receive: as many as k a token, dropless or balanced):
    the sum over mlp_linears, each expert linear k times."""
    return sum(inputs * outputs * (arch.moe_topk if expert else 1) for inputs, outputs, _, expert in mlp_linears(h, arch))


def mlp_linears(h, arch=PAPER) -> list:
    """The MLP's linears a token goes through, (inputs, outputs, split: SPLITS, expert): fc1 (gate and up
    under SwiGLU) and fc2; in a mixture of experts the router (whole), each routed expert's fc1 and fc2
    (expert: a token goes through k of them, split by ETP) and the shared experts' (SwiGLU, 2f_s then f_s)."""
    if not arch.moe:
        return [(h, arch.fc1_width * arch.ffn(h), "column", False), (arch.ffn(h), h, "row", False)]
    f_e, f_s = arch.expert_ffn(h), arch.moe_shared_ffn
    shared = [] if f_s is None else [(h, 2 * f_s, "column", False), (f_s, h, "row", False)]
    return [(h, arch.num_experts, "whole", False), (h, arch.fc1_width * f_e, "column", True),
            (f_e, h, "row", True), *shared]


def _layer_counts(L, arch) -> tuple:
    """(layers of the architecture's own kind, dense layers among them): a MoE model's dense layers
    (--moe-layer-freq) are its dense twin's."""
    if not arch.moe:
        return L, 0
    from actmem.model.experts import moe_layers

    moe = sum(moe_layers(arch, L))
    return moe, L - moe


def mlp_tensor_parallel_share(arch, L) -> float:
    """The share of the L layers whose MLP runs tensor-parallel collectives: every dense MLP, and a MoE
    layer's shared experts (its routed experts move their tokens through the dispatcher)."""
    own, dense = _layer_counts(L, arch)
    return (dense + own * (arch.moe_shared_ffn is not None)) / L if arch.moe else 1


def layers_weights(h, L, arch=PAPER, heads=None):
    """Σ W over the L layers: L·W, or a MoE model's MoE layers' and dense layers' each at theirs."""
    own, dense = _layer_counts(L, arch)
    if not dense:
        return L * matmul_weights(h, arch, heads)
    from actmem.model.experts import dense_twin

    return own * matmul_weights(h, arch, heads) + dense * matmul_weights(h, dense_twin(arch), heads)


def _parts(B, s, L, h, v, arch, heads=None):
    """(layers' matmuls, attention scores, logits) of one forward pass, FLOPs, in float64:
    a 1T-parameter iteration is ~4e19 FLOPs, past int64, and the planner passes int64
    arrays. The scores (QKᵀ and ·V) are 2·B·s²·L·score_width: 4·B·s²·L·ad. D multi-token-prediction
    layers (mtp_weights) add their layers' matmuls and scores and D more logits."""
    depth = arch.mtp_layers
    return (2.0 * B * s * (layers_weights(h, L, arch, heads) + mtp_weights(h, L, arch, heads)),
            2.0 * B * s * s * (L + depth) * score_width(h, arch, heads), 2.0 * B * s * h * v * (1 + depth))


def mtp_weights(h, L, arch=PAPER, heads=None):
    """The weights a token multiplies in the D multi-token-prediction layers (multi_token_prediction.py,
    MultiTokenPredictionLayer): eh_proj [h, 2h] and a transformer layer of the model's last layer's kind
    (gpt_layer_specs.py, get_gpt_mtp_block_spec) each."""
    if not arch.mtp_layers:
        return 0
    from actmem.model.experts import dense_twin, last_layer_moe

    last = dense_twin(arch) if arch.moe and not last_layer_moe(arch, L) else arch
    return arch.mtp_layers * (2 * h * h + matmul_weights(h, last, heads))


def model_flops(B, s, L, h, v, arch=PAPER, heads=None):
    """Forward and backward (3x the forward) of the layers' matmuls, the attention scores and
    the logits: 6·B·s·L·W + 12·B·s²·L·h + 6·B·s·h·v. For the paper's layer (W = 12h²) this
    is the appendix's 72·B·s·L·h²·(1 + s/(6h) + v/(12hL))."""
    layers, scores, logits = _parts(B, s, L, h, v, arch, heads)
    return 3 * (layers + scores + logits)


APPENDIX_MODEL_FLOPS = "72·B·s·L·h²·(1 + s/(6h) + v/(12hL))"
_ACTIVATION = {"gelu": "GeLU", "swiglu": "SwiGLU", "squared_relu": "squared-ReLU"}


def model_flops_formula(model, global_batch: int, arch=PAPER) -> dict:
    """What model_flops counts for this model, as text: the appendix's closed form where the layer
    is the paper's (W = 12h², a·d = h, whatever its norms, biases or positions), else the sum it
    generalises, W written out; + MTP where the model has multi-token-prediction layers.
    {'formula', 'where': lines of its letters' values, 'counts'}."""
    if not arch.mtp_layers:
        return _formula(model, global_batch, arch)
    from dataclasses import replace

    text = _formula(model, global_batch, replace(arch, mtp_layers=0))
    args = (global_batch, model.seq_len, model.layers, model.hidden, model.vocab)
    mtp = model_flops(*args, arch, model.heads) - model_flops(*args, replace(arch, mtp_layers=0), model.heads)
    return text | {"formula": f"{text['formula']} + MTP",
                   "where": [*text["where"], f"MTP = {mtp:.4e}: D = {arch.mtp_layers} multi-token-prediction layers, "
                             "each eh_proj's 2h² and a layer of the last layer's kind a token, its scores, and the "
                             "logits once more"]}


def _formula(model, global_batch: int, arch) -> dict:
    h, heads = model.hidden, model.heads
    weights, width = matmul_weights(h, arch, heads), arch.attention_width(h, heads)
    dims = f"B={global_batch:,} s={model.seq_len:,} L={model.layers:,} h={h:,} v={model.vocab:,}"
    if weights == 12 * h * h and width == h:
        return {"formula": APPENDIX_MODEL_FLOPS, "where": [dims],
                "counts": "the paper's appendix: each layer's matmuls (12h² weights a token), its attention "
                          "scores (s/(6h)) and the logits (v/(12hL)), forward and backward"}
    grouped = arch.query_groups is not None or arch.head_dim is not None
    attention, scores, qkv, letters = _attention_text(model, arch, grouped, width)
    mlp = (f"the {_ACTIVATION[arch.activation]} MLP's "
           f"{'gate and up, then down' if arch.fc1_width == 2 else 'fc1 and fc2'}, f = {arch.ffn(h):,}")
    weights_text = f"{attention} + {arch.fc1_width + 1}·h·f"
    if arch.moe:
        return _moe_formula(model, arch, weights_text, scores, dims, letters)
    return {"formula": f"6·B·s·L·W + {scores} + 6·B·s·h·v",
            "where": [f"W = {weights_text} = {weights:,}", *letters, dims],
            "counts": f"per-layer matmul FLOPs of this architecture, forward and backward (3 × the forward), "
                      f"the paper's appendix generalised: W the weights a token multiplies in a layer ({qkv}; "
                      f"the projection; {mlp}); {scores} the attention scores QKᵀ and ·V over the "
                      f"whole s²; 6·B·s·h·v the logits. The appendix's {APPENDIX_MODEL_FLOPS} is the case "
                      f"W = 12h², a·d = h, which this layer is not"}


def _attention_text(model, arch, grouped: bool, width) -> tuple:
    """(the attention's weights as text, the scores' FLOPs as text, what the linears before the core are,
    the where-lines of their letters)."""
    heads = model.heads
    if arch.multi_latent_attention:
        q_rank = arch.q_lora_rank
        query = "h·a·(d_qk + d_r)" if q_rank is None else "h·q_r + q_r·a·(d_qk + d_r)"
        ranks = ("" if q_rank is None else f"q_r = {q_rank:,}, ") + f"kv_r = {arch.kv_lora_rank:,}"
        return (f"{query} + h·(kv_r + d_r) + kv_r·a·(d_qk + d_v) + a·d_v·h", "6·B·s²·L·(a·(d_qk + d_r) + a·d_v)",
                "multi-latent attention's down and up projections",
                [f"{ranks}, a = {heads:,}, d_qk = {arch.qk_head_dim:,}, d_r = {arch.qk_pos_emb_head_dim:,}, "
                 f"d_v = {arch.v_head_dim:,}"])
    qkv = (f"QKV with {arch.query_groups_or(heads):,} query groups of d = {arch.head_dim_or(model.hidden, heads):,}"
           if grouped else "QKV")
    return ("h·(a·d + 2·g·d) + a·d·h" if grouped else "4h²", f"12·B·s²·L·{'a·d' if grouped else 'h'}", qkv,
            [f"a·d = {width:,}"] if grouped else [])


def _moe_formula(model, arch, dense_text: str, scores: str, dims: str, letters: list) -> dict:
    """model_flops_formula of a mixture of experts: W_e of a MoE layer (the router, k experts of f_e and the
    shared experts in place of the MLP), W of its dense layers where it has them."""
    from actmem.model.experts import dense_twin

    h, heads = model.hidden, model.heads
    own, dense = _layer_counts(model.layers, arch)
    attention = dense_text.rsplit(" + ", 1)[0]
    shared = " + 3·h·f_s" if arch.moe_shared_ffn is not None else ""
    moe_text = f"{attention} + E·h + k·{arch.fc1_width + 1}·h·f_e{shared}"
    layers = "(L_e·W_e + L_d·W)" if dense else "L·W_e"
    where = [f"W_e = {moe_text} = {matmul_weights(h, arch, heads):,}",
             *([f"W = {dense_text} = {matmul_weights(h, dense_twin(arch), heads):,}", f"L_e = {own:,}, L_d = {dense:,}"]
               if dense else []),
             f"E = {arch.num_experts:,}, k = {arch.moe_topk}, f_e = {arch.expert_ffn(h):,}"
             + (f", f_s = {arch.moe_shared_ffn:,}" if shared else ""),
             *letters, dims]
    return {"formula": f"6·B·s·{layers} + {scores} + 6·B·s·h·v", "where": where,
            "counts": "per-layer matmul FLOPs, forward and backward (3 × the forward), the paper's appendix "
                      "generalised to a mixture of experts: a token multiplies the router's E·h and the k experts "
                      "it is routed to (and the shared experts), not all E; "
                      + ("its dense layers their MLP; " if dense else "")
                      + f"{scores} the attention scores; 6·B·s·h·v the logits. Dropped tokens "
                      "(a capacity factor) would do less: not counted"}


def mlp_forward_flops(B, s, L, h, arch=PAPER):
    """One forward of the dense MLPs' matmuls, what --recompute-modules mlp reruns: 2·B·s·L·(1 + fc1
    width)·h·f (16·B·s·L·h² for the paper's, f = 4h); of a MoE model its dense layers alone (the mlp
    module leaves a MoE layer whole)."""
    if arch.moe:
        from actmem.model.experts import dense_twin

        return 2.0 * B * s * _layer_counts(L, arch)[1] * mlp_weights(h, dense_twin(arch))
    return 2.0 * B * s * L * mlp_weights(h, arch)


def op_rerun_flops(B, s, L, h, arch=PAPER, heads=None):
    """One forward of what torchtitan's per-op checkpointing reruns of a block's matmuls: those its policy does not
    cache, the 2nd, 4th and 6th (wk, wo, w3: 2·B·s·L·(h·gd + ad·h + h·f)); the attention core is cached (SDPA is
    in its list), so its scores are not rerun (actmem.memory.terms: OP_CHECKPOINT_TERMS)."""
    return 2.0 * B * s * L * h * (arch.kv_width(h, heads) + arch.attention_width(h, heads) + arch.ffn(h))


def hardware_flops(B, s, L, h, v, recompute: Recompute, arch=PAPER, heads=None, modules=DEFAULT_MODULES, ops=False):
    """What the GPUs really compute, recomputation included (the paper's appendix).

    selective of the attention core: the paper counts the attention-score part again,
    12·B·s²·L·h (72BsLh²·s/(6h)), which is how it gets its 2.7% (GPT-3) and 1.6% (530B)
    overheads and the HFU column of Table 5; of the MLP (``modules``, --recompute-modules):
    one more forward of its matmuls, as full recompute counts its rerun. full: one more
    forward of every layer, not of the logits: 8·B·s·L·W + 16·B·s²·L·h + 6·B·s·h·v, the
    appendix's 96BsLh²·(1 + s/(6h) + v/(16hL)). ``ops``: torchtitan's per-op checkpointing (op_rerun_flops).
    """
    return sum(hardware_parts(B, s, L, h, v, recompute, arch, heads, modules, ops))


def hardware_parts(B, s, L, h, v, recompute: Recompute, arch=PAPER, heads=None, modules=DEFAULT_MODULES, ops=False):
    """hardware_flops by part: (the layers' matmuls, the attention scores, the logits), each with
    what recompute reruns of it; the planner times each at its own kernels' speed."""
    layers, scores, logits = _parts(B, s, L, h, v, arch, heads)
    if ops:
        return 3 * layers + op_rerun_flops(B, s, L, h, arch, heads), 3 * scores, 3 * logits
    if recompute is Recompute.NONE:
        return 3 * layers, 3 * scores, 3 * logits
    if recompute is Recompute.SELECTIVE:
        return (3 * layers + mlp_forward_flops(B, s, L, h, arch) * ("mlp" in modules),
                3 * scores + 3 * scores * ("core_attn" in modules), 3 * logits)
    return 4 * layers, 4 * scores, 3 * logits


def utilization(flops, seconds, gpus, peak_flops):
    """Share of the GPUs' peak: MFU with model FLOPs, HFU with hardware FLOPs."""
    return flops / (seconds * gpus * peak_flops)


def flops_report(model, global_batch: int, gpus: int | None, peak_flops: float,
                 seconds: float | None, arch=PAPER) -> dict:
    """Model and hardware FLOPs per iteration for each recompute mode; MFU and HFU when an
    iteration time is given."""
    dims = dict(B=global_batch, s=model.seq_len, L=model.layers, h=model.hidden, v=model.vocab, arch=arch,
                heads=model.heads)
    flops = model_flops(**dims)
    report = {"global_batch": global_batch, "gpus": gpus, "peak_flops": peak_flops,
              "iteration_s": seconds, "model_flops": flops,
              "model_flops_formula": model_flops_formula(model, global_batch, arch), "hardware": []}
    if seconds is not None:
        report["mfu"] = utilization(flops, seconds, gpus, peak_flops)
    for name, choice in PLAN_RECOMPUTE.items():
        if choice.ops and not arch.code.op_checkpointing:        # torchtitan's, torch-native's alone
            continue
        hardware = hardware_flops(**dims, recompute=choice.granularity, modules=choice.modules, ops=choice.ops)
        row = {"recompute": name, "hardware_flops": hardware, "overhead": hardware / flops - 1}
        if seconds is not None:
            row["hfu"] = utilization(hardware, seconds, gpus, peak_flops)
        report["hardware"].append(row)
    return report
