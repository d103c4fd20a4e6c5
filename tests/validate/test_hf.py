"""The hf backend: transformers' own LlamaForCausalLM, unmodified, keeps what actmem's hf rows
say, to the byte, eager and sdpa, at small shapes for real and at Llama 3.1 8B's dims with
fake tensors; a saved tensor no rule names turns the gate red. Numbers by hand below."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from actmem_validate import hf  # noqa: E402
from actmem_validate.compare import judge  # noqa: E402
from actmem_validate.grid import HF, configs_for, hf_presets, small_spec  # noqa: E402
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
    assert rows["key_value"]["measured_bytes"] == 2 * 8_192
    assert not any("softmax_output" in name for name in rows)


def test_llama_8b_dims_with_fake_tensors():
    """Two layers at Llama 3.1 8B's dims (s = 8192, b = 1): sdpa keeps k, v g = 8 groups wide,
    2 x 2·8192·8·128 = 33,554,432 B a layer, and no mask (the fake-tensor shims answer as a
    real run); eager keeps the fp32 softmax, 4·32·8192² = 8,589,934,592 B a layer."""
    eager, sdpa = hf_presets()
    rows = run_fake([eager, sdpa])
    assert judge(rows, 0.0) == []
    by = {(r["config"], r["term"]): r["measured_bytes"] for r in rows}
    assert by[(sdpa.label, "key_value")] == 2 * 33_554_432
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
    from dataclasses import replace

    from actmem import engine, implementation

    code = implementation.IMPLEMENTATIONS["hf"]
    monkeypatch.setitem(implementation.IMPLEMENTATIONS, "hf", replace(code, keeps=code.keeps - {"softmax_fp32"}))
    engine.term_bytes.cache_clear()
    try:
        rows, failures = _measure("eager")
    finally:
        engine.term_bytes.cache_clear()
    assert rows["softmax_output_fp32"]["formula_bytes"] == 0 and rows["softmax_output_fp32"]["gate"] == "fail"
