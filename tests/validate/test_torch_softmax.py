"""Megatron's local core on torch's fallback softmax (fused_softmax.py, forward_torch_softmax),
measured: the harness runs its ops as Megatron's code does, autograd keeps what it keeps, and
the gate turns red both ways when the harness or the formula leaves its tensors out."""

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from actmem_validate import gpt  # noqa: E402
from actmem_validate.compare import judge  # noqa: E402
from actmem_validate.grid import FP32_SOFTMAX, configs_for, small_spec  # noqa: E402
from actmem_validate.launch import run_fake  # noqa: E402


def measured(technique="tp", **architecture):
    """Rank 0 of t = 2, b = 1, s = 32, h = 64, a = 8, two layers, fake tensors: b·a/t = 4
    attention batches, not a multiple of the kernel's 8 rows a block at s <= 128."""
    rows = run_fake(configs_for(small_spec(2, 2, b=1, **architecture), [technique], 1))
    return {row["term"]: row for row in rows}, judge(rows, 0.0, 30.0)


def test_in_16_bits_the_fallback_keeps_the_kernel_s_bytes_and_the_mask_it_made():
    """Two layers: softmax_output 2 x 2as²b/t = 2 x 2·8·32²·1/2 = 16,384 B; the causal mask,
    2 x s² = 2 x 1,024 = 2,048 B; the floor under the peak."""
    rows, failures = measured()
    assert failures == []
    assert rows["softmax_output"]["measured_bytes"] == 16_384
    assert rows["softmax_causal_mask"]["measured_bytes"] == 2_048


def test_in_fp32_the_fallback_keeps_its_fp32_output_and_the_dropout_not_the_16_bit_copy():
    """softmax_output_fp32 2 x 4as²b/t = 2 x 4·8·32²/2 = 32,768 B; with attention dropout the
    16-bit copy is kept by nothing; the dropout's output (16,384 B) as the paper counts it."""
    rows, failures = measured(**FP32_SOFTMAX)
    assert failures == []
    assert rows["softmax_output_fp32"]["measured_bytes"] == 32_768 and "softmax_output" not in rows
    assert rows["softmax_dropout_output"]["measured_bytes"] == 16_384


def test_the_fused_kernel_s_stand_in_where_megatron_falls_back_fails(monkeypatch):
    """A harness that runs the kernel where Megatron cannot keeps no mask: the formula's fails."""
    probabilities = gpt.LocalSoftmax.probabilities
    monkeypatch.setattr(gpt.LocalSoftmax, "probabilities",
                        lambda self, q, k, mask=None: probabilities(replace(self, fused=True), q, k, mask))
    rows, failures = measured()
    mask = rows["softmax_causal_mask"]
    assert mask["measured_bytes"] == 0 < mask["formula_bytes"] and mask["gate"] == "fail" and failures


def test_the_mask_missing_from_the_formula_fails(monkeypatch):
    """The engine forgets the fallback's mask: measured where the formula has none."""
    from actmem.memory import engine
    from tests.validate.test_gate import _clear_engine_caches

    term_bytes = engine.term_bytes
    monkeypatch.setattr(engine, "term_bytes", lambda term, technique, arch=None: 0
                        if term.name == "softmax_causal_mask" else term_bytes(term, technique, arch))
    _clear_engine_caches()
    try:
        rows, failures = measured()
    finally:
        monkeypatch.undo()
        _clear_engine_caches()
    mask = rows["softmax_causal_mask"]
    assert mask["measured_bytes"] > mask["formula_bytes"] == 0 and mask["gate"] == "fail" and failures


def test_paper_scale_past_the_kernel_s_4096_matches_to_the_byte():
    """The 22B at s = 8192, b = 1 (rank 0 of t = 8, fake tensors): torch's softmax, every term
    exact, its causal mask 48 x 8192² = 3,221,225,472 B, and the peak within 0.5% of the floor."""
    from actmem.sources.presets import load_preset
    from actmem.model.spec import build_spec

    preset = load_preset("22b")
    spec = build_spec(preset.model | {"seq_len": 8192}, preset.run | {"micro_batch": 1}, name="22b",
                      architecture=preset.architecture, dims_only=True)
    rows = run_fake(configs_for(spec, ["tp"]))
    assert judge(rows, 0.0, 0.5) == []
    terms = {row["term"]: row for row in rows}
    assert terms["softmax_causal_mask"]["measured_bytes"] == 48 * 8192**2 == 3_221_225_472
