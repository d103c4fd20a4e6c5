"""A Hugging Face ``config.json`` as the model: read as JSON, no download, no transformers.

The file says what the model is (its dims and architecture); how it is trained (t, p, the
recompute) stays a run setting, and the implementation is Megatron-Core's with Transformer
Engine, so the attention core is flash, as Megatron-Core's default backend runs it. What a
field means is taken from transformers' own configuration and modelling files
(``models/<type>/configuration_<type>.py`` and ``modeling_<type>.py``), cited per family.
"""

import json
from pathlib import Path

from actmem.errors import SpecError

#: config keys and model types that make a mixture of experts: read for Mixtral, Qwen2-MoE, Qwen3-MoE and
#: DeepSeek-V2/V3 (as Megatron-Core's MoE layer trains them), refused for the others, one line
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
MOE_TYPES = ("dbrx", "jamba", "olmoe")
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
#: the mixtures of experts read, and the dense family each one's attention is (DeepSeek's: its own, MLA)
MOE_READ = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3", "deepseek_v2": None, "deepseek_v3": None}
SUPPORTED = LLAMA_LIKE + tuple(MOE_READ) + ("gpt2", "gpt_neox")


def is_hf_config(path: Path) -> bool:
    return path.suffix == ".json"


def read_hf_config(path: Path) -> dict:
    """{'name', 'source', 'model', 'architecture', 'notes'} from a config.json."""
    config = _load(path)
    kind = config.get("model_type")
    if kind in MOE_TYPES or (kind not in MOE_READ and any(config.get(key) for key in MOE_KEYS)):
        raise SpecError(f"{path}: a mixture-of-experts model ({kind}) is not supported yet: actmem reads "
                        f"{' and '.join(MOE_READ)} (Megatron-Core's MoE layer)")
    if kind not in SUPPORTED:
        raise SpecError(f"{path}: model_type {kind!r} is not supported; actmem reads "
                        f"{', '.join(SUPPORTED)}")
    model, architecture, notes = {"llama": _llama, "mistral": _llama, "qwen2": _llama, "qwen3": _llama, "gpt2": _gpt2,
                                  "gpt_neox": _gpt_neox, "mixtral": _moe, "qwen2_moe": _moe, "qwen3_moe": _moe,
                                  "deepseek_v2": _deepseek, "deepseek_v3": _deepseek}[kind](config, path)
    learned_rows = model["seq_len"] if architecture.get("position_embedding") == "learned" else None
    return dict(name=f"{kind}:{path.parent.name or path.stem}", source=str(path), model=model,
                position_table=learned_rows,
                architecture={"attention_core": "flash"} | architecture,
                unmeasured={"hf": why} if (why := _hf_unmeasured(kind, config)) else {},
                notes=(f"{path.name}: {kind}, read as a {'MoE' if kind in MOE_READ else 'dense'} layer, its attention "
                       "core flash unless --attention-core says otherwise (the code line says whose kernels count it)",)
                + notes[1:],
                seq_len_note=notes[0])


