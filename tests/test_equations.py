"""Each composition of the term table equals the paper's closed form, symbolically."""

import pytest
import sympy

from actmem.memory import engine
from actmem.memory.pipeline import chunks_in_flight
from actmem.model.symbols import L, a, b, h, m, p, s, t, v
from actmem.model.recompute import FULL
from actmem.memory.techniques import BY_NAME, run_technique
from actmem.memory.terms import LAYER_TERMS

# Table 2 of Korthikanti et al. 2022, as printed.
TABLE_2 = {
    "none": s * b * h * (34 + 5 * a * s / h),                       # Eq 1
    "tp": s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),           # Eq 2
    "tp-sp": s * b * h * (34 / t + 5 * a * s / (h * t)),             # Eq 4
    "tp-sel": s * b * h * (10 + 24 / t),
    "tp-sp-sel": s * b * h * 34 / t,                                  # Eq 6 per layer
    "full": 2 * s * b * h,
}


def same(x, y):
    return sympy.simplify(x - y) == 0


@pytest.mark.parametrize("name", TABLE_2)
def test_table_2_row(name):
    assert same(engine.per_layer_bytes(BY_NAME[name]), TABLE_2[name])


def test_eq_4_is_eq_1_divided_by_t():
    assert same(engine.per_layer_bytes(BY_NAME["tp-sp"]), engine.per_layer_bytes(BY_NAME["none"]) / t)


def test_section_4_1_block_sums():
    """Attention 11sbh + 5as²b, MLP 19sbh, two layer norms 4sbh (section 4.1)."""
    none = BY_NAME["none"]
    size = {term.name: engine.term_bytes(term, none) for term in LAYER_TERMS}
    attention = ["qkv_input", "query_key", "softmax_output", "softmax_dropout_mask",
                 "softmax_dropout_output", "value", "projection_input", "attention_dropout_mask"]
    mlp = ["fc1_input", "gelu_input", "fc2_input", "mlp_dropout_mask"]
    norms = ["attention_layernorm_input", "mlp_layernorm_input"]
    assert same(sum(size[n] for n in attention), 11 * s * b * h + 5 * a * s**2 * b)
    assert same(sum(size[n] for n in mlp), 19 * s * b * h)
    assert same(sum(size[n] for n in norms), 4 * s * b * h)
    assert set(size) == set(attention + mlp + norms + ["layer_input_checkpoint"])


def test_tp_floor_is_10sbh():
    """What plain tensor parallelism cannot split: layer norms 4, block inputs 4, masks 2."""
    assert same(sympy.limit(engine.per_layer_bytes(BY_NAME["tp"]), t, sympy.oo), 10 * s * b * h)


def test_eq_5_first_stage_1f1b():
    eq5 = engine.per_layer_bytes(BY_NAME["tp-sp"]) * engine.layers_in_flight(interleaved=False)
    assert same(eq5, s * b * h * L / t * (34 + 5 * a * s / h))


def test_eq_6_selective_first_stage():
    eq6 = engine.per_layer_bytes(BY_NAME["tp-sp-sel"]) * engine.layers_in_flight(interleaved=False)
    assert same(eq6, 34 * s * b * h * L / t)


def test_interleave_factor():
    """Section 4.4: the interleaved schedule holds L(1 + (p-1)/(pm)) layers."""
    assert same(engine.layers_in_flight(interleaved=True), L * (1 + (p - 1) / (p * m)))
    assert chunks_in_flight(8, 3, interleaved=True) == 31   # 2(p-1) + (m-1)p warm-up + 1


def test_section_4_5_extra_terms_with_sp():
    """sbhL/t·(p/L + δ_{p=1}·4/L·(1 + v/h))."""
    tp_sp = BY_NAME["tp-sp-sel"]
    p_gt_1 = engine.extra_bytes(tp_sp, p, 0)
    p_eq_1 = engine.extra_bytes(tp_sp, 1, 1)
    paper = lambda pp, delta: s * b * h * L / t * (pp / L + delta * 4 / L * (1 + v / h))
    assert same(p_gt_1, paper(p, 0))
    assert same(p_eq_1, paper(1, 1))


def test_section_4_5_extra_terms_without_sp():
    """Derived: without SP the embedding mask (sbh a microbatch) and the inputs of the final
    layer norm and the output layer (2sbh each) are replicated; the fp32 logits stay split
    over the vocabulary (4sbv/t). So sbhp + δ_{p=1}·(4sbh + 4sbv/t)."""
    tp = BY_NAME["tp"]
    assert same(engine.extra_bytes(tp, p, 0), s * b * h * p)
    assert same(engine.extra_bytes(tp, 1, 1), s * b * h + 4 * s * b * h + 4 * s * b * v / t)


def test_full_recompute_keeps_the_layer_input_split_under_sp():
    """Section 5: 2sbh per layer; with SP the checkpointed input is already split (2sbh/t)."""
    assert same(engine.per_layer_bytes(run_technique(False, FULL)), 2 * s * b * h)
    assert same(engine.per_layer_bytes(run_technique(True, FULL)), 2 * s * b * h / t)
