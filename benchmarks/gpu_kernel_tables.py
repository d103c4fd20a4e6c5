"""Measure the tables the planner's time model reads: bf16 GEMM and attention throughput by shape.

Run on the GPU the table is for (one GPU, nothing else running on it):

    python benchmarks/gpu_kernel_tables.py OUTDIR
    python benchmarks/gpu_kernel_tables.py --keep OUTDIR h100     # then, on any machine

The first writes OUTDIR/gemm.csv, OUTDIR/attention.csv and OUTDIR/meta.json; the second keeps them
for the planner, the meta line as their source, in actmem/planner/data/<gpu>_*.csv. Each is a measurement
of this script on that GPU, not a vendor number.

- gemm.csv: out[M, N] = A · B in bf16 (fp32 accumulation, cuBLAS through torch), every (M, N, K)
  of DIMS^3 in the three layouts a linear layer runs: fprop (out = X · W^T, torch's F.linear),
  dgrad (dX = dY · W) and wgrad (dW = dY^T · X). Random normal data (zeros run faster).
- elementwise.csv: the memory-bound kernels beside them (_elementwise_ops), forward and backward,
  on 8192 rows of several widths.
- attention.csv: torch's scaled_dot_product_attention in bf16, head dim 128, one batch of
  `heads` heads, q and k/v of `seq` tokens each, causal or not, through the flash and cuDNN
  backends; forward alone and forward + backward.

Each row has two timings (`timed`): eager, a Python loop launching the op as eager PyTorch code
does (small kernels then wait on the CPU's dispatch), and graphed, the same calls replayed from
a CUDA graph (the GPU's own time).
"""

import csv
import itertools
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

DIMS = [int(x) for x in os.environ.get("DIMS", "128 256 512 1024 2048 4096 8192 16384 32768").split()]
SEQS = [int(x) for x in os.environ.get("SEQS", "256 512 1024 2048 4096 8192 16384 32768").split()]
HEADS = [int(x) for x in os.environ.get("HEADS", "1 2 4 8 16 32 64 128").split()]
HEAD_DIM = 128
MAX_ATTENTION_FLOPS = float(os.environ.get("MAX_ATTENTION_FLOPS", "4e13"))
"""Forward FLOPs above which an attention shape is skipped (large shapes saturate; their time is long)."""
TARGET_SECONDS = 5e-3
TABLES = os.environ.get("TABLES", "attention gemm elementwise").split()
DEVICE = os.environ.get("DEVICE", "cuda")


def _synchronize():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn, graph=True) -> tuple[float, float | None]:
    """(eager, graphed) seconds per call. Eager: the median of three CUDA-event timings of `reps`
    back-to-back calls after two warm-ups, reps chosen so that one timing spans about 5 ms (at
    least 3 calls): what a Python loop launching it gets, the CPU's dispatch included where the
    kernel is shorter. Graphed: the same `reps` calls captured in one CUDA graph, replayed three
    times: the GPU's own time, no dispatch (None where capture fails)."""
    fn(), fn()
    _synchronize()
    start = time.perf_counter()
    fn()
    _synchronize()
    estimate = max(time.perf_counter() - start, 1e-6)
    reps = min(1000, max(3, math.ceil(TARGET_SECONDS / estimate)))
    eager = statistics.median(_timing(lambda: [fn() for _ in range(reps)]) / reps for _ in range(3))
    if DEVICE != "cuda" or not graph:       # the elementwise ops: long enough that eager is the GPU's time
        return eager, None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(), fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        graphed = statistics.median(_timing(graph.replay) / reps for _ in range(3))
        del graph
        return eager, graphed
    except RuntimeError as error:
        print("no graph:", str(error).splitlines()[0], flush=True)
        torch.cuda.synchronize()
        return eager, None


def _timing(run) -> float:
    """Seconds one run takes, by CUDA events (wall clock on a CPU)."""
    if DEVICE != "cuda":
        start = time.perf_counter()
        run()
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    run()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def gemm_rows():
    layouts = {
        "fprop": lambda m, n, k: ((m, k), (n, k), lambda a, b: F.linear(a, b)),
        "dgrad": lambda m, n, k: ((m, k), (k, n), lambda a, b: a @ b),
        "wgrad": lambda m, n, k: ((k, m), (k, n), lambda a, b: a.t() @ b),
    }
    for m, n, k in itertools.product(DIMS, repeat=3):
        for layout, make in layouts.items():
            a_shape, b_shape, op = make(m, n, k)
            a = torch.randn(a_shape, device=DEVICE, dtype=torch.bfloat16)
            b = torch.randn(b_shape, device=DEVICE, dtype=torch.bfloat16)
            eager, graphed = timed(lambda: op(a, b))
            yield dict(layout=layout, m=m, n=n, k=k, eager_seconds=eager, graphed_seconds=graphed)
            del a, b