def _hf_unmeasured(kind: str, config: dict) -> str | None:
    """Why transformers runs this config with code the harness has not measured: the harness
    runs LlamaForCausalLM (MistralForCausalLM is its code: modular_mistral.py), Qwen2ForCausalLM,
    Qwen3ForCausalLM, GPT2LMHeadModel with gelu_new, MixtralForCausalLM, Qwen3MoeForCausalLM and
    Qwen2MoeForCausalLM without their aux loss or router jitter (hf.py); None where it is that."""
    if kind not in ("llama", "mistral", "qwen2", "qwen3", "gpt2", "mixtral", "qwen3_moe", "qwen2_moe"):
        return f"{kind} is a class of its own in transformers, whose own code actmem has not measured"
    if kind == "mistral" and config.get("sliding_window"):
        return ("a sliding window: MistralModel then makes a sliding-window mask, which sdpa keeps beside k and v "
                "repeated to every head; actmem has not measured it (sliding_window null, Mistral 7B v0.2 on, "
                "runs LlamaForCausalLM's code)")
    if kind in MOE_READ and config.get("output_router_logits"):
        return ("output_router_logits: transformers then adds the aux loss, keeping every layer's router logits "
                "(load_balancing_loss_func), which actmem has not measured")
    if kind == "mixtral" and config.get("router_jitter_noise"):
        return "router_jitter_noise: the jitter's noise and its product are kept, which actmem has not measured"
    if (kind == "mixtral" and config.get("sliding_window")) or (kind in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe")
                                                                and config.get("use_sliding_window")):
        return ("a sliding window: sdpa is then handed a mask, which it keeps beside k and v repeated to every head "
                "(sdpa_attention.py, use_gqa_in_sdpa: no enable_gqa with a mask); actmem has not measured it")
    experts = config.get("experts_implementation")
    if kind in MOE_READ and experts not in (None, "grouped_mm"):
        return (f"experts_implementation {experts!r}: its experts keep other tensors than grouped_mm's, transformers' "
                "default, which alone actmem has measured")
    act = config.get("activation_function", "gelu_new")
    if kind == "gpt2" and act != "gelu_new":
        return (f"its activation_function is {act}, and only gelu_new, GPT-2's own, is measured "
                "(F.gelu keeps its input alone, gelu_new three more f-wide tensors)")
    if kind == "gpt2" and config.get("reorder_and_upcast_attn"):
        return ("reorder_and_upcast_attn: GPT2Attention then keeps fp32 copies of q and k and an fp32 "
                "softmax, which actmem has not measured")
    return None


def _load(path: Path) -> dict:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise SpecError(f"{path}: cannot read it ({error.strerror})")
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise SpecError(f"{path}: not a JSON config ({error})")
    if not isinstance(config, dict):
        raise SpecError(f"{path}: not a JSON config (an object at the top)")
    return config


def _need(config: dict, path: Path, key: str) -> int:
    """A positive integer the config must give."""
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SpecError(f"{path}: {key} must be a positive integer, got {value!r}")
    return value


