"""Measure the hf implementation: transformers' own LlamaForCausalLM, Qwen3ForCausalLM or
GPT2LMHeadModel (the model class the architecture is), unmodified, built from a config with
random weights, one microbatch forward (labels given, so the loss runs as a trainer runs it)
on one device.

transformers' code cannot carry the harness's labels, so each saved tensor is named after
the term of actmem's table by the module that was running and the aten op that made or
consumed it: ``RULES``, ``QWEN3_RULES`` and ``gpt2_rules`` below, data read off
modeling_llama.py, modeling_qwen3.py and modeling_gpt2.py (5.23.0). A dispatch mode applies
them as the ops run; the ledger then files every saved storage under its name, and whatever
no rule names is 'unattributed', which fails the gate. A storage that holds several terms
(GPT-2's one QKV output, which the attention keeps as views) is named 'a+b' and compared
with the terms' sum.

Two things a CPU does differently from a GPU, and how the harness deals with each: dropout
(at::dropout runs torch.native_dropout, keeping a bool mask, only on a GPU; a CPU keeps a
16-bit noise tensor) is sent to native_dropout, the GPU's op (``_dropout_as_on_a_gpu``); and
nn.LayerNorm's mean and rstd, fp32 on a GPU, are 16-bit on a CPU, so those rows are checked
at half the formula's fp32 bytes and say so (``CPU_WIDTHS``).
"""

from contextlib import ExitStack, contextmanager, nullcontext
from fractions import Fraction

import torch

from actmem.memory.estimate import estimate
from actmem_validate.compare import CUDNN_RNG_STATE_BYTES, INDEX_BYTES, STATISTIC_BYTES, _row, term_rows
from actmem_validate.ledger import Ledger
from actmem_validate.naming import naming
from actmem_validate.torch_compat import LiveBytes, fake_tensor_mode

TRANSFORMERS_VERSION = "5.23.0"
_NORMS = ("input_layernorm", "post_attention_layernorm")
_STATISTICS = {"input_layernorm": "attention_norm_statistics", "post_attention_layernorm": "mlp_norm_statistics",
               "ln_1": "attention_norm_statistics", "ln_2": "mlp_norm_statistics"}

_LOSS = (        # ForCausalLMLoss (loss_utils.py): its fp32 log-softmax and shifted int64 targets
    ("", "_log_softmax.default", "out", "logits_fp32"),
    ("", "nll_loss_forward.default", 1, "cross_entropy_targets"),
    ("", "nll_loss_forward.default", "out1", "cross_entropy_total_weight"),
)
#: Read off modeling_llama.py and loss_utils.py (5.23.0), in actmem_validate.naming's form:
#: (trailing module names, aten op, which of its tensors, term). The first name a storage
#: gets sticks: the norm's output is named by the linear that keeps it, the softmax's 16-bit
#: copy before ·V sees it again.
def _rms_norm_rules(norm: str, copy: str, statistics: str, normalized: str) -> tuple:
    """LlamaRMSNorm.forward (and Qwen3RMSNorm, written the same): x.to(float32) kept by pow and
    the mul by rsqrt; rsqrt's result; the 16-bit normalized tensor kept by weight * x."""
    return ((norm, "_to_copy.default", "out:float32", copy), (norm, "rsqrt.default", "out", statistics),
            (norm, "_to_copy.default", "out:bfloat16", normalized))


def _cudnn_sdpa_rules(attention: str) -> tuple:
    """aten._scaled_dot_product_cudnn_attention: q, k, v, its output and fp32 log-sum-exp, and the
    philox state its backward reads (derivatives.yaml: philox_seed, philox_offset)."""
    op = "_scaled_dot_product_cudnn_attention.default"
    return ((attention, op, 0, "query"), (attention, op, 1, "key"), (attention, op, 2, "value"),
            (attention, op, "out0", "projection_input"), (attention, op, "out1", "softmax_lse"),
            (attention, op, "out", "sdpa_rng_state"))


