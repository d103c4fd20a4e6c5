"""The planner's measured kernel tables (actmem.planner.kernels): every expected number is read
straight from the CSV rows the H100 measured, and the shapes are derived by hand beside each test."""

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from actmem.model.architecture import Architecture
from actmem.planner import iteration, kernels

DATA = str(Path(__file__).parents[1] / "actmem" / "planner" / "data" / "h100_{}.csv")


@pytest.fixture(scope="module")
def gemm():
    frame = pd.read_csv(DATA.format("gemm"), comment="#")
    return lambda layout, m, n, k: frame[(frame.layout == layout) & (frame.m == m) & (frame.n == n)
                                         & (frame.k == k)].graphed_seconds.item()


@pytest.fixture(scope="module")
def per_element():
    """Seconds an element of a memory-bound op, forward and backward, as measured on 8192 rows of a width."""
    frame = pd.read_csv(DATA.format("elementwise"), comment="#")
    return lambda op, width: frame[(frame.op == op) & (frame.width == width)].eager_seconds.item() / (8192 * width)


@pytest.fixture(scope="module")
def attention():
    frame = pd.read_csv(DATA.format("attention"), comment="#")
    return lambda backend, causal, heads, seq: frame[
        (frame.backend == backend) & (frame.causal == causal) & (frame.heads == heads)
        & (frame.seq == seq)].forward_backward_graphed_seconds.item()


def test_the_tables_say_where_they_were_measured():
    for table in ("gemm", "attention"):
        with open(DATA.format(table)) as f:
            first = f.readline()
        assert first.startswith("# measured by benchmarks/gpu_kernel_tables.py on one NVIDIA H100"), first


def test_a_linear_at_measured_shapes_is_its_three_gemms(gemm):
    """y[1024, 4096] = x[1024, 8192]·Wᵀ: fprop (m=1024 n=4096 k=8192), dgrad dx[1024, 8192] = dy·W
    (m=1024 n=8192 k=4096), wgrad dW[4096, 8192] = dyᵀ·x (m=4096 n=8192 k=1024)."""
    expected = gemm("fprop", 1024, 4096, 8192) + gemm("dgrad", 1024, 8192, 4096) + gemm("wgrad", 4096, 8192, 1024)
    assert kernels.linear_seconds("h100", 1024, 8192, 4096) == pytest.approx(expected, rel=1e-12)


def test_between_measured_shapes_throughput_is_linear_in_log2(gemm):
    """m = 1024·√2 sits halfway (in log2) between 1024 and 2048: each GEMM's throughput is the mean
    of the two measured throughputs, its FLOPs 2·m·n·k."""
    m, n, k = 1024 * math.sqrt(2), 4096, 8192
    shapes = {"fprop": ((1024, n, k), (2048, n, k)), "dgrad": ((1024, k, n), (2048, k, n)),
              "wgrad": ((n, k, 1024), (n, k, 2048))}
    expected = 0.0
    for layout, (low, high) in shapes.items():
        throughput = [2.0 * math.prod(shape) / gemm(layout, *shape) for shape in (low, high)]
        scale = 2.0 * m * n * k / (2.0 * math.prod(low))     # the FLOPs at m over those at 1024
        expected += 2.0 * math.prod(low) * scale / (sum(throughput) / 2)
    assert kernels.linear_seconds("h100", m, k, n) == pytest.approx(expected, rel=1e-9)


def test_beyond_the_largest_shape_throughput_holds(gemm):
    """65,536 rows: twice the FLOPs of 32,768 rows, at 32,768's measured throughput."""
    at_edge = kernels.linear_seconds("h100", 32768, 4096, 4096)
    assert kernels.linear_seconds("h100", 65536, 4096, 4096) == pytest.approx(2 * at_edge, rel=1e-12)
    assert at_edge == pytest.approx(gemm("fprop", 32768, 4096, 4096) + gemm("dgrad", 32768, 4096, 4096)
                                    + gemm("wgrad", 4096, 4096, 32768), rel=1e-12)


def test_attention_without_context_parallelism_is_one_causal_kernel(attention):
    assert kernels.attention_seconds("h100", "cudnn", 16, 8192, 1) == pytest.approx(
        attention("cudnn", 1, 16, 8192), rel=1e-12)


