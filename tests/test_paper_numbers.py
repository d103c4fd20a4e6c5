"""Numbers a reader can check by hand from the paper."""

import sympy

from actmem.memory import engine
from actmem.model.symbols import a, b, h, s
from actmem.memory.techniques import BY_NAME
from actmem.memory.terms import LAYER_TERMS


def per_layer(out, name):
    return {row["technique"]: row for row in out["techniques"]}[name]["per_layer_bytes"]


def test_selective_recompute_saves_70_and_65_percent(actmem):
    """Section 5: (5as/h)/(34 + 5as/h) = 80/114 = 70% for GPT-3, 64/98 = 65% for MT-NLG."""
    for preset, percent in (("gpt3", 70), ("mt-nlg", 65)):
        out = actmem.json("estimate", "--model", preset)
        saved = 1 - per_layer(out, "tp-sp-sel") / per_layer(out, "tp-sp")
        assert round(100 * saved) == percent


def test_attention_overtakes_structure_near_870_for_gpt3():
    """34sbh = 5as²b at s = 34h/(5a) = 34·12288/480 = 870.4 (Figure 1 of the explainer)."""
    none = BY_NAME["none"]
    attention = sum(engine.term_bytes(term, none) for term in LAYER_TERMS if term.module_of() == "core_attn")
    structural = engine.per_layer_bytes(none) - attention
    gpt3 = {a: 96, h: 12288, b: 1}
    x = sympy.Symbol("x", positive=True)   # s as a real number: the crossing is not whole
    crossing = sympy.solve(sympy.Eq(attention.subs(gpt3).subs(s, x), structural.subs(gpt3).subs(s, x)), x)
    assert crossing == [sympy.Rational(34 * 12288, 5 * 96)]
    assert attention.subs(gpt3 | {s: 870}) < structural.subs(gpt3 | {s: 870})
    assert attention.subs(gpt3 | {s: 871}) > structural.subs(gpt3 | {s: 871})


def test_one_gpt3_layer_holds_about_2_87_gb(actmem):
    """sbh(34 + 5as/h) = 2048·12288·(34 + 80) = 2,868,903,936 bytes ≈ 2.87 GB."""
    out = actmem.json("estimate", "--model", "gpt3", "--micro-batch", "1", "--seq-len", "2048")
    assert per_layer(out, "none") == 2048 * 12288 * 114
    assert round(per_layer(out, "none") / 1e9, 2) == 2.87


def test_figure_7_ladder_for_gpt3(actmem):
    """Per layer, as a share of the t = 8 baseline sbh(10 + 24/8 + 80/8) = 23sbh:
    SP + selective 34/8/23 = 18.5% (the ~5x cut), full recompute 2/23 = 8.7%."""
    out = actmem.json("estimate", "--model", "gpt3")
    shares = {row["technique"]: row["percent_of_tp"] for row in out["techniques"]}
    assert shares["tp"] == 100
    assert shares["tp-sp-sel"] == round(100 * 4.25 / 23, 2)
    assert shares["full"] == round(100 * 2 / 23, 2)
    assert shares["tp-sp"] == round(100 * (34 / 8 + 10) / 23, 2)
    assert shares["tp-sel"] == round(100 * 13 / 23, 2)


def test_extra_terms_are_small_but_not_negligible_for_22b(actmem):
    """Section 4.5 calls the extra terms negligible. For the 22B model (p = 1, no pipeline)
    they are sbh/t·(1 + 4(1 + v/h)) = sbh/t·38.33 against Eq 5's sbh/t·48·(34 + 5·64·2048/6144):
    0.57% with no recompute, and 2.3% of Eq 6 with selective recompute."""
    out = actmem.json("estimate", "--model", "22b", "--recompute", "none")
    row = {r["technique"]: r for r in out["techniques"]}["tp-sp"]
    expected = (1 + 4 * (1 + 51200 / 6144)) / (48 * (34 + 5 * 64 * 2048 / 6144))
    assert abs(row["extra_bytes"] / row["layers_bytes"] - expected) < 1e-12
    assert 0.005 < expected < 0.006


def test_every_table_3_run_fits_an_80_gib_gpu(actmem):
    """The paper trained all four (SP + selective recompute) on 80 GB A100s."""
    for preset in ("22b", "175b", "530b", "1t"):
        assert actmem.json("estimate", "--model", preset)["fits"] is True


def test_without_the_techniques_the_models_do_not_fit(actmem):
    """Section 6: without sequence parallelism and selective recompute, none of them fits."""
    for preset in ("22b", "175b", "530b", "1t"):
        out = actmem.json("estimate", "--model", preset, "--no-sp", "--recompute", "none")
        assert out["fits"] is False