RULES = (
    *(rule for norm in _NORMS for rule in _rms_norm_rules(norm, "norm_input_fp32", _STATISTICS[norm],
                                                          "norm_normalized")),
    *_rms_norm_rules("model.norm", "final_norm_input_fp32", "final_norm_statistics", "final_norm_normalized"),
    # the linears keep their inputs; gate_proj and up_proj their outputs too (silu and the product)
    *((proj, op, "in", "qkv_input") for proj in ("q_proj", "k_proj", "v_proj")
      for op in ("mm.default", "addmm.default")),
    ("o_proj", "mm.default", "in", "projection_input"),
    *((proj, "mm.default", "in", "fc1_input") for proj in ("gate_proj", "up_proj")),
    *((proj, "mm.default", "out", "swiglu_input") for proj in ("gate_proj", "up_proj")),
    ("act_fn", "silu.default", "out", "silu_output"),
    ("down_proj", "mm.default", "in", "fc2_input"),
    ("lm_head", "mm.default", "in", "output_layer_input"),
    # eager_attention_forward: QKᵀ keeps copies of q and of k repeated to a heads; the fp32
    # softmax and its 16-bit copy; ·V keeps the copy and v repeated (the second bmm)
    ("self_attn", "bmm.default#0", "in", "query_key"),
    ("self_attn", "_softmax.default", "out", "softmax_output_fp32"),
    ("self_attn", "_to_copy.default", "out:bfloat16", "softmax_output"),
    ("self_attn", "bmm.default#1", "in", "value"),
    # sdpa_attention_forward: SDPA's flash kernel keeps q, k, v (g groups: enable_gqa), its
    # output (the o_proj input, one storage) and the fp32 log-sum-exp
    ("self_attn", "_scaled_dot_product_flash_attention_for_cpu.default", 0, "query"),
    ("self_attn", "_scaled_dot_product_flash_attention_for_cpu.default", 1, "key"),
    ("self_attn", "_scaled_dot_product_flash_attention_for_cpu.default", 2, "value"),
    ("self_attn", "_scaled_dot_product_flash_attention_for_cpu.default", "out0", "projection_input"),
    ("self_attn", "_scaled_dot_product_flash_attention_for_cpu.default", "out1", "softmax_lse"),
    # on a GPU, the kernel sdpa chose on an H200 (torch 2.11): cuDNN's, which keeps the same and its
    # philox seed and offset (the op's other tensor outputs)
    *_cudnn_sdpa_rules("self_attn"),
    # LlamaRotaryEmbedding: cos and sin, made once a forward, kept by every layer's rotation
    ("rotary_emb", "_to_copy.default", "out:bfloat16", "rotary_tables"),
    # the embedding keeps its int64 token ids
    ("embed_tokens", "embedding.default", 1, "token_ids"),
    *_LOSS,
)


#: Read off modeling_mixtral.py, modeling_qwen3_moe.py and integrations/moe.py (5.23.0,
#: grouped_mm_experts_forward, transformers' default experts implementation): the router
#: (module 'mlp.gate') and the experts ('mlp.experts'). They come first: the experts' silu is
#: an 'act_fn' too, which the dense rule below would name otherwise.
EXPERT_RULES = (
    ("mlp.gate", "mm.default", "in", "gate_input"),
    ("mlp.gate", "_softmax.default", "out", "gate_softmax_fp32"),
    ("mlp.gate", "topk.default", "out1", "gate_topk_indices"),
    ("mlp.gate", "clone.default", "out", "gate_topk_values_fp32"),      # autograd's copy of div_'s self
    ("mlp.gate", "sum.dim_IntList", "out", "gate_topk_sum"),
    ("mlp.experts", "floor_divide.default", "out", "experts_token_indices"),         # perm // k
    ("mlp.experts", "sort.default", "out1", "experts_sort_permutation"),
    ("mlp.experts", "cumsum.default", "out", "experts_offsets"),
    ("mlp.experts", "index.Tensor#0", "out", "experts_gathered_input"),             # hidden_states[perm // k]
    ("mlp.experts", "index.Tensor#1", "out", "experts_routing_weights"),            # sample_weights[perm]
    ("mlp.experts", "_grouped_mm.default#0", "out", "experts_gate_up_output"),
    ("mlp.experts.act_fn", "silu.default", "out", "experts_silu_output"),
    ("mlp.experts", "mul.Tensor#0", "out", "experts_down_input"),                   # act_fn(gate) * up
    ("mlp.experts", "_grouped_mm.default#1", "out", "experts_down_output"),
    ("mlp.experts", "empty_like.default", "out", "experts_inverse_permutation"),    # inv_perm
)