def test_context_parallel_attention_is_a_causal_step_then_half_blocks(attention):
    """c = 16 at 8K tokens: a rank attends its 512 queries to every earlier key, 8192²/32 pairs: its own
    512 keys causally (step 0), then 15 steps of half a 512² block, 7.5 non-causal 512-token kernels
    (512²/2 + 15·512²/2 = 8192²/32). Slower per token than one causal kernel over 8K (a 16th of its
    time): the small blocks run far from the peak. At c = 2: the causal kernel over 4K and half a
    non-causal one, slower than half the causal 8K's."""
    ring = kernels.attention_seconds("h100", "cudnn", 16, 8192, 16)
    assert ring == pytest.approx(attention("cudnn", 1, 16, 512) + 7.5 * attention("cudnn", 0, 16, 512), rel=1e-12)
    assert ring > 2.5 * attention("cudnn", 1, 16, 8192) / 16
    two = kernels.attention_seconds("h100", "cudnn", 16, 8192, 2)
    assert two == pytest.approx(attention("cudnn", 1, 16, 4096) + 0.5 * attention("cudnn", 0, 16, 4096), rel=1e-12)
    assert two > attention("cudnn", 1, 16, 8192) / 2


def test_memory_bound_ops_go_at_their_measured_seconds_an_element(per_element):
    """At a measured size, the row itself; between two, the mean (in log2 of the elements) of their
    seconds an element; below the smallest, the smallest's."""
    assert kernels.elementwise_seconds("h100", "gelu", 8192 * 16384) == pytest.approx(
        8192 * 16384 * per_element("gelu", 16384), rel=1e-12)
    between = 8192 * 8192
    assert kernels.elementwise_seconds("h100", "gelu", between) == pytest.approx(
        between * (per_element("gelu", 4096) + per_element("gelu", 16384)) / 2, rel=1e-12)
    assert kernels.elementwise_seconds("h100", "add", 1000) == pytest.approx(1000 * per_element("add", 4096), rel=1e-12)


def test_a_layer_s_efficiency_is_its_linears_flops_over_their_measured_time(gemm, attention, per_element):
    """h = 4096, a = 32 heads of 128, g = 16 groups, SwiGLU f = 8192, at t = 4, c = 1, b = 1, s = 4096:
    every linear of a rank runs on T = 4096 rows: QKV 4096 -> (4096 + 2·2048)/4 = 2048, the projection
    4096/4 = 1024 -> 4096, fc1 4096 -> 2·8192/4 = 4096, fc2 8192/4 = 2048 -> 4096. The memory-bound
    kernels beside them: under sequence parallelism the two norms and four adds on T/t = 1024 rows of
    4096 (4,194,304 elements: under the smallest kept, 8192 x 4096, so at its seconds an element),
    rope over 4096 x (4096 + 2048)/4 (likewise), SwiGLU over 4096 x 8192/4 outputs (GeLU's 8192 x 4096
    seconds an element, x 8/5 accesses: kernels.SWIGLU_OVER_GELU). The scores: 8 heads of one causal kernel, against their counted
    3 x 2·b·s²·2ad/t FLOPs. The logits: 4096 -> 32768/4, and the cross entropy over 4096 x 8192
    (the 8192 x 4096 row)."""
    arch = Architecture(query_groups=16, activation="swiglu", ffn_hidden=8192, attention_core="flash",
                        normalization="rmsnorm", position_embedding="rope")
    T, peak = 4096, 989e12
    linears = [(4096, 2048), (1024, 4096), (4096, 4096), (2048, 4096)]
    seconds = sum(gemm("fprop", T, o, i) + gemm("dgrad", T, i, o) + gemm("wgrad", o, i, T) for i, o in linears)
    boundary = 1024 * 4096
    seconds += (2 * boundary * per_element("rms_norm", 4096) + 4 * boundary * per_element("add", 4096)
                + 4096 * 6144 / 4 * per_element("scale", 4096) + 8 / 5 * 8192 * 1024 * per_element("gelu", 4096))
    flops = sum(6 * T * i * o for i, o in linears)
    layers, scores, logits = iteration.kernel_efficiencies("h100", arch, 4096, 4096, 32, np.array([32768]), 2,
                                                           np.array([4]), np.array([1]), np.array([1]), 1,
                                                           np.array([4]), peak)
    assert layers == pytest.approx(flops / seconds / peak, rel=1e-12)
    assert scores == pytest.approx(3 * 2 * 4096**2 * 2 * 4096 / 4 / attention("cudnn", 1, 8, 4096) / peak, rel=1e-12)
    logit_seconds = (gemm("fprop", T, 8192, 4096) + gemm("dgrad", T, 4096, 8192) + gemm("wgrad", 8192, 4096, T)
                     + 8192 * 4096 * per_element("cross_entropy", 4096))
    assert logits == pytest.approx(6 * T * 4096 * 8192 / logit_seconds / peak, rel=1e-12)
    flash_attn = replace(arch, attention_core="flash-attn")            # TE's flash-attn core: flash-attn's kernel
    _, scores, _ = iteration.kernel_efficiencies("h100", flash_attn, 4096, 4096, 32, np.array([32768]), 2,
                                                 np.array([4]), np.array([1]), np.array([1]), 1, np.array([4]), peak)
    assert scores == pytest.approx(3 * 2 * 4096**2 * 2 * 4096 / 4 / attention("flash", 1, 8, 4096) / peak, rel=1e-12)


