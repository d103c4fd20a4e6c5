"""The formula `actmem flops` prints is the one its number was computed with (issue 25):
the appendix's closed form for the paper's layer, the generalised sum, named, for any other."""

import pytest

APPENDIX = "72·B·s·L·h²·(1 + s/(6h) + v/(12hL))"


def _model_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("model FLOPs per iteration:"))


def test_530b_shows_the_papers_formula_beside_its_number(actmem):
    """MT-NLG 530B, Table 3: B = 280, s = 2048, L = 105, h = 20480, v = 51200.

    72·B·s·L·h² = 72·280·2048·105·20480² = 4,335,206,400·419,430,400 = 1.81831e18;
    1 + s/(6h) + v/(12hL) = 1 + 2048/122,880 + 51,200/25,804,800 = 1.0186508;
    model FLOPs = 1.81831e18 · 1.0186508 = 1.8522e18.
    """
    B, s, L, h, v = 280, 2048, 105, 20480, 51200
    expected = 72 * B * s * L * h**2 * (1 + s / (6 * h) + v / (12 * h * L))
    assert f"{expected:.4e}" == "1.8522e+18"
    result = actmem("flops", "--model", "530b")
    assert result.exit_code == 0, result.output
    assert _model_line(result.stdout) == f"model FLOPs per iteration: 1.8522e+18 = {APPENDIX}"
    assert "B=280 s=2,048 L=105 h=20,480 v=51,200" in result.stdout
    out = actmem.json("flops", "--model", "530b")
    assert out["model_flops"] == pytest.approx(expected, rel=1e-12)
    assert out["model_flops_formula"]["formula"] == APPENDIX


def test_llama_405b_shows_its_own_sum_not_the_gpt_text(actmem):
    """Llama 3.1 405B (Llama 3 paper, Table 3; config.json): a = 128, h = 16384, L = 126,
    g = 8 key/value heads, d = h/a = 128, f = 53248 (SwiGLU), v = 128256, s = 8192; B = 2048.

    W, the weights a token multiplies in a layer: QKV h·(a·d + 2·g·d) = 16384·(16384 + 2048),
    projection a·d·h = 16384·16384, SwiGLU gate, up and down 3·h·f = 3·16384·53248:
      W = 16384·(18432 + 16384 + 159744) = 16384·194560 = 3,187,671,040
    model FLOPs = 6·B·s·L·W + 12·B·s²·L·a·d + 6·B·s·h·v
                = 4.0431e19 + 3.4047e18 + 2.1153e17 = 4.4047e19
    (the appendix's 72BsLh²(1 + s/(6h) + v/(12hL)) would give 4.4473e19: 12h² is 3,221,225,472, not W)
    """
    B, s, L, h, v, g, d, f = 2048, 8192, 126, 16384, 128256, 8, 128, 53248
    a_d = 128 * d
    W = h * (a_d + 2 * g * d) + a_d * h + 3 * h * f
    assert W == 3_187_671_040
    expected = 6 * B * s * L * W + 12 * B * s * s * L * a_d + 6 * B * s * h * v
    assert f"{expected:.4e}" == "4.4047e+19"
    result = actmem("flops", "--model", "llama-3.1-405b")
    assert result.exit_code == 0, result.output
    line = _model_line(result.stdout)
    assert line == "model FLOPs per iteration: 4.4047e+19 = 6·B·s·L·W + 12·B·s²·L·a·d + 6·B·s·h·v"
    assert "72·B" not in line
    out = " ".join(result.stdout.split())            # the text wraps at 80 columns
    assert "W = h·(a·d + 2·g·d) + a·d·h + 3·h·f = 3,187,671,040" in out
    assert "a·d = 16,384" in out
    for named in ("per-layer matmul FLOPs of this architecture", "the paper's appendix generalised",
                  "QKV with 8 query groups of d = 128", "SwiGLU MLP's gate and up, then down, f = 53,248",
                  "attention scores", "logits"):
        assert named in out, named
    report = actmem.json("flops", "--model", "llama-3.1-405b")
    assert report["model_flops"] == pytest.approx(expected, rel=1e-12)
    assert report["model_flops_formula"]["formula"] != APPENDIX


def _preset(tmp_path, architecture: str):
    """A 22B-shaped GPT (Table 3: a = 64, h = 6144, L = 48) with other architecture settings."""
    path = tmp_path / "gpt.toml"
    path.write_text('name = "gpt"\n[model]\nheads = 64\nhidden = 6144\nlayers = 48\nvocab = 51200\n'
                    'seq_len = 2048\n[run]\ntensor_parallel = 8\npipeline_parallel = 1\nmicro_batch = 4\n'
                    'global_batch = 4\ngpus = 8\n[architecture]\n' + architecture)
    return str(path)


def test_a_layer_with_the_papers_matmuls_keeps_the_papers_formula(actmem, tmp_path):
    """RMSNorm and no biases change no matmul: W = 12h² and a·d = h, the appendix's case."""
    out = actmem("flops", "--model", _preset(tmp_path, 'normalization = "rmsnorm"\nbias = false\n'))
    assert out.exit_code == 0, out.output
    assert _model_line(out.stdout).endswith(f"= {APPENDIX}")


def test_a_gpt_with_another_ffn_width_shows_its_w(actmem, tmp_path):
    """f = 3h = 18432 (GeLU): W = 4h² + 2·h·f = 4·6144² + 2·6144·18432 = 150,994,944 +
    226,492,416 = 377,487,360 (10h², not the paper's 12h²)."""
    out = actmem("flops", "--model", _preset(tmp_path, "ffn_hidden = 18432\n"))
    assert out.exit_code == 0, out.output
    assert _model_line(out.stdout).endswith("= 6·B·s·L·W + 12·B·s²·L·h + 6·B·s·h·v")
    text = " ".join(out.stdout.split())
    assert "W = 4h² + 2·h·f = 377,487,360" in text
    assert "GeLU MLP's fc1 and fc2, f = 18,432" in text
