"""Choose t, p, m, b, sequence parallelism, recompute and the distributed optimizer.

Every valid configuration for a model, a GPU count and a global batch is enumerated as
one row of a pandas frame; memory (the engine's lambdified term table) and time (the
model in ``iteration``) are evaluated for all rows at once, never one sympy substitution
per configuration.
"""

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from actmem import engine, iteration
from actmem.errors import SpecError
from actmem.flops import model_flops
from actmem.hardware import DEFAULT_EFFICIENCY, Gpu
from actmem.parameters import GRADIENT_BYTES, OPTIMIZER_BYTES, WEIGHT_BYTES, first_stage_parameters
from actmem.pipeline import held_counts
from actmem.spec import Model, padded_vocab, require_positive_int
from actmem.techniques import run_technique
from actmem.terms import Recompute

MEMORY_PARTS = ("activations_bytes", "weights_bytes", "gradients_bytes", "optimizer_bytes")


@dataclass(frozen=True)
class PlanRequest:
    model: Model
    gpus: int
    global_batch: int
    gpu: Gpu
    gpu_memory_bytes: int
    reserve_bytes: int = 0
    """Headroom kept free for the allocator, workspaces and communication buffers."""
    gpus_per_node: int = 8
    """Tensor parallelism stays inside a node: t <= gpus_per_node."""
    efficiency: float = DEFAULT_EFFICIENCY
    """Share of the peak the matmuls reach; scales every compute time alike."""
    max_micro_batch: int = 16
    vocab_divisible_by: int = 128

    def __post_init__(self):
        for name in ("gpus", "global_batch", "gpus_per_node", "max_micro_batch", "gpu_memory_bytes"):
            require_positive_int(name, getattr(self, name))
        if not 0 <= self.reserve_bytes < self.gpu_memory_bytes:
            raise SpecError(f"reserve ({self.reserve_bytes:,} B) must be less than the GPU memory "
                            f"({self.gpu_memory_bytes:,} B)")
        if not 0 < self.efficiency <= 1:
            raise SpecError(f"efficiency must be in (0, 1], got {self.efficiency}")

    @property
    def budget_bytes(self) -> int:
        return self.gpu_memory_bytes - self.reserve_bytes


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _frame(column: str, values) -> pd.DataFrame:
    return pd.DataFrame({column: list(values)})