#: Read off modeling_qwen2_moe.py (5.23.0, Qwen2MoeSparseMoeBlock.forward): the shared expert runs first, on the
#: block's input (the router's, one storage: named here, where it is first saved), an unfused SwiGLU whose
#: gate_proj and up_proj outputs are the fused kernel's one input in two; its gate's sigmoid and the product with
#: the shared expert's output, in the block itself ('mlp'). Before the dense rules, which would take gate_proj.
QWEN2_MOE_SHARED_RULES = (
    ("shared_expert.gate_proj", "mm.default", "in", "gate_input"),
    *((f"shared_expert.{proj}", "mm.default", "out", "shared_experts_swiglu_input") for proj in ("gate_proj", "up_proj")),
    ("shared_expert.act_fn", "silu.default", "out", "shared_experts_silu_output"),
    ("shared_expert.down_proj", "mm.default", "in", "shared_experts_fc2_input"),
    ("shared_expert.down_proj", "mm.default", "out", "shared_experts_output"),
    ("mlp", "sigmoid.default", "out", "shared_experts_gate_score"),
)


#: Qwen3's layer is Llama's with q_norm and k_norm (modeling_qwen3.py, Qwen3Attention.forward:
#: Qwen3RMSNorm over each head of q_proj's and k_proj's outputs, written as LlamaRMSNorm is)
QWEN3_RULES = RULES + tuple(rule for norm in ("q_norm", "k_norm") for rule in _rms_norm_rules(
    norm, "qk_norm_input_fp32", "qk_norm_statistics", "qk_norm_normalized"))


def gpt2_rules(attention_core: str) -> tuple:
    """GPT2LMHeadModel's rules, read off modeling_gpt2.py, activations.py and pytorch_utils.py
    (5.23.0). Conv1D is torch.addmm(bias, x.view(-1, h), weight): its input is argument 1."""
    # the attention keeps q, k, v as views of c_attn's one output: the views sdpa is given;
    # under eager, matmul's reshape is a view at b = 1 and a copy at b > 1 (then the copies
    # are named by the two bmm's, and the output is saved by nothing)
    qkv = "query_key+value" if attention_core == "eager" else "query+key+value"
    return (
        *((norm, "native_layer_norm.default", 0, term) for norm, term in (
            ("ln_1", "attention_layernorm_input"), ("ln_2", "mlp_layernorm_input"), ("ln_f", "final_layernorm_input"))),
        *((norm, "native_layer_norm.default", which, _STATISTICS[norm]) for norm in ("ln_1", "ln_2")
          for which in ("out1", "out2")),
        *(("ln_f", "native_layer_norm.default", which, "final_norm_statistics") for which in ("out1", "out2")),
        ("c_attn", "addmm.default", 1, "qkv_input"),
        ("c_attn", "addmm.default", "out", qkv),
        ("attn", "bmm.default#0", "in", "query_key"),
        ("attn", "_softmax.default", "out", "softmax_output"),
        ("attn", "native_dropout.default", "out0", "softmax_dropout_output"),
        ("attn", "native_dropout.default", "out1", "softmax_dropout_mask"),
        ("attn", "bmm.default#1", "in", "value"),
        ("attn", "_scaled_dot_product_flash_attention_for_cpu.default", "out0", "projection_input"),
        ("attn", "_scaled_dot_product_flash_attention_for_cpu.default", "out1", "softmax_lse"),
        *_cudnn_sdpa_rules("attn")[3:],        # q, k, v are views of c_attn's output, named above
        ("attn.c_proj", "addmm.default", 1, "projection_input"),
        ("resid_dropout", "native_dropout.default", "out1", "attention_dropout_mask"),
        ("c_fc", "addmm.default", 1, "fc1_input"),
        ("c_fc", "addmm.default", "out", "gelu_input"),
        # NewGELUActivation: 0.5 * x (the first mul), tanh's result, 1 + tanh (the second add)
        ("mlp.act", "mul.Tensor#0", "out", "gelu_tanh_intermediates"),
        ("mlp.act", "tanh.default", "out", "gelu_tanh_intermediates"),
        ("mlp.act", "add.Tensor#1", "out", "gelu_tanh_intermediates"),
        ("mlp.c_proj", "addmm.default", 1, "fc2_input"),
        ("mlp.dropout", "native_dropout.default", "out1", "mlp_dropout_mask"),
        ("transformer.drop", "native_dropout.default", "out1", "embedding_dropout_mask"),
        ("wte", "embedding.default", 1, "token_ids"),
        ("wpe", "embedding.default", 1, "position_ids"),
        ("lm_head", "mm.default", "in", "output_layer_input"),
        *_LOSS,
    )


