"""Measure the hf implementation: transformers' own LlamaForCausalLM, unmodified, built from a
config with random weights, one microbatch forward (labels given, so the loss runs as a
trainer runs it) on one device.

transformers' code cannot carry the harness's labels, so each saved tensor is named after
the term of actmem's table by the module that was running and the aten op that made or
consumed it: ``RULES`` below, data read off modeling_llama.py (5.23.0). A dispatch mode
applies them as the ops run; the ledger then files every saved storage under its name, and
whatever no rule names is 'unattributed', which fails the gate.
"""

from contextlib import contextmanager, nullcontext

import torch

from actmem.estimate import estimate
from actmem_validate.compare import INDEX_BYTES, STATISTIC_BYTES, term_rows
from actmem_validate.ledger import Ledger
from actmem_validate.naming import naming
from actmem_validate.torch_compat import fake_tensor_mode

TRANSFORMERS_VERSION = "5.23.0"
_NORMS = ("input_layernorm", "post_attention_layernorm")

#: Read off modeling_llama.py and loss_utils.py (5.23.0), in actmem_validate.naming's form:
#: (module name ends with, aten op, which of its tensors, term). The first name a storage
#: gets sticks: the norm's output is named by the linear that keeps it, the softmax's 16-bit
#: copy before ·V sees it again.
RULES = (
    # LlamaRMSNorm.forward: x.to(float32) kept by pow and the mul by rsqrt; rsqrt's result;
    # the 16-bit normalized tensor kept by weight * x
    *((norm, "_to_copy.default", "out:float32", "norm_input_fp32") for norm in _NORMS),
    *((norm, "rsqrt.default", "out", "norm_statistics") for norm in _NORMS),
    *((norm, "_to_copy.default", "out:bfloat16", "norm_normalized") for norm in _NORMS),
    ("model.norm", "_to_copy.default", "out:float32", "final_norm_input_fp32"),
    ("model.norm", "rsqrt.default", "out", "final_norm_statistics"),
    ("model.norm", "_to_copy.default", "out:bfloat16", "final_norm_normalized"),
    # the linears keep their inputs; gate_proj and up_proj their outputs too (silu and the product)
    *((proj, op, "in", "qkv_input") for proj in ("q_proj", "k_proj", "v_proj") for op in ("mm.default", "addmm.default")),
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
    ("self_attn", "_scaled_dot_product_flash_attention_for_cpu.default", 1, "key_value"),
    ("self_attn", "_scaled_dot_product_flash_attention_for_cpu.default", 2, "key_value"),
    ("self_attn", "_scaled_dot_product_flash_attention_for_cpu.default", "out0", "projection_input"),
    ("self_attn", "_scaled_dot_product_flash_attention_for_cpu.default", "out1", "softmax_lse"),
    # LlamaRotaryEmbedding: cos and sin, made once a forward, kept by every layer's rotation
    ("rotary_emb", "_to_copy.default", "out:bfloat16", "rotary_tables"),
    # the embedding keeps its int64 token ids; the loss (ForCausalLMLoss) its fp32 log-softmax
    # and its shifted int64 targets
    ("embed_tokens", "embedding.default", 1, "token_ids"),
    ("", "_log_softmax.default", "out", "logits_fp32"),
    ("", "nll_loss_forward.default", 1, "cross_entropy_targets"),
    ("", "nll_loss_forward.default", "out1", "cross_entropy_total_weight"),
)



def build_model(spec):
    """LlamaForCausalLM as the spec describes it, bf16, training mode, no KV cache."""
    try:
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        raise ImportError("the hf backend runs Hugging Face transformers: pip install 'actmem[hf]' "
                          f"(transformers=={TRANSFORMERS_VERSION})") from None
    if transformers.__version__ != TRANSFORMERS_VERSION:
        raise ImportError(f"the hf backend's rules are read off transformers {TRANSFORMERS_VERSION}; "
                          f"this is {transformers.__version__}: pip install 'actmem[hf]'")

    model, arch = spec.model, spec.architecture
    config = LlamaConfig(
        vocab_size=model.vocab, hidden_size=model.hidden, intermediate_size=arch.ffn(model.hidden),
        num_hidden_layers=model.layers, num_attention_heads=model.heads,
        num_key_value_heads=arch.query_groups_or(model.heads), head_dim=arch.head_dim_or(model.hidden, model.heads),
        max_position_embeddings=model.seq_len, attention_bias=arch.has_qkv_bias, mlp_bias=False,
        tie_word_embeddings=arch.tied_output, use_cache=False, attention_dropout=0.0,
        attn_implementation="eager" if arch.attention_core == "eager" else "sdpa")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)        # made in bf16: fake parameters cannot be cast
    try:
        return LlamaForCausalLM(config).train()
    finally:
        torch.set_default_dtype(default)


def measure(config, rank: int = 0, device: str = "cpu", fake: bool = False) -> list[dict]:
    """Saved bytes by term of one microbatch through the whole model, against actmem."""
    spec = config.spec
    if device != "cpu":          # validate refuses it in one line first (cli._check_backends)
        raise NotImplementedError("the hf backend runs on the CPU only so far")
    torch.manual_seed(1234)
    with fake_tensor_mode() if fake else nullcontext(), _masks_as_in_a_real_run() if fake else nullcontext():
        model = build_model(spec)
        tokens = torch.randint(0, spec.model.vocab, (spec.run.micro_batch, spec.model.seq_len))
        ledger = Ledger([*model.parameters(), *model.buffers()])
        with ledger.recording(), naming(model, RULES):
            loss = model(input_ids=tokens, labels=tokens).loss
        measured = ledger.by_term()
        loss.backward()
    return _compare(config, rank, measured)


@contextmanager
def _masks_as_in_a_real_run():
    """The shims for fake tensors, and the only ones. transformers' masking_utils reads the
    data to decide whether sdpa may run with is_causal and no mask; a fake tensor has no data,
    so it stops at its tracing checks (import_utils.is_tracing counts a FakeTensor) and builds
    the mask, which would make sdpa keep it and k, v repeated to a heads. Here both decisions
    answer as a real run of these inputs does: find_packed_sequence_indices finds no packing
    (the position ids are 0..s-1), and _ignore_causal_mask_sdpa skips the mask (no padding, as
    many queries as keys)."""
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


def _compare(config, rank: int, measured: dict) -> list[dict]:
    """A row a term of the estimate (one microbatch, every layer: p = 1) and a residual (int64
    token ids and shifted targets; the loss's fp32 total weight), against the ledger's."""
    spec = config.spec
    s, b = spec.model.seq_len, spec.run.micro_batch
    # the shifted targets: pad(labels, (0, 1))[..., 1:].contiguous() copies (b, s), except at
    # b = 1, where the slice is already contiguous and keeps the padded (1, s + 1) storage
    targets = s * b if b > 1 else s + 1
    residuals = {"token_ids": s * b * INDEX_BYTES, "cross_entropy_targets": targets * INDEX_BYTES,
                 "cross_entropy_total_weight": STATISTIC_BYTES}
    return term_rows(config, rank, {row.term.name: row.total_bytes for row in estimate(spec).run_terms} | residuals,
                     measured)