def _probability(config: dict, path: Path, key: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise SpecError(f"{path}: {key} must be a probability in [0, 1), got {value!r}")
    return float(value)


def _switch(config: dict, path: Path, key: str, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise SpecError(f"{path}: {key} must be true or false, got {value!r}")
    return value


def _optional_int(config: dict, path: Path, key: str):
    return None if config.get(key) is None else _need(config, path, key)


def _dims(config, path, heads, hidden, layers, positions) -> dict:
    """The model: the training sequence defaults to the context the config allows."""
    return dict(heads=_need(config, path, heads), hidden=_need(config, path, hidden),
                layers=_need(config, path, layers), vocab=_need(config, path, "vocab_size"),
                seq_len=_need(config, path, positions))


def _seq_note(config, key) -> tuple:
    return (f"sequence length s = {key} ({config[key]:,}) from the config; give --seq-len for "
            "the run's own",)


def _llama(config, path):
    """LlamaConfig, MistralConfig, Qwen2Config: a gated MLP of intermediate_size (gate_proj,
    up_proj, down_proj), RMSNorm, rope; num_key_value_heads groups; head_dim when given;
    biases: Llama's attention_bias and mlp_bias (default off), Mistral's none, Qwen2's q, k, v always
    (modeling_qwen2.py: q_proj bias=True, o_proj bias=False), Qwen3's on q, k, v and o with
    attention_bias and never on its MLP. Qwen3Config: q_norm and k_norm, RMSNorms over each
    head (modeling_qwen3.py, Qwen3Attention.forward: before rope), Megatron's --qk-layernorm."""
    kind = config["model_type"]
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise SpecError(f"{path}: hidden_act {act!r}: actmem models the gated MLP with silu (SwiGLU) only")
    model = _dims(config, path, "num_attention_heads", "hidden_size", "num_hidden_layers",
                  "max_position_embeddings")
    groups = _optional_int(config, path, "num_key_value_heads") or model["heads"]
    # Qwen3Config's head_dim defaults to 128 (configuration_qwen3.py), the others' to h/a
    default_dim = 128 if kind == "qwen3" else model["hidden"] // model["heads"]
    head_dim = _optional_int(config, path, "head_dim") or default_dim
    # Qwen2's q, k and v have biases always; Mistral's linears and Qwen2's and Qwen3's MLPs
    # have none whatever the config says (bias=False in modeling_mistral.py, MistralAttention
    # and MistralMLP; modeling_qwen2.py and modeling_qwen3.py, the MLPs)
    attention_bias = kind == "qwen2" or (kind != "mistral" and _switch(config, path, "attention_bias", False))
    mlp_bias = kind == "llama" and _switch(config, path, "mlp_bias", False)
    if kind in ("llama", "qwen3") and attention_bias != mlp_bias:
        raise SpecError(f"{path}: attention_bias and mlp_bias differ ({kind}'s attention_bias is on q, k, v and "
                        "o); actmem models biases on all the linear layers, none, or on the QKV linear only")
    architecture = dict(
        ffn_hidden=_need(config, path, "intermediate_size"), activation="swiglu", normalization="rmsnorm",
        bias=mlp_bias, qkv_bias=attention_bias if attention_bias != mlp_bias else None,
        tied_output=_switch(config, path, "tie_word_embeddings", False),
        query_groups=None if groups == model["heads"] else groups,
        head_dim=None if head_dim * model["heads"] == model["hidden"] else head_dim,
        position_embedding="rope", attention_dropout=_probability(config, path, "attention_dropout", 0.0),
        hidden_dropout=0.0, qk_norm=kind == "qwen3")
    notes = _seq_note(config, "max_position_embeddings")
    window = _optional_int(config, path, "sliding_window")
    if window and config.get("use_sliding_window", kind == "mistral"):
        notes += (f"sliding window {window:,}: flash attention keeps the same tensors with or without it",)
    elif kind == "mistral":
        notes += ("mistral: MistralForCausalLM is LlamaForCausalLM's code (transformers' modular_mistral.py), its "
                  "attention handed sliding_window null: under --implementation hf priced and measured as "
                  "LlamaForCausalLM",)
    return model, architecture, notes


def _moe(config, path):
    """MixtralConfig, Qwen2MoeConfig and Qwen3MoeConfig: the dense family's attention (Mistral's; Qwen2's
    with q, k, v biases; Qwen3's with its q and k norms) and a MoE MLP in every layer: num_local_experts
    (Mixtral) or num_experts SwiGLU experts of intermediate_size (Mixtral: MixtralSparseMoeBlock) or
    moe_intermediate_size, top num_experts_per_tok. Mixtral renormalises the top-k probabilities, as
    Qwen does with norm_topk_prob: Megatron's softmax over the top-k scores; without it the softmax
    over every expert comes first, Megatron's --moe-router-pre-softmax. Qwen2-MoE's shared expert
    (shared_expert_intermediate_size) is gated by sigmoid(shared_expert_gate(x)) (modeling_qwen2_moe.py,
    Qwen2MoeSparseMoeBlock): --moe-shared-expert-gate. Qwen's dense layers (mlp_only_layers,
    decoder_sparse_step > 1) are not modelled. The token dispatcher is the run's choice: Megatron's
    default, allgather, unless --moe-token-dispatcher-type says otherwise."""
    kind = config["model_type"]
    if kind != "mixtral" and (config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1):
        raise SpecError(f"{path}: dense layers among the MoE layers (mlp_only_layers, decoder_sparse_step) are not "
                        "modelled yet: actmem models a MoE MLP in every layer")
    renormalised = kind == "mixtral" or _switch(config, path, "norm_topk_prob", False)
    dense = dict(config, model_type=MOE_READ[kind])
    if kind == "mixtral" and config.get("head_dim") is None:
        dense.pop("head_dim", None)
    model, architecture, notes = _llama(dense, path)
    experts = _need(config, path, "num_local_experts" if kind == "mixtral" else "num_experts")
    expert_ffn = None if kind == "mixtral" else _need(config, path, "moe_intermediate_size")
    coeff = config.get("router_aux_loss_coef", 0.0)
    if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or coeff < 0:
        raise SpecError(f"{path}: router_aux_loss_coef must be a number >= 0, got {coeff!r}")
    # Qwen2MoeConfig (transformers 5.23, configuration_qwen2_moe.py): shared_expert_intermediate_size
    # defaults to 5632 and Qwen2MoeSparseMoeBlock always builds it with its gate; qkv_bias defaults to true
    shared = (_optional_int(config, path, "shared_expert_intermediate_size") or 5632) if kind == "qwen2_moe" else None
    if kind == "qwen2_moe" and not _switch(config, path, "qkv_bias", True):
        architecture["qkv_bias"] = None
    architecture |= dict(num_experts=experts, moe_topk=_need(config, path, "num_experts_per_tok"),
                         moe_ffn_hidden=expert_ffn, moe_aux_loss_coeff=float(coeff), moe_pre_softmax=not renormalised,
                         moe_shared_ffn=shared, moe_shared_gate=shared is not None)
    return model, architecture, notes + (
        f"{kind}: {experts} experts, top-{architecture['moe_topk']}, in every layer; as Megatron-Core's MoE layer "
        f"trains them, the aux loss at the config's router_aux_loss_coef ({coeff:g}; --moe-aux-loss-coeff) and the "
        "token dispatcher the run's choice (--moe-token-dispatcher-type; Megatron's default allgather)",)


def _deepseek(config, path):
    """DeepseekV2Config and DeepseekV3Config (transformers 5.23, modeling_deepseek_v2.py and _v3.py): multi-latent
    attention (q_lora_rank, null for a q projected straight from h; kv_lora_rank; qk_nope_head_dim, qk_rope_head_dim,
    v_head_dim; q_a_layernorm and kv_a_layernorm, RMSNorms of the latents: Megatron's --qk-layernorm) and a MoE MLP
    after the first first_k_dense_replace dense layers (intermediate_size): n_routed_experts SwiGLU experts of
    moe_intermediate_size, top num_experts_per_tok, and n_shared_experts as one ungated MLP of n_shared_experts x
    moe_intermediate_size. The router's logits are fp32 (F.linear of fp32 copies: --moe-router-dtype fp32).
    V2 scores by softmax over every expert, renormalised over the top-k with norm_topk_prob (else
    --moe-router-pre-softmax), group-limited under topk_method group_limited_greedy; V3 by sigmoid with
    e_score_correction_bias choosing (topk_method noaux_tc: --moe-router-enable-expert-bias), its top-k
    renormalised, group-limited over n_group groups (--moe-router-num-groups, --moe-router-group-topk).
    DeepSeek's own configs name a sequence-wise aux loss (seq_aux, aux_loss_alpha): seq_aux_loss at that
    coefficient. The multi-token-prediction layers it was trained with (num_nextn_predict_layers, V3's 1) are
    Megatron's --mtp-num-layers."""
    kind = config["model_type"]
    if config.get("hidden_act", "silu") != "silu":
        raise SpecError(f"{path}: hidden_act {config.get('hidden_act')!r}: actmem models the gated MLP with silu only")
    model = _dims(config, path, "num_attention_heads", "hidden_size", "num_hidden_layers", "max_position_embeddings")
    if config.get("moe_layer_freq", 1) != 1:
        raise SpecError(f"{path}: moe_layer_freq {config['moe_layer_freq']!r}: DeepSeek's MoE layers every N-th layer "
                        "after the dense ones are not read yet (1: every layer after first_k_dense_replace)")
    dense = config.get("first_k_dense_replace", 3 if kind == "deepseek_v3" else 0)
    if isinstance(dense, bool) or not isinstance(dense, int) or not 0 <= dense < model["layers"]:
        raise SpecError(f"{path}: first_k_dense_replace must be an integer from 0 to num_hidden_layers - 1, got {dense!r}")
    v3 = kind == "deepseek_v3"
    renormalised = _switch(config, path, "norm_topk_prob", v3)
    method = config.get("topk_method", "noaux_tc" if v3 else "greedy")
    if v3 and (method != "noaux_tc" or config.get("scoring_func", "sigmoid") != "sigmoid" or not renormalised):
        raise SpecError(f"{path}: {kind} with topk_method {method!r}, scoring_func {config.get('scoring_func')!r}, "
                        f"norm_topk_prob {renormalised}: actmem reads DeepSeek-V3's router (sigmoid, noaux_tc, "
                        "renormalised), as Megatron runs it")
    if not v3 and method not in ("greedy", "group_limited_greedy"):
        raise SpecError(f"{path}: topk_method {method!r}: actmem reads greedy and group_limited_greedy for {kind}")
    grouped = v3 or method == "group_limited_greedy"
    groups = _optional_int(config, path, "n_group") if grouped else None
    shared = config.get("n_shared_experts") or 0
    expert_ffn = _need(config, path, "moe_intermediate_size")
    coeff = config.get("aux_loss_alpha", 0.0) if config.get("seq_aux", False) else 0.0
    if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or coeff < 0:
        raise SpecError(f"{path}: aux_loss_alpha must be a number >= 0, got {coeff!r}")
    layers = model["layers"]
    architecture = dict(
        ffn_hidden=_need(config, path, "intermediate_size"), activation="swiglu", normalization="rmsnorm", bias=False,
        tied_output=_switch(config, path, "tie_word_embeddings", False), position_embedding="rope",
        attention_dropout=_probability(config, path, "attention_dropout", 0.0), hidden_dropout=0.0,
        multi_latent_attention=True, q_lora_rank=_optional_int(config, path, "q_lora_rank"),
        kv_lora_rank=_need(config, path, "kv_lora_rank"), qk_head_dim=_need(config, path, "qk_nope_head_dim"),
        qk_pos_emb_head_dim=_need(config, path, "qk_rope_head_dim"), v_head_dim=_need(config, path, "v_head_dim"),
        qk_norm=True, num_experts=_need(config, path, "n_routed_experts"),
        moe_topk=_need(config, path, "num_experts_per_tok"), moe_ffn_hidden=expert_ffn,
        moe_layer_freq=(0,) * dense + (1,) * (layers - dense) if dense else 1, moe_router_dtype="fp32",
        moe_score_function="sigmoid" if v3 else "softmax", moe_expert_bias=v3,
        moe_pre_softmax=not v3 and not renormalised,
        moe_router_groups=groups if groups and groups > 1 else None,
        moe_router_group_topk=_optional_int(config, path, "topk_group") if groups and groups > 1 else None,
        moe_shared_ffn=shared * expert_ffn if shared else None,
        moe_load_balancing="seq_aux_loss" if coeff else "aux_loss", moe_aux_loss_coeff=float(coeff))
    mtp = config.get("num_nextn_predict_layers", config.get("num_mtp_layers", 0)) or 0
    if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0:
        raise SpecError(f"{path}: num_nextn_predict_layers must be an integer >= 0, got {mtp!r}")
    architecture["mtp_layers"] = mtp
    notes = _seq_note(config, "max_position_embeddings") + (
        f"{kind}: multi-latent attention and {architecture['num_experts']} experts, top-{architecture['moe_topk']}, "
        f"after {dense} dense layer{'s' if dense != 1 else ''}, as Megatron-Core trains them (the router in fp32, as "
        "transformers computes it; the token dispatcher the run's choice, Megatron's default allgather)"
        + (f"; the sequence-wise aux loss at the config's aux_loss_alpha ({coeff:g})" if coeff else
           "; no aux loss (the config names none: DeepSeek-V3 trains with a sequence-wise one, "
           "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4)"),)
    if mtp:
        notes += (f"num_nextn_predict_layers {mtp}: {mtp} multi-token-prediction layer{'s' if mtp > 1 else ''} on the "
                  "last stage, as Megatron trains them (--mtp-num-layers; give --mtp-num-layers 0 to leave "
                  f"{'them' if mtp > 1 else 'it'} out)",)
    if config.get("quantization_config"):
        notes += ("quantization_config: the released weights' format, not the training precision, which the run's "
                  "flags choose (16 bits, or FP8 under --fp8-format)",)
    return model, architecture, notes


def _gpt2(config, path):
    """GPT2Config: n_embd, n_head, n_layer, n_positions; n_inner (None: 4h); LayerNorm, GeLU,
    biases, learned positions, output tied to the embedding (GPT2LMHeadModel ties always);
    attn_pdrop on the probabilities, resid_pdrop and embd_pdrop on the hidden states."""
    model = _dims(config, path, "n_head", "n_embd", "n_layer", "n_positions")
    act = config.get("activation_function", "gelu_new")
    if not str(act).startswith("gelu"):
        raise SpecError(f"{path}: activation_function {act!r}: actmem models gelu for gpt2")
    hidden = _probability(config, path, "resid_pdrop", 0.1)
    embedding = _probability(config, path, "embd_pdrop", 0.1)
    if hidden != embedding:
        raise SpecError(f"{path}: resid_pdrop ({hidden}) and embd_pdrop ({embedding}) differ; actmem "
                        "has one hidden dropout")
    architecture = dict(ffn_hidden=_optional_int(config, path, "n_inner"), activation="gelu",
                        normalization="layernorm", bias=True,
                        tied_output=_switch(config, path, "tie_word_embeddings", True), position_embedding="learned",
                        attention_dropout=_probability(config, path, "attn_pdrop", 0.1), hidden_dropout=hidden)
    return model, architecture, _seq_note(config, "n_positions")


def _gpt_neox(config, path):
    """GPTNeoXConfig: LayerNorm, GeLU MLP of intermediate_size, biases (attention_bias), rope
    on rotary_pct of each head (the same tensors), untied by default. Its parallel residual
    (use_parallel_residual, on by default) is not Megatron-Core's sequential layer: refused."""
    if _switch(config, path, "use_parallel_residual", True):
        raise SpecError(f"{path}: use_parallel_residual: attention and MLP side by side keep different "
                        "tensors from Megatron-Core's sequential layer, and actmem does not model them yet")
    act = config.get("hidden_act", "gelu")
    if not str(act).startswith("gelu"):
        raise SpecError(f"{path}: hidden_act {act!r}: actmem models gelu for gpt_neox")
    model = _dims(config, path, "num_attention_heads", "hidden_size", "num_hidden_layers",
                  "max_position_embeddings")
    if not _switch(config, path, "attention_bias", True):
        raise SpecError(f"{path}: attention_bias false leaves the MLP's biases on; actmem models biases "
                        "on all the linear layers, none, or on the QKV linear only")
    architecture = dict(ffn_hidden=_need(config, path, "intermediate_size"), activation="gelu",
                        normalization="layernorm", bias=True,
                        tied_output=_switch(config, path, "tie_word_embeddings", False), position_embedding="rope",
                        attention_dropout=_probability(config, path, "attention_dropout", 0.0),
                        hidden_dropout=_probability(config, path, "hidden_dropout", 0.0))
    return model, architecture, _seq_note(config, "max_position_embeddings")
