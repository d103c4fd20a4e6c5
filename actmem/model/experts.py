"""The mixture-of-experts MLP as actmem models it: Megatron-Core's MoELayer, read and measured at
megatron-core 0.16.1 (the release on PyPI; the harness runs its MoELayer on a CPU).

What a token's trip through that layer keeps (actmem.memory.terms, the MoE rows): the router's
input, its top-k choice and probabilities, the aux loss's own scores, the permutation's maps,
and the rows the rank's experts receive, T = k·N·ETP tokens when routing is balanced (N = s·b/t
tokens a rank holds under sequence parallelism; the alltoall dispatcher all-gathers over the
expert-tensor-parallel group, the allgather one gathers every token of the ETP·EP ranks and keeps
those of its experts). The routing imbalance r scales T on the busiest rank: T = ⌈r·k·N·ETP⌉.

Modelled: every layer a MoE layer, SwiGLU experts without biases, the alltoall and allgather dispatchers,
dropless routing, softmax top-k with the aux loss or no load balancing, TE's grouped GEMM or
SequentialMLP. The rest is refused with its reason here, never priced as something else.
"""

from dataclasses import dataclass, replace

from actmem.errors import SpecError

#: Megatron's defaults of the MoE settings (megatron/training/arguments.py, transformer_config.py)
DEFAULTS = {"moe_topk": 2, "moe_ffn_hidden": None, "moe_load_balancing": "aux_loss", "moe_aux_loss_coeff": 0.0,
            "moe_router_dtype": None, "moe_dispatcher": "allgather", "moe_grouped_gemm": False,
            "moe_shared_ffn": None, "moe_shared_gate": False, "moe_shared_overlap": False, "moe_pre_softmax": False,
            "moe_score_function": "softmax", "moe_expert_bias": False, "moe_router_groups": None,
            "moe_router_group_topk": None, "moe_capacity_factor": None, "moe_drop_policy": "probs",
            "moe_pad_to_capacity": False, "moe_permute_fusion": False, "moe_bf16_padding": None}
#: bytes of the routing probabilities the permutation and the experts keep, by --moe-router-dtype
#: (router.py: the logits in that dtype; moe_utils.py, topk_routing_with_score_function: probs type_as
#: the logits); the softmax's own outputs are fp32 whatever it is
ROUTER_BYTES = {None: 2, "fp32": 4, "fp64": 8}
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "none")
DISPATCHERS = ("allgather", "alltoall")
#: Megatron's other load-balancing types and dispatchers, and why actmem does not price them yet
_NOT_MODELLED = {
    "global_aux_loss": "its global aux loss keeps scores across the data-parallel group, not measured yet",
    "sinkhorn": "the Sinkhorn router keeps its iterations' tensors, not measured yet",
    "flex": "the flex dispatcher (DeepEP or HybridEP) keeps each layer's handle past the backward and its buffers "
            "outside PyTorch's allocator, not modelled yet: give --moe-token-dispatcher-type alltoall to price the rest",
}


def layer_pattern(freq) -> int | tuple:
    """Megatron's --moe-layer-freq (arguments.py, moe_freq_type): an int N, one MoE layer every N
    (layer i is MoE where i % N == 0), or a list expression of 0 (dense) and 1 (MoE) such as
    "([0]*3+[1]*58)" or "([1]*3+[0]*2)*2", read here without eval: lists of 0 and 1, + and * by ints."""
    import ast

    if isinstance(freq, bool):
        raise SpecError(f"--moe-layer-freq must be an integer or a list pattern, got {freq!r}")
    if isinstance(freq, int) or (isinstance(freq, str) and freq.strip().isdigit()):
        if int(freq) < 1:
            raise SpecError(f"--moe-layer-freq must be at least 1, got {freq}")
        return int(freq)
    if isinstance(freq, (tuple, list)):
        pattern = tuple(freq)
    else:
        try:
            pattern = tuple(_pattern(ast.parse(str(freq).strip(), mode="eval").body))
        except (SyntaxError, ValueError):
            raise SpecError(f"--moe-layer-freq {freq}: not an integer nor a list of 0 and 1 such as ([0]*3+[1]*58)")
    if not pattern or any(layer not in (0, 1) or isinstance(layer, bool) for layer in pattern):
        raise SpecError(f"--moe-layer-freq must list 0 (dense) and 1 (MoE) layers, got {freq!r}")
    return pattern


