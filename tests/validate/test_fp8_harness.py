"""FP8 (issue 29) in the harness: TE's FP8 linears and weight workspaces over a CPU stand-in (layers.Fp8Save,
make_fp8_state) keeping what TE 2.11's keep, measured against actmem's FP8 rows; each row can fail both ways."""

import pytest

pytest.importorskip("torch")

from actmem_validate.compare import judge  # noqa: E402
from actmem_validate.grid import fp8_configs  # noqa: E402
from actmem_validate.launch import run_real  # noqa: E402


@pytest.fixture(scope="module")
def fp8_rows():
    return run_real(fp8_configs())


def test_every_fp8_row_is_measured_to_the_byte(fp8_rows):
    """Delayed at t = 1 and with SP at t = 2, tensorwise with the core recomputed: every term 0 B off, the peak
    within the gate. Two layers of h = 64, s = 32, b = 2, f = 96 (SwiGLU): at t = 1 a layer's QKV and fc1 inputs
    s·b·h + 4 = 4100 (one byte an element, a 4-byte scale_inv), fc2's s·b·f + 4 = 6148, the projection's
    quantized copy 4100 beside its 16-bit 8192; at t = 2 with SP the shards, 2048 + 4 and 3072 + 4; tensorwise
    keeps no projection copy."""
    assert judge(fp8_rows, 0.0) == []
    got = {(row["config"], row["rank"], row["term"]): row["measured_bytes"] for row in fp8_rows}

    def measured(name, t, term):
        return next(n for (config, rank, row_term), n in got.items()
                    if config.startswith(f"{name} t={t} ") and rank == 0 and row_term == term)

    assert (measured("small-flash-fp8-delayed", 1, "fc2_input"), measured("small-flash-fp8-delayed", 1, "qkv_input"),
            measured("small-flash-fp8-delayed", 1, "projection_input_fp8")) == (2 * 6148, 2 * 4100, 2 * 4100)
    assert (measured("small-flash-fp8-delayed", 2, "fc2_input"), measured("small-flash-fp8-delayed", 2, "fc1_input")) \
        == (2 * 3076, 2 * 2052)
    assert not [n for (config, _, term), n in got.items()
                if config.startswith("small-flash-fp8-tensorwise") and term == "projection_input_fp8" and n]


@pytest.mark.parametrize("term, wrong", [("fc2_input", 2), ("projection_input_fp8", 0), ("qkv_input", 0.5)])
def test_the_gate_fails_an_fp8_row_counted_wrong(fp8_rows, term, wrong):
    """Inject: the row counted 16-bit (x2), left out (x0), or without its scale (half): red."""
    rows = [dict(row) for row in fp8_rows]
    for row in rows:
        if row["term"] == term and row["formula_bytes"]:
            row["formula_bytes"] = int(row["formula_bytes"] * wrong)
    assert judge(rows, 0.0)


def test_llama_8b_under_fp8_at_full_scale_with_fake_tensors():
    """Llama 3.1 8B at t = 8 with SP, fake tensors at its full dims (validate --grid presets runs the same): delayed
    scaling on an H100, with and without the core recomputed, and MXFP8 on a B200; every row 0 B off, and the
    projection's quantized copy s·b·a·d/t + 4 = 8192·4096/8 + 4 = 4,194,308 B a layer, 32 layers: 134,217,856."""
    from actmem_validate.grid import fp8_presets
    from actmem_validate.launch import run_fake

    rows = run_fake(fp8_presets())
    assert judge(rows, 0.0) == []
    copies = {row["config"].split()[0]: row["measured_bytes"] for row in rows
              if row["term"] == "projection_input_fp8" and "tp-sp-sel" not in row["config"]}
    assert copies == {"llama-3.1-8b-fp8-delayed": 134_217_856}


def test_first_and_last_layers_in_bf16_are_measured_to_the_byte(fp8_rows):
    """--first-last-layers-bf16 under tensorwise, t = 2 with SP, 4 layers (h = 64, s = 32, b = 2, f = 96): on one
    stage layers 0 and 3 keep 16-bit QKV inputs, 2·(s/t)·b·h = 4096 B, layers 1 and 2 one byte and a scale_inv,
    2048 + 4: 2 x 4096 + 2 x 2052 = 12,296; on a pipeline's first stage (p = 2) layer 0 in bf16 and layer 1 in
    FP8, two microbatches: 2 x (4096 + 2052), the same."""
    rows = [row for row in fp8_rows if "first-last" in row["config"]]
    assert rows and judge(rows, 0.0) == []
    qkv = {row["config"].split()[2]: row["measured_bytes"] for row in rows
           if row["term"] == "qkv_input" and row["rank"] == 0}
    assert qkv == {"p=1": 12_296, "p=2": 12_296}


def test_the_gate_fails_a_bf16_layer_counted_in_fp8(fp8_rows):
    """Inject: the formula counts every layer FP8 (the bf16 layers' 16-bit QKV inputs halved): red."""
    rows = [dict(row) for row in fp8_rows if "first-last" in row["config"]]
    for row in rows:
        if row["term"] == "qkv_input":
            row["formula_bytes"] = 4 * 2052 if "p=1" in row["config"] else 2 * 2 * 2052
    assert judge(rows, 0.0)
