"""Property tests: no valid input crashes the CLI, and no invalid one passes silently."""

import json
from fractions import Fraction

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import Cli, assert_one_line_error

_SETTINGS = settings(max_examples=120, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])


def fused_softmax_runs(s, b, heads_per_rank):
    """Megatron's fused causal softmax runs (fused_softmax.py, is_kernel_available; the
    kernel's get_batch_per_block: 8 rows a block up to 128 keys, 4 above), written out
    independently of actmem.model.rules."""
    return 16 < s <= 4096 and s % 4 == 0 and (b * heads_per_rank) % (8 if s <= 128 else 4) == 0


@st.composite
def valid_runs(draw):
    """Any s (a multiple of t, up to 8192), b, a and t: the fused softmax runs or not."""
    t = draw(st.sampled_from([1, 2, 4, 8]))
    s = t * draw(st.integers(1, 8192 // t))
    micro_batch = draw(st.integers(1, 4))
    heads = t * draw(st.integers(1, 8))
    hidden = heads * draw(st.sampled_from([8, 16, 64, 128]))
    p = draw(st.integers(1, 4))
    m = 1 if p == 1 else draw(st.integers(1, 3))
    layers = p * m * draw(st.integers(1, 3))
    flags = {"--heads": heads, "--hidden": hidden, "--layers": layers, "--tp": t, "--pp": p,
             "--interleave": m, "--seq-len": s,
             "--micro-batch": micro_batch, "--vocab": draw(st.integers(1, 60000)),
             "--recompute": draw(st.sampled_from(["none", "selective", "full"]))}
    if draw(st.booleans()):
        d = draw(st.integers(1, 4))
        n = p * draw(st.integers(1, 4)) if m > 1 else draw(st.integers(1, 8))
        flags |= {"--gpus": t * p * d, "--global-batch": n * flags["--micro-batch"] * d}
    args = [str(x) for flag, value in flags.items() for x in (flag, value)]
    sp = t > 1 and draw(st.booleans())          # sequence parallelism needs t > 1
    return flags, args + ["--sp" if sp else "--no-sp"]


def expected_layer_activations(flags):
    """Section 4.4 by hand: 1F1B holds min(p, n) microbatches of L/p layers; the interleaved
    schedule min(pm + p - 1, nm) chunks of L/(pm) layers; n unknown means a full pipeline."""
    L, p, m = flags["--layers"], flags["--pp"], flags["--interleave"]
    n = None
    if "--gpus" in flags:
        d = flags["--gpus"] // (flags["--tp"] * p)
        n = flags["--global-batch"] // (flags["--micro-batch"] * d)
    if m == 1:
        return L // p * (p if n is None else min(p, n))
    chunks = p * m + p - 1
    return L // (p * m) * (chunks if n is None else min(chunks, n * m))


#: the rows that keep the attention core, and with it, on torch's fallback softmax, the s² causal
#: mask each layer makes (selective recompute reruns the core, full recompute the layer)
KEEPS_THE_CORE = ("none", "tp", "tp-sp")


@_SETTINGS
@given(valid_runs())
def test_valid_input_never_crashes_and_matches_table_2(case):
    """Table 2's closed forms where Megatron's fused softmax runs at the row's t ('none' at 1);
    where it does not, torch's fallback, which keeps the causal mask it makes, s² bytes a layer,
    on the rows that keep the core, and is named in the assumptions."""
    flags, args = case
    result = Cli()("estimate", *args, "--format", "json")
    assert result.exit_code == 0, (args, result.output)
    out = json.loads(result.stdout)
    s, b, h, a, t = (flags[k] for k in ("--seq-len", "--micro-batch", "--hidden", "--heads", "--tp"))
    sbh, attention = Fraction(s * b * h), Fraction(5 * a * s, h)
    paper = {"none": sbh * (34 + attention), "tp": sbh * (10 + Fraction(24, t) + attention / t),
             "tp-sp": sbh / t * (34 + attention), "tp-sel": sbh * (10 + Fraction(24, t)),
             "tp-sp-sel": sbh * 34 / t, "full": 2 * sbh, "tp-sp-full": 2 * sbh / t}
    held = expected_layer_activations(flags)
    assert out["stage"]["layer_activations"] == held
    for row in out["techniques"]:
        row_t = 1 if row["technique"] == "none" else t
        fallback = not fused_softmax_runs(s, b, a // row_t) and row["technique"] in KEEPS_THE_CORE
        assert row["per_layer_bytes"] == paper[row["technique"]] + fallback * s * s
        assert row["layers_bytes"] == row["per_layer_bytes"] * held
        assert row["first_stage_bytes"] == row["layers_bytes"] + row["extra_bytes"]
    assert sum(term["bytes"] for term in out["run_terms"]) == out["activations_bytes"]
    assert out["total_bytes"] == out["activations_bytes"] + out["parameters"]["total_bytes"]
    named = any("forward_torch_softmax" in note for note in out["assumptions"])
    assert named == (not fused_softmax_runs(s, b, a // t))


def is_valid(heads, hidden, layers, t, p, m, s, sp):
    """The constraints of the estimator issue, written out independently of actmem.model.spec (Megatron's
    local core runs for any s, b and t: its fused softmax, or torch's where the kernel does not)."""
    if min(heads, hidden, layers, t, p, m, s) <= 0:
        return False
    return (hidden % heads == 0 and hidden % t == 0 and heads % t == 0
            and (not sp or (t > 1 and s % t == 0)) and layers % p == 0 and (layers // p) % m == 0
            and (m == 1 or p > 1))


@st.composite
def perhaps_invalid_runs(draw):
    """A valid run with, half the time, one dim or size replaced by any small integer."""
    t = draw(st.sampled_from([1, 2, 4]))
    heads = t * draw(st.integers(1, 16))
    p = draw(st.integers(1, 3))
    m = 1 if p == 1 else draw(st.integers(1, 2))
    dims = {"heads": heads, "hidden": heads * 16, "layers": p * m * draw(st.integers(1, 3)),
            "t": t, "p": p, "m": m, "s": 4 * t * draw(st.integers(2, 8)), "sp": draw(st.booleans())}
    if draw(st.booleans()):
        key = draw(st.sampled_from(["heads", "hidden", "layers", "t", "p", "m", "s"]))
        dims[key] = draw(st.integers(-3, 40))
    return dims


@_SETTINGS
@given(perhaps_invalid_runs())
def test_invalid_input_never_passes_silently(dims):
    args = ["estimate", "--heads", dims["heads"], "--hidden", dims["hidden"],
            "--layers", dims["layers"], "--tp", dims["t"], "--pp", dims["p"],
            "--interleave", dims["m"], "--seq-len", dims["s"], "--vocab", 1000,
            "--sp" if dims["sp"] else "--no-sp", "--format", "json"]
    result = Cli()(*map(str, args))
    if is_valid(**dims):
        assert result.exit_code == 0, (args, result.output)
        json.loads(result.stdout)
    else:
        assert_one_line_error(result)