#: rows a CPU keeps at another width than a GPU: nn.LayerNorm's mean and rstd are the input's
#: dtype on a CPU (layer_norm.cpp's CPU kernel, param_scalar_type; with fake tensors
#: torch/_refs native_layer_norm: "if input.device.type == 'cpu'", cast to input.dtype) and
#: fp32 on a GPU (layer_norm_kernel.cu: acc_type)
_HALF = (Fraction(1, 2), "16-bit on a CPU: 1/2 of the fp32 formula")
CPU_WIDTHS = dict.fromkeys(("attention_norm_statistics", "mlp_norm_statistics", "final_norm_statistics"), _HALF)


def build_model(spec):
    """The spec's model class (LlamaForCausalLM, Qwen3ForCausalLM or GPT2LMHeadModel) as it
    describes it, bf16, training mode, no KV cache."""
    try:
        import transformers
    except ImportError:
        raise ImportError("the hf backend runs Hugging Face transformers: pip install 'actmem[hf]' "
                          f"(transformers=={TRANSFORMERS_VERSION})") from None
    if transformers.__version__ != TRANSFORMERS_VERSION:
        raise ImportError(f"the hf backend's rules are read off transformers {TRANSFORMERS_VERSION}; "
                          f"this is {transformers.__version__}: pip install 'actmem[hf]'")

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)        # made in bf16: fake parameters cannot be cast
    try:
        model = _model(spec).train()
    finally:
        torch.set_default_dtype(default)
    if spec.run.recompute.value == "full":
        # the Trainer's --activation_checkpointing with no kwargs (trainer.py): every layer checkpointed alone by
        # torch's non-reentrant checkpoint (modeling_utils.py, _activation_checkpointing_enable)
        model.activation_checkpointing_enable()
    return model


