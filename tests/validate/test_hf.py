"""The hf backend: transformers' own LlamaForCausalLM, Qwen3ForCausalLM, GPT2LMHeadModel,
MixtralForCausalLM, Qwen3MoeForCausalLM and Qwen2MoeForCausalLM, unmodified, keep what actmem's hf rows say, to the byte, eager and sdpa, at small shapes for
real and at Llama 3.1 8B's, Qwen3 8B's and the paper's 22B dims with fake tensors; a saved
tensor no rule names turns the gate red. Numbers by hand below."""

from contextlib import contextmanager, nullcontext

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from actmem_validate import hf  # noqa: E402
from actmem_validate.compare import judge  # noqa: E402
from actmem_validate.grid import HF, HF_GPT2, HF_MIXTRAL, HF_QWEN2_MOE, HF_QWEN3_MOE, configs_for, hf_presets, small_spec  # noqa: E402
from actmem_validate.launch import run_fake  # noqa: E402


def _measure(core, fake=False, **dims):
    config = configs_for(small_spec(2, 1, name="small-hf", **(HF | dict(attention_core=core))), ["none"], 1)[0]
    rows = hf.measure(config, fake=fake)
    return {r["term"]: r for r in rows}, judge(rows, 0.0)


def test_eager_keeps_an_fp32_softmax_and_fp32_norm_inputs():
    """Small shapes (h = 64, a = 8, g = 4, f = 96, s = 32, b = 2, L = 2), real tensors.
    Eager attention keeps the fp32 softmax, 4·a·s²·b = 65,536 B a layer, beside its 16-bit copy
    (32,768); each LlamaRMSNorm an fp32 copy of its input, 4sbh = 16,384 B, and no 16-bit input."""
    rows, failures = _measure("eager")
    assert failures == []
    assert rows["softmax_output_fp32"]["measured_bytes"] == 2 * 65_536
    assert rows["softmax_output"]["measured_bytes"] == 2 * 32_768
    assert rows["norm_input_fp32"]["measured_bytes"] == 2 * 2 * 16_384
    assert "attention_layernorm_input" not in rows
    assert rows["query_key"]["measured_bytes"] == 2 * 2 * 2 * 32 * 2 * 64   # q and k repeated to a heads


def test_sdpa_keeps_k_and_v_in_their_groups():
    """sdpa: is_causal with enable_gqa, SDPA's CPU flash kernel: k and v stay g = 4 groups wide,
    2 x 2sb·g·d = 2 x 2·32·2·4·8 = 8,192 B a layer; no s² tensor."""
    rows, failures = _measure("flash")
    assert failures == []
    assert rows["key"]["measured_bytes"] == rows["value"]["measured_bytes"] == 8_192
    assert not any("softmax_output" in name for name in rows)


def test_llama_8b_dims_with_fake_tensors():
    """Two layers at Llama 3.1 8B's dims (s = 8192, b = 1): sdpa keeps k, v g = 8 groups wide,
    2 x 2·8192·8·128 = 33,554,432 B a layer, and no mask (the fake-tensor shims answer as a
    real run); eager keeps the fp32 softmax, 4·32·8192² = 8,589,934,592 B a layer."""
    eager, sdpa, *_ = hf_presets()
    rows = run_fake([eager, sdpa])
    assert judge(rows, 0.0) == []
    by = {(r["config"], r["term"]): r["measured_bytes"] for r in rows}
    assert by[(sdpa.label, "key")] == by[(sdpa.label, "value")] == 33_554_432
    assert by[(eager.label, "softmax_output_fp32")] == 2 * 8_589_934_592
    assert (sdpa.label, "unattributed") not in by


def test_a_tensor_no_rule_names_turns_the_gate_red(monkeypatch):
    """Without the rule for silu's output, the tensor lands in 'unattributed': red."""
    monkeypatch.setattr(hf, "RULES", tuple(rule for rule in hf.RULES if rule[3] != "silu_output"))
    rows, failures = _measure("flash")
    assert rows["unattributed"]["gate"] == "fail" and rows["silu_output"]["gate"] == "fail"
    assert any("unattributed" in line for line in failures)


def test_a_tensor_the_formula_lacks_turns_the_gate_red(monkeypatch):
    """Were actmem to forget the fp32 softmax, the measured one fails against a formula of 0."""
    with _forgetting(monkeypatch, "LlamaForCausalLM", "softmax_fp32"):
        rows, failures = _measure("eager")
    assert rows["softmax_output_fp32"]["formula_bytes"] == 0 and rows["softmax_output_fp32"]["gate"] == "fail"


