"""Whose code runs the layer: the second axis of the term table, beside the architecture.

The same architecture keeps different tensors under different code. An implementation is
data read off its source: which of the term table's rows its code keeps beyond Megatron's
(``terms.py`` asks ``keeps``), which tensors it places differently (PyTorch-native DTensor
keeps a column-parallel linear's input all-gathered under sequence parallelism, where
Megatron keeps the local shard), and the architecture and run it is modelled for. Each
field cites the code it was read from; the harness runs that code and measures it.
"""

from dataclasses import dataclass

from actmem.errors import SpecError

MEGATRON = "megatron"
HF_ATTENTION = {"eager": "eager", "flash": "sdpa"}
"""transformers' attn_implementation for each attention core the hf code runs."""


@dataclass(frozen=True)
class ModelClass:
    """One model class of a library that runs several (transformers' LlamaForCausalLM and
    GPT2LMHeadModel): the architecture it has and what its code keeps beyond the library's
    shared behaviour."""
    name: str
    architecture: tuple
    """(field, allowed values, why), as Implementation.architecture."""
    keeps: frozenset = frozenset()
    notes: tuple = ()
    rules: tuple = ()
    """(holds: architecture -> bool, why): what a single field's allowed values cannot say."""


@dataclass(frozen=True)
class Implementation:
    name: str
    label: str
    """One line a person reads: the code, and where it was read."""
    gathered_under_sp: frozenset = frozenset()
    """Terms kept whole along the sequence under sequence parallelism (divided by nothing)
    where Megatron keeps the local shard (divided by t)."""
    keeps: frozenset = frozenset()
    """Behaviours that add rows of the term table, by name (terms.py's predicates ask)."""
    architecture: tuple = ()
    """(field, allowed values, why): the architecture the implementation is modelled for."""
    runs: frozenset = frozenset({"tensor", "pipeline", "context", "partial_recompute", "distributed_optimizer",
                                 "expert", "cpu_offloading", "megatron_fsdp"})
    """Which of Megatron's run shapes it has: t > 1, p > 1, c > 1, --recompute-method, the
    distributed optimizer (model state is counted as Megatron's mixed-precision Adam), experts
    spread over ranks (EP > 1, and with them a routing imbalance between ranks), and Transformer
    Engine's whole-layer CPU offloading (--cpu-offloading-num-layers), megatron-core's own FSDP
    (--use-megatron-fsdp); and "fsdp", PyTorch's FSDP2 as
    torchtitan applies it (--fsdp), which Megatron's code does not run; and "zero", DeepSpeed's ZeRO as the
    Hugging Face Trainer runs it (--zero-stage, --deepspeed)."""
    selective_recompute: str | None = None
    """Why its selective recompute is not modelled; None where it is Megatron's."""
    op_checkpointing: bool = False
    """Its selective recompute is torchtitan's per-op checkpointing, given --selective-ac-option op
    (actmem.model.recompute: selective:op); selective_recompute then says why plain selective is refused."""
    full_recompute: str | None = None
    """Why its full recompute is not modelled; None where it is."""
    full_recompute_note: str | None = None
    """What its full recompute is, where it is modelled and not Megatron's (an estimate's note)."""
    sequence_parallel_default: str | None = None
    """Why its tensor parallelism has sequence parallelism unless told otherwise (an estimate's note); None:
    Megatron's, off unless --sequence-parallel."""
    notes: tuple = ()
    """What an estimate under this code says about it (its assumptions)."""
    models: tuple = ()
    """The model classes it is measured for (ModelClass); empty: one layer, the fields above.
    An architecture must be one of them, and takes its keeps and notes."""
    has: frozenset = frozenset()
    """What of Megatron-Core with Transformer Engine this code has, by name (MEGATRON_CORE): the
    switches the architecture may set only where the code has them (SWITCHES), and the
    behaviours the term table and the peak floor count where it does."""
    limits: tuple = ()
    """(breaks: architecture -> bool, message): what is not modelled under this code."""
    attention_names: dict | None = None
    """What the code calls each attention core where it names them itself (transformers'
    attn_implementation); None where the core is actmem's own word."""
    dropped_settings: tuple = ()
    """(field, value): Megatron's settings this code has no use for, reset to the value when the
    same model is compared under it (side_by_side): a kernel choice, the dataloader's mask."""
    flash_head_dim_limit: int | None = None
    """The largest head dim d its flash core is modelled for (None: any)."""
    flash_head_dim_why: str = ""
    """What its flash core does beyond that d."""
    unpadded_vocab: str | None = None
    """Why the vocabulary is not padded (None: Megatron pads it to a multiple of 128·t,
    --make-vocab-size-divisible-by). DTensor shards it unevenly, rank 0 holding ceil(v/t)
    rows (as if padded to a multiple of t)."""

    @property
    def pads_vocab(self) -> bool:
        return self.unpadded_vocab is None

    def vocab_divisible_by(self, requested: int | None, default: int) -> int:
        """Megatron's padding multiple: the one asked for, or the default; 1 where the code pads
        none, and a request for padding there is refused."""
        if self.pads_vocab:
            return default if requested is None else requested
        if requested is not None and requested != 1:
            raise SpecError(f"--make-vocab-size-divisible-by is Megatron's vocabulary padding; "
                            f"--implementation {self.name} pads none ({self.unpadded_vocab})")
        return 1

    def stored_padding(self, value: int, default: int) -> int:
        """What a Spec or PlanRequest keeps as its padding multiple: the value given (the
        default read as not asked for), or 1 where the code pads none."""
        return self.vocab_divisible_by(None if value == default else value, default)

    def attention_label(self, core: str) -> str:
        """The name of the attention core this code runs ('sdpa' for transformers' flash), or ''."""
        return self.attention_names[core] if self.attention_names else ""

    def check(self, arch) -> None:
        """Refuse an architecture this implementation is not modelled for, with the reason."""
        for needs, in_use, message in SWITCHES:
            if in_use(arch) and needs not in self.has:
                raise SpecError(message.format(code=self.name, arch=arch))
        for breaks, message in self.limits:
            if breaks(arch):
                raise SpecError(message)
        if _broken(self.architecture, arch):
            raise SpecError(f"--implementation {self.name} is modelled for {_why(self.architecture, arch)}")
        model = self.model_class(arch)
        if self.models and model is None:
            # the closest: a class with experts for a mixture of experts (and none for a dense MLP), then the
            # fewest broken constraints
            def distance(model):
                broken = _broken(model.architecture, arch)
                return (any(field == "moe" for field, _, _ in broken), len(broken))

            fewest = min(distance(model) for model in self.models)
            closest = [model for model in self.models if distance(model) == fewest]
            raise SpecError(f"--implementation {self.name} is modelled for "
                            f"{', '.join(model.name for model in self.models)}; the closest: "
                            + "; ".join(f"{model.name}, for {_why(model.architecture, arch)}" for model in closest))
        for holds, why in model.rules if model else ():
            if not holds(arch):
                raise SpecError(f"--implementation {self.name} is modelled for {why}")

    def model_class(self, arch) -> ModelClass | None:
        """The model class this architecture is, the first that fits; None where there are none."""
        return next((model for model in self.models if not _broken(model.architecture, arch)), None)

    def keeps_for(self, arch) -> frozenset:
        """What this code keeps beyond Megatron's rows, for this architecture."""
        model = self.model_class(arch)
        return self.keeps | (model.keeps if model else frozenset())

    def notes_for(self, arch) -> tuple:
        model = self.model_class(arch)
        return (model.notes if model else ()) + self.notes

    def label_for(self, arch) -> str:
        model = self.model_class(arch)
        return self.label.format(model=model.name if model else "")