def _model(spec):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, \
        Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    model, arch = spec.model, spec.architecture
    core = "eager" if arch.attention_core == "eager" else "sdpa"
    if arch.moe:
        return _moe_model(spec, core)
    if _class_name(spec) == "Qwen3ForCausalLM":       # no biases: the model class refuses them
        return Qwen3ForCausalLM(Qwen3Config(
            vocab_size=model.vocab, hidden_size=model.hidden, intermediate_size=arch.ffn(model.hidden),
            num_hidden_layers=model.layers, num_attention_heads=model.heads,
            num_key_value_heads=arch.query_groups_or(model.heads),
            head_dim=arch.head_dim_or(model.hidden, model.heads), max_position_embeddings=model.seq_len,
            attention_bias=False, tie_word_embeddings=arch.tied_output, use_cache=False, attention_dropout=0.0,
            attn_implementation=core))
    if _class_name(spec) == "Qwen2ForCausalLM":       # q, k, v biases always, none elsewhere
        return Qwen2ForCausalLM(Qwen2Config(
            vocab_size=model.vocab, hidden_size=model.hidden, intermediate_size=arch.ffn(model.hidden),
            num_hidden_layers=model.layers, num_attention_heads=model.heads,
            num_key_value_heads=arch.query_groups_or(model.heads), head_dim=arch.head_dim_or(model.hidden, model.heads),
            max_position_embeddings=model.seq_len, tie_word_embeddings=arch.tied_output, use_cache=False,
            attention_dropout=0.0, use_sliding_window=False, attn_implementation=core))
    if _is_gpt2(spec):
        return GPT2LMHeadModel(GPT2Config(
            vocab_size=model.vocab, n_positions=model.seq_len, n_embd=model.hidden, n_layer=model.layers,
            n_head=model.heads, n_inner=arch.ffn_hidden, activation_function="gelu_new",
            attn_pdrop=arch.attention_dropout, resid_pdrop=arch.hidden_dropout, embd_pdrop=arch.hidden_dropout,
            tie_word_embeddings=arch.tied_output, use_cache=False, attn_implementation=core,
            bos_token_id=None, eos_token_id=None))          # GPT-2's 50256 is outside a small vocabulary
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=model.vocab, hidden_size=model.hidden, intermediate_size=arch.ffn(model.hidden),
        num_hidden_layers=model.layers, num_attention_heads=model.heads,
        num_key_value_heads=arch.query_groups_or(model.heads), head_dim=arch.head_dim_or(model.hidden, model.heads),
        max_position_embeddings=model.seq_len, attention_bias=arch.has_qkv_bias, mlp_bias=False,
        tie_word_embeddings=arch.tied_output, use_cache=False, attention_dropout=0.0,
        attn_implementation=core))


def _moe_model(spec, core: str):
    """MixtralForCausalLM or Qwen3MoeForCausalLM as the spec describes it: no aux loss
    (output_router_logits false), no router jitter, no sliding window, the experts run by
    transformers' default implementation (grouped_mm), every layer sparse."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, \
        Qwen3MoeForCausalLM

    model, arch = spec.model, spec.architecture
    common = dict(vocab_size=model.vocab, hidden_size=model.hidden, num_hidden_layers=model.layers,
                  num_attention_heads=model.heads, num_key_value_heads=arch.query_groups_or(model.heads),
                  head_dim=arch.head_dim_or(model.hidden, model.heads), max_position_embeddings=model.seq_len,
                  num_experts_per_tok=arch.moe_topk, tie_word_embeddings=arch.tied_output, use_cache=False,
                  attention_dropout=0.0, output_router_logits=False, attn_implementation=core)
    if _class_name(spec) == "MixtralForCausalLM":
        return MixtralForCausalLM(MixtralConfig(**common, intermediate_size=arch.expert_ffn(model.hidden),
                                                num_local_experts=arch.num_experts, router_jitter_noise=0.0,
                                                sliding_window=None))
    if _class_name(spec) == "Qwen2MoeForCausalLM":    # q, k, v biases; the shared expert and its gate
        return Qwen2MoeForCausalLM(Qwen2MoeConfig(
            **common, intermediate_size=arch.ffn(model.hidden), moe_intermediate_size=arch.expert_ffn(model.hidden),
            shared_expert_intermediate_size=arch.moe_shared_ffn, num_experts=arch.num_experts,
            norm_topk_prob=not arch.moe_pre_softmax, decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True,
            use_sliding_window=False))
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **common, intermediate_size=arch.ffn(model.hidden), moe_intermediate_size=arch.expert_ffn(model.hidden),
        num_experts=arch.num_experts, norm_topk_prob=not arch.moe_pre_softmax, decoder_sparse_step=1,
        mlp_only_layers=[], attention_bias=False))


def _rules(spec) -> tuple:
    """The rules of the spec's model class."""
    name = _class_name(spec)
    if name == "GPT2LMHeadModel":
        return gpt2_rules(spec.architecture.attention_core)
    rules = QWEN3_RULES if name in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM") else RULES
    shared = QWEN2_MOE_SHARED_RULES if name == "Qwen2MoeForCausalLM" else ()
    return shared + EXPERT_RULES + rules if spec.architecture.moe else rules