@contextmanager
def _forgetting(monkeypatch, model_class: str, kept: str):
    """actmem's hf code with one model class no longer keeping ``kept``."""
    from dataclasses import replace

    from actmem.memory import engine
    from actmem.model import implementation

    code = implementation.IMPLEMENTATIONS["hf"]
    models = tuple(replace(model, keeps=model.keeps - {kept}) if model.name == model_class else model
                   for model in code.models)
    monkeypatch.setitem(implementation.IMPLEMENTATIONS, "hf", replace(code, models=models))
    engine.term_bytes.cache_clear()
    try:
        yield
    finally:
        engine.term_bytes.cache_clear()


def _checkpointed(core, model="small-hf", **architecture):
    spec = small_spec(2, 1, name=model, **(HF | dict(attention_core=core) | architecture))
    rows = hf.measure(configs_for(spec, ["full"], 1)[0])
    return {r["term"]: r["measured_bytes"] for r in rows}, judge(rows, 0.0)


def test_checkpointed_layers_keep_their_input_and_their_call_arguments():
    """The Trainer's activation checkpointing over transformers' own Llama (small shapes: h = 64, s = 32, b = 2,
    d = 8, L = 2, eager): nothing of the layers but each one's input, 2sbh = 8,192 B; and, held by every
    checkpoint's closure (read off the partial the harness is handed), the rotary tables 2 x 2sd = 1,024 B, the
    int64 position ids 8s = 256 B and the eager core's 16-bit mask 2bs² = 4,096 B."""
    rows, failures = _checkpointed("eager")
    assert failures == []
    assert rows["layer_input_checkpoint"] == 2 * 8_192
    assert (rows["rotary_tables"], rows["checkpoint_position_ids"], rows["checkpoint_causal_mask"]) == (1_024, 256, 4_096)
    assert not {"query", "softmax_output_fp32", "fc1_input", "norm_input_fp32"} & set(rows)


def test_checkpoint_arguments_unnamed_or_uncounted_turn_the_gate_red(monkeypatch):
    """Without the harness naming what each checkpoint is handed, the layer inputs are unattributed and the
    closure's position ids go unmeasured: the forward leaves 256 B alive that no saved tensor the ledger filed
    holds; were actmem to forget the call's arguments, the measured ones have no formula. Each is red."""
    monkeypatch.setattr(hf, "_naming_checkpoint_arguments", lambda model: None)
    rows, failures = _checkpointed("flash")
    assert rows["unattributed"] == 2 * 8_192 and rows["checkpoint_position_ids"] == 0
    assert any("held_at_forward_end" in line and "leaves 182,788 B alive" in line for line in failures)
    monkeypatch.undo()
    from dataclasses import replace

    from actmem.memory import engine
    from actmem.model import implementation

    code = implementation.IMPLEMENTATIONS["hf"]
    monkeypatch.setitem(implementation.IMPLEMENTATIONS, "hf", replace(code, keeps=code.keeps - {"layer_call_arguments"}))
    engine.term_bytes.cache_clear()
    try:
        rows, failures = _checkpointed("eager")
    finally:
        engine.term_bytes.cache_clear()
    assert rows["checkpoint_causal_mask"] == 4_096 and any("checkpoint_causal_mask" in line for line in failures)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_mistral_keeps_what_llama_keeps(monkeypatch, recompute):
    """A Mistral config without a sliding window is priced as LlamaForCausalLM (modular_mistral.py: its classes
    are Llama's, the attention handed sliding_window None): MistralForCausalLM itself, built at the small Llama
    spec's dims and measured with Llama's rules, is 0 B off that spec's rows, checkpointed or not."""
    from transformers import MistralConfig, MistralForCausalLM

    def mistral(spec):
        model, arch = spec.model, spec.architecture
        return MistralForCausalLM(MistralConfig(
            vocab_size=model.vocab, hidden_size=model.hidden, intermediate_size=arch.ffn(model.hidden),
            num_hidden_layers=model.layers, num_attention_heads=model.heads,
            num_key_value_heads=arch.query_groups_or(model.heads), head_dim=arch.head_dim_or(model.hidden, model.heads),
            max_position_embeddings=model.seq_len, sliding_window=None, use_cache=False, attention_dropout=0.0,
            attn_implementation="sdpa"))

    monkeypatch.setattr(hf, "_model", mistral)
    spec = small_spec(2, 1, name="small-hf", **(HF | dict(attention_core="flash")))
    model = hf.build_model(spec)
    assert type(model).__name__ == "MistralForCausalLM"
    rows = hf.measure(configs_for(spec, [recompute], 1)[0])
    assert judge(rows, 0.0) == [] and not any(row["term"] == "unattributed" for row in rows)