def _parallel_sizes(req: PlanRequest) -> pd.DataFrame:
    """(t, p, d) with t | heads, t | hidden, t <= a node, p | layers, d = gpus/(t·p) | batch."""
    model = req.model
    ts = [t for t in _divisors(math.gcd(model.heads, model.hidden)) if t <= req.gpus_per_node]
    pairs = [(t, p) for t in ts for p in _divisors(model.layers) if req.gpus % (t * p) == 0]
    if not pairs:
        raise SpecError(f"no t (dividing heads {model.heads} and hidden {model.hidden}, at most "
                        f"{req.gpus_per_node} a node) times p (dividing layers {model.layers}) "
                        f"divides {req.gpus} GPUs")
    sizes = pd.DataFrame(pairs, columns=["t", "p"])
    sizes["d"] = req.gpus // (sizes.t * sizes.p)
    sizes = sizes[req.global_batch % sizes.d == 0]
    if sizes.empty:
        ds = sorted({req.gpus // (t * p) for t, p in pairs})
        raise SpecError(f"global batch {req.global_batch} is divisible by none of the data-parallel "
                        f"sizes d = gpus/(t·p) possible here: {', '.join(map(str, ds))}")
    return sizes


def candidates(req: PlanRequest) -> pd.DataFrame:
    """Every valid configuration, one a row: t p d b n m sequence_parallel recompute
    distributed_optimizer."""
    model = req.model
    grid = (_parallel_sizes(req)
            .merge(_frame("b", range(1, req.max_micro_batch + 1)), how="cross")
            .merge(_frame("m", _divisors(model.layers)), how="cross")
            .merge(_frame("sequence_parallel", [False, True]), how="cross")
            .merge(_frame("recompute", [mode.value for mode in Recompute]), how="cross")
            .merge(_frame("distributed_optimizer", [False, True]), how="cross"))
    grid = grid[req.global_batch % (grid.b * grid.d) == 0]
    grid["n"] = req.global_batch // (grid.b * grid.d)
    valid = (
        ((model.layers // grid.p) % grid.m == 0)
        # Megatron's interleaved schedule: p > 1 and microbatches a multiple of p
        & ((grid.m == 1) | ((grid.p > 1) & (grid.n % grid.p == 0)))
        & (~grid.sequence_parallel | ((grid.t > 1) & (model.seq_len % grid.t == 0)))
        & (~grid.distributed_optimizer | (grid.d > 1))       # d = 1: nothing to shard
    )
    return grid[valid].reset_index(drop=True)


def evaluate(req: PlanRequest, grid: pd.DataFrame) -> pd.DataFrame:
    """Memory per GPU of the first stage and time per iteration, for every row at once."""
    grid = grid.copy()
    model = req.model
    s, h, a, L = model.seq_len, model.hidden, model.heads, model.layers
    grid["vocab"] = padded_vocab(model.vocab, grid.t, req.vocab_divisible_by)
    grid["layer_activations"], grid["microbatches_held"] = held_counts(L, grid.p, grid.m, grid.n)
    grid["activations_bytes"] = _activations(grid, s, h, a, L)
    count = first_stage_parameters(h, L, grid.p, grid.t, grid.vocab, s)
    shards = np.where(grid.distributed_optimizer, grid.d, 1)
    grid["parameters"] = count
    grid["weights_bytes"] = WEIGHT_BYTES * count
    grid["gradients_bytes"] = GRADIENT_BYTES * count
    grid["optimizer_bytes"] = -(-OPTIMIZER_BYTES * count // shards)
    grid["total_bytes"] = grid[list(MEMORY_PARTS)].sum(axis=1)
    grid["fits"] = grid.total_bytes <= req.budget_bytes
    _add_time(req, grid)
    return grid


def _activations(grid: pd.DataFrame, s, h, a, L) -> pd.Series:
    result = pd.Series(0, index=grid.index, dtype="int64")
    for (sp, recompute), rows in grid.groupby(["sequence_parallel", "recompute"]):
        f = engine.numeric(engine.held_bytes(run_technique(bool(sp), Recompute(recompute))))
        values = f(s, rows.b, h, a, L, rows.t, rows.p, rows.vocab, rows.m,
                   rows.layer_activations, rows.microbatches_held, (rows.p == 1).astype(int))
        result[rows.index] = np.rint(values).astype("int64")   # exact: whole bytes below 2^53
    return result


def _add_time(req: PlanRequest, grid: pd.DataFrame) -> None:
    model, gpu = req.model, req.gpu
    s, h, L = model.seq_len, model.hidden, model.layers
    grid["compute_s"] = iteration.compute_seconds(req.global_batch, s, L, h, grid.vocab, grid.recompute,
                                                  req.gpus, gpu.peak_flops, req.efficiency)
    grid["tensor_parallel_s"] = iteration.tensor_parallel_seconds(
        s, grid.b, h, L, grid.p, grid.t, grid.n, grid.recompute, gpu.intra_node_bandwidth)
    grid["bubble"] = iteration.bubble_factor(grid.p, grid.m, grid.n)
    across_nodes = gpu.inter_node_bandwidth if req.gpus > req.gpus_per_node else gpu.intra_node_bandwidth
    grid["pipeline_p2p_s"] = iteration.pipeline_p2p_seconds(s, grid.b, h, grid.t, grid.p, grid.m,
                                                             grid.n, across_nodes)
    grid["data_parallel_s"] = iteration.data_parallel_seconds(grid.parameters, grid.d,
                                                              grid.distributed_optimizer, across_nodes)
    grid["iteration_s"] = ((grid.compute_s + grid.tensor_parallel_s + grid.pipeline_p2p_s) * grid.bubble
                           + grid.data_parallel_s)
    flops = model_flops(req.global_batch, s, L, h, model.vocab)
    grid["mfu"] = flops / (grid.iteration_s * req.gpus * gpu.peak_flops)


@dataclass(frozen=True)
class Plan:
    request: PlanRequest
    evaluated: pd.DataFrame
    """Every configuration, fitting ones first, each group fastest first."""

    @property
    def fitting(self) -> pd.DataFrame:
        return self.evaluated[self.evaluated.fits]

    def why_not(self) -> pd.DataFrame:
        """For each t: its leanest configuration, and for a t where nothing fits, the part of
        the memory that is largest (what broke the budget)."""
        leanest = self.evaluated.loc[self.evaluated.groupby("t").total_bytes.idxmin()].copy()
        leanest["over_bytes"] = leanest.total_bytes - self.request.budget_bytes
        leanest["largest_part"] = leanest[list(MEMORY_PARTS)].idxmax(axis=1).str.removesuffix("_bytes")
        any_fit = self.evaluated.groupby("t").fits.any()
        leanest["t_fits"] = leanest.t.map(any_fit)
        return leanest.reset_index(drop=True)


def plan(req: PlanRequest) -> Plan:
    evaluated = evaluate(req, candidates(req))
    ranked = evaluated.sort_values(["fits", "iteration_s", "total_bytes"], ascending=[False, True, True])
    return Plan(req, ranked.reset_index(drop=True))


def config_label(row) -> str:
    """'t=8 p=8 m=3 b=1 sp sel' (+ ' dopt'): what --explain takes back."""
    short = {"none": "none", "selective": "sel", "full": "full"}[row.recompute]
    label = (f"t={row.t} p={row.p} m={row.m} b={row.b} {'sp' if row.sequence_parallel else 'nosp'} "
             f"{short}")
    return label + (" dopt" if row.distributed_optimizer else "")


_RECOMPUTE_WORDS = {"none": "none", "sel": "selective", "selective": "selective", "full": "full"}


def parse_config(text: str) -> dict:
    """'t=8 p=8 m=3 b=1 sp sel dopt' (commas or spaces) -> run values; unnamed ones default to
    t = p = m = b = 1, no SP, no recompute, no distributed optimizer."""
    run = {"tensor_parallel": 1, "pipeline_parallel": 1, "interleave": 1, "micro_batch": 1,
           "sequence_parallel": False, "recompute": "none", "distributed_optimizer": False}
    keys = {"t": "tensor_parallel", "p": "pipeline_parallel", "m": "interleave", "b": "micro_batch"}
    for token in text.replace(",", " ").split():
        key, _, value = token.partition("=")
        if key in keys and value.isdigit():
            run[keys[key]] = int(value)
        elif token in ("sp", "nosp"):
            run["sequence_parallel"] = token == "sp"
        elif token in _RECOMPUTE_WORDS:
            run["recompute"] = _RECOMPUTE_WORDS[token]
        elif token in ("dopt", "nodopt"):
            run["distributed_optimizer"] = token == "dopt"
        else:
            raise SpecError(f"--explain: cannot read {token!r} in {text!r}; write it as the plan "
                            f"prints it, e.g. 't=8 p=8 m=3 b=1 sp sel'")
    return run


def explain(req: PlanRequest, config: str):
    """One configuration in full: the exact estimate and its time breakdown."""
    from actmem.estimate import estimate
    from actmem.spec import Run, Spec

    run = parse_config(config)
    spec = Spec(req.model, Run(**run | {"recompute": Recompute(run["recompute"]),
                                        "gpus": req.gpus, "global_batch": req.global_batch}),
                gpu_memory_bytes=req.budget_bytes, vocab_divisible_by=req.vocab_divisible_by)
    row = pd.DataFrame([{"t": spec.run.tensor_parallel, "p": spec.run.pipeline_parallel,
                         "d": spec.data_parallel, "b": spec.run.micro_batch, "n": spec.microbatches,
                         "m": spec.run.interleave, "sequence_parallel": spec.run.sequence_parallel,
                         "recompute": spec.run.recompute.value,
                         "distributed_optimizer": spec.run.distributed_optimizer}])
    return estimate(spec), evaluate(req, row).iloc[0]