#: what a checkpointed layer's call is given, by the forward's parameter name: the hidden states (the
#: checkpoint's one positional input under Llama's layers; GPT-2 hands it the mask positionally too) and the
#: keywords its partial holds until the layer's backward (modeling_layers.py, forward_with_checkpointing). Any
#: other tensor is filed as checkpoint_<its name>, a term the formula lacks, which fails the gate.
CHECKPOINT_ARGUMENTS = {"hidden_states": "layer_input_checkpoint", "attention_mask": "checkpoint_causal_mask",
                        "position_ids": "checkpoint_position_ids", "position_embeddings": "rotary_tables"}


def _naming_checkpoint_arguments(model) -> None:
    """Wrap each checkpointed layer's checkpoint function (transformers' own, set by
    activation_checkpointing_enable) so that it names what the layer's call is given and files the
    keyword tensors in the ledger: torch's non-reentrant checkpoint saves only the positional ones
    (torch 2.13: _CheckpointFrame.save_inputs; 2.11: _NoopSaveInputs) and keeps the partial, keywords and all, in its recompute closure, which no
    saved-tensor hook sees. The ledger files a storage once, under its first live name (GPT-2's
    position ids are the position embedding's saved indices)."""
    import inspect

    from actmem_validate.ledger import label, record

    def naming(checkpoint):
        def checkpoint_naming(function, *args, **kwargs):
            bound = inspect.signature(function.func).bind(*function.args, *args, **function.keywords).arguments
            held = bound | bound.pop("kwargs", {})
            for name, value in held.items():
                for tensor in value if isinstance(value, tuple) else (value,):
                    if isinstance(tensor, torch.Tensor):
                        record(label(tensor, CHECKPOINT_ARGUMENTS.get(name, f"checkpoint_{name}")))
            return checkpoint(function, *args, **kwargs)
        return checkpoint_naming

    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = naming(module._gradient_checkpointing_func)


def _class_name(spec) -> str:
    return spec.architecture.code.model_class(spec.architecture).name


def _is_gpt2(spec) -> bool:
    return _class_name(spec) == "GPT2LMHeadModel"


def measure(config, rank: int = 0, device: str = "cpu", fake: bool = False) -> list[dict]:
    """Saved bytes by term of one microbatch through the whole model, against actmem."""
    spec = config.spec
    torch.manual_seed(1234)
    rules = _rules(spec)
    with ExitStack() as stack:
        if fake:
            stack.enter_context(fake_tensor_mode())
            stack.enter_context(_masks_as_in_a_real_run())
        stack.enter_context(_dropout_as_on_a_gpu())
        stack.enter_context(torch.device(device))     # the model, its tokens and what it makes, there
        model = build_model(spec)
        _naming_checkpoint_arguments(model)
        tokens = torch.randint(0, spec.model.vocab, (spec.run.micro_batch, spec.model.seq_len))
        ledger = Ledger([*model.parameters(), *model.buffers()])
        with ledger.recording(), naming(model, rules), (nullcontext() if fake else LiveBytes()) as live:
            base = live.current() if live else 0
            loss = model(input_ids=tokens, labels=tokens).loss
            held = live.current() - base if live else None
        ledger.drop_freed()
        measured = ledger.by_term()
        loss.backward()
    rows = _compare(config, rank, measured, on_a_cpu=torch.device(device).type == "cpu")
    if held is None:
        return rows
    # what the forward leaves alive, less the loss itself and with the token ids it was handed: every storage
    # the saved tensors hold, and nothing else (a checkpoint's closure freed early, or holding an unfiled tensor,
    # fails it)
    left = held - loss.untyped_storage().nbytes() + tokens.untyped_storage().nbytes()
    return rows[:-1] + [_row(config, rank, "held_at_forward_end", sum(measured.values()), left, "held")] + rows[-1:]