def _qwen3(core):
    spec = small_spec(2, 1, name="small-hf-qwen3", qk_norm=True, **(HF | dict(attention_core=core)))
    rows = hf.measure(configs_for(spec, ["none"], 1)[0])
    return {r["term"]: r for r in rows}, judge(rows, 0.0)


@pytest.mark.parametrize("core", ["eager", "flash"])
def test_qwen3_q_and_k_norms_keep_fp32_copies_not_the_projections(core):
    """Qwen3ForCausalLM at small shapes (a = 8, g = 4, d = 8, s = 32, b = 2, L = 2): q_norm and
    k_norm keep an fp32 copy of q and k, 4sb·(a + g)d = 4·32·2·12·8 = 24,576 B a layer, the
    16-bit normalized tensors, 12,288 B, and the fp32 rsqrt, 4sb·(a + g) = 3,072 B; nothing
    keeps q_proj's or k_proj's 16-bit outputs (the gate would find them unattributed)."""
    rows, failures = _qwen3(core)
    assert failures == []
    assert rows["qk_norm_input_fp32"]["measured_bytes"] == 2 * 24_576
    assert rows["qk_norm_normalized"]["measured_bytes"] == 2 * 12_288
    assert rows["qk_norm_statistics"]["measured_bytes"] == 2 * 3_072
    assert "unattributed" not in rows


def test_qwen3_8b_dims_with_fake_tensors():
    """Two layers at Qwen3 8B's dims (s = 4096, b = 1, a = 32, g = 8, d = 128): the q and k
    norms' fp32 copies, 4·4096·40·128 = 83,886,080 B a layer."""
    configs = [config for config in hf_presets() if config.spec.name.startswith("qwen3-8b")]
    rows = run_fake(configs)
    assert len(configs) == 2 and judge(rows, 0.0) == []
    assert {r["measured_bytes"] for r in rows if r["term"] == "qk_norm_input_fp32"} == {2 * 83_886_080}


def test_qwen3_without_its_norm_rules_turns_the_gate_red(monkeypatch):
    """The rules forget q_norm's fp32 copy: it lands in 'unattributed', and the formula's row is
    measured as nothing."""
    monkeypatch.setattr(hf, "QWEN3_RULES", tuple(rule for rule in hf.QWEN3_RULES if rule[3] != "qk_norm_input_fp32"))
    rows, failures = _qwen3("flash")
    assert rows["unattributed"]["gate"] == "fail" and rows["qk_norm_input_fp32"]["gate"] == "fail"
    assert failures


# GPT2LMHeadModel at small shapes: h = 64, a = 8, s = 32, f = 4h = 256, L = 2, v = 512, dropout
# 0.1 (none on the attention under sdpa). One (s, b, h) 16-bit tensor is 2·32·b·64 = 4,096b B.


def _gpt2(core, b, fake=False):
    config = configs_for(small_spec(2, 1, name="small-hf-gpt2", b=b, **HF_GPT2[core]), ["none"], 1)[0]
    rows = hf.measure(config, fake=fake)
    return {r["term"]: r for r in rows}, judge(rows, 0.0)