def _broken(constraints: tuple, arch) -> list:
    """The (field, allowed, why) constraints ``arch`` breaks."""
    return [(field, allowed, why) for field, allowed, why in constraints if getattr(arch, field) not in allowed]


#: the flag that sets a field, where it is not --field
_FLAGS = {"bias": "--disable-bias-linear", "qkv_bias": "--add-qkv-bias", "moe": "--num-experts",
          "tied_output": "--untie-embeddings-and-output-weights", "position_embedding": "--position-embedding-type",
          "moe_layer_freq": "--moe-layer-freq", "moe_score_function": "--moe-router-score-function",
          "moe_router_dtype": "--moe-router-dtype", "moe_router_groups": "--moe-router-num-groups",
          "moe_expert_bias": "--moe-router-enable-expert-bias", "moe_shared_ffn": "--moe-shared-expert-intermediate-size",
          "moe_capacity_factor": "--moe-expert-capacity-factor", "moe_dispatcher": "--moe-token-dispatcher-type",
          "moe_load_balancing": "--moe-router-load-balancing-type", "moe_pre_softmax": "--moe-router-pre-softmax",
          "moe_pad_to_capacity": "--moe-pad-expert-input-to-capacity"}


def _why(constraints: tuple, arch) -> str:
    """The broken constraints, as a person reads them: the first one's reason and setting, then every other
    setting to change, so one refusal names them all rather than one a try."""
    (field, allowed, why), *others = _broken(constraints, arch)
    also = "; also " + "; ".join(_setting(arch, *other[:2]) for other in others) if others else ""
    return f"{why}: {_setting(arch, field, allowed)}{also}"


