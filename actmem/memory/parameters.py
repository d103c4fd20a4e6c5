"""Parameters, gradients and optimizer state on one GPU of the first stage (and the dummy
weight gradients Megatron's linears hand autograd).

Figure 1 of the paper sets these beside the activations. The count follows
Megatron's GPT layer; arithmetic only, so it runs on ints and numpy arrays alike.
"""

from dataclasses import dataclass, replace
from functools import lru_cache

from actmem.memory.megatron_fsdp import buckets, gathered_outside_units, pools, state_bytes
from actmem.model.architecture import PAPER
from actmem.model.widths import FP8_BYTES, GRADIENT_BYTES, OPTIMIZER_BYTES, WEIGHT_BYTES

FP8_SAVING = WEIGHT_BYTES - FP8_BYTES
"""Bytes an element an FP8 parameter (--fp8-param-gather) saves in DDP's buffer against a 16-bit one."""


def layer_parameters(h, t, arch=PAPER, heads=None):
    """One transformer layer's parameters on one of t GPUs.

    QKV h·(ad + 2gd) (+ its bias), projection ad·h (+h), the MLP's first linear h·f, or
    2h·f gated (+f or 2f), its second f·h (+h), two norms of h or 2h each, and with QK norms
    two of d or 2d; ad = h and g = a unless given. The paper's layer (f = 4h, biases, layer
    norms) is 12h² + 13h. Tensor parallelism splits the weights and the column-parallel
    biases; the row-parallel biases and the norms are replicated (every rank normalises its
    own heads with the same q and k norms, whose grads Megatron all-reduces over t:
    finalize_model_grads.py, _allreduce_layernorm_grads).
    """
    f, width, bias = arch.ffn(h), arch.fc1_width, int(arch.bias)
    qkv = qkv_width(h, arch, heads)
    mlp = 0 if arch.moe else width * h * f + f * h + bias * width * f     # experts: expert_parameters
    if arch.moe and arch.moe_shared_ffn is not None:     # the shared experts: one tensor-parallel SwiGLU MLP
        mlp = 3 * h * arch.moe_shared_ffn
    split = h * qkv + arch.attention_width(h, heads) * h + mlp + int(arch.has_qkv_bias) * qkv
    replicated = bias * 2 * h + 2 * arch.norm_parameters * h
    if arch.multi_latent_attention:     # its projections in place of the QKV linear
        split += latent_parameters(h, arch, heads)[0] - h * qkv - int(arch.has_qkv_bias) * qkv
        replicated += latent_parameters(h, arch, heads)[1]
    if arch.moe:          # the router's [E, h] weight, whole on every rank (router.py, TopKRouter)
        replicated += arch.num_experts * h + h * int(arch.moe_shared_gate)   # the shared gate's [1, h]
    if arch.qk_norm and not arch.multi_latent_attention:
        if heads is None:
            raise ValueError("QK norms need the head count")
        replicated += 2 * arch.norm_parameters * arch.head_dim_or(h, heads)
    return split // t + replicated