def test_gpt2_eager_keeps_the_paper_layer_and_gelu_new_intermediates():
    """b = 2: q and k copied by matmul's reshape, 2 x 4,096·2 B a layer; the softmax and the
    dropout output 2·a·s²·b = 32,768 B each and a 1-byte mask of 16,384 B (native_dropout, as on
    a GPU); gelu_new's three f-wide tensors beside its input, 3 x 2·32·2·256 = 98,304 B; the two
    LayerNorms' mean and rstd, 2 x 2 x 4 B x sb = 1,024 B a layer in fp32, measured at the CPU's
    16 bits: 512 B a layer."""
    rows, failures = _gpt2("eager", 2)
    assert failures == []
    assert rows["query_key"]["measured_bytes"] == 2 * 16_384
    assert rows["softmax_output"]["measured_bytes"] == rows["softmax_dropout_output"]["measured_bytes"] == 2 * 32_768
    assert rows["softmax_dropout_mask"]["measured_bytes"] == 2 * 16_384
    assert rows["gelu_tanh_intermediates"]["measured_bytes"] == 2 * 98_304
    for norm in ("attention", "mlp"):         # 256 B a layer each
        stats = next(row for name, row in rows.items() if name.startswith(f"{norm}_norm_statistics ("))
        assert stats["measured_bytes"] == 2 * 256 and "16-bit on a CPU" in stats["term"]


@pytest.mark.parametrize("core, joint", [("eager", "query_key+value"), ("flash", "query+key+value")])
def test_gpt2_keeps_q_k_v_as_views_of_one_qkv_output(core, joint):
    """sdpa at any b, and eager at b = 1 (the reshape in matmul is a view there), keep q, k, v
    as views of c_attn's one output: one storage of 6sbh = 6·32·64 = 12,288 B a layer at b = 1,
    checked against the terms' sum."""
    rows, failures = _gpt2(core, 1)
    assert failures == []
    assert rows[joint]["measured_bytes"] == rows[joint]["formula_bytes"] == 2 * 12_288
    assert not {"query_key", "value", "query", "key"} & set(rows)


def test_gpt2_at_the_paper_22b_dims_with_fake_tensors():
    """Two layers of GPT2LMHeadModel at 22B's dims (h = 6144, a = 64, s = 2048, b = 1, f = 4h):
    eager keeps the softmax, 2·64·2048² = 536,870,912 B a layer, a 1-byte mask of 268,435,456 B,
    and gelu_new's 3 x 2·2048·24,576 = 301,989,888 B; sdpa's one QKV storage is 6·2048·6144 =
    75,497,472 B a layer."""
    eager, sdpa = (config for config in hf_presets() if config.spec.name.startswith("22b"))
    rows = run_fake([eager, sdpa])
    assert judge(rows, 0.0) == []
    by = {(r["config"], r["term"]): r["measured_bytes"] for r in rows}
    assert by[(eager.label, "softmax_output")] == 2 * 536_870_912
    assert by[(eager.label, "softmax_dropout_mask")] == 2 * 268_435_456
    assert by[(eager.label, "gelu_tanh_intermediates")] == 2 * 301_989_888
    assert by[(sdpa.label, "query+key+value")] == 2 * 75_497_472


def test_a_cpu_dropout_would_turn_the_gate_red(monkeypatch):
    """Without sending dropout to native_dropout, a CPU multiplies by a 16-bit noise tensor and
    keeps that: no mask is found where the formula has one, and the noise, 2 B an element, is
    unattributed (at least the two layers' softmax noise, 2 x 2·a·s²·b = 65,536 B): red."""
    monkeypatch.setattr(hf, "_dropout_as_on_a_gpu", nullcontext)
    rows, failures = _gpt2("eager", 2)
    assert rows["softmax_dropout_mask"]["measured_bytes"] == 0 and rows["softmax_dropout_mask"]["gate"] == "fail"
    assert rows["mlp_dropout_mask"]["gate"] == "fail"
    assert rows["unattributed"]["gate"] == "fail" and rows["unattributed"]["measured_bytes"] >= 65_536


def test_norm_statistics_at_the_formula_fp32_width_fail_on_a_cpu(monkeypatch):
    """Checked at the formula's fp32 bytes, the CPU's 16-bit statistics are half: red. The
    width is named, not hidden."""
    monkeypatch.setattr(hf, "CPU_WIDTHS", {})
    rows, failures = _gpt2("eager", 2)
    for stats in ("attention_norm_statistics", "mlp_norm_statistics"):
        assert rows[stats]["measured_bytes"] * 2 == rows[stats]["formula_bytes"]
        assert rows[stats]["gate"] == "fail"


def test_one_storage_named_as_one_term_turns_the_gate_red(monkeypatch):
    """Without the joint name, b = 1's one QKV storage lands under query_key (6sbh against its
    4sbh) and value is missing: both fail."""
    rules = hf.gpt2_rules
    monkeypatch.setattr(hf, "gpt2_rules", lambda core: tuple(rule for rule in rules(core) if "+" not in rule[3]))
    rows, failures = _gpt2("eager", 1)
    assert rows["query_key"]["gate"] == "fail" and rows["value"]["gate"] == "fail"


