"""What the model is, beyond its dims: the choices that decide which tensors a layer keeps
and how many parameters it has.

The paper's GPT is the default, so its numbers never move. Each field that removes or adds
a row of the term table names that row; ``actmem.memory.terms`` asks the predicates below. The
kernels behind each choice are Megatron-Core's with Transformer Engine (cited in terms.py).
"""

from dataclasses import dataclass, replace

from actmem.errors import SpecError
from actmem.model.implementation import MEGATRON, implementation

PAPER_DROPOUT = 0.1   # the GPT models of the paper train with dropout 0.1
ACTIVATIONS = ("gelu", "swiglu", "squared_relu")
NORMALIZATIONS = ("layernorm", "rmsnorm")
ATTENTION_CORES = ("eager", "flash", "flash-attn")
POSITION_EMBEDDINGS = ("learned", "rope", "none")
#: Megatron's other spellings of them (--position-embedding-type learned_absolute)
POSITION_EMBEDDING_ALIASES = {"learned_absolute": "learned"}


@dataclass(frozen=True)
class Architecture:
    attention_dropout: float = PAPER_DROPOUT
    """Dropout on the attention probabilities (Megatron's --attention-dropout). At 0 the
    eager core keeps no mask and no separate dropout output: ·V keeps the softmax output."""
    hidden_dropout: float = PAPER_DROPOUT
    """Dropout after the embedding, the attention projection and the MLP (Megatron's
    --hidden-dropout). At 0 none of the three keeps a mask."""
    ffn_hidden: int | None = None
    """The MLP's hidden size f (Megatron's --ffn-hidden-size); None: 4h, the paper's."""
    activation: str = "gelu"
    """'gelu' (the paper's), 'swiglu' (gated: the first linear is 2f wide; --swiglu) or
    'squared_relu' (relu(x)² as Megatron's --squared-relu: Nemotron)."""
    normalization: str = "layernorm"
    """'layernorm' (weight and bias) or 'rmsnorm' (weight only; --normalization RMSNorm)."""
    bias: bool = True
    """Biases on the linear layers (Megatron's --disable-bias-linear turns them off)."""
    qkv_bias: bool | None = None
    """A bias on the QKV linear whatever ``bias`` says (Megatron's --add-qkv-bias with
    --disable-bias-linear: Qwen2's q, k, v biases); None: as ``bias``."""
    tied_output: bool = True
    """The output layer shares the word embedding's weights (the paper's); False is
    Megatron's --untie-embeddings-and-output-weights."""
    query_groups: int | None = None
    """g: key/value heads (Megatron's --num-query-groups; MQA is 1); None: one a head."""
    head_dim: int | None = None
    """d (Megatron's --kv-channels); None: h/a."""
    attention_core: str = "eager"
    """'eager' (the paper's: QKᵀ, softmax, dropout, ·V, keeping the s² softmax output);
    'flash' (TE's cuDNN fused attention, Megatron-Core's default on Hopper: keeps q, k, v,
    its output and an fp32 log-sum-exp; no s² term); 'flash-attn' (the flash-attn package
    through TE, which at b > 1 also keeps a contiguous copy of its output)."""
    position_embedding: str = "learned"
    """'learned' (the paper's: an s·h table on the first stage), 'rope' (rotary: no
    parameters; modelled under the flash core only) or 'none'."""
    position_rows: int | None = None
    """Rows of the learned position table (Megatron's --max-position-embeddings; GPT-2's
    n_positions): None is s, the paper's count. A table longer than s holds parameters no token
    reads; a shorter one cannot hold s positions (refused by the spec)."""
    rotary_percent: float = 1.0
    """The share of each head's d that rope rotates (Megatron's --rotary-percent; RotaryEmbedding
    rotates int(d·percent) dims and passes the rest)."""
    rope_fusion: bool = True
    """Rotary positions by Transformer Engine's fused kernel (Megatron's default); False is
    --no-rope-fusion, Megatron's own rope_utils.py, whose 16-bit cos and sin are kept."""
    qk_norm: bool = False
    """A norm on each head of q and of k before rope (Megatron's --qk-layernorm; Qwen3's
    q_norm and k_norm), of the model's normalization, d wide, as TE's TENorm runs it. Under
    multi-latent attention, the norms of the q and kv latents instead (fused into the up projections)."""
    multi_latent_attention: bool = False
    """Multi-head latent attention (Megatron's --multi-latent-attention; DeepSeek-V2/V3): q, k and v
    projected up from low-rank latents (actmem.model.latent)."""
    q_lora_rank: int | None = None
    """The q latent's width (--q-lora-rank); None: q projected from the hidden state directly."""
    kv_lora_rank: int = 32
    """The kv latent's width (--kv-lora-rank; Megatron's default 32, DeepSeek-V3's 512)."""
    qk_head_dim: int = 128
    """Each head's q and k width without rope (--qk-head-dim)."""
    qk_pos_emb_head_dim: int = 64
    """Each head's rope part of q and k (--qk-pos-emb-head-dim); k's is one for all heads."""
    v_head_dim: int = 128
    """Each head's v width (--v-head-dim): a·d_v is the attention's output width."""
    fp8_format: str | None = None
    """FP8 training through Transformer Engine (--fp8-format e4m3 or hybrid; None: 16-bit). Both formats keep
    one byte an element; the recipe decides what more (actmem.model.fp8)."""
    fp8_recipe: str | None = None
    """--fp8-recipe: delayed (Megatron's default under --fp8-format) or tensorwise; None: the default."""
    fp8_param_gather: bool = False
    """--fp8-param-gather: the linears' weights are FP8 themselves (one byte), all-gathered as they are."""
    fp8_amax_history_len: int = 1
    """--fp8-amax-history-len: the rows of delayed scaling's amax history (Megatron's default 1)."""
    fp8_first_last_bf16: bool = False
    """--first-last-layers-bf16: the model's first and last layers run in bf16 under FP8 (fp8_utils.py,
    is_first_last_bf16_layer: by global layer index, so on the first and last pipeline stages)."""
    fp8_bf16_start: int = 1
    """--num-layers-at-start-in-bf16 (Megatron's default 1), read with --first-last-layers-bf16."""
    fp8_bf16_end: int = 1
    """--num-layers-at-end-in-bf16 (Megatron's default 1), read with --first-last-layers-bf16."""
    mtp_layers: int = 0
    """Multi-token prediction (Megatron's --mtp-num-layers; DeepSeek-V3's 1): D more layers on the last
    pipeline stage, each predicting one token further (actmem.memory.terms, MTP_TERMS), and D more logits."""
    rope_type: str | None = None
    """Megatron's --rope-type: None (its default: yarn under MLA, rope otherwise), 'rope' or 'yarn'."""
    attention_mask: bool = False
    """Megatron's dataloader builds a causal mask for each microbatch, [b, 1, s, s] of bool, and
    hands it to every layer of the first and last stages (under context parallelism a rank's
    s/c rows of it; create_attention_mask_in_dataloader:
    Megatron's default; --no-create-attention-mask-in-dataloader turns it off). TE's causal
    kernels never read it, but the recompute checkpoints save it with their other arguments.
    False (the paper's count, and the flags' default): not counted."""
    masked_softmax_fusion: bool = True
    """Megatron's fused scale-mask-softmax kernel for the eager (local) core; False is its
    --no-masked-softmax-fusion. The kernel runs only where FusedScaleMaskSoftmax.is_kernel_available
    allows (rules.fused_softmax_runs); elsewhere, or switched off, Megatron runs torch's softmax
    (fused_softmax.py, forward_torch_softmax), which keeps the causal mask it fills and, with
    softmax_in_fp32, an fp32 softmax. An estimate turns it off for a run where the kernel does not
    run (with_fused_softmax). Changes nothing under TE's flash cores."""
    softmax_in_fp32: bool = False
    """Megatron's --attention-softmax-in-fp32 (set too by --apply-query-key-layer-scaling:
    TransformerConfig.__post_init__): torch's fallback softmax upcasts the scores and keeps its
    fp32 output. The fused kernel keeps its 16-bit probabilities either way."""
    gradient_accumulation_fusion: bool = True
    """Megatron's default (TE's fuse_wgrad_accumulation): each linear's weight gradient is
    accumulated straight into the fp32 main_grad and autograd is handed TE's cached dummy;
    False is --no-gradient-accumulation-fusion: a 16-bit weight gradient is made at each linear's
    backward (TE linear.py: the wgrad GEMM with no out), added to main_grad by DDP's hook and
    freed, and no dummy is kept."""
    num_experts: int | None = None
    """E: a mixture-of-experts MLP in every layer, of E experts (Megatron's --num-experts); None:
    the dense MLP. actmem.model.experts holds what it is modelled for."""
    moe_layer_freq: object = 1
    """Which layers are MoE layers (--moe-layer-freq): an int N, every N-th from the first (1: all,
    Megatron's default), or a tuple of 0 (dense) and 1 (MoE) a layer (DeepSeek-V3's first three
    dense: (0, 0, 0, 1, ...)); actmem.model.experts.layer_pattern reads Megatron's spellings."""
    moe_topk: int = 2
    """k: experts each token is routed to (--moe-router-topk; Megatron's default 2)."""
    moe_ffn_hidden: int | None = None
    """f_e: each expert's hidden size (--moe-ffn-hidden-size); None: ffn_hidden, as Megatron sets it."""
    moe_load_balancing: str = "aux_loss"
    """The router's load balancing (--moe-router-load-balancing-type): 'aux_loss' (Megatron's
    default, which keeps its own softmax over every expert), 'seq_aux_loss' (the same a sequence:
    DeepSeek-V2/V3) or 'none'."""
    moe_aux_loss_coeff: float = 0.0
    """The aux loss's coefficient (--moe-aux-loss-coeff; Megatron's default 0): the router computes the
    aux loss, and keeps its scores, only above 0 (router.py, TopKRouter.routing)."""
    moe_shared_ffn: int | None = None
    """f_s: the shared experts' hidden size, all shared experts as one MLP that every token passes
    (--moe-shared-expert-intermediate-size; DeepSeek, Qwen2-MoE, Llama 4); None: none."""
    moe_shared_gate: bool = False
    """A sigmoid gate scales the shared experts' output (--moe-shared-expert-gate; Qwen2-MoE)."""
    moe_shared_overlap: bool = False
    """The shared experts run beside the dispatcher's communication (--moe-shared-expert-overlap,
    alltoall only), their fc1 keeping its all-gathered input."""
    moe_score_function: str = "softmax"
    """The router's scores (--moe-router-score-function): 'softmax' (Megatron's default) or 'sigmoid'
    (DeepSeek-V3, GLM-4.5, Kimi K2), whose top-k (k > 1) is normalised by its sum."""
    moe_expert_bias: bool = False
    """A per-expert bias added to the sigmoid scores for the choice only (--moe-router-enable-expert-bias;
    DeepSeek-V3's aux-loss-free balancing): the scores are gathered at the chosen experts."""
    moe_pre_softmax: bool = False
    """The router's softmax over every expert before its top-k (--moe-router-pre-softmax; Megatron's
    default is the softmax over the top-k scores, which renormalises them): Qwen2-MoE's routing
    (norm_topk_prob false), and what top-1 routing needs. The sigmoid router ignores it."""
    moe_router_groups: int | None = None
    """Group-limited routing (--moe-router-num-groups, DeepSeek-V3's node-limited choice): the experts in
    this many groups, the top-k taken among the best --moe-router-group-topk groups."""
    moe_router_group_topk: int | None = None
    """The groups a token's experts may come from (--moe-router-group-topk)."""
    moe_router_dtype: str | None = None
    """The router's logits and probabilities (--moe-router-dtype): None, the activations' 16 bits
    (Megatron's default), 'fp32' or 'fp64'."""
    moe_dispatcher: str = "allgather"
    """How tokens reach their experts (--moe-token-dispatcher-type): Megatron's default 'allgather',
    'alltoall' or 'flex'; actmem models alltoall."""
    moe_capacity_factor: float | None = None
    """Each expert's capacity, ⌈k·N/E·factor⌉ tokens from each rank's N (--moe-expert-capacity-factor): the
    router drops the tokens over it (moe_utils.py, apply_router_token_dropping); None: dropless (Megatron's
    default)."""
    moe_drop_policy: str = "probs"
    """Which tokens over capacity are dropped (--moe-token-drop-policy): 'probs' (the lowest probabilities,
    Megatron's default) or 'position' (the last)."""
    moe_pad_to_capacity: bool = False
    """Every expert's input padded to its capacity (--moe-pad-expert-input-to-capacity, 'drop and pad'): its
    map's column holds C tokens, those not routed to it at probability 0, so the rows are C·EP·ETP an
    expert whatever the routing (moe_utils.py, apply_router_token_dropping: final_map = capacity_mask)."""
    moe_permute_fusion: bool = False
    """The permutation as Transformer Engine's fused kernels (--moe-permute-fusion): they keep an int32
    row map [N, 2E+1] (E/EP local experts' of the gathered tokens under allgather) in place of the routing
    map, its probabilities and the int64 indices, and under alltoall an int32 [T] map each way where a rank
    has several experts (TE's permutation.py)."""
    moe_grouped_gemm: bool = False
    """The experts as TE's grouped GEMM (--moe-grouped-gemm, TEGroupedMLP) rather than one MLP each
    (SequentialMLP): the same saved tensors (actmem.model.experts)."""
    moe_bf16_padding: int | None = None
    """a of a MoE layer that runs in bf16 inside an FP8 run (--first-last-layers-bf16; Architecture.bf16_twin): its
    TEGroupedMLP still pads each expert's rows, keyed on the run's config.fp8 (experts.py: quantization_padding),
    to the multiple TE's Fp8Padding takes outside an FP8 autocast (fp8.bf16_padding_multiple); None elsewhere."""
    implementation: str = MEGATRON
    """The second axis, whose code runs the layer (actmem.model.implementation): 'megatron' (the
    paper's, the default), 'torch-native' (DTensor TP/SP as torchtitan plans it) or 'hf'
    (transformers' Llama, Qwen3 or GPT-2; the attention core is its attn_implementation). It travels
    with the architecture because every term asks both at once; it changes no parameter."""

    def __post_init__(self):
        for name in ("activation", "normalization", "attention_core", "position_embedding",
                     "implementation"):   # RMSNorm
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, getattr(self, name).lower())
        object.__setattr__(self, "position_embedding",
                           POSITION_EMBEDDING_ALIASES.get(self.position_embedding, self.position_embedding))
        percent = self.rotary_percent
        if isinstance(percent, bool) or not isinstance(percent, (int, float)) or not 0 < percent <= 1:
            raise SpecError(f"rotary_percent must be in (0, 1], got {percent!r}")
        for name in ("attention_dropout", "hidden_dropout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise SpecError(f"{name} must be a probability in [0, 1), got {value!r}")
        for name in ("ffn_hidden", "query_groups", "head_dim", "position_rows", "num_experts", "moe_topk",
                     "moe_ffn_hidden", "moe_shared_ffn", "moe_router_groups", "moe_router_group_topk"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise SpecError(f"{name} must be a positive integer, got {value!r}")
        for name, allowed in (("activation", ACTIVATIONS), ("normalization", NORMALIZATIONS),
                              ("attention_core", ATTENTION_CORES), ("position_embedding", POSITION_EMBEDDINGS)):
            if getattr(self, name) not in allowed:
                raise SpecError(f"{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        if self.qkv_bias is not None and not isinstance(self.qkv_bias, bool):
            raise SpecError(f"qkv_bias must be true or false, got {self.qkv_bias!r}")
        if isinstance(self.mtp_layers, bool) or not isinstance(self.mtp_layers, int) or self.mtp_layers < 0:
            raise SpecError(f"mtp_layers must be an integer >= 0, got {self.mtp_layers!r}")
        if self.rope_type is not None and self.rope_type not in ("rope", "yarn"):
            raise SpecError(f"rope_type must be rope or yarn; got {self.rope_type!r}")
        for name in ("bias", "tied_output", "rope_fusion", "qk_norm", "multi_latent_attention", "attention_mask", "masked_softmax_fusion",
                     "softmax_in_fp32", "gradient_accumulation_fusion", "moe_grouped_gemm", "moe_pad_to_capacity", "moe_permute_fusion", "fp8_param_gather",
                     "moe_shared_gate", "fp8_first_last_bf16",
                     "moe_shared_overlap", "moe_pre_softmax", "moe_expert_bias"):
            if not isinstance(getattr(self, name), bool):
                raise SpecError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.qkv_bias is False and self.bias:
            raise SpecError("qkv_bias false with biases on the other linear layers: Megatron cannot express "
                            "it (its QKV bias is add_bias_linear or add_qkv_bias)")
        if self.rotary_percent != 1 and self.position_embedding != "rope":
            raise SpecError(f"--rotary-percent {self.rotary_percent:g} shapes Megatron's rotary positions; this model's "
                            f"positions are {self.position_embedding} under {self.implementation}")
        if not self.rope_fusion and self.position_embedding != "rope":
            raise SpecError(f"--no-rope-fusion chooses how rotary positions are applied; this model's positions "
                            f"are {self.position_embedding}")
        from actmem.model.experts import check_experts, layer_pattern
        from actmem.model.fp8 import check_fp8
        from actmem.model.latent import check_latent

        object.__setattr__(self, "moe_layer_freq", layer_pattern(self.moe_layer_freq))
        check_experts(self)
        check_latent(self)
        check_fp8(self)
        self.code.check(self)

    def bf16_layer(self, index: int, layers: int) -> bool:
        """Whether layer ``index`` (global, of ``layers``) runs in bf16 though the run trains in FP8 (Megatron's
        fp8_utils.py, is_first_last_bf16_layer)."""
        return bool(self.fp8 and self.fp8_first_last_bf16
                    and (index < self.fp8_bf16_start or index >= layers - self.fp8_bf16_end))

    def bf16_twin(self, generation: str | None = None) -> "Architecture":
        """This layer as it runs outside FP8: a first or last layer under --first-last-layers-bf16, given the GPU's FP8
        ``generation``, a MoE layer's experts still padded as on it (moe_bf16_padding); without, the layer of a
        bf16 run."""
        from actmem.model.fp8 import bf16_padding_multiple

        padding = bf16_padding_multiple(generation) if self.moe and self.fp8 and generation else None
        return replace(self, fp8_format=None, fp8_recipe=None, fp8_param_gather=False, fp8_amax_history_len=1,
                       fp8_first_last_bf16=False, fp8_bf16_start=1, fp8_bf16_end=1, moe_bf16_padding=padding)

    @property
    def fp8(self) -> str | None:
        """The FP8 recipe the run trains with (Megatron's default, delayed, under --fp8-format), or None."""
        return None if self.fp8_format is None else self.fp8_recipe or "delayed"

    @property
    def moe(self) -> bool:
        """Every layer's MLP is a mixture of experts (--num-experts)."""
        return self.num_experts is not None

    def record(self) -> dict:
        """The fields as the JSON output carries them, less those of a feature the model does not use (latent
        attention's widths, FP8's settings, the experts' settings: Megatron's defaults, which such a model never
        reads) and moe_bf16_padding (a bf16 layer's of an FP8 run, never the run's own); the switch that turns each
        on stays (multi_latent_attention, fp8_format, num_experts)."""
        unused = ("moe_bf16_padding",) + (("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                                                                  "v_head_dim")
                  * (not self.multi_latent_attention)
                  + tuple(name for name in vars(self) if name.startswith("fp8_") and name != "fp8_format") * (not self.fp8)
                  + tuple(name for name in vars(self) if name.startswith("moe_")) * (not self.moe))
        return {name: value for name, value in vars(self).items() if name not in unused}

    def expert_ffn(self, hidden):
        """f_e: an expert's hidden size (--moe-ffn-hidden-size, else the MLP's f)."""
        return self.ffn(hidden) if self.moe_ffn_hidden is None else self.moe_ffn_hidden

    def with_fused_softmax(self, kernel_runs: bool) -> "Architecture":
        """This architecture as a run of it executes: Megatron's fused softmax off where its kernel
        does not run at the run's s, b, a and t (``kernel_runs``: rules.fused_softmax_runs), so its
        local core counts what torch's fallback softmax keeps. Other cores and codes: itself."""
        if kernel_runs or not torch_softmax_possible(self) or not self.masked_softmax_fusion:
            return self
        return replace(self, masked_softmax_fusion=False)

    def rotary_dim(self, hidden, heads):
        """The dims rope rotates in each head: int(d·percent) (Megatron's RotaryEmbedding), d when whole; under
        multi-latent attention of the rope part, d_rope (multi_latent_attention.py: RotaryEmbedding(
        qk_pos_emb_head_dim, rotary_percent) for --rope-type rope, YarnRotaryEmbedding(qk_pos_emb_head_dim),
        which takes no percent, for yarn)."""
        import sympy   # off --help's path

        if self.multi_latent_attention and self.rope_type != "rope":
            return self.qk_pos_emb_head_dim
        d = self.qk_pos_emb_head_dim if self.multi_latent_attention else self.head_dim_or(hidden, heads)
        if self.rotary_percent == 1:
            return d
        # RotaryEmbedding: dim = int(d·percent), inv_freq over arange(0, dim, 2), the freqs cat'd with themselves:
        # 2·ceil(dim/2) wide (rotary_pos_embedding.py), one more than dim where dim is odd
        return 2 * sympy.ceiling(sympy.floor(d * sympy.Rational(str(self.rotary_percent))) / 2)

    def ffn(self, hidden):
        """f: the given size, or 4h (works on ints, arrays and sympy symbols)."""
        return 4 * hidden if self.ffn_hidden is None else self.ffn_hidden

    def attention_width(self, hidden, heads):
        """a·d, the width of the queries and of the attention's output: h unless d is given; under
        multi-latent attention the output's a·d_v (the queries are a·(d_qk + d_rope): latent.query_width)."""
        if self.multi_latent_attention:
            return heads * self.v_head_dim
        return hidden if self.head_dim is None else heads * self.head_dim

    def query_groups_or(self, heads):
        return heads if self.query_groups is None else self.query_groups

    def head_dim_or(self, hidden, heads):
        return hidden // heads if self.head_dim is None else self.head_dim

    @property
    def has_qkv_bias(self) -> bool:
        return self.bias if self.qkv_bias is None else self.qkv_bias

    @property
    def fc1_width(self) -> int:
        """How many f-wide outputs the first MLP linear has: 2 for SwiGLU (gate and up)."""
        return 2 if self.activation == "swiglu" else 1

    def kv_width(self, hidden, heads):
        """g·d, the width of the keys (and of the values): a·d unless query groups are given."""
        if self.query_groups is None:
            return self.attention_width(hidden, heads)
        return self.query_groups * (hidden / heads if self.head_dim is None else self.head_dim)

    @property
    def keeps(self) -> frozenset:
        """What its code keeps beyond Megatron's rows (its model class's too): terms.py asks."""
        return self.code.keeps_for(self)

    @property
    def code(self):
        """The implementation (actmem.model.implementation.Implementation) this layer runs under."""
        return implementation(self.implementation)

    def unmodelled_recompute(self, heads=None, modules=None, option=None) -> dict:
        """{recompute mode: why actmem does not model it for this architecture}; selective
        recompute of ``modules`` (None: core_attn, Megatron's default), or with torchtitan's
        selective_ac_option ``option`` ('op': its per-op checkpointing, where the code runs it)."""
        if option is not None:
            return {} if self.code.op_checkpointing else {
                "selective": f"torchtitan's selective checkpointing (selective_ac_option {option}) is torch-native's; "
                             f"--implementation {self.code.name} has no such option"}
        if self.code.full_recompute is not None:
            return {"selective": self.code.selective_recompute or self.code.full_recompute,
                    "full": self.code.full_recompute}
        if self.code.selective_recompute is not None:
            return {"selective": self.code.selective_recompute}
        if modules is not None and {"moe", "shared_experts"} & set(modules) and not self.moe:
            return {"selective": f"--recompute-modules {' '.join(sorted({'moe', 'shared_experts'} & set(modules)))} "
                                 "recomputes parts of a mixture-of-experts layer; this model has none"}
        if modules is not None and "shared_experts" in modules and (not self.moe_shared_ffn or self.moe_shared_overlap):
            return {"selective": "--recompute-modules shared_experts needs shared experts that do not overlap the "
                                 "dispatcher (Megatron raises with --moe-shared-expert-overlap: transformer_config.py)"
                                 if self.moe_shared_ffn else "--recompute-modules shared_experts: this MoE layer has "
                                 "no shared experts (--moe-shared-expert-intermediate-size)"}
        if modules is not None and "moe_act" in modules and not (self.moe and self.moe_grouped_gemm):
            return {"selective": "--recompute-modules moe_act recomputes the experts' activation, which Megatron "
                                 "does only in a grouped GEMM (it raises otherwise: transformer_config.py): "
                                 + ("give --moe-grouped-gemm" if self.moe else "this model has no experts")}
        if modules is not None and "mla_up_proj" in modules and not self.multi_latent_attention:
            return {"selective": "--recompute-modules mla_up_proj recomputes multi-latent attention's up projections; "
                                 "this model has none (Megatron raises: transformer_config.py)"}
        if modules is not None and "layernorm" in modules and not te_layer_spec(self):
            return {"selective": "--recompute-modules layernorm under the eager core: Megatron runs that core in "
                                 "its local spec, whose norms are modules of their own, and frees their outputs "
                                 "(the linears' inputs) until the backward (CheckpointWithoutOutput); not "
                                 "modelled yet"}
        if modules is not None and "core_attn" not in modules:
            return {}
        if self.attention_core != "eager":     # the checkpoint's q and k: rope's or the norms' outputs
            if self.position_embedding == "rope" or self.qk_norm:
                return {}
            return {"selective": "selective recompute of the attention core (Megatron's core_attn) under flash "
                                 "attention is modelled with rotary positions or q and k norms, which make q and "
                                 "k tensors of their own; without either its checkpoint keeps q and k as views "
                                 "or copies of the QKV output, which actmem does not count yet: choose none, "
                                 "full, or --recompute-modules mlp"}
        if self.query_groups is not None and heads is not None and self.query_groups < heads:
            return {"selective": "selective recompute with query groups under the eager core keeps the "
                                 "checkpoint's unexpanded k and v as views of the QKV output (and q as a "
                                 "copy when t < g), which actmem does not count yet: choose none, full, or "
                                 "--recompute-modules mlp"}
        return {}

    def describe(self) -> str:
        """One line a person reads: 'gelu MLP (f = 4h) · layernorm · biases · tied output'."""
        f = "4h" if self.ffn_hidden is None else f"{self.ffn_hidden:,}"
        groups = "" if self.query_groups is None else f"g = {self.query_groups} query groups · "
        groups += "QK norm · " if qk_norm(self) else ""
        if self.multi_latent_attention:
            q = "q from h" if self.q_lora_rank is None else f"q_r = {self.q_lora_rank}"
            groups += (f"MLA ({q}, kv_r = {self.kv_lora_rank}{', latent norms' if self.qk_norm else ''}, "
                       f"d = {self.qk_head_dim} + {self.qk_pos_emb_head_dim} rope, d_v = {self.v_head_dim}) · ")
        groups += "" if self.masked_softmax_fusion or not torch_softmax_possible(self) else "torch softmax · "
        groups += "softmax in fp32 · " if self.softmax_in_fp32 and torch_softmax_possible(self) else ""
        head = "" if self.head_dim is None or self.multi_latent_attention else f"d = {self.head_dim} · "
        core = {"eager": "", "flash": "flash attention · ", "flash-attn": "flash attention (flash-attn) · "}
        rope = {"learned": "", "rope": "rope · " if self.rope_fusion else "rope (unfused) · ",
                "none": "no positions · "}[self.position_embedding]
        mlp = f"{self.activation} MLP (f = {f})"
        if self.moe:
            f_e = f if self.moe_ffn_hidden is None else f"{self.moe_ffn_hidden:,}"
            mlp = f"MoE: {self.num_experts} {self.activation} experts, top-{self.moe_topk} (f_e = {f_e})"
        return (f"{core[self.attention_core]}{rope}{groups}{head}{mlp} · {self.normalization} · "
                f"{self.biases} · {'tied' if self.tied_output else 'untied'} output")

    @property
    def biases(self) -> str:
        """'biases', 'no biases', 'QKV bias only' or 'no QKV bias'."""
        if self.has_qkv_bias == self.bias:
            return "biases" if self.bias else "no biases"
        return "QKV bias only" if self.has_qkv_bias else "no QKV bias"

    @property
    def norm_statistics(self) -> int:
        """fp32 statistics a norm keeps a token: mu and rsigma, or rsigma for RMSNorm."""
        return 2 if self.normalization == "layernorm" else 1

    @property
    def norm_parameters(self) -> int:
        """Parameters of one norm per unit of h: weight and bias, or weight only."""
        return 2 if self.normalization == "layernorm" else 1


PAPER = Architecture()


def attention_dropout(arch: Architecture) -> bool:
    """attention dropout > 0"""
    return arch.attention_dropout > 0


def hidden_dropout(arch: Architecture) -> bool:
    """hidden dropout > 0"""
    return arch.hidden_dropout > 0


def gelu(arch: Architecture) -> bool:
    """the activation is GeLU"""
    return arch.activation == "gelu"


def swiglu(arch: Architecture) -> bool:
    """the activation is SwiGLU"""
    return arch.activation == "swiglu"


def squared_relu(arch: Architecture) -> bool:
    """the activation is the squared ReLU"""
    return arch.activation == "squared_relu"


def eager(arch: Architecture) -> bool:
    """the attention core is eager (the paper's)"""
    return arch.attention_core == "eager"


def eager_with_attention_dropout(arch: Architecture) -> bool:
    """the attention core is eager and its dropout > 0"""
    return eager(arch) and attention_dropout(arch)


def flash(arch: Architecture) -> bool:
    """the attention core is flash"""
    return arch.attention_core in ("flash", "flash-attn")


def flash_repeated_key_value(arch: Architecture) -> bool:
    """the attention core is flash and the code expands k and v to a heads before it"""
    return flash(arch) and "repeated_key_value" in arch.keeps


def flash_grouped_key_value(arch: Architecture) -> bool:
    """the attention core is flash and keeps k and v g groups wide (not multi-latent attention's)"""
    return flash(arch) and not flash_repeated_key_value(arch) and not latent(arch)


def flash_heads(arch: Architecture) -> bool:
    """the attention core is flash over the QKV linear's heads (not multi-latent attention's)"""
    return flash(arch) and not latent(arch)


def latent(arch: Architecture) -> bool:
    """multi-latent attention (--multi-latent-attention)"""
    return arch.multi_latent_attention


def latent_query(arch: Architecture) -> bool:
    """multi-latent attention projecting q through a latent (--q-lora-rank)"""
    return latent(arch) and arch.q_lora_rank is not None


def latent_norms(arch: Architecture) -> bool:
    """multi-latent attention normalising its latents (--qk-layernorm), each norm fused into the up projection"""
    return latent(arch) and arch.qk_norm


def latent_query_norm(arch: Architecture) -> bool:
    """multi-latent attention normalising its q latent"""
    return latent_query(arch) and arch.qk_norm


def eager_or_flash_grouped_value(arch: Architecture) -> bool:
    """·V keeps V: the eager core's, or flash's g groups wide"""
    return eager(arch) or flash_grouped_key_value(arch)


def dataloader_mask(arch: Architecture) -> bool:
    """Megatron's dataloader makes a b·s² attention mask (create_attention_mask_in_dataloader)"""
    return arch.attention_mask


def te_flash_core(arch: Architecture) -> bool:
    """the attention core is Transformer Engine's flash core under Megatron-Core, which makes v
    contiguous inside the core, where Megatron's core_attn checkpoint wraps it"""
    return flash(arch) and "te_flash_core" in arch.code.has


def te_flash_core_heads(arch: Architecture) -> bool:
    """TE's flash core under Megatron-Core over the QKV linear's heads (not multi-latent attention's,
    whose v is a contiguous copy of its own)"""
    return te_flash_core(arch) and not latent(arch)


def swiglu_keeping_silu_output(arch: Architecture) -> bool:
    """the MLP is SwiGLU, unfused: silu's output is kept beside its input"""
    return swiglu(arch) and "silu_output" in arch.keeps


def loss_in_fp32_gradients(arch: Architecture) -> bool:
    """the loss's backward makes fp32 gradients of the logits, not Megatron's one 16-bit copy: PyTorch's own
    cross entropy on fp32 logits (torchtitan's loss, under loss_parallel at t > 1)"""
    return "cross_entropy_fp32_gradients" in arch.keeps


def gelu_keeping_tanh_intermediates(arch: Architecture) -> bool:
    """the MLP is GeLU's tanh form written in Python, keeping its intermediates (gelu_new)"""
    return gelu(arch) and "gelu_tanh_intermediates" in arch.keeps


def norm_keeps_fp32_copy(arch: Architecture) -> bool:
    """the norm keeps an fp32 copy of its input and a 16-bit normalized tensor, not the input
    itself (transformers' LlamaRMSNorm)"""
    return "norm_fp32_copy" in arch.keeps


def op_checkpointing(arch: Architecture) -> bool:
    """the code's selective recompute is torchtitan's per-op checkpointing (torch-native), whose cached op outputs
    are rows of their own"""
    return arch.code.op_checkpointing


def keeps_norm_input(arch: Architecture) -> bool:
    """the norm keeps its 16-bit input (Megatron's TE kernels, the GPU's fused RMSNorm)"""
    return not norm_keeps_fp32_copy(arch)


def counts_norm_statistics(arch: Architecture) -> bool:
    """the norms' fp32 statistics are terms of the table: on the flash path (beside TE's
    kernels) and wherever the code is not Megatron's (the paper leaves them out)"""
    return flash(arch) or "paper_norms" not in arch.code.has


def unfused_weight_gradients(arch: Architecture) -> bool:
    """Megatron without gradient accumulation fusion: each linear makes a 16-bit weight gradient"""
    return "wgrad_fusion" in arch.code.has and not arch.gradient_accumulation_fusion


def torch_softmax_possible(arch: Architecture) -> bool:
    """the attention core is Megatron's local one, whose softmax is its fused kernel or torch's"""
    return eager(arch) and "softmax_switches" in arch.code.has


def torch_softmax(arch: Architecture) -> bool:
    """Megatron's local core runs torch's softmax, not its fused kernel (fused_softmax.py,
    FusedScaleMaskSoftmax.forward_torch_softmax): switched off, or where the kernel does not run"""
    return torch_softmax_possible(arch) and not arch.masked_softmax_fusion


def torch_softmax_16bit(arch: Architecture) -> bool:
    """torch's fallback softmax in 16 bits (no --attention-softmax-in-fp32)"""
    return torch_softmax(arch) and not arch.softmax_in_fp32


def torch_softmax_fp32(arch: Architecture) -> bool:
    """torch's fallback softmax in fp32 (--attention-softmax-in-fp32)"""
    return torch_softmax(arch) and arch.softmax_in_fp32


def torch_softmax_making_mask(arch: Architecture) -> bool:
    """torch's fallback softmax, handed no mask: it makes the causal mask itself (no dataloader mask)"""
    return torch_softmax(arch) and not arch.attention_mask


def eager_softmax_fp32(arch: Architecture) -> bool:
    """the eager core keeps an fp32 softmax beside its 16-bit copy (transformers' Llama), or
    Megatron's torch fallback keeps its fp32 softmax"""
    return eager(arch) and ("softmax_fp32" in arch.keeps or torch_softmax_fp32(arch))


def eager_keeping_16bit_softmax(arch: Architecture) -> bool:
    """the eager core keeps 16-bit probabilities: the fused kernel's, torch's 16-bit softmax's, or the
    16-bit copy of an fp32 softmax that ·V keeps; not that copy where attention dropout comes
    between (the dropout keeps only its mask, ·V its output)"""
    return eager(arch) and not (torch_softmax_fp32(arch) and attention_dropout(arch))


def rotary_tables(arch: Architecture) -> bool:
    """the model's rotary cos and sin are saved activations (transformers' Llama)"""
    return "rotary_tables" in arch.keeps


def checkpoint_position_ids(arch: Architecture) -> bool:
    """under full recompute each layer's checkpoint holds the int64 position ids its call is given (transformers'
    rope models: LlamaModel.forward hands every layer position_ids beside position_embeddings)"""
    return "layer_call_arguments" in arch.keeps and rotary_tables(arch)


def checkpoint_causal_mask(arch: Architecture) -> bool:
    """under full recompute each layer's checkpoint holds the causal mask its call is given: transformers' eager
    core gets a 16-bit additive mask (masking_utils.eager_mask), sdpa none (is_causal)"""
    return "layer_call_arguments" in arch.keeps and eager(arch)


def unfused_rope(arch: Architecture) -> bool:
    """rotary positions applied by Megatron's unfused rope_utils.py (--no-rope-fusion)"""
    return arch.position_embedding == "rope" and not arch.rope_fusion


def qk_norm_keeping_input(arch: Architecture) -> bool:
    """q and k are normalised per head before rope (--qk-layernorm), by a norm that keeps its
    16-bit input (TE's)"""
    return qk_norm(arch) and keeps_norm_input(arch)


def qk_norm_keeping_fp32_copy(arch: Architecture) -> bool:
    """q and k are normalised per head by a norm that keeps an fp32 copy of its input and a
    16-bit normalized tensor (transformers' Qwen3RMSNorm)"""
    return qk_norm(arch) and norm_keeps_fp32_copy(arch)


def qk_norm(arch: Architecture) -> bool:
    """q and k are normalised per head before rope (--qk-layernorm; under multi-latent attention it
    normalises the latents instead: latent_norms)"""
    return arch.qk_norm and not latent(arch)


def te_layer_spec(arch: Architecture) -> bool:
    """Megatron builds Transformer Engine's layer spec, each norm fused into the next linear
    (TELayerNormColumnParallelLinear; input_layernorm and pre_mlp_layernorm IdentityOps; a MoE
    layer's pre_mlp_layernorm is a TENorm of its own, whose output the router keeps): every
    core but the eager one, which Megatron runs only in its local spec (--attention-backend
    local needs --spec local), whose norms are modules of their own (LNImpl)"""
    return arch.attention_core != "eager"


def flash_attn(arch: Architecture) -> bool:
    """the attention core is flash-attn through TE"""
    return arch.attention_core == "flash-attn"


def learned_positions(arch: Architecture) -> bool:
    """the position embedding is learned"""
    return arch.position_embedding == "learned"


def dense_mlp(arch: Architecture) -> bool:
    """the MLP is dense (no --num-experts)"""
    return not arch.moe


def moe(arch: Architecture) -> bool:
    """the MLP is a mixture of experts"""
    return arch.moe


def megatron_moe(arch: Architecture) -> bool:
    """the MLP is Megatron-Core's MoELayer"""
    return arch.moe and "moe" in arch.code.has


def grouped_mm_experts(arch: Architecture) -> bool:
    """the MLP is transformers' sparse MoE block, its experts run by grouped_mm (its default)"""
    return arch.moe and "grouped_mm_experts" in arch.keeps


def grouped_mm_renormalised(arch: Architecture) -> bool:
    """transformers' router divides the top-k probabilities by their sum (Mixtral; Qwen3-MoE's norm_topk_prob)"""
    return grouped_mm_experts(arch) and not arch.moe_pre_softmax


def moe_topk_softmax(arch: Architecture) -> bool:
    """the MoE router's softmax runs over the top-k scores (Megatron's default)"""
    return arch.moe and arch.moe_score_function == "softmax" and not arch.moe_pre_softmax


def moe_pre_softmax(arch: Architecture) -> bool:
    """the MoE router's softmax runs over every expert before the top-k (--moe-router-pre-softmax)"""
    return arch.moe and arch.moe_score_function == "softmax" and arch.moe_pre_softmax


def moe_group_mask(arch: Architecture) -> bool:
    """group-limited routing whose top-k values become the probabilities (not the expert bias's choice):
    its masked_fill keeps the group mask"""
    return arch.moe and arch.moe_router_groups is not None and not (
        arch.moe_score_function == "sigmoid" and arch.moe_expert_bias)


def moe_sigmoid(arch: Architecture) -> bool:
    """the MoE router scores by sigmoid (--moe-router-score-function sigmoid)"""
    return arch.moe and arch.moe_score_function == "sigmoid"


def moe_sigmoid_normalised(arch: Architecture) -> bool:
    """the MoE router scores by sigmoid and routes to k > 1 experts, so it divides by their sum"""
    return moe_sigmoid(arch) and arch.moe_topk > 1


def moe_sigmoid_aux_loss(arch: Architecture) -> bool:
    """the MoE router scores by sigmoid and computes the aux loss, whose scores it normalises too"""
    return moe_sigmoid(arch) and moe_aux_loss(arch)


def moe_aux_loss(arch: Architecture) -> bool:
    """the MLP is a mixture of experts whose router keeps the aux loss's scores (aux_loss at a
    coefficient above 0)"""
    return arch.moe and arch.moe_load_balancing in ("aux_loss", "seq_aux_loss") and arch.moe_aux_loss_coeff > 0


def shared_experts(arch: Architecture) -> bool:
    """the MoE layer has shared experts"""
    return arch.moe and arch.moe_shared_ffn is not None


def shared_experts_keeping_silu_output(arch: Architecture) -> bool:
    """the MoE layer's shared experts are an unfused SwiGLU MLP, which keeps silu's output (transformers')"""
    return shared_experts(arch) and "silu_output" in arch.keeps


def shared_experts_gate(arch: Architecture) -> bool:
    """the MoE layer's shared experts are gated"""
    return shared_experts(arch) and arch.moe_shared_gate


def shared_experts_overlap(arch: Architecture) -> bool:
    """the MoE layer's shared experts overlap the dispatcher's communication"""
    return shared_experts(arch) and arch.moe_shared_overlap


def mtp(arch: Architecture) -> bool:
    """multi-token prediction layers on the last stage (--mtp-num-layers)"""
    return arch.mtp_layers > 0


def always(arch: Architecture) -> bool:
    """always"""
    return True