def layer_shapes(h, t, arch, heads) -> tuple:
    """One dense layer's parameter shapes on one of t GPUs, in the order a Megatron-Core TransformerLayer of the TE
    spec names them (named_parameters; its sum is layer_parameters'): the attention's projection [h, ad/t] (bias
    [h]) (Attention.__init__ builds linear_proj before SelfAttention its linear_qkv), QKV's fused norm [h] (and
    bias) before its weight [(ad + 2gd)/t, h] (bias), the QK norms [d] (and biases), fc1's fused norm [h] (and
    bias) before its weight [f/t or 2f/t, h] (bias), fc2 [h, f/t] (bias [h]). Megatron-FSDP lays its buckets out
    from these (megatron_fsdp.bucket_layout). Multi-latent attention's projections are not listed (refused there)."""
    f, width, bias, norm = arch.ffn(h), arch.fc1_width, arch.bias, arch.norm_parameters
    qkv = qkv_width(h, arch, heads)
    head_dim = arch.head_dim_or(h, heads)
    return ((h, arch.attention_width(h, heads) // t), *((h,),) * bias,
            *((h,),) * norm, (qkv // t, h), *((qkv // t,),) * arch.has_qkv_bias,
            *((head_dim,),) * (2 * norm * arch.qk_norm),
            *((h,),) * norm, (width * f // t, h), *((width * f // t,),) * bias,
            (h, f // t), *((h,),) * bias)


def outside_shapes(h, t, v, s, arch) -> tuple:
    """(before the layers, after them): the parameter shapes of a one-stage GPTModel outside its layers, in
    named_parameters order: the word embedding [v/t, h] and a learned position embedding [rows, h]; the final
    norm [h] (and bias) and an untied output layer [v/t, h] (stage_parameters)."""
    rows = s if arch.position_rows is None else arch.position_rows
    before = ((v // t, h), *((rows, h),) * (arch.position_embedding == "learned"))
    return before, (*((h,),) * arch.norm_parameters, *((v // t, h),) * (not arch.tied_output))


@lru_cache(maxsize=64)
def megatron_fsdp_buckets(h, t, v, s, arch, heads, layers, shards, strategy, bucket_size=None, rank=None):
    """Megatron-FSDP's buckets (megatron_fsdp.Buckets) of a one-stage GPTModel of dense layers (layer_shapes,
    outside_shapes) over ``shards`` ranks; cached: an estimate asks for them a technique and a stage."""
    return buckets(layer_shapes(h, t, arch, heads), layers, *outside_shapes(h, t, v, s, arch), shards, strategy, rank,
                   bucket_size, output_into_embedding=arch.tied_output and arch.gradient_accumulation_fusion,
                   fp8_weights=bool(arch.fp8 and arch.fp8_param_gather))


def latent_parameters(h, arch, heads):
    """Multi-latent attention's projections and latent norms, (split over t, whole on every rank),
    as multi_latent_attention.py builds them, none with a bias: q from h straight [a(d_qk + d_rope), h]
    (linear_q_proj, column-parallel) or through its latent, down [q_r, h] (TELinear 'duplicated': whole on
    every tensor-parallel rank) and up [a(d_qk + d_rope), q_r]; kv down [kv_r + d_rope, h] (whole) and up
    [a(d_qk + d_v), kv_r]; under --qk-layernorm the latents' norms, of q_r and kv_r (the up projections'
    fused layer_norm_weight, whole). The output projection (a·d_v·h) is counted with the layer's."""
    if heads is None:
        raise ValueError("multi-latent attention needs the head count")
    q_heads = heads * (arch.qk_head_dim + arch.qk_pos_emb_head_dim)
    q_rank, kv_rank = arch.q_lora_rank, arch.kv_lora_rank
    split = (h if q_rank is None else q_rank) * q_heads + kv_rank * heads * (arch.qk_head_dim + arch.v_head_dim)
    whole = (0 if q_rank is None else h * q_rank) + h * (kv_rank + arch.qk_pos_emb_head_dim)
    if arch.qk_norm:
        whole += arch.norm_parameters * (kv_rank + (0 if q_rank is None else q_rank))
    return split, whole


def mtp_parameters(h, t, v, arch, p):
    """The multi-token-prediction layers' own parameters on the last stage, beside their transformer
    layers (counted as layers of the stage): each its enorm, hnorm and final norm (h each, RMSNorm's weight)
    and eh_proj [h/t, 2h] (multi_token_prediction.py, MultiTokenPredictionLayer); and at p > 1 the stage's own
    copy of the word embedding, which the predictions look their tokens up in (gpt_model.py: the
    embedding is built where pre_process or mtp_process), v·h/t."""
    if not arch.mtp_layers:
        return 0
    return arch.mtp_layers * (3 * arch.norm_parameters * h + 2 * h * h // t) + (p > 1) * v * h // t


def expert_parameters(h, arch, ep, etp):
    """One MoE layer's expert weights on one rank: E/EP experts, each SwiGLU's fc1 [2f_e, h] and
    fc2 [h, f_e] split over ETP (experts.py: SequentialMLP, TEGroupedMLP); 0 for a dense MLP.
    Their gradients and optimizer state shard over the expert data-parallel ranks, not d·c."""
    if not arch.moe:
        return 0
    f_e = arch.expert_ffn(h)
    return arch.num_experts // ep * 3 * h * f_e // etp


def qkv_width(h, arch, heads):
    """ad + 2gd: the QKV linear's outputs (3h for the paper's layer)."""
    if arch.query_groups is None and arch.head_dim is None:
        return 3 * h
    if heads is None:
        raise ValueError("query groups or a head dim need the head count")
    return arch.attention_width(h, heads) + 2 * arch.query_groups_or(heads) * arch.head_dim_or(h, heads)


def first_stage_parameters(h, L, p, t, v, s, arch=PAPER, heads=None, stage_layers=None):
    """The first stage's parameters (stage_parameters at stage 0)."""
    return stage_parameters(h, L, p, t, v, s, arch, heads, stage_layers)


def stage_parameters(h, L, p, t, v, s, arch=PAPER, heads=None, stage_layers=None, stage=0):
    """A stage's parameters: its layers (L/p, or stage_layers when uneven); on the first
    stage the word embedding split over the vocabulary (v·h/t) and the learned position
    embedding (rows·h, rows = s unless the table is longer; rotary positions have none); on the last the final norm and the output
    layer's v·h/t: its own weights when untied, and when tied a copy of the word embedding
    if the last stage is not the first (Megatron's word_embeddings_for_head; tied at p = 1
    they are one tensor: section 3)."""
    first, last = stage == 0, stage == p - 1          # elementwise where p or stage are arrays
    own_head = int(not arch.tied_output) + int(arch.tied_output) * (stage != 0)
    head = last * (arch.norm_parameters * h + own_head * v * h // t)
    rows = s if arch.position_rows is None else arch.position_rows    # --max-position-embeddings
    positions = rows * h if arch.position_embedding == "learned" else 0
    layers = L // p if stage_layers is None else stage_layers
    return layers * layer_parameters(h, t, arch, heads) + first * (v * h // t + positions) + head


def dummy_wgrad_elements(h, t, v, arch=PAPER, heads=None, holds_output=0, etp=None, dense_too=False):
    """Elements of the 16-bit dummy weight gradients a stage keeps for the process. Under
    Megatron's DDP a linear that accumulates its weight gradient into main_grad (gradient
    accumulation fusion) still returns a tensor of the weight's shape, uncomputed, so that
    the DDP hooks run on the main backward thread; TE's get_dummy_wgrad
    (transformer_engine/pytorch/module/base.py; TE PR #1651, 2025) caches one per distinct
    (shape, dtype) for the life of the process, and Megatron's own ColumnParallelLinear
    (tensor_parallel/layers.py) takes it from TE too. The shapes: QKV [(ad + 2gd)/t, h],
    the projection [h, ad/t], fc1 [f/t, h] (2f/t gated), fc2 [h, f/t] (multi-latent attention's four
    projections in place of QKV: _attention_shapes), and on the stage
    with the output layer [v/t, h]; shapes that coincide are one tensor. A MoE layer's experts in
    place of fc1 and fc2: [2f_e/ETP, h] and [h, f_e/ETP], one a shape whatever the expert count
    (TE's grouped_linear.py asks get_dummy_wgrad per expert weight, by main_grad's shape); its router
    computes a real weight gradient (moe_utils.py, RouterGatingLinearFunction.backward). Megatron's
    layer only (the other implementations compute real gradients). Arithmetic only."""
    if "wgrad_fusion" not in arch.code.has or not arch.gradient_accumulation_fusion:
        return 0                   # real gradients: autograd's own, or unfused 16-bit ones made and freed
    f, split = (arch.expert_ffn(h), etp) if arch.moe else (arch.ffn(h), t)      # the experts' linears: over ETP
    shared = arch.moe_shared_ffn if arch.moe and arch.moe_shared_ffn is not None else 0   # TE linears over t
    shapes = (*_attention_shapes(h, t, arch, heads), (h, arch.attention_width(h, heads) // t, 1),
              (arch.fc1_width * f // split, h, 1), (h, f // split, 1), (v // t, h, holds_output),
              (2 * shared // t, h, int(shared > 0)), (h, shared // t, int(shared > 0)),
              # a MoE model's dense layers on the stage (dense_too): their MLP's fc1 and fc2, of ffn_hidden
              (arch.fc1_width * arch.ffn(h) // t, h, 1 * dense_too), (h, arch.ffn(h) // t, 1 * dense_too),
              # the multi-token-prediction layers' eh_proj on the stage with the output layer
              (h // t, 2 * h, holds_output * int(arch.mtp_layers > 0)))
    total = 0
    for i, (rows, cols, here) in enumerate(shapes):
        seen = 0                              # an earlier shape on the stage equal to this one
        for earlier_rows, earlier_cols, there in shapes[:i]:
            seen = seen + (rows == earlier_rows) * (cols == earlier_cols) * there
        total = total + rows * cols * here * (seen == 0)
    return total


def _attention_shapes(h, t, arch, heads) -> tuple:
    """(rows, cols, 1) of the linears before the attention core: the QKV linear [(ad + 2gd)/t, h], or
    multi-latent attention's (latent_parameters: its down projections whole, TE linears all)."""
    if not arch.multi_latent_attention:
        return ((qkv_width(h, arch, heads) // t, h, 1),)
    q_heads = heads * (arch.qk_head_dim + arch.qk_pos_emb_head_dim)
    q_rank = arch.q_lora_rank
    query = ((q_heads // t, h, 1),) if q_rank is None else ((q_rank, h, 1), (q_heads // t, q_rank, 1))
    return query + ((arch.kv_lora_rank + arch.qk_pos_emb_head_dim, h, 1),
                    (heads * (arch.qk_head_dim + arch.v_head_dim) // t, arch.kv_lora_rank, 1))


def fp8_attention_shapes(h, t, arch, heads) -> tuple:
    """(rows, cols) of the attention's TE linear weights on one of t GPUs, those FP8 quantizes: QKV
    [(ad + 2gd)/t, h] or multi-latent attention's projections (_attention_shapes: its down projections
    whole), and proj [h, ad/t] (a·d_v/t under MLA)."""
    return (*((rows, cols) for rows, cols, _ in _attention_shapes(h, t, arch, heads)),
            (h, arch.attention_width(h, heads) // t))


def fp8_linear_shapes(h, t, arch, heads) -> tuple:
    """(rows, cols) of a dense layer's TE linear weights on one of t GPUs, those FP8 quantizes: the attention's
    (fp8_attention_shapes), fc1 [f/t, h] (2f/t gated), fc2 [h, f/t] (no biases nor norms)."""
    f = arch.ffn(h)
    return (*fp8_attention_shapes(h, t, arch, heads), (arch.fc1_width * f // t, h), (h, f // t))


def fp8_state(h, t, arch, heads, layers, generation, moe_layers=None, ep=1, etp=1):
    """(bytes the weights shrink by, bytes TE keeps beside them) of ``layers`` layers under FP8
    (actmem.model.fp8): --fp8-param-gather turns a linear weight's 2 bytes into 1; TE keeps a weight element's
    FP8 workspace or Hopper transpose (weight_copy_bytes) and each module's scaling state. A MoE model's
    ``moe_layers`` of them (None: all) keep their attention's two modules', their shared experts' two and their E/EP
    experts' (expert_fp8_kept);
    the others are its dense twin's. 0, 0 without FP8."""
    from actmem.model import fp8

    if not arch.fp8:
        return 0, 0
    if arch.moe:
        from actmem.model.experts import dense_twin

        own = layers if moe_layers is None else moe_layers
        dense_shrink, dense = fp8_state(h, t, dense_twin(arch), heads, layers - own, generation)
        linears = fp8_attention_shapes(h, t, arch, heads)
        if arch.moe_shared_ffn is not None:                          # the shared experts' fc1 and fc2, over t
            linears += ((2 * arch.moe_shared_ffn // t, h), (h, arch.moe_shared_ffn // t))
        kept = (sum(fp8.weight_copy_bytes(arch, generation, rows, cols) for rows, cols in linears)
                + len(linears) * fp8.module_state_bytes(arch) + expert_fp8_kept(h, arch, ep, etp, generation))
        # --fp8-param-gather: each expert's GroupedLinear weight{i} an FP8 parameter as a dense TE linear's
        # (base.py, reset_parameters: quantizer(param)), one byte in the expert data-parallel buffer
        elements = sum(rows * cols for rows, cols in linears) + expert_parameters(h, arch, ep, etp)
        return own * elements * FP8_SAVING * int(arch.fp8_param_gather) + dense_shrink, own * kept + dense
    shapes = fp8_linear_shapes(h, t, arch, heads)
    shrink = layers * sum(rows * cols for rows, cols in shapes) * FP8_SAVING * int(arch.fp8_param_gather)
    kept = layers * (sum(fp8.weight_copy_bytes(arch, generation, rows, cols) for rows, cols in shapes)
                     + len(shapes) * fp8.module_state_bytes(arch))
    return shrink, kept


def expert_fp8_kept(h, arch, ep, etp, generation):
    """What TE keeps for one MoE layer's FP8 experts on a rank: each of its G = E/EP experts' fc1 [2f_e/ETP, h]
    and fc2 [h, f_e/ETP] weight copies (grouped_linear.py: get_weight_workspace, cache_name f"weight{i}", made
    on an iteration's first microbatch and kept), and fc1's and fc2's GroupedLinear's scaling state, a module's
    worth an expert (base.py: num_gemms·3 forward and num_gemms·2 backward quantizers, a weight scale_inv each)."""
    from actmem.model import fp8

    f_e, groups = arch.expert_ffn(h), arch.num_experts // ep
    weights = (fp8.weight_copy_bytes(arch, generation, 2 * f_e // etp, h)
               + fp8.weight_copy_bytes(arch, generation, h, f_e // etp))
    return groups * (weights + 2 * fp8.module_state_bytes(arch))


@dataclass(frozen=True)
class ParameterBytes:
    count: int
    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    dummy_wgrads_bytes: int = 0
    """TE's cached 16-bit dummy weight gradients (dummy_wgrad_elements): model state too,
    allocated at the first backward and kept."""
    fp8_bytes: int = 0
    """What TE keeps for FP8 beside the weights (fp8_state): their cached FP8 copies (or Hopper's transposes of
    FP8 weights), the scaling state; model state, kept from the first step on."""
    fsdp: bool = False
    """FSDP2's model state (actmem.memory.fsdp): fp32 sharded weights, and gradients that are not held at every
    moment (the peak counts them where they are live)."""
    zero: int = 0
    """DeepSpeed's ZeRO stage (actmem.memory.zero), 0 where none: at stages 1 and 2 the gradients are not held at
    every moment either."""
    megatron_fsdp: str | None = None
    """Megatron-FSDP's sharding strategy (actmem.memory.megatron_fsdp), None where the run does not use it: its
    buffers are held at every moment."""
    buckets: object = None
    """Under Megatron-FSDP, its buckets (megatron_fsdp.Buckets: the padding, the units, what the backward holds)."""
    gathered_bytes: int = 0
    """Under Megatron-FSDP's optim_grads_params, the 16-bit weights outside its units (the embedding, the output
    layer, the final norm) all-gathered in the forward and kept until the backward's end: held at every moment of
    the first backward (megatron_fsdp.gathered_outside_units)."""
    double_buffer_bytes: int = 0
    """Under Megatron-FSDP's --fsdp-double-buffer, its fixed pools of two buffers for the units' gathered weights and
    gradient buckets, held for the run (megatron_fsdp.pools)."""

    @property
    def transient_gradients(self) -> bool:
        """The gradients are the moments' rows, not held at every moment (FSDP2's, ZeRO-1's and ZeRO-2's)."""
        return self.fsdp or self.zero in (1, 2)

    @property
    def held_bytes(self):
        """What is held at every moment of the step: all of it, but transient gradients."""
        return self.total_bytes - self.gradients_bytes * self.transient_gradients

    @property
    def total_bytes(self):
        return (self.weights_bytes + self.gradients_bytes + self.optimizer_bytes + self.dummy_wgrads_bytes
                + self.fp8_bytes + self.gathered_bytes + self.double_buffer_bytes)

    def __add__(self, other: "ParameterBytes") -> "ParameterBytes":
        """Two groups of parameters on one GPU (a MoE layer's experts beside the rest: sharded over
        different data-parallel ranks)."""
        return ParameterBytes(*(getattr(self, name) + getattr(other, name) for name in
                                ("count", "weights_bytes", "gradients_bytes", "optimizer_bytes", "dummy_wgrads_bytes",
                                 "fp8_bytes")))


def parameter_bytes(count, data_parallel, distributed_optimizer, dummy_wgrads=0,
                    gradient_bytes=GRADIENT_BYTES, optimizer_bytes=OPTIMIZER_BYTES) -> ParameterBytes:
    """18 bytes a parameter, or 6 + 12/d with the distributed optimizer (rounded up: the
    largest shard), 2 less a parameter with 16-bit main gradients, the optimizer's 12 bytes
    as its dtypes say (optimizer_state.OptimizerState); and 2 bytes a dummy weight-gradient
    element (dummy_wgrad_elements).
    Arithmetic only: the planner passes numpy arrays, one element a configuration."""
    shards = 1 + (data_parallel - 1) * distributed_optimizer
    optimizer = -(-optimizer_bytes * count // shards)
    return ParameterBytes(count, WEIGHT_BYTES * count, gradient_bytes * count, optimizer,
                          WEIGHT_BYTES * dummy_wgrads)


def stage_state(h, L, p, t, v, s, arch, heads, *, stage_layers, stage, shards, expert_shards,
                distributed_optimizer, gradient_bytes, optimizer_bytes, ep=1, etp=None, moe_layers=None,
                extra=0, dense_layers_too=False, gpu_fp8=None, fp8_layers=None, eh_projections=0,
                megatron_fsdp=None, fsdp_bucket_size=None, fsdp_double_buffer=False) -> ParameterBytes:
    """A stage's model state: its layers' parameters and the embedding's and the output layer's where it
    holds them (stage_parameters), the dummy weight gradients (dummy_wgrad_elements), over ``shards``
    data-parallel ranks; a MoE model's experts (expert_parameters, E/EP a rank over ETP) over
    ``expert_shards``. ``moe_layers``: how many of the stage's layers have experts (None: all, or none
    for a dense model); the others are ``arch``'s dense twin's (actmem.model.experts.dense_twin).
    ``extra``: parameters beside the layers (the multi-token-prediction layers'), sharded as the dense.
    ``gpu_fp8``: the GPU's FP8 generation, for what TE keeps of FP8 weights (fp8_state); ``fp8_layers``: (the
    stage's layers that run in FP8, those of them with experts) where some run in bf16 (--first-last-layers-bf16;
    None: all); ``eh_projections``:
    the multi-token-prediction layers' eh_proj on the stage, TE linears [h/t, 2h] of their own under FP8 (their
    transformer layers are among ``stage_layers``); ``megatron_fsdp``: Megatron-FSDP's sharding strategy, which
    shards the state over ``shards`` as it says (actmem.memory.megatron_fsdp; a dense model: the rules), its buckets
    outside the units split at ``fsdp_bucket_size`` elements (None: whole), its units' buffers in fixed pools under
    ``fsdp_double_buffer``.
    Arithmetic only: one stage of an estimate, or a column a configuration of the plan's sweep."""
    from actmem.model.experts import dense_twin

    own = stage_layers if moe_layers is None else moe_layers
    dense = dense_twin(arch) if arch.moe else arch
    count = stage_parameters(h, L, p, t, v, s, arch, heads, own, stage) + extra
    holds_output = (stage == p - 1) * 1
    dummies = dummy_wgrad_elements(h, t, v, arch, heads, holds_output=holds_output, etp=etp, dense_too=dense_layers_too)
    if moe_layers is not None:           # a stage of dense layers alone: their shapes (ints, or arrays over a sweep)
        count = count + (stage_layers - own) * layer_parameters(h, t, dense, heads)
        only_dense = dummy_wgrad_elements(h, t, v, dense, heads, holds_output=holds_output)
        dummies = dummies * (own > 0) + only_dense * (own == 0)
    if megatron_fsdp is not None:      # one stage of dense layers (the rules); TE's dummy weight gradients as DDP's
        laid = megatron_fsdp_buckets(h, t, v, s, arch, heads, stage_layers, shards, megatron_fsdp, fsdp_bucket_size)
        return ParameterBytes(count, *state_bytes(laid, megatron_fsdp, gradient_bytes, optimizer_bytes),
                              WEIGHT_BYTES * dummies, _megatron_fsdp_fp8_kept(h, t, arch, heads, stage_layers, gpu_fp8,
                                                                             laid),
                              megatron_fsdp=megatron_fsdp, buckets=laid,
                              gathered_bytes=gathered_outside_units(laid, megatron_fsdp),
                              double_buffer_bytes=fsdp_double_buffer * sum(pools(laid, megatron_fsdp, gradient_bytes,
                                                                                 stage_layers)))
    state = parameter_bytes(count, shards, distributed_optimizer, dummies, gradient_bytes, optimizer_bytes)
    if arch.moe:
        experts = own * expert_parameters(h, arch, ep, etp)
        state = state + parameter_bytes(experts, expert_shards, distributed_optimizer, 0, gradient_bytes,
                                        optimizer_bytes)
    if not arch.fp8:
        return state
    fp8_all, fp8_moe = (stage_layers, own) if fp8_layers is None else fp8_layers
    shrink, kept = fp8_state(h, t, arch, heads, fp8_all, gpu_fp8, fp8_moe if arch.moe else None, ep, etp)
    # under --fp8-param-gather eh_proj's weight is FP8 too (multi_token_prediction.py: built under
    # get_fp8_context(is_init=True)), one byte an element in DDP's buffer
    shrink += eh_projections * (h // t) * 2 * h * FP8_SAVING * int(arch.fp8_param_gather)
    return replace(state, weights_bytes=state.weights_bytes - shrink,
                   fp8_bytes=kept + eh_projections * _eh_proj_fp8_kept(h, t, arch, gpu_fp8))


def _megatron_fsdp_fp8_kept(h, t, arch, heads, layers, generation, laid) -> int:
    """What TE keeps for FP8 beside Megatron-FSDP's buffers: as under DDP (fp8_state: each linear's cached FP8
    weight, Hopper's transpose too, and the modules' scaling state), but under --fp8-param-gather the FP8 weights'
    Hopper transposes, which Megatron-FSDP drops at each unit's release (megatron_fsdp.py,
    release_params_fp8_transpose_cache) and makes again at its backward (megatron_fsdp.backward_rows): the scaling
    state alone. 0 without FP8."""
    if not arch.fp8:
        return 0
    from actmem.model.fp8 import PARAM_GATHER_COPY_BYTES

    _, kept = fp8_state(h, t, arch, heads, layers, generation)
    return kept - layers * laid.unit_fp8_count * PARAM_GATHER_COPY_BYTES[generation] * bool(arch.fp8_param_gather)


def _eh_proj_fp8_kept(h, t, arch, generation):
    """What TE keeps for one multi-token-prediction eh_proj under FP8: its [h/t, 2h] weight's copies and a
    module's scaling state (actmem.model.fp8); 0 in 16 bits."""
    from actmem.model import fp8

    if not arch.fp8:
        return 0
    return fp8.weight_copy_bytes(arch, generation, h // t, 2 * h) + fp8.module_state_bytes(arch)