def test_gpt2_formula_forgetting_gelu_new_turns_the_gate_red(monkeypatch):
    with _forgetting(monkeypatch, "GPT2LMHeadModel", "gelu_tanh_intermediates"):
        rows, failures = _gpt2("eager", 2)
    assert rows["gelu_tanh_intermediates"]["formula_bytes"] == 0
    assert rows["gelu_tanh_intermediates"]["gate"] == "fail"


# MixtralForCausalLM and Qwen3MoeForCausalLM at small shapes (h = 64, E = 8, k = 2, f_e = 48, s = 32,
# b = 2, L = 2): N = 64 tokens, N·k = 128 routed copies, their experts run by grouped_mm.


def _moe(extra, fake=False):
    config = configs_for(small_spec(2, 1, name="small-hf-moe", **(HF | extra)), ["none"], 1)[0]
    rows = hf.measure(config, fake=fake)
    return {r["term"]: r for r in rows}, judge(rows, 0.0)


@pytest.mark.parametrize("core", ["flash", "eager"])
@pytest.mark.parametrize("extra, weight_bytes", [(HF_MIXTRAL, 4), (HF_QWEN3_MOE, 2)])
def test_the_sparse_moe_block_keeps_its_rows_to_the_byte(extra, weight_bytes, core):
    """A layer: the gate_up output 4·128·48 = 24,576 B, the gathered rows 2·128·64 = 16,384, the three
    int64 permutations 8·128 = 1,024 each, the int32 offsets 4·8 = 32, the router's fp32 softmax
    4·64·8 = 2,048, the division's copy of the fp32 top-k values 4·128 = 512 and their sum 4·64 = 256;
    the routing weights 128·4 = 512 (Mixtral: fp32) or 128·2 = 256 (Qwen3-MoE: 16-bit)."""
    rows, failures = _moe(extra | dict(attention_core=core))
    assert failures == [] and "unattributed" not in rows
    measured = {name: row["measured_bytes"] for name, row in rows.items()}
    assert measured["experts_gate_up_output"] == 2 * 24_576 and measured["experts_gathered_input"] == 2 * 16_384
    assert measured["experts_token_indices"] == measured["experts_sort_permutation"] \
        == measured["experts_inverse_permutation"] == 2 * 1_024
    assert measured["experts_offsets"] == 2 * 32 and measured["gate_softmax_fp32"] == 2 * 2_048
    assert measured["gate_topk_values_fp32"] == 2 * 512 and measured["gate_topk_sum"] == 2 * 256
    assert measured["experts_routing_weights"] == 2 * 128 * weight_bytes


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_qwen2_moe_s_gated_shared_expert_keeps_its_rows_to_the_byte(pre_softmax):
    """Qwen2MoeForCausalLM, a shared expert of f_s = 40 gated by sigmoid(shared_expert_gate(x)), N = 64 tokens a
    layer: gate_proj's and up_proj's outputs 2·2·64·40 = 10,240 B, silu's output and the product 5,120 each, the
    gate's sigmoid 2·64 = 128 and the output it scales 2·64·64 = 8,192; two layers; the router and experts as
    Qwen3-MoE's, with and without norm_topk_prob; nothing unattributed."""
    rows, failures = _moe(HF_QWEN2_MOE | dict(moe_pre_softmax=pre_softmax))
    assert failures == [] and "unattributed" not in rows
    measured = {name: row["measured_bytes"] for name, row in rows.items() if name.startswith("shared_experts_")}
    assert measured == {"shared_experts_swiglu_input": 2 * 10_240, "shared_experts_silu_output": 2 * 5_120,
                        "shared_experts_fc2_input": 2 * 5_120, "shared_experts_gate_score": 2 * 128,
                        "shared_experts_output": 2 * 8_192}


def test_qwen3_moe_without_norm_topk_prob_keeps_no_division():
    """norm_topk_prob false (--moe-router-pre-softmax): no in-place division, so no copy of the values
    and no sum is kept, and the gate finds nothing unattributed."""
    rows, failures = _moe(HF_QWEN3_MOE | dict(moe_pre_softmax=True))
    assert failures == []
    assert not {"gate_topk_values_fp32", "gate_topk_sum", "unattributed"} & set(rows)


