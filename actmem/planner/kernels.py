"""Measured kernel times by shape: the planner's compute time on a GPU that has tables.

A flat share of the peak for every FLOP cannot tell a [512, 16384] GEMM from an [8192, 16384]
one, nor flash attention over 512 tokens from 8K. On a GPU with tables (hardware.Gpu.kernel_tables),
each linear's three GEMMs (forward, input gradient, weight gradient) and the attention core are
looked up at the shapes one rank runs, in tables that benchmarks/gpu_kernel_tables.py measured on
that GPU (actmem/planner/data/<name>_gemm.csv, _attention.csv; each file's first line says where
and when).

Reading a table: throughput (FLOP/s) is interpolated linearly in log2 of each dimension between
the measured points, and held at the edge outside them (large shapes saturate; a dimension under
the smallest measured takes the smallest's throughput, which flatters it). The timings read are
the graphed ones, the GPU's own time: in a training step the CPU runs ahead of large kernels and
its dispatch is hidden (the eager column, kept beside them, is what a Python loop of small
kernels waits on).
"""

import functools
from importlib import resources

import numpy as np

#: backward of attention against its forward: flash's backward runs five GEMMs to the forward's two
#: (the FLOPs convention the attention table's throughput is read in; it cancels out of the times)
ATTENTION_BACKWARD = 2.5
#: the head width the attention table was measured at; other widths are taken at its throughput
MEASURED_HEAD_DIM = 128
LAYOUTS = ("fprop", "dgrad", "wgrad")


def _read(name: str, table: str):
    import pandas as pd

    with resources.files("actmem.planner").joinpath("data", f"{name}_{table}.csv").open() as f:
        return pd.read_csv(f, comment="#")


@functools.cache
def _gemm_grid(name: str) -> tuple[np.ndarray, dict]:
    """(log2 of the measured dimensions, {layout: FLOP/s over [m, n, k]})."""
    frame = _read(name, "gemm")
    dims = np.array(sorted(set(frame.m)))
    grids = {}
    for layout, rows in frame.groupby("layout"):
        cube = rows.set_index(["m", "n", "k"]).graphed_seconds.unstack("k").reindex(columns=dims)
        seconds = cube.to_numpy().reshape(len(dims), len(dims), len(dims))
        flops = 2.0 * dims[:, None, None] * dims[None, :, None] * dims[None, None, :]
        grids[layout] = flops / seconds
    return np.log2(dims), grids