def _setting(arch, field: str, allowed: tuple) -> str:
    shown = " or ".join("unset" if v is None else str(v) for v in allowed)
    flag = _FLAGS.get(field, f"--{field.replace('_', '-')}")
    return f"{field} must be {shown}, got {getattr(arch, field)} ({flag})"


# torchtitan's Llama 3 block, parallelised by torchtitan's plan (torchtitan/models/llama3/
# infra/parallelize.py, apply_tp): SequenceParallel norms, PrepareModuleInput all-gathering
# Shard(1) -> Replicate() before the attention and the feed-forward, ColwiseParallel wq, wk,
# wv, w1, w3 and RowwiseParallel wo, w2 reduce-scattering to Shard(1).
_TORCHTITAN_LLAMA = (
    ("attention_core", ("flash",), "torchtitan's Llama layer, whose attention is "
                                  "F.scaled_dot_product_attention (a flash kernel)"),
    ("activation", ("swiglu",), "torchtitan's Llama layer (w2(silu(w1 x) * w3 x))"),
    ("normalization", ("rmsnorm",), "torchtitan's Llama layer (nn.RMSNorm)"),
    ("attention_dropout", (0,), "torchtitan's Llama layer, which has no dropout"),
    ("hidden_dropout", (0,), "torchtitan's Llama layer, which has no dropout"),
    ("rope_fusion", (True,), "torchtitan's Llama layer, whose rotation is its own (--no-rope-fusion is "
                             "Megatron's)"),
    ("qk_norm", (False,), "torchtitan's Llama layer, which has no q and k norms (its Qwen3 model, "
                          "which has them, is not measured)"),
    ("position_embedding", ("rope",), "torchtitan's Llama model, whose positions are rotary (precompute_freqs_cis)"),
    ("bias", (False,), "torchtitan's Llama model, whose linears have no bias"),
    ("qkv_bias", (None, False), "torchtitan's Llama model, whose linears have no bias"),
    ("tied_output", (False,), "torchtitan's Llama model, whose output layer is its own"),
)

# transformers 5.23.0's LlamaDecoderLayer (models/llama/modeling_llama.py), as LlamaModel runs
# it in training with no padding: RMSNorm in Python, the MLP unfused, eager or SDPA attention.
_LLAMA_LAYER = (
    ("activation", ("swiglu",), "transformers' Llama layer (w2(silu(w1 x) * w3 x))"),
    ("normalization", ("rmsnorm",), "transformers' Llama layer (LlamaRMSNorm)"),
    ("position_embedding", ("rope",), "transformers' Llama layer (rotary)"),
    ("attention_dropout", (0,), "transformers' Llama layer at its default attention_dropout 0 (with "
                                "dropout SDPA falls back to its math kernel on a CPU, unmeasured here)"),
    ("hidden_dropout", (0,), "transformers' Llama layer, which has no hidden dropout"))
_DENSE = ("moe", (False,), "transformers' {} layer, a dense MLP (MixtralForCausalLM, Qwen3MoeForCausalLM and "
                           "Qwen2MoeForCausalLM have experts)")
_HF_LLAMA = ModelClass(
    "LlamaForCausalLM",
    architecture=_LLAMA_LAYER + (("qk_norm", (False,), "transformers' Llama layer, which has no q and k "
                                                       "norms (Qwen3ForCausalLM has them)"),
                                 (_DENSE[0], _DENSE[1], _DENSE[2].format("Llama")),
                                 ("bias", (False,), "transformers' Llama layer without biases (its attention_bias "
                                                    "and mlp_bias are not measured; Qwen2ForCausalLM's q, k and v "
                                                    "biases are: --add-qkv-bias)")),
    keeps=frozenset({"silu_output", "norm_fp32_copy", "softmax_fp32", "rotary_tables"}),
    notes=("hf: transformers 5.23 LlamaForCausalLM on one device, as measured by the harness: "
           "LlamaRMSNorm keeps an fp32 copy of its input and its 16-bit normalized tensor, not "
           "its input; eager attention keeps q and k, v repeated to a heads and the softmax in "
           "fp32 beside its 16-bit copy; sdpa (is_causal, enable_gqa) keeps k and v in their "
           "groups; the unfused SwiGLU keeps four f-wide tensors; cos and sin once a forward",))