def test_mixtral_and_qwen3_moe_at_full_dims_with_fake_tensors():
    """Two layers at Mixtral 8x7B's dims (s = 4096, k = 2, f_e = 14,336): the gate_up output
    4·4096·2·14,336 = 469,762,048 B a layer; at Qwen3-30B-A3B's (k = 8, f_e = 768, E = 128):
    4·4096·8·768 = 100,663,296 B a layer, the fp32 softmax 4·4096·128 = 2,097,152."""
    mixtral, qwen3_moe = (config for config in hf_presets() if config.spec.architecture.moe)
    rows = run_fake([mixtral, qwen3_moe])
    assert judge(rows, 0.0) == []
    by = {(r["config"], r["term"]): r["measured_bytes"] for r in rows}
    assert by[(mixtral.label, "experts_gate_up_output")] == 2 * 469_762_048
    assert by[(qwen3_moe.label, "experts_gate_up_output")] == 2 * 100_663_296
    assert by[(qwen3_moe.label, "gate_softmax_fp32")] == 2 * 2_097_152
    assert (mixtral.label, "unattributed") not in by


def test_mixtral_weights_counted_in_16_bits_turn_the_gate_red(monkeypatch):
    """Were actmem to count Mixtral's routing weights at 16 bits, the measured fp32 ones are twice it: red."""
    with _forgetting(monkeypatch, "MixtralForCausalLM", "fp32_routing_weights"):
        rows, failures = _moe(HF_MIXTRAL)
    row = rows["experts_routing_weights"]
    assert row["measured_bytes"] == 2 * row["formula_bytes"] and row["gate"] == "fail"


def test_an_expert_tensor_named_as_the_dense_mlp_turns_the_gate_red(monkeypatch):
    """Without the experts' silu rule, the dense rule names the storage silu_output, a row a MoE layer
    does not have: measured but not in the formula, red (and the experts' own row measured as nothing)."""
    monkeypatch.setattr(hf, "EXPERT_RULES", tuple(rule for rule in hf.EXPERT_RULES if rule[3] != "experts_silu_output"))
    rows, failures = _moe(HF_QWEN3_MOE)
    assert rows["silu_output"]["formula_bytes"] == 0 and rows["silu_output"]["gate"] == "fail"
    assert rows["experts_silu_output"]["measured_bytes"] == 0 and rows["experts_silu_output"]["gate"] == "fail"


def test_an_unnamed_permutation_turns_the_gate_red(monkeypatch):
    """Without the rule for the inverse permutation, it lands in 'unattributed': red."""
    monkeypatch.setattr(hf, "EXPERT_RULES", tuple(rule for rule in hf.EXPERT_RULES
                                                  if rule[3] != "experts_inverse_permutation"))
    rows, failures = _moe(HF_MIXTRAL)
    assert rows["unattributed"]["gate"] == "fail" and rows["unattributed"]["measured_bytes"] == 2 * 1_024


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("core", ["eager", "flash"])
@pytest.mark.parametrize("extra", [HF_MIXTRAL, HF_QWEN3_MOE], ids=["mixtral", "qwen3-moe"])
def test_on_a_gpu_the_cuda_kernels_keep_the_same_bytes(extra, core):
    """On a GPU the experts run grouped_mm's CUDA kernel and histc over int ids, the eager core CUDA's bmm
    and softmax, sdpa cuDNN's attention (q, k, v, its output and log-sum-exp, and its 16-byte philox state):
    every row as on the CPU, 0 B off, nothing unattributed (small shapes, real tensors)."""
    config = configs_for(small_spec(2, 1, name="small-hf-moe", **(HF | extra | dict(attention_core=core))),
                         ["none"], 1)[0]
    rows = hf.measure(config, device="cuda")
    assert judge(rows, 0.0) == [] and "unattributed" not in {row["term"] for row in rows}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_every_hf_preset_keeps_the_formula_bytes():
    """hf_presets' two layers (Llama 3.1 8B and Qwen3 8B eager and sdpa, GPT-2 at 22B's dims with dropout,
    Mixtral 8x7B and Qwen3-30B-A3B), real tensors and real routing on the GPU: 0 B off on every row, the
    norms' statistics at the GPU's fp32 and dropout's masks bool."""
    for config in hf_presets():
        assert judge(hf.measure(config, device="cuda"), 0.0) == [], config.label