@functools.cache
def _attention_grid(name: str, backend: str, causal: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(log2 heads, log2 tokens, forward + backward FLOP/s over [heads, tokens]); a shape the
    benchmark skipped as too large takes the measured one with the most heads at its length."""
    frame = _read(name, "attention")
    frame = frame[(frame.backend == backend) & (frame.causal == int(causal))]
    seconds = frame.pivot(index="heads", columns="seq", values="forward_backward_graphed_seconds")
    heads, seq = seconds.index.to_numpy(), seconds.columns.to_numpy()
    flops = attention_flops(heads[:, None], seq[None, :], causal, MEASURED_HEAD_DIM)
    throughput = (flops / seconds).ffill()
    return np.log2(heads), np.log2(seq), throughput.to_numpy()


def attention_flops(heads, tokens, causal, head_dim):
    """Forward and backward FLOPs of attention over `tokens` queries and keys: QKᵀ and ·V, 4·t²·d a
    head forward (half of it causal), the backward ATTENTION_BACKWARD times that."""
    return (1 + ATTENTION_BACKWARD) * 4.0 * tokens * tokens * head_dim * heads / np.where(causal, 2, 1)


def _interpolate(axes: list, values: np.ndarray, points: list) -> np.ndarray:
    """Multilinear interpolation of values over a regular grid of axes at points (arrays), each
    coordinate clamped to its axis's range."""
    corners = []
    for axis, point in zip(axes, np.broadcast_arrays(*points)):
        x = np.clip(np.asarray(point, dtype=float), axis[0], axis[-1])
        i = np.clip(np.searchsorted(axis, x, side="right") - 1, 0, len(axis) - 2)
        corners.append((i, (x - axis[i]) / (axis[i + 1] - axis[i])))
    result = 0.0
    for offsets in np.ndindex(*(2,) * len(axes)):
        index = tuple(i + o for (i, _), o in zip(corners, offsets))
        weight = 1.0
        for (_, f), o in zip(corners, offsets):
            weight = weight * (f if o else 1 - f)
        result = result + weight * values[index]
    return result


@functools.cache
def _elementwise_grid(name: str, op: str) -> tuple[np.ndarray, np.ndarray]:
    """(log2 of the elements measured, seconds an element) of one memory-bound op, forward and backward."""
    frame = _read(name, "elementwise")
    rows = frame[frame.op == op].sort_values("width")
    elements = (rows.rows * rows.width).to_numpy(dtype=float)
    return np.log2(elements), rows.eager_seconds.to_numpy() / elements


def elementwise_seconds(name: str, op: str, elements):
    """A memory-bound op's forward and backward over `elements` (rows x its width; SwiGLU's output width),
    at the seconds an element measured at the nearest sizes (linear in log2 of the elements between
    them, held beyond). Eager PyTorch kernels of 8192 rows (benchmarks/gpu_kernel_tables.py,
    _elementwise_ops): long enough that their dispatch hides, but unfused where Megatron fuses
    SwiGLU and GeLU, and torch's norms rather than TE's."""
    axis, per_element = _elementwise_grid(name, op)
    elements = np.asarray(elements, dtype=float)
    return elements * _interpolate([axis], per_element, [np.log2(elements)])


#: SwiGLU against GeLU, accesses an output element, forward and backward: reading 2f and writing f,
#: then reading the gradient (f) and the input (2f) and writing 2f, 8 to GeLU's 2 + 3. The table has
#: no SwiGLU of its own: its measurement split the input twice (extra zeros, cat and add in backward)
SWIGLU_OVER_GELU = 8 / 5


def activation_seconds(name: str, activation: str, elements):
    """The MLP's activation over `elements` outputs: GeLU's measured seconds (squared ReLU's taken as
    GeLU's), SwiGLU's as GeLU's times SWIGLU_OVER_GELU."""
    return (SWIGLU_OVER_GELU if activation == "swiglu" else 1.0) * elementwise_seconds(name, "gelu", elements)


def linear_seconds(name: str, tokens, inputs, outputs):
    """One linear layer's forward and backward on a rank, y[T, out] = x[T, in]·Wᵀ: its forward
    (fprop m=T n=out k=in), its input gradient dx = dy·W (dgrad m=T n=in k=out) and its weight
    gradient dW = dyᵀ·x (wgrad m=out n=in k=T), each 2·T·in·out FLOPs at its measured throughput."""
    axis, grids = _gemm_grid(name)
    flops = 2.0 * np.asarray(tokens, dtype=float) * inputs * outputs
    shapes = {"fprop": (tokens, outputs, inputs), "dgrad": (tokens, inputs, outputs),
              "wgrad": (outputs, inputs, tokens)}
    return sum(flops / _interpolate([axis] * 3, grids[layout], [np.log2(d) for d in shapes[layout]])
               for layout in LAYOUTS)


def attention_seconds(name: str, backend: str, heads, tokens, c, head_dim=MEASURED_HEAD_DIM):
    """A rank's causal attention forward and backward over `heads` heads (b·a/t: a batch's
    sequences run as more heads) of `tokens` tokens a sequence, split over c context-parallel
    ranks. c = 1: one causal kernel. c > 1: Transformer Engine's ring (AttnFuncWithCPAndKVP2P,
    load-balanced into 2c chunks, two a rank) has each rank attend its tokens/c queries to every
    earlier key, tokens²/(2c) query-key pairs: at step 0 its own keys, one causal kernel over
    tokens/c; at each of the c - 1 others half a block, (tokens/c) x (tokens/2c), taken as half
    the non-causal kernel over tokens/c (its throughput at the square block's)."""
    c = np.asarray(c, dtype=float)
    block = np.asarray(tokens, dtype=float) / c
    total = 0.0
    for is_causal, blocks in ((True, 1.0), (False, (c - 1) / 2)):
        log_heads, log_tokens, grid = _attention_grid(name, backend, is_causal)
        throughput = _interpolate([log_heads, log_tokens], grid, [np.log2(heads), np.log2(block)])
        total = total + blocks * attention_flops(heads, block, is_causal, head_dim) / throughput
    return total