# transformers 5.23.0's Qwen2ForCausalLM (models/qwen2/modular_qwen2.py): LlamaForCausalLM's classes with
# biases on q_proj, k_proj and v_proj always, none on o_proj or the MLP, and Gemma2's rotary embedding (cos and
# sin in the input's dtype, as Llama's); without a sliding window (use_sliding_window false, the default)
_HF_QWEN2 = ModelClass(
    "Qwen2ForCausalLM",
    architecture=_LLAMA_LAYER + (
        ("qk_norm", (False,), "transformers' Qwen2 layer, which has no q and k norms (Qwen3ForCausalLM has them)"),
        (_DENSE[0], _DENSE[1], _DENSE[2].format("Qwen2")),
        ("bias", (False,), "transformers' Qwen2 layer, whose o_proj and MLP have no biases"),
        ("qkv_bias", (True,), "transformers' Qwen2 attention, whose q, k and v always have biases")),
    keeps=_HF_LLAMA.keeps,
    notes=("hf: transformers 5.23 Qwen2ForCausalLM on one device, as measured by the harness: Llama's layer (see "
           "LlamaForCausalLM) with biases on q, k and v, which keep nothing more",))

# transformers 5.23.0's Qwen3DecoderLayer (models/qwen3/modeling_qwen3.py): Llama's layer with
# q_norm and k_norm, Qwen3RMSNorms over each head of q_proj's and k_proj's outputs before rope
# (written as LlamaRMSNorm is), and biases on q, k, v and o alone (attention_bias), never on the MLP.
_HF_QWEN3 = ModelClass(
    "Qwen3ForCausalLM",
    architecture=_LLAMA_LAYER + (
        ("qk_norm", (True,), "transformers' Qwen3 layer, whose q_norm and k_norm normalise each head"),
        (_DENSE[0], _DENSE[1], _DENSE[2].format("Qwen3")),
        ("bias", (False,), "transformers' Qwen3 layer, whose MLP has no biases"),
        ("qkv_bias", (None,), "transformers' Qwen3 layer, whose attention_bias puts biases on q, k, v and o "
                              "alike, which actmem cannot express")),
    keeps=_HF_LLAMA.keeps,
    notes=("hf: transformers 5.23 Qwen3ForCausalLM on one device, as measured by the harness: Llama's "
           "layer (see LlamaForCausalLM), and q_norm and k_norm, Qwen3RMSNorms over each head, keep an "
           "fp32 copy of q and of k, their fp32 rsqrt and their 16-bit normalized tensors, not q_proj's "
           "and k_proj's outputs",))

# transformers 5.23.0's GPT2Block (models/gpt2/modeling_gpt2.py) in GPT2LMHeadModel: nn.LayerNorm,
# Conv1D linears (addmm: one fused QKV output), gelu_new (NewGELUActivation, activations.py:
# 0.5 * x * (1 + tanh(...)) in Python), nn.Dropout, eager or SDPA attention.
_HF_GPT2 = ModelClass(
    "GPT2LMHeadModel",
    architecture=(
        ("activation", ("gelu",), "transformers' GPT2Block (gelu_new)"),
        ("normalization", ("layernorm",), "transformers' GPT2Block (nn.LayerNorm)"),
        ("position_embedding", ("learned",), "transformers' GPT2Model (wpe)"),
        ("query_groups", (None,), "transformers' GPT2Attention, one key a head"),
        ("head_dim", (None,), "transformers' GPT2Attention, head dim h/a"),
        ("bias", (True,), "transformers' Conv1D, which always has a bias"),
        ("qk_norm", (False,), "transformers' GPT2Attention, which has no q and k norms"),
        (_DENSE[0], _DENSE[1], _DENSE[2].format("GPT2"))),
    keeps=frozenset({"gelu_tanh_intermediates"}),
    rules=((lambda arch: arch.attention_core == "eager" or arch.attention_dropout == 0,
            "transformers' GPT2 under sdpa with no attention dropout: with dropout a GPU's flash kernel "
            "keeps only its RNG state, but a CPU's SDPA falls back to its math kernel, so the harness cannot "
            "measure it (--attention-dropout 0, or --attention-core eager)"),),
    notes=("hf: transformers 5.23 GPT2LMHeadModel on one device, as measured by the harness: "
           "nn.LayerNorm keeps its input and fp32 mean and rstd (on a GPU; a CPU keeps them in 16 bits); "
           "the attention keeps q, k and v as views of the one QKV output (sdpa; eager at b = 1) or as "
           "copies (eager, b > 1), the same bytes; gelu_new, written in Python, keeps its input and three "
           "more f-wide tensors; dropout keeps 1-byte masks (torch.native_dropout, as on a GPU); the "
           "int64 position ids (8s B) are not counted",))