def _pattern(node) -> list:
    import ast

    if isinstance(node, ast.List) and all(isinstance(e, ast.Constant) and type(e.value) is int for e in node.elts):
        return [e.value for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _pattern(node.left) + _pattern(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        list_side, count = (node.left, node.right) if isinstance(node.right, ast.Constant) else (node.right, node.left)
        if isinstance(count, ast.Constant) and type(count.value) is int and count.value >= 0:
            return _pattern(list_side) * count.value
    raise ValueError("not a pattern")


def moe_layers(arch, layers: int) -> tuple:
    """1 for each MoE layer of the model's ``layers``, 0 for each dense one."""
    freq = arch.moe_layer_freq
    if isinstance(freq, int):
        return tuple(int(i % freq == 0) for i in range(layers))
    return tuple(freq)


def last_layer_moe(arch, layers: int) -> int:
    """1 where the model's last layer is a MoE layer (the kind its multi-token-prediction layers take:
    gpt_layer_specs.py, get_gpt_mtp_block_spec), else 0."""
    return moe_layers(arch, layers)[-1] if arch.moe else 0


def dense_twin(arch):
    """The architecture of the model's dense layers: the same, its MLP dense (of ffn_hidden)."""
    from dataclasses import replace

    return replace(arch, num_experts=None, moe_layer_freq=1, **DEFAULTS)


def check_experts(arch) -> None:
    """Refuse a MoE setting without experts, and a MoE layer actmem does not model, with why."""
    if not arch.moe:
        given = [name for name, default in DEFAULTS.items() if getattr(arch, name) != default]
        given += ["moe_layer_freq"] * (arch.moe_layer_freq != 1)
        if given:
            raise SpecError(f"{', '.join(given)} shape a mixture-of-experts MLP: give --num-experts")
        return
    if not arch.moe_topk <= arch.num_experts:
        raise SpecError(f"--moe-router-topk ({arch.moe_topk}) must be at most --num-experts ({arch.num_experts})")
    if arch.moe_score_function not in ("softmax", "sigmoid"):
        raise SpecError(f"moe_score_function must be softmax or sigmoid; got {arch.moe_score_function!r}")
    if arch.moe_expert_bias and arch.moe_score_function != "sigmoid":
        raise SpecError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (Megatron raises: "
                        "transformer_config.py)")
    groups, group_topk = arch.moe_router_groups, arch.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        raise SpecError("give --moe-router-num-groups and --moe-router-group-topk together: Megatron limits the "
                        "routing to groups only with both (moe_utils.py, topk_routing_with_score_function)")
    if groups is not None and (arch.num_experts % groups or group_topk > groups):
        raise SpecError(f"--moe-router-num-groups ({groups}) must divide the experts ({arch.num_experts}) and be at "
                        f"least --moe-router-group-topk ({group_topk})")
    if arch.moe_topk == 1 and arch.moe_score_function == "softmax" and not arch.moe_pre_softmax \
            and "moe" in arch.code.has:            # Megatron's own rule; transformers renormalises k = 1 too
        raise SpecError("top-1 routing with a softmax router needs --moe-router-pre-softmax (Megatron raises: "
                        "transformer_config.py): give it")
    if arch.moe_shared_ffn is None and (arch.moe_shared_gate or arch.moe_shared_overlap):
        raise SpecError("--moe-shared-expert-gate and --moe-shared-expert-overlap shape shared experts: give "
                        "--moe-shared-expert-intermediate-size")
    if arch.moe_shared_overlap and arch.moe_dispatcher != "alltoall":
        raise SpecError("--moe-shared-expert-overlap only works with the alltoall dispatcher (Megatron raises: "
                        "transformer_config.py)")
    if arch.moe_router_dtype not in ROUTER_BYTES:
        raise SpecError(f"moe_router_dtype must be fp32 or fp64 (or unset: 16-bit); got {arch.moe_router_dtype!r}")
    coeff = arch.moe_aux_loss_coeff
    if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or not coeff >= 0:
        raise SpecError(f"moe_aux_loss_coeff must be a number >= 0, got {coeff!r}")
    if arch.moe_grouped_gemm and arch.attention_core == "eager":
        raise SpecError("--moe-grouped-gemm under the eager core: Megatron's local spec builds its legacy GroupedMLP "
                        "(grouped_gemm's gmm, real weight gradients), which actmem does not model: drop "
                        "--moe-grouped-gemm, or --attention-core flash (TE's grouped GEMM)")
    for name, flag in (("moe_load_balancing", "--moe-load-balancing"),
                       ("moe_dispatcher", "--moe-token-dispatcher-type")):
        if getattr(arch, name) in _NOT_MODELLED:
            raise SpecError(f"{flag} {getattr(arch, name)}: {_NOT_MODELLED[getattr(arch, name)]}")
    if arch.moe_load_balancing not in LOAD_BALANCING:
        raise SpecError(f"moe_load_balancing must be one of {', '.join(LOAD_BALANCING + tuple(_NOT_MODELLED)[:2])}; "
                        f"got {arch.moe_load_balancing!r}")
    if arch.moe_dispatcher not in DISPATCHERS:
        raise SpecError(f"moe_dispatcher must be alltoall, allgather or flex; got {arch.moe_dispatcher!r}")
    factor = arch.moe_capacity_factor
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0):
        raise SpecError(f"moe_capacity_factor must be a number > 0, got {factor!r}")
    if arch.moe_drop_policy not in ("probs", "position"):
        raise SpecError(f"moe_drop_policy must be probs or position; got {arch.moe_drop_policy!r}")
    if factor is None and arch.moe_drop_policy != "probs":
        raise SpecError("--moe-token-drop-policy chooses which tokens over capacity are dropped: give "
                        "--moe-expert-capacity-factor")
    if factor is None and arch.moe_pad_to_capacity:
        raise SpecError("--moe-pad-expert-input-to-capacity pads each expert's input to its capacity: give "
                        "--moe-expert-capacity-factor (Megatron raises: transformer_config.py)")
    if arch.activation != "swiglu":
        raise SpecError(f"mixture-of-experts layers are modelled with SwiGLU experts (Mixtral, Qwen3, DeepSeek); "
                        f"{arch.activation} experts keep what actmem has not measured yet")
    if arch.bias:
        raise SpecError("mixture-of-experts layers are modelled without biases (--disable-bias-linear), as "
                        "Mixtral, Qwen3 and DeepSeek train")


def expert_shards(shards, gpus, etp, ep, p):
    """The ranks the distributed optimizer shards the experts' state over: the expert data-parallel
    group, gpus/(ETP·EP·p) (parallel_state.py: expert_data_parallel_size); at EP = 1 the dense
    parameters' own ``shards``, d·c (the experts join their buffers: transformer_engine.py, allreduce =
    not (is_expert and EP > 1)). Arithmetic only: ints, or arrays over a sweep."""
    return shards + (ep != 1) * (gpus // (etp * ep * p) - shards)


def capacity(arch, tokens):
    """C, each expert's capacity from a rank's ``tokens`` N (an int, or an array over a sweep), as Megatron computes
    it, in floating point: ceil((N·k / E) · factor) (moe_utils.py, get_capacity, called with N·k tokens:
    apply_router_token_dropping); 1 where there is no capacity factor (no row reads it then)."""
    if not (arch.moe and arch.moe_capacity_factor is not None):
        return 1
    share = (tokens * arch.moe_topk / arch.num_experts) * arch.moe_capacity_factor
    if isinstance(share, float):
        import math

        return math.ceil(share)
    import numpy as np          # a sweep's column: numpy is the planner's already

    return np.ceil(share)


def capped_imbalance(imbalance, ep, experts, topk):
    """The routing imbalance r a rank can see: a token sends at most min(k, E/EP) of its k copies to one
    rank, so a rank receives at most min(k, E/EP)·N·EP rows against its balanced k·N: r at most min(EP, E/k),
    1 at EP = 1. Ints, Fractions or arrays of EP."""
    from fractions import Fraction

    import numpy as np

    most = Fraction(experts, topk)
    if isinstance(ep, np.ndarray):
        return np.minimum(np.minimum(imbalance, ep), float(most))
    return min(imbalance, ep, most)


@dataclass(frozen=True)
class BusiestRank:
    """Where a load histogram puts the most expert rows: r, the rows of the busiest EP rank over its balanced
    share, and which rank (its experts) in which layer of the histogram."""
    imbalance: object
    rank: int
    experts: tuple
    layer: int


def busiest_rank(loads: tuple, ep: int) -> BusiestRank:
    """The busiest EP rank of a per-expert load histogram (``loads``: a row of E token counts a layer, as
    Megatron logs tokens_per_expert): Megatron gives rank j experts j·E/EP .. (j+1)·E/EP - 1 (moe_layer.py,
    local_expert_indices), so its rows are their loads' sum, and its share the layer's total over EP. r is
    the largest ratio over the ranks and the layers, exact; at most EP, 1 at EP = 1."""
    from fractions import Fraction

    best = None
    for layer, row in enumerate(loads):
        local = len(row) // ep
        for rank in range(ep):
            ratio = Fraction(sum(row[rank * local:(rank + 1) * local]) * ep, sum(row))
            if best is None or ratio > best.imbalance:
                best = BusiestRank(ratio, rank, (rank * local, (rank + 1) * local - 1), layer)
    r = best.imbalance
    return replace(best, imbalance=int(r) if r.denominator == 1 else r)


def check_routing(arch, imbalance, loads) -> None:
    """The routing asked for: an imbalance or a load histogram, not both; a histogram only for a mixture of
    experts, of E non-negative counts a layer with some tokens in each (an imbalance on a dense model is the
    rules' to refuse); neither where the experts' input is padded to capacity, whose rows no routing changes."""
    if arch.moe and arch.moe_pad_to_capacity and (imbalance != 1 or loads is not None):
        raise SpecError(f"{'--moe-load-histogram' if loads is not None else f'--moe-imbalance {imbalance}'} with "
                        "--moe-pad-expert-input-to-capacity: padded, every expert receives C rows from each rank "
                        "whatever the routing, so the imbalance changes nothing; drop it")
    if loads is None:
        return
    if imbalance != 1:
        raise SpecError("give --moe-imbalance or --moe-load-histogram, not both: the histogram gives the "
                        "busiest rank's imbalance")
    if not arch.moe:
        raise SpecError("--moe-load-histogram shapes a mixture-of-experts layer: give --num-experts")
    _check_loads(loads, arch.num_experts)


def _check_loads(loads: tuple, experts: int) -> None:
    for layer, row in enumerate(loads):
        if len(row) != experts:
            raise SpecError(f"the expert load histogram's layer {layer} has {len(row)} counts; the model has {experts} "
                            "experts")
        if sum(row) <= 0:
            raise SpecError(f"the expert load histogram's layer {layer} routes no tokens")