def attention_rows():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    if DEVICE != "cuda":
        backends = {"math": SDPBackend.MATH}
    for backend, causal, heads, seq in itertools.product(backends, (True, False), HEADS, SEQS):
        flops = 4 * seq * seq * HEAD_DIM * heads / (2 if causal else 1)
        if flops > MAX_ATTENTION_FLOPS:
            continue
        q, k, v = (torch.randn(1, heads, seq, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn(1, heads, seq, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
        try:
            with sdpa_kernel(backends[backend]):
                forward = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                both = timed(lambda: torch.autograd.grad(
                    F.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), grad))
        except RuntimeError as error:       # a backend that refuses the shape: say so, go on
            print("skip", backend, causal, heads, seq, str(error).splitlines()[0], flush=True)
            continue
        yield dict(backend=backend, causal=int(causal), heads=heads, seq=seq, head_dim=HEAD_DIM,
                   forward_eager_seconds=forward[0], forward_graphed_seconds=forward[1],
                   forward_backward_eager_seconds=both[0], forward_backward_graphed_seconds=both[1],
                   forward_flops=flops)
        del q, k, v, grad


def _elementwise_ops():
    """name: (make inputs for rows x width, the forward) of the memory-bound kernels a layer runs
    beside its GEMMs, each timed forward and backward (autograd.grad of its output): the norms (with
    their weight's gradient), SwiGLU over [rows, 2·width] (width: its output), GeLU, a residual add
    (forward only: its backward hands the gradient on), a one-read-one-write op standing for a fused
    rope (x·2), and the loss's cross entropy over fp32 logits cast from bf16. Eager PyTorch kernels:
    Megatron fuses SwiGLU and GeLU with their bias (jit), which this does not."""
    bf16 = dict(device=DEVICE, dtype=torch.bfloat16)

    def tensor(*shape, grad=True):
        return torch.randn(*shape, **bf16).requires_grad_(grad)

    return {
        "rms_norm": (lambda r, w: (tensor(r, w), tensor(w)), lambda x, g: F.rms_norm(x, (x.shape[-1],), g)),
        "layer_norm": (lambda r, w: (tensor(r, w), tensor(w), tensor(w)),
                       lambda x, g, b: F.layer_norm(x, (x.shape[-1],), g, b)),
        "swiglu": (lambda r, w: (tensor(r, 2 * w),), lambda x: (lambda a, b: F.silu(a) * b)(*x.chunk(2, -1))),
        "gelu": (lambda r, w: (tensor(r, w),), lambda x: F.gelu(x, approximate="tanh")),
        "add": (lambda r, w: (tensor(r, w), tensor(r, w)), lambda x, y: x + y),
        "scale": (lambda r, w: (tensor(r, w),), lambda x: x * 2.0),
        "cross_entropy": (lambda r, w: (tensor(r, w), torch.randint(0, w, (r,)).to(DEVICE)),
                          lambda x, t: F.cross_entropy(x.float(), t)),
    }


ELEMENTWISE_ROWS = 8192
ELEMENTWISE_WIDTHS = [int(x) for x in os.environ.get("WIDTHS", "1024 4096 16384 32768").split()]


def elementwise_rows():
    for name, (make, forward) in _elementwise_ops().items():
        if name not in os.environ.get("OPS", name).split():
            continue
        for width in ELEMENTWISE_WIDTHS:
            inputs = make(ELEMENTWISE_ROWS, width)
            leaves = [x for x in inputs if x.requires_grad]
            out = forward(*inputs)
            grad = torch.ones_like(out) if out.dim() == 0 else torch.randn(out.shape, dtype=out.dtype).to(DEVICE)
            eager, graphed = timed(lambda: torch.autograd.grad(forward(*inputs), leaves, grad), graph=False)
            yield dict(op=name, rows=ELEMENTWISE_ROWS, width=width, eager_seconds=eager, graphed_seconds=graphed)
            del inputs, leaves, out, grad


def write(path, rows):
    rows = iter(rows)
    first = next(rows)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(first))
        writer.writeheader()
        for count, row in enumerate(itertools.chain([first], rows)):
            writer.writerow(row)
            f.flush()
            if count % 200 == 0:
                print(path, count, row, flush=True)


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    meta = dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__, script="benchmarks/gpu_kernel_tables.py")
    if DEVICE == "cuda":
        props = torch.cuda.get_device_properties(0)
        meta |= dict(gpu=props.name, multiprocessors=props.multi_processor_count, total_memory=props.total_memory,
                     cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    start = time.time()
    for table in TABLES:
        write(os.path.join(out, f"{table}.csv"), globals()[f"{table}_rows"]())
        meta[f"{table}_seconds"] = round(time.time() - start, 1)
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(json.dumps(meta), flush=True)


def keep(measured: str, name: str) -> None:
    """Write a measured OUTDIR as the planner's tables actmem/planner/data/<name>_gemm.csv and
    <name>_attention.csv: seconds to 4 significant digits, the meta line as a comment at the
    top (the tables' source)."""
    import pandas as pd

    meta = json.load(open(os.path.join(measured, "meta.json")))
    source = (f"# measured by {meta['script']} on one {meta['gpu']} ({meta['date']}, torch {meta['torch']}, "
              f"CUDA {meta['cuda']}, cuDNN {meta['cudnn']}); see that script's docstring\n")
    data = os.path.join(os.path.dirname(__file__), "..", "actmem", "planner", "data")
    missing = [t for t in ("gemm", "attention", "elementwise") if not os.path.exists(os.path.join(measured, f"{t}.csv"))]
    if missing:                 # the planner reads all three of a GPU's tables
        sys.exit(f"{measured} lacks {', '.join(missing)}.csv: measure every table of a GPU (TABLES)")
    for table in ("gemm", "attention", "elementwise"):
        frame = pd.read_csv(os.path.join(measured, f"{table}.csv")).drop(columns="forward_flops", errors="ignore")
        for column in (c for c in frame if c.endswith("_seconds")):
            frame[column] = frame[column].map(lambda x: float(f"{x:.4g}"))
        with open(os.path.join(data, f"{name}_{table}.csv"), "w") as f:
            f.write(source)
            frame.to_csv(f, index=False)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--keep"]:
        keep(*sys.argv[2:4])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "gpu_tables")