# transformers 5.23.0's sparse MoE blocks (models/mixtral/modeling_mixtral.py, models/qwen3_moe/
# modeling_qwen3_moe.py): a softmax router over every expert, top-k, and the experts as 3-D weights run by
# the experts implementation transformers picks by default, grouped_mm (modeling_utils.py,
# get_correct_experts_implementation; integrations/moe.py, grouped_mm_experts_forward), on one device.
_HF_EXPERTS = (
    ("moe", (True,), "transformers' sparse MoE block"),
    ("moe_layer_freq", (1,), "transformers' sparse MoE block in every layer (Qwen3-MoE's mlp_only_layers are "
                             "not modelled)"),
    ("moe_score_function", ("softmax",), "transformers' router, a softmax over every expert"),
    ("moe_router_dtype", (None,), "transformers' router, whose logits are the model's 16 bits"),
    ("moe_router_groups", (None,), "transformers' router, which routes over every expert (no groups)"),
    ("moe_expert_bias", (False,), "transformers' router, which has no expert bias"),
    ("moe_shared_ffn", (None,), "transformers' Mixtral and Qwen3-MoE blocks, which have no shared experts "
                                "(Qwen2-MoE's are not modelled)"),
    ("moe_capacity_factor", (None,), "transformers' sparse MoE block, which drops no tokens"),
    ("moe_pad_to_capacity", (False,), "transformers' sparse MoE block, which pads no expert's input"),
    ("moe_permute_fusion", (False,), "transformers' experts, which permute with torch's own ops (--moe-permute-fusion "
                                     "is Megatron's, TE's kernels)"),
    ("moe_dispatcher", ("allgather",), "transformers' sparse MoE block on one device, with no token dispatcher "
                                       "(--moe-token-dispatcher-type is Megatron's)"),
    ("moe_grouped_gemm", (False,), "transformers' experts, run by its grouped_mm by default (--moe-grouped-gemm "
                                   "is Megatron's)"),
    ("moe_load_balancing", ("aux_loss", "none"), "transformers' sparse MoE block, whose aux loss "
                                                 "(load_balancing_loss_func) is a function of the router logits"),
    ("bias", (False,), "transformers' Mixtral and Qwen3-MoE layers, which have no biases"),
    ("qkv_bias", (None,), "transformers' Mixtral and Qwen3-MoE layers, which have no biases"),
)
_HF_EXPERTS_NOTE = ("hf: the experts run by transformers' default experts implementation, grouped_mm (the token "
                    "rows sorted by expert, int64 indices and int32 offsets kept); eager and batched_mm keep other "
                    "tensors and are not modelled; every expert sits on the one device, so the rows are k·N "
                    "whatever the routing; the aux loss is not computed (output_router_logits false, the configs' "
                    "default; its coefficient, --moe-aux-loss-coeff, changes nothing): with it, the router logits of "
                    "every layer are kept, not counted")
_HF_MIXTRAL = ModelClass(
    "MixtralForCausalLM",
    architecture=_LLAMA_LAYER + _HF_EXPERTS + (
        ("qk_norm", (False,), "transformers' Mixtral layer, which has no q and k norms (Qwen3MoeForCausalLM has "
                              "them)"),
        ("moe_pre_softmax", (False,), "transformers' MixtralTopKRouter, which always renormalises the top-k "
                                      "probabilities")),
    keeps=_HF_LLAMA.keeps | {"grouped_mm_experts", "fp32_routing_weights"},
    notes=("hf: transformers 5.23 MixtralForCausalLM on one device, as measured by the harness: Llama's attention "
           "and norms (see LlamaForCausalLM); the router keeps its fp32 softmax over every expert and renormalises "
           "the top-k in place, handing the experts fp32 weights", _HF_EXPERTS_NOTE))
_HF_QWEN3_MOE = ModelClass(
    "Qwen3MoeForCausalLM",
    architecture=_LLAMA_LAYER + _HF_EXPERTS + (
        ("qk_norm", (True,), "transformers' Qwen3-MoE layer, whose q_norm and k_norm normalise each head"),),
    keeps=_HF_LLAMA.keeps | {"grouped_mm_experts"},
    notes=("hf: transformers 5.23 Qwen3MoeForCausalLM on one device, as measured by the harness: Qwen3's attention "
           "and norms (see Qwen3ForCausalLM); the router keeps its fp32 softmax over every expert, renormalises the "
           "top-k in place where norm_topk_prob (else --moe-router-pre-softmax) and hands the experts 16-bit "
           "weights", _HF_EXPERTS_NOTE))