def test_a_moe_layer_weights_its_experts_at_their_rows(gemm, per_element):
    """E = 8 experts of f_e = 2048 (SwiGLU), k = 2, beside GQA attention (h = 4096, 32 heads of 128,
    16 groups), at s = 4096, b = 1, c = 1, t = 2, EP = 4, ETP = 1: the dense linears run on T = 4096
    rows (QKV 4096 -> 8192/2, projection 4096/2 -> 4096); the router whole on T/t = 2048 rows, 4096 -> 8
    (8 under the smallest measured width, 128: taken at 128's throughput); each of the E/EP = 2 local
    experts on k·(T/t)·EP·ETP/E = 2·2048·4/8 = 2048 rows, fc1 4096 -> 4096, fc2 2048 -> 4096. Beside them
    the norms and four adds on T/t = 2048 rows of 4096, rope over 4096 x 6144/2, and each local expert's
    SwiGLU over 2048 x 2048 outputs (8/5 of GeLU's), all under the smallest kept (8192 x 4096's)."""
    arch = Architecture(query_groups=16, activation="swiglu", attention_core="flash", normalization="rmsnorm",
                        position_embedding="rope", bias=False, num_experts=8, moe_topk=2, moe_ffn_hidden=2048)
    peak = 989e12

    def timed(rows, i, o, count=1):
        """(FLOPs, seconds) of count linears i -> o on rows, each GEMM at its (clamped) measured throughput."""
        shapes = {"fprop": (rows, o, i), "dgrad": (rows, i, o), "wgrad": (o, i, rows)}
        seconds = sum(2 * rows * i * o / (2 * math.prod(max(d, 128) for d in shape)
                                          / gemm(layout, *(max(d, 128) for d in shape)))
                      for layout, shape in shapes.items())
        return count * 6 * rows * i * o, count * seconds

    parts = [timed(4096, 4096, 4096), timed(4096, 2048, 4096), timed(2048, 4096, 8),
             timed(2048, 4096, 4096, 2), timed(2048, 2048, 4096, 2)]
    boundary = 2048 * 4096
    parts.append((0, 2 * boundary * per_element("rms_norm", 4096) + 4 * boundary * per_element("add", 4096)
                  + 4096 * 6144 / 2 * per_element("scale", 4096) + 8 / 5 * 2 * 2048 * 2048 * per_element("gelu", 4096)))
    layers, _, _ = iteration.kernel_efficiencies("h100", arch, 4096, 4096, 32, np.array([32768]), 2, np.array([2]),
                                                 np.array([1]), np.array([1]), np.array([4]), np.array([1]), peak)
    assert layers == pytest.approx(sum(f for f, _ in parts) / sum(s for _, s in parts) / peak, rel=1e-12)


def test_without_sequence_parallelism_the_norms_run_on_every_row(per_element):
    """The same dense layer at t = 4 without SP: the norms and adds on all T = 4096 rows, not T/t = 1024:
    six more boundary passes of 3 x 1024 x 4096 elements (both at 8192 x 4096's seconds an element)."""
    arch = Architecture(query_groups=16, activation="swiglu", ffn_hidden=8192, attention_core="flash",
                        normalization="rmsnorm", position_embedding="rope")
    other = {sp: iteration.other_seconds("h100", arch, 4096, 32, 32768, 4.0, 4.0, 1.0, 4096.0, sp)["layer"](arch)
             for sp in (True, False)}
    extra = 3 * 1024 * 4096 * (2 * per_element("rms_norm", 4096) + 4 * per_element("add", 4096))
    assert other[False] - other[True] == pytest.approx(extra, rel=1e-12)


def test_multi_latent_attention_rotates_its_whole_q_and_k():
    """DeepSeek-V3's MLA: rope over q and k of a·(d_qk + d_r) = 128 x 192 each, not the values' a·d_v."""
    from actmem.sources.presets import load_preset

    arch = Architecture(**load_preset("deepseek-v3").architecture)
    assert iteration._rotated_width(arch, 7168, 128) == 2 * 128 * (128 + 64)
