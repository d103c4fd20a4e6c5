"""megatron-core's own multi-latent attention measured against the rows of actmem's table (issue 27):
`actmem validate --grid mla` runs megatron-core 0.16.1's TransformerLayer with MLASelfAttention and a
SwiGLU MLP over real gloo ranks, Transformer Engine's modules replaced by stand-ins that keep what they
keep, without recompute and under selective recompute of its modules."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from actmem_validate.compare import judge, term_rows  # noqa: E402
from actmem_validate.megatron_mla import formula, measure, mla_grid  # noqa: E402
from actmem.memory.terms import MLA_TERMS  # noqa: E402
from tests.conftest import assert_one_line_error  # noqa: E402
from tests.validate.cli_grid import validate_grid  # noqa: E402


@pytest.fixture(scope="module")
def grid_rows():
    return validate_grid("mla")        # CI's run of `actmem validate --grid mla` (tests/validate/cli_grid.py)


def _forward(grid_rows) -> list:
    """The rows of what the forward keeps (not the rerun rows of the backward)."""
    return [row for row in grid_rows if row["kind"] != "rerun"]


def test_every_row_of_megatrons_mla_is_counted_to_the_byte(grid_rows):
    """Twelve layouts (one rank; t = 2 with SP; t = 2 without; q straight from h, no latent norms, at t = 2
    with SP; selective recompute of mla_up_proj, layernorm and mlp, of mla_up_proj alone, of core_attn, of
    core_attn and mla_up_proj, of mla_up_proj and layernorm with q from h; the unfused rope, YaRN on one rank,
    plain rope at t = 2 with SP, YaRN beside core_attn, layernorm and mlp; under FP8: tensorwise at t = 2 with SP,
    delayed with q from h and no latent norms, with mla_up_proj recomputed under both and with the latent norms,
    MXFP8 and blockwise on one rank, layernorm recomputed with and without a q latent), every rank: each row
    measured equals its formula, nothing unnamed, the totals equal; and every
    MLA row of the table is measured, non-zero, on some layout."""
    assert judge(grid_rows, 0.0) == []
    assert len({row["config"] for row in grid_rows}) == 21
    measured = {row["term"] for row in grid_rows if row["measured_bytes"] > 0}
    assert {term.name for term in MLA_TERMS} | {"qkv_input", "softmax_lse", "projection_input",
                                                "core_attn_mask_type"} <= measured


def test_the_measured_bytes_are_the_hand_derived_ones(grid_rows):
    """One rank, h = 16, a = 4, s = 16, b = 2, q_r = 18, kv_r = 12, d_qk = 6, d_rope = 4, d_v = 10, f = 14,
    2-byte activations: the input norm's input and output (the down projections' input) 2·s·b·h = 1024 each, its
    rsigma 4·s·b = 128; the q latent and its norm's output 2·s·b·q_r = 1152 each, rsigma 128; the kv latent
    (a contiguous copy) and its norm's output 2·s·b·kv_r = 768 each, rsigma 128; q and k 2·s·b·a·(d_qk + d_rope)
    = 2560 each; v 2·s·b·a·d_v = 2560; the output 2560; the log-sum-exp 4·b·a·s = 512; the MLP's norm input and
    output 1024 each, rsigma 128, SwiGLU's input 2·s·b·2f = 1792, fc2's 896. At t = 2 with SP every one halves
    (the sequence under SP, the heads and f over t)."""
    one = {row["term"]: row["measured_bytes"] for row in _forward(grid_rows)
           if row["config"] == "mla q_r=18 kv_r=12 norms t=1 b=2"}
    assert one == {"attention_layernorm_input": 1024, "attention_norm_statistics": 128, "qkv_input": 1024,
                   "mla_q_latent": 1152, "mla_q_latent_statistics": 128,
                   "mla_q_latent_normed": 1152, "mla_kv_latent": 768, "mla_kv_latent_statistics": 128,
                   "mla_kv_latent_normed": 768, "mla_query": 2560, "mla_key": 2560, "mla_value": 2560,
                   "softmax_lse": 512, "projection_input": 2560, "mlp_layernorm_input": 1024,
                   "mlp_norm_statistics": 128, "fc1_input": 1024, "swiglu_input": 1792, "fc2_input": 896,
                   "total": 21888}
    sp = [row for row in _forward(grid_rows) if row["config"] == "mla q_r=18 kv_r=12 norms t=2 sp b=2" and row["term"] != "total"]
    assert {row["term"]: row["measured_bytes"] for row in sp} == {name: n // 2 for name, n in one.items()
                                                                    if name != "total"}


def test_the_up_projections_checkpoint_keeps_its_arguments(grid_rows):
    """--recompute-modules mla_up_proj layernorm mlp at t = 2 with SP, a rank: the input norm's input 2·8·2·16 =
    512, the q latent 2·8·2·18 = 576, the kv down projection's whole output (the kv latent's view) 2·8·2·(12 + 4) =
    512, the rope key gathered 2·16·2·4 = 256, the log-sum-exp 4·2·2·16 = 256, the core's output 2·16·2·20 = 1280,
    the MLP's checkpoint's input 512: 3904, nothing else (q, k and v discarded, the norms rerun)."""
    kept = {row["term"]: row["measured_bytes"] for row in _forward(grid_rows) if row["rank"] == 0 and row["measured_bytes"]
            and row["config"] == "mla q_r=18 kv_r=12 norms t=2 sp b=2 selective:layernorm+mla_up_proj+mlp"}
    assert kept == {"attention_layernorm_input": 512, "mla_q_latent": 576, "mla_kv_down_output": 512,
                    "mla_rope_key_gathered": 256, "softmax_lse": 256, "projection_input": 1280,
                    "mlp_layernorm_input": 512, "total": 3904}


def test_the_gate_fails_a_row_left_out_of_the_formula_or_a_tensor_no_row_names():
    """Inject the failures: the formula without the kv latent's copy (measured, not in the formula),
    the formula with a row the layer does not keep, and a saved tensor named by no row."""
    config = mla_grid()[0]
    rank, named, _ = measure(config)[0]
    expected = formula(config.spec, config.technique)
    assert judge(term_rows(config, rank, expected, named), 0.0) == []
    missing = {name: n for name, n in expected.items() if name != "mla_kv_latent"}
    assert any("mla_kv_latent measured" in line for line in judge(term_rows(config, rank, missing, named), 0.0))
    extra = expected | {"mla_value": expected["mla_value"] + 2}
    assert judge(term_rows(config, rank, extra, named), 0.0)
    stray = named | {"unnamed bfloat16 [16, 2, 20]": 1280}
    assert any("no term or named residual" in line for line in judge(term_rows(config, rank, expected, stray), 0.0))


@pytest.mark.parametrize("args, fragments", [
    (["--grid", "mla", "--mode", "fake"], ["--grid mla runs megatron-core's multi-latent attention on real CPU"]),
    (["--grid", "mla", "--tp", "2"], ["--grid mla sets the model, run and techniques itself; drop --tp"]),
    (["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "32", "--vocab", "128", "--swiglu",
      "--attention-core", "flash", "--position-embedding", "rope", "--multi-latent-attention"],
     ["validate measures multi-latent attention with --grid mla"]),
])
def test_validate_refuses_an_mla_run_it_cannot_measure(actmem, args, fragments):
    assert_one_line_error(actmem("validate", *args), *fragments)


def test_the_unfused_rope_keeps_cos_and_sin_for_q_and_k(grid_rows):
    """Megatron's own unfused path (rope_utils.py, _apply_rotary_pos_emb_bshd) on one rank: 16-bit cos_ and sin_
    [s, 1, 1, d_rope] for q and again for k, 4·2·16·4 = 512 B; the rest of the layer as under the fused kernel
    (21,888 B), so 22,400 in all; at t = 2 with SP still 512 on each rank (the rope sees the whole sequence)."""
    one = {row["term"]: row["measured_bytes"] for row in _forward(grid_rows)
           if row["config"] == "mla q_r=18 kv_r=12 norms unfused yarn t=1 b=2"}
    assert one["rope_cos_sin"] == 512 and one["total"] == 21_888 + 512
    sp = {row["term"]: row["measured_bytes"] for row in _forward(grid_rows)
          if row["config"] == "mla q_r=18 kv_r=12 norms unfused rope t=2 sp b=2" and row["rank"] == 1}
    assert sp["rope_cos_sin"] == 512


def test_fp8_keeps_two_one_byte_copies_of_the_norm_output_and_quantized_latents(grid_rows):
    """Tensorwise at t = 2 with SP (h = 32, a = 4, s = 16, b = 2, q_r = 48, kv_r = 16, f = 64; n = 8 rows a rank):
    the q and kv down projections keep a copy each of the norm's output, n·b·h + 4 = 516 (its 16-bit self kept by
    neither); with the latent norms, the latents 16-bit (their norms' inputs: 2·8·2·48 = 1536, 2·8·2·16 = 512)
    and the norms' outputs quantized, 8·2·48 + 4 = 772 and 8·2·16 + 4 = 260; the projection keeps nothing of its
    own (its original input); fc1 the MLP norm's output 516, fc2 s·b·f/t + 4 = 16·2·32 + 4 = 1028. Delayed with q
    from h: the projection keeps its input quantized, s·b·a·d_v/t + 4 = 16·2·2·8 + 4 = 516, and the kv latent
    (no norm) its copy, 8·2·16 + 4 = 260. Recomputing mla_up_proj under FP8, the checkpoint keeps the 16-bit q
    latent (1536) in place of the up projection's copy, and with q from h the norm's 16-bit output (1024)."""
    def kept(config):
        return {row["term"]: row["measured_bytes"] for row in _forward(grid_rows) if row["rank"] == 0 and row["measured_bytes"]
                and row["config"] == config}

    tensorwise = kept("mla q_r=48 kv_r=16 norms fp8 tensorwise t=2 sp b=2")
    assert {name: tensorwise[name] for name in ("qkv_input", "qkv_input_q_fp8", "mla_q_latent", "mla_q_latent_normed",
                                                "mla_kv_latent", "mla_kv_latent_normed", "fc1_input", "fc2_input")} \
        == {"qkv_input": 516, "qkv_input_q_fp8": 516, "mla_q_latent": 1536, "mla_q_latent_normed": 772,
            "mla_kv_latent": 512, "mla_kv_latent_normed": 260, "fc1_input": 516, "fc2_input": 1028}
    assert "projection_input_fp8" not in tensorwise
    delayed = kept("mla q from h kv_r=16 fp8 delayed t=2 sp b=2")
    assert (delayed["projection_input_fp8"], delayed["mla_kv_latent"]) == (516, 260)
    assert kept("mla q_r=48 kv_r=16 fp8 tensorwise t=2 sp b=2 selective:mla_up_proj")["mla_q_latent_checkpointed"] == 1536
    assert kept("mla q from h kv_r=16 fp8 delayed t=2 sp b=2 selective:core_attn+mla_up_proj")[
        "mla_norm_output_checkpointed"] == 1024


def test_the_gate_fails_fp8_mla_priced_wrong():
    """Inject the failures on the tensorwise layer: one copy of the norm's output where the layer keeps two, the
    16-bit norm output held beside the copies, the latents priced in 16 bits."""
    from dataclasses import replace

    config = next(c for c in mla_grid() if c.label == "mla q_r=48 kv_r=16 norms fp8 tensorwise t=2 sp b=2")
    rank, named, _ = measure(config)[0]
    expected = formula(config.spec, config.technique)
    assert judge(term_rows(config, rank, expected, named), 0.0) == []
    one_copy = {name: n for name, n in expected.items() if name != "qkv_input_q_fp8"}
    assert any("qkv_input_q_fp8 measured" in line for line in judge(term_rows(config, rank, one_copy, named), 0.0))
    held = named | {"unnamed bfloat16 [8, 2, 32]": 1024}
    assert judge(term_rows(config, rank, expected, held), 0.0)
    bf16 = replace(config.spec, architecture=config.spec.architecture.bf16_twin())
    assert judge(term_rows(config, rank, formula(bf16, config.technique), named), 0.0)


def test_fp8_layernorm_recompute_frees_the_down_projections_copies(grid_rows):
    """Under FP8 with the input norm recomputed, Megatron has the q and kv down projections save the norm's 16-bit
    output itself (multi_latent_attention.py, set_for_recompute_input_layernorm), which the norm's checkpoint
    frees: neither one-byte copy stays (h = 32, s/t·b = 16 rows: 512 + 4 each without it). Without a q latent the
    q projection is not told to, and keeps its copy of the rank's shard, 16·32 + 4 = 516."""
    def kept(config):
        return {row["term"]: row["measured_bytes"] for row in _forward(grid_rows) if row["measured_bytes"]
                and row["config"] == config}

    latent = kept("mla q_r=48 kv_r=16 norms fp8 tensorwise t=2 sp b=2 selective:layernorm")
    assert not {"qkv_input", "qkv_input_q_fp8"} & set(latent) and latent["mla_q_latent"] == 1536
    assert kept("mla q_r=48 kv_r=16 norms fp8 tensorwise t=2 sp b=2")["qkv_input_q_fp8"] == 516
    from_h = kept("mla q from h kv_r=16 fp8 tensorwise t=2 sp b=2 selective:layernorm")
    assert from_h["qkv_input_q_fp8"] == 516 and "qkv_input" not in from_h


def test_the_gate_fails_fp8_layernorm_recompute_priced_as_if_the_copies_stayed():
    """Inject the failure: the q latent layer with layernorm recomputed, priced as without it (both copies kept)."""
    config = next(c for c in mla_grid() if c.label == "mla q_r=48 kv_r=16 norms fp8 tensorwise t=2 sp b=2 "
                                                      "selective:layernorm")
    rank, named, _ = measure(config)[0]
    assert judge(term_rows(config, rank, formula(config.spec, config.technique), named), 0.0) == []
    from actmem.memory.techniques import run_technique
    from actmem.model.recompute import NONE

    kept = formula(config.spec, run_technique(True, NONE))
    assert judge(term_rows(config, rank, kept, named), 0.0)


def _reruns(grid_rows, label: str) -> dict:
    """{(rank, unit): (formula, measured)} of a layout's rerun rows."""
    return {(row["rank"], row["term"].removeprefix("rerun ")): (row["formula_bytes"], row["measured_bytes"])
            for row in grid_rows if row["kind"] == "rerun" and row["config"] == label}


def test_each_checkpoint_without_output_rerun_is_measured_as_it_ends(grid_rows):
    """Megatron's CheckpointWithoutOutput reruns (the input norm's under layernorm, the up projections' under
    mla_up_proj), measured where each ends (gloo.rerun_moments), against actmem's rerun moment, by hand:
    - q from h, tensorwise, layernorm, t = 2 with SP (h = 32, s = 16, b = 2, 2 heads a rank, d_qk 16, d_v 8): the
      hook fires on the attention's output gradient, the MLP's rows freed. Held: the layer's input 2·8·2·32 = 1024,
      the q projection's FP8 copy 512 + 4, the kv latent's 256 + 4, q and k 2·16·2·2·16 = 2048 each, v 1024, the
      fp32 log-sum-exp 256, the projection's input 1024: 8200. The rerun: the norm's output restored (1024) and its
      own beside it (ctx.outputs, 1024), its fp32 statistics 4·8·2 = 64: 10,312.
    - q_r = 18, kv_r = 12, core_attn and mla_up_proj, t = 2 with SP (h = 16, 4 heads, d_qk 10 = 6 + 4, d_v 10):
      the hook fires on the core's output gradient, the projection's backward done; the core's checkpoint keeps q,
      k and v alone, so its output, the projection's input, is freed. Held: the input 512, its norm's statistics
      64 and output 512, the q latent 576, the kv down projection's output 2·8·2·16 = 512, the gathered rope key
      256, the mask type 4: 2436. The rerun: the latents' norms' statistics 64 twice, the q latent normed 576, the
      kv latent 384 and normed 384, and q, k, v 2·16·2·2·10 = 1280 each, twice (restored, and ctx.outputs): 11,588.
    The earlier pricing of the up projections' rerun (their outputs once, the core's rows and the kv latent's
    freed) gave 6,980."""
    norm = _reruns(grid_rows, "mla q from h kv_r=16 fp8 tensorwise t=2 sp b=2 selective:layernorm")
    assert norm == {(rank, "input_layernorm"): (10_312, 10_312) for rank in (0, 1)}
    assert 1024 + 516 + 260 + 2 * 2048 + 1024 + 256 + 1024 + 2 * 1024 + 64 == 10_312
    up = _reruns(grid_rows, "mla q_r=18 kv_r=12 norms t=2 sp b=2 selective:core_attn+mla_up_proj")
    # the core's rerun (Megatron's own checkpoint, measured before the backward through it) comes next, on the q, k
    # and v the up projections restored: all of their rerun held, and the core's own, its fp32 log-sum-exp
    # 4·b·(a/t)·s = 4·2·2·16 = 256 and its output, the projection's input 2·16·2·2·10 = 1280
    assert up == {(rank, unit): (n, n) for rank in (0, 1) for unit, n in (("mla_up_proj", 11_588),
                                                                           ("core_attn", 11_588 + 256 + 1280))}
    assert 512 + 64 + 512 + 576 + 512 + 256 + 4 + 2 * 64 + 576 + 2 * 384 + 6 * 1280 == 11_588
    # beside layernorm, the norm's rerun came first and holds its output twice and its statistics through the
    # up projections' rerun: every layout that reruns both measures it
    both = [row for row in grid_rows if row["kind"] == "rerun" and "layernorm+mla_up_proj" in row["config"]]
    assert len(both) == 8 and all(row["formula_bytes"] == row["measured_bytes"] > 0 for row in both)


def test_the_gate_fails_a_rerun_priced_wrong_either_way():
    """Inject the failures on the norm's rerun (q from h, tensorwise, layernorm): its own copy of the output not
    counted (1024 B less), a rerun measured that actmem does not price, one priced that does not run."""
    from actmem_validate.compare import rerun_rows
    from actmem.memory.terms import layer_terms

    config = next(c for c in mla_grid() if c.label == "mla q from h kv_r=16 fp8 tensorwise t=2 sp b=2 selective:layernorm")
    spec, technique = config.spec, config.technique
    rank, named, moments = measure(config)[0]
    expected = formula(spec, technique)

    def gate(measured):
        return judge(rerun_rows(config, rank, technique, spec.architecture, expected, layer_terms(spec.architecture),
                                spec.bindings_at(2), measured), 0.0)

    assert moments == {"input_layernorm": 10_312} and gate(moments) == []
    assert any("rerun input_layernorm" in line for line in gate({"input_layernorm": 10_312 - 1024}))
    assert any("rerun mla_up_proj" in line for line in gate(moments | {"mla_up_proj": 1}))
    assert any("rerun input_layernorm" in line for line in gate({}))