# transformers 5.23.0's Qwen2MoeSparseMoeBlock (models/qwen2_moe/modeling_qwen2_moe.py): Qwen3-MoE's router
# and grouped_mm experts beside a shared expert, Qwen2MoeMLP of shared_expert_intermediate_size (an unfused
# SwiGLU), scaled by sigmoid(shared_expert_gate(x)); Qwen2's attention, biases on q, k and v alone
_HF_QWEN2_MOE = ModelClass(
    "Qwen2MoeForCausalLM",
    architecture=_LLAMA_LAYER + tuple(constraint for constraint in _HF_EXPERTS
                                      if constraint[0] not in ("moe_shared_ffn", "qkv_bias")) + (
        ("qk_norm", (False,), "transformers' Qwen2-MoE layer, which has no q and k norms (Qwen3MoeForCausalLM has "
                              "them)"),
        ("qkv_bias", (True,), "transformers' Qwen2-MoE attention, whose q, k and v have biases (qkv_bias)"),
        ("moe_shared_gate", (True,), "transformers' Qwen2-MoE block, which gates its shared expert: "
                                     "sigmoid(shared_expert_gate(x))"),
        ("moe_shared_overlap", (False,), "transformers' Qwen2-MoE block, which runs its shared expert in line "
                                         "(--moe-shared-expert-overlap is Megatron's)")),
    keeps=_HF_LLAMA.keeps | {"grouped_mm_experts"},
    rules=((lambda arch: arch.moe_shared_ffn is not None,
            "transformers' Qwen2-MoE block, which always has its shared expert (--moe-shared-expert-intermediate-size)"),),
    notes=("hf: transformers 5.23 Qwen2MoeForCausalLM on one device, as measured by the harness: Llama's attention "
           "and norms (see LlamaForCausalLM), q, k and v with biases; the router and experts as Qwen3-MoE's; the "
           "shared expert, an unfused SwiGLU, keeps gate_proj's and up_proj's outputs, silu's and the product, and "
           "its gate's sigmoid with the output it scales", _HF_EXPERTS_NOTE))

#: Megatron's kernel choice (--no-rope-fusion) and its dataloader's attention mask, which other codes have not
_NOT_MEGATRON = (("rope_fusion", True), ("attention_mask", False))

#: ... and Megatron's MoE settings transformers has no use for: one device has no token dispatcher, and its
#: experts run by its own grouped_mm
_NOT_MEGATRON_EXPERTS = (("moe_dispatcher", "allgather"), ("moe_grouped_gemm", False))

_HF = dict(runs=frozenset({"zero"}), attention_names=HF_ATTENTION, dropped_settings=_NOT_MEGATRON + _NOT_MEGATRON_EXPERTS, unpadded_vocab="transformers keeps the config's vocabulary",
           flash_head_dim_limit=256, keeps=frozenset({"cross_entropy_fp32_gradients", "layer_call_arguments"}),
           flash_head_dim_why="transformers' sdpa passes enable_gqa only for a head dim of at most 256 "
                              "(sdpa_attention.py, use_gqa_in_sdpa); beyond, it copies k and v to a heads, "
                              "which actmem does not count yet",
           models=(_HF_QWEN2, _HF_LLAMA, _HF_QWEN3, _HF_GPT2, _HF_MIXTRAL, _HF_QWEN3_MOE, _HF_QWEN2_MOE),
           selective_recompute="transformers has no selective recompute: choose none or full (the Trainer's "
                               "activation checkpointing)",
           full_recompute_note="hf: full recompute is the Trainer's --activation_checkpointing "
                               "(activation_checkpointing_enable, no kwargs): torch's non-reentrant checkpoint of "
                               "every layer, with early stop; each keeps its input, and their closures the call's "
                               "keywords once for all layers (the rotary tables, the position ids, the eager core's "
                               "mask); every_n_layers, offload and use_reentrant true are not modelled (the "
                               "reentrant one holds the rerun's output too, 2sbh)",
           notes=("hf: int64 token ids and shifted labels (8 B a token each) are not counted; model state is "
                  "counted as mixed-precision Adam on one GPU (DDP) unless --zero-stage or --deepspeed prices "
                  "DeepSpeed's ZeRO (FSDP under accelerate is not modelled)",
                  "hf: the loss (ForCausalLMLoss: logits.float(), then F.cross_entropy) keeps the fp32 "
                  "log-softmax, and its backward holds fp32 gradients of the log-probabilities and of the "
                  "logits beside it (8sbv)"))