@contextmanager
def _dropout_as_on_a_gpu():
    """F.dropout in training with 0 < p < 1 as a GPU runs it: at::dropout calls
    torch.native_dropout (autograd keeps its bool mask, derivatives.yaml) where
    is_fused_kernel_acceptable holds, on CUDA only (Dropout.cpp); on a CPU it multiplies by a
    16-bit noise tensor and keeps that. nn.Dropout and transformers' eager attention both
    call torch.nn.functional.dropout, so this one name covers them."""
    functional = torch.nn.functional
    original = functional.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if training and 0 < p < 1 and not inplace and input.numel() > 0:
            return torch.native_dropout(input, p, True)[0]
        return original(input, p, training, inplace)

    functional.dropout = dropout
    try:
        yield
    finally:
        functional.dropout = original


@contextmanager
def _masks_as_in_a_real_run():
    """The shims for fake tensors only (dropout's, above, runs in both modes). transformers'
    masking_utils reads the data to decide whether sdpa may run with is_causal and no mask; a
    fake tensor has no data, so it stops at its tracing checks (import_utils.is_tracing counts
    a FakeTensor) and builds the mask, which would make sdpa keep it and k, v repeated to a
    heads. Here both decisions answer as a real run of these inputs does:
    find_packed_sequence_indices finds no packing (the position ids are 0..s-1), and
    _ignore_causal_mask_sdpa skips the mask (no padding, as many queries as keys)."""
    from transformers import masking_utils

    packed, decide = masking_utils.find_packed_sequence_indices, masking_utils._ignore_causal_mask_sdpa

    def skip_when_plain(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        if padding_mask is None and q_length == kv_length and local_attention_size is None:
            return True
        return decide(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size)

    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    masking_utils._ignore_causal_mask_sdpa = skip_when_plain
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices, masking_utils._ignore_causal_mask_sdpa = packed, decide


def _compare(config, rank: int, measured: dict, on_a_cpu: bool) -> list[dict]:
    """A row a term of the estimate (one microbatch, every layer: p = 1) and a residual (int64
    token ids, GPT-2's position ids and the shifted targets; the loss's fp32 total weight),
    against the ledger's; GPT-2's norm statistics at a CPU's width there, cuDNN's philox state on a GPU."""
    spec = config.spec
    s, b = spec.model.seq_len, spec.run.micro_batch
    # the shifted targets: pad(labels, (0, 1))[..., 1:].contiguous() copies (b, s), except at
    # b = 1, where the slice is already contiguous and keeps the padded (1, s + 1) storage
    targets = s * b if b > 1 else s + 1
    residuals = {"token_ids": s * b * INDEX_BYTES, "cross_entropy_targets": targets * INDEX_BYTES,
                 "cross_entropy_total_weight": STATISTIC_BYTES}
    gpt2 = _is_gpt2(spec)
    if gpt2:
        residuals["position_ids"] = s * INDEX_BYTES     # torch.arange(s).unsqueeze(0): (1, s)
    if not on_a_cpu and spec.architecture.attention_core == "flash":
        residuals["sdpa_rng_state"] = spec.model.layers * CUDNN_RNG_STATE_BYTES
    formula = {row.term.name: row.total_bytes for row in estimate(spec).run_terms}
    return term_rows(config, rank, formula | residuals, measured, CPU_WIDTHS if gpt2 and on_a_cpu else {})