#: What Megatron-Core with Transformer Engine has that the other codes do not, each read off its source:
#: - dataloader_mask: the dataloader's causal mask (create_attention_mask_in_dataloader);
#: - softmax_switches: its local core's fused softmax and torch's fallback (fused_softmax.py), with
#:   --no-masked-softmax-fusion and --attention-softmax-in-fp32;
#: - wgrad_fusion: gradient accumulation fusion into main_grad, with TE's cached dummy weight
#:   gradients (module/base.py, get_dummy_wgrad), and --no-gradient-accumulation-fusion;
#: - rotary_percent: --rotary-percent of its rope (rope_utils.py);
#: - te_flash_core: TE's attention, which makes v contiguous inside core_attn's checkpoint;
#: - paper_norms: the paper's eager layer, whose norm statistics the paper leaves out;
#: - layer_backward: its layer's backward, op by op (actmem.memory.backward's moments);
#: - megatron_args: it is what a Megatron-LM launch script runs (--megatron-args);
#: - moe: its MoELayer (actmem.model.experts), the mixture of experts actmem models;
#: - fp8: TE's FP8 linears (actmem.model.fp8);
#: - multi_token_prediction: its MTP block (multi_token_prediction.py; actmem.memory's mtp rows);
#: - multi_latent_attention: its MLASelfAttention (actmem.model.latent).
MEGATRON_CORE = frozenset({"dataloader_mask", "softmax_switches", "wgrad_fusion", "rotary_percent",
                           "te_flash_core", "paper_norms", "layer_backward", "megatron_args", "moe", "fp8",
                           "multi_token_prediction", "multi_latent_attention"})

#: (what the code must have, whether the architecture uses it, the refusal where it does not)
SWITCHES = (
    ("dataloader_mask", lambda arch: arch.attention_mask,
     "the dataloader's attention mask is Megatron's (create_attention_mask_in_dataloader); "
     "--implementation {code} builds no such mask: give --no-attention-mask"),
    ("softmax_switches", lambda arch: not arch.masked_softmax_fusion or arch.softmax_in_fp32,
     "masked_softmax_fusion and softmax_in_fp32 are Megatron's switches of its local core's "
     "softmax (fused_softmax.py); --implementation {code} has no such kernel"),
    ("wgrad_fusion", lambda arch: not arch.gradient_accumulation_fusion,
     "--no-gradient-accumulation-fusion is Megatron's switch; --implementation {code} computes its weight "
     "gradients with autograd already"),
    ("moe", lambda arch: arch.moe and not any("grouped_mm_experts" in model.keeps for model in arch.code.models),
     "mixture-of-experts layers are modelled as Megatron-Core's MoELayer and as transformers' MixtralForCausalLM, "
     "Qwen3MoeForCausalLM and Qwen2MoeForCausalLM; --implementation {code}'s own keeps what actmem has not read yet: give "
     "--implementation megatron"),
    ("multi_token_prediction", lambda arch: arch.mtp_layers,
     "multi-token prediction is modelled as Megatron-Core runs it; --implementation {code} has none"),
    ("rotary_percent", lambda arch: arch.rotary_percent != 1,
     "--rotary-percent {arch.rotary_percent:g} shapes Megatron's rotary positions; this model's positions are "
     "{arch.position_embedding} under {code}"),
)

#: what Megatron's local spec (its eager core) keeps that actmem does not count yet
_MEGATRON_LIMITS = (
    (lambda arch: arch.position_embedding == "rope" and arch.attention_core == "eager",
     "rotary position embedding is modelled under the flash attention core only: under Megatron's eager "
     "(local) core the value view keeps the whole QKV output alive beside the rotated q and k, which actmem "
     "does not count yet"),
    (lambda arch: arch.qk_norm and arch.attention_core == "eager",
     "--qk-layernorm is modelled under the flash attention core only: Megatron runs the eager core in its "
     "local spec, whose q and k norms (LNImpl: apex's or torch's) keep what actmem does not count yet"),
)

#: Megatron-FSDP's --data-parallel-sharding-strategy, each with what it shards over the d·c data-parallel ranks:
#: (16-bit weights, main gradients, optimizer state: the fp32 main weights and Adam's moments). megatron-core 0.16.1,
#: distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py (_init_each_parameter_group_buffers: the buffers a
#: strategy shards; no weight buffer under no_shard, the module's own weights); Megatron-LM's default, d98e8a64,
#: optim_grads_params (arguments.py)
MEGATRON_FSDP_STRATEGIES = {"no_shard": (False, False, False), "optim": (False, False, True),
                            "optim_grads": (False, True, True), "optim_grads_params": (True, True, True)}
MEGATRON_FSDP_DEFAULT = "optim_grads_params"

#: torchtitan 018740b7's fsdp_reshard_after_forward (models/llama3/infra/parallelize.py, apply_fsdp): which of
#: FSDP2's groups the forward reshards (--fsdp-reshard-after-forward; actmem.memory.fsdp)
RESHARD_POLICIES = {
    "default": "the embedding and the blocks resharded after the forward, (norm, output) not",
    "always": "every group resharded after the forward, (norm, output) too",
    "never": "no group resharded after the forward: each stays gathered until its post-backward",
}

IMPLEMENTATIONS = {
    MEGATRON: Implementation(
        MEGATRON, "Megatron-Core with Transformer Engine (the paper's code; the default)", has=MEGATRON_CORE,
        limits=_MEGATRON_LIMITS),
    "torch-native": Implementation(
        "torch-native",
        "PyTorch-native DTensor tensor + sequence parallelism, torchtitan's Llama 3 plan "
        "(parallelize_module with ColwiseParallel, RowwiseParallel, SequenceParallel)",
        gathered_under_sp=frozenset({"qkv_input", "fc1_input", "output_layer_input"}),
        keeps=frozenset({"repeated_key_value", "silu_output", "cross_entropy_fp32_gradients"}),
        architecture=_TORCHTITAN_LLAMA,
        runs=frozenset({"tensor", "fsdp"}),
        unpadded_vocab="DTensor shards the vocabulary unevenly", dropped_settings=_NOT_MEGATRON,
        notes=("torch-native: torchtitan's Llama 3 block (commit 018740b7) under parallelize_module with "
               "its plan, as it keeps it without checkpointing: PrepareModuleInput all-gathers each norm's output, "
               "and wq, wk, wv (and w1, w3) keep that gathered (s, b, h) input, not the shard Megatron keeps; repeat_kv copies k and v "
               "to a/t heads unless g = t; the unfused SwiGLU keeps silu's output; the rotation keeps only "
               "the model's table; the norms are counted as the GPU's fused RMSNorm keeps them (16-bit "
               "input, fp32 rstd), not as torch's CPU decomposition (fp32 copies)",
               "torch-native: with --sp, torchtitan's plan; without, plain DTensor TP (ColwiseParallel and "
               "RowwiseParallel, the norms replicated), which torchtitan does not use; without --fsdp (one "
               "data-parallel rank: torchtitan shards more with FSDP2), model state is counted as Megatron's "
               "mixed-precision Adam split over t, and the layers in bf16 as under FSDP2's mixed precision, "
               "whereas torchtitan trains TP alone in fp32 and one GPU under AMP (maybe_enable_amp)",
               "torch-native: the output layer keeps its all-gathered input too, and the loss (under "
               "loss_parallel) the fp32 log-softmax of its vocabulary shard; int64 token ids and targets "
               "(8 B a token each, whole on every rank) are not counted; the loss's backward holds fp32 "
               "gradients of the logits, 8sbv at t = 1, 12sbv/t under loss_parallel"),
        selective_recompute="Megatron's selective recompute (core_attn, mlp, ...) is not torchtitan's selective "
                            "checkpointing, which actmem models given its option: --selective-ac-option op (its "
                            "per-op policy, which keeps the outputs of chosen ops) or N (a block checkpointed whole "
                            "every N: its default, 2); or choose none or full",
        op_checkpointing=True,
        sequence_parallel_default="torchtitan's plan always has it under tensor parallelism (--no-sp for plain "
                                  "DTensor TP)"),
    "hf": Implementation(
        "hf", "Hugging Face transformers 5.23 {model} (attn_implementation eager for the eager core, "
              "sdpa with is_causal for flash; a whole model a GPU: data parallelism alone, DDP or DeepSpeed's ZeRO)",
        architecture=(("attention_core", ("eager", "flash"), "transformers' eager and sdpa attention (flash is sdpa, "
                                                             "transformers' default; its flash_attention_2 runs the "
                                                             "flash-attn package on a GPU and is not measured)"),
                      ("rope_fusion", (True,), "transformers' own rotary embedding (--no-rope-fusion is "
                                               "Megatron's)")),
        **_HF),
}


def implementation(name: str) -> Implementation:
    """The implementation of this name, or SpecError naming the known ones."""
    try:
        return IMPLEMENTATIONS[name]
    except (KeyError, TypeError):
        raise SpecError(f"implementation must be one of {', '.join(IMPLEMENTATIONS)}; got {name!r}") from None
