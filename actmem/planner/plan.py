"""Choose t, c, p, m, b, sequence parallelism, recompute and the distributed optimizer.

Every valid configuration for a model, a GPU count and a global batch is enumerated as
one row of a pandas frame; memory (the engine's lambdified term table) and time (the
model in ``iteration``) are evaluated for all rows at once, never one sympy substitution
per configuration. Validity is ``actmem.model.rules``, the same rules a single spec obeys.
"""

import math
from dataclasses import dataclass, replace
from types import SimpleNamespace

import numpy as np
import pandas as pd

from actmem.model import defaults, rules
from actmem.memory import engine, fsdp
from actmem.planner import iteration
from actmem.model.architecture import PAPER, Architecture
from actmem.errors import SpecError
from actmem.planner.flops import mlp_tensor_parallel_share, model_flops
from actmem.model.hardware import DEFAULT_EFFICIENCY, DEFAULT_RESERVE, Gpu, gpu_label
from actmem.model.optimizer_state import OptimizerState
from actmem.memory.parameters import ParameterBytes, expert_parameters, first_stage_parameters, mtp_parameters, stage_state
from actmem.model.experts import capacity, check_routing, dense_twin, expert_shards, last_layer_moe
from actmem.model.fp8 import check_gpu, expert_block_rows, expert_padding_rows
from actmem.planner.expert_sweep import expert_sizes, expert_values, imbalance, middle_stages, mixed, prefix_or_periodic, \
    stage_kinds
from actmem.memory.pipeline import chunks_held, held_counts, split_text, stage_split
from actmem.model.recompute import Recompute
from actmem.model.spec import Model, check_imbalance, padded_vocab, require_positive_int
from actmem.memory.stage_model import StageCounts, largest_bytes, stage_activations
from actmem.memory.techniques import PLAN_BLOCK, PLAN_CHOICES, PLAN_RECOMPUTE, row_policy, run_technique
from actmem.units import parse_bytes
from actmem.model.widths import GRADIENT_BYTES, OPTIMIZER_BYTES, WEIGHT_BYTES

MEMORY_PARTS = ("activations_bytes", "weights_bytes", "gradients_bytes", "optimizer_bytes", "dummy_wgrads_bytes",
                "fp8_bytes", "transient_bytes")
"""The first stage's peak floor by part (actmem.memory.peak); they add to first_peak_bytes. Transient:
what the peak moment holds above the total (the rerun less what was freed, or the loss's
16-bit gradient where the stage holds the output layer; under FSDP2, whose total counts the
sharded gradients that its moments hold only from their reduce-scatter on, it can be below 0)."""

#: The largest inputs the sweep takes. Beyond them int64 parameter counts could overflow,
#: and the divisor loops and the grid grow past what answers in seconds.
LIMITS = {"gpus": 2**20, "global_batch": 2**24, "max_micro_batch": 1024, "gpus_per_node": 64,
          "vocab_divisible_by": 2**20, "gpu_memory_bytes": 2**50,
          "hidden": 2**17, "heads": 2**17, "layers": 2**14, "seq_len": 2**24, "vocab": 2**24}
MAX_CONFIGURATIONS = 1_000_000
"""Rows the sweep evaluates at once (about 300 MB of frame)."""
SATURATED_BYTES = 2**62
"""Activation counts are evaluated in float64: exact below 2^53 bytes (8 PiB), and stored
as at most this, which no GPU holds; the fits verdict is unaffected."""


#: (architecture -> true where the sweep does not model it, what it is, why not)
_NOT_SWEPT = (
    (lambda arch: arch.moe and not prefix_or_periodic(arch.moe_layer_freq), "this --moe-layer-freq pattern",
     "the sweep sizes dense layers first then MoE layers, as DeepSeek's first-k-dense, or one MoE layer every N"),
)


@dataclass(frozen=True)
class PlanRequest:
    model: Model
    gpus: int
    global_batch: int
    gpu: Gpu
    gpu_memory_bytes: int
    reserve_bytes: int = parse_bytes(DEFAULT_RESERVE)
    """Headroom kept free above the modelled peak for what no model knows (hardware.DEFAULT_RESERVE)."""
    gpus_per_node: int = defaults.GPUS_PER_NODE
    """Tensor parallelism stays inside a node: t <= gpus_per_node."""
    efficiency: float | None = None
    """Share of the peak every FLOP reaches, scaling every compute time alike; None: the GPU's measured
    kernels at each configuration's shapes where it has them (kernels.py), else DEFAULT_EFFICIENCY."""
    max_micro_batch: int = defaults.MAX_MICRO_BATCH
    vocab_divisible_by: int = defaults.VOCAB_DIVISIBLE_BY
    architecture: Architecture = PAPER
    gradient_bytes: int = GRADIENT_BYTES
    """Bytes a main gradient: 4 (fp32) or 2 (16-bit: a paste's fp16 without fp32 accumulation,
    or --grad-reduce-in-bf16), as estimate's Spec.gradient_bytes."""
    optimizer: OptimizerState = OptimizerState()
    """Adam's state, as estimate's Spec.optimizer: the precision-aware optimizer keeps only the
    distributed optimizer's rows (rules.py)."""
    routing_imbalance: object = 1
    """r >= 1 of a mixture of experts: the busiest rank's expert rows over the balanced count, as
    estimate's Run.routing_imbalance; the verdict is that rank's."""
    expert_loads: tuple | None = None
    """A per-expert load histogram in place of r (Run.expert_loads): each EP swept takes its busiest rank's."""
    overlap_grad_reduce: bool = False
    """Megatron's --overlap-grad-reduce (off by default): the gradient reduction overlaps the last
    microbatch's backward (iteration.exposed_data_parallel_seconds)."""
    overlap_param_gather: bool = False
    """Megatron's --overlap-param-gather (off by default; needs --overlap-grad-reduce): the distributed
    optimizer's all-gather overlaps the next iteration's forward."""
    gpu_default: bool = False
    """The GPU is actmem's default (hardware.DEFAULT_GPU), not one the input named: the output says so."""

    @property
    def gpu_label(self) -> str:
        """The GPU's name, and where it is actmem's default, that it is (as Spec.gpu_label)."""
        return gpu_label(self.gpu.name, self.gpu_default)

    def __post_init__(self):
        for name in ("gpus", "global_batch", "gpus_per_node", "max_micro_batch", "gpu_memory_bytes",
                     "vocab_divisible_by"):
            require_positive_int(name, getattr(self, name))
        # the precision-aware optimizer's master weight hangs on the FP8 recipe (OptimizerState.fp8_recipe)
        object.__setattr__(self, "optimizer", replace(self.optimizer, fp8_recipe=self.architecture.fp8))
        check_imbalance(self.routing_imbalance)
        if (self.routing_imbalance != 1 or self.expert_loads is not None) and not self.architecture.moe:
            raise SpecError("--moe-imbalance and --moe-load-histogram shape a mixture-of-experts layer: give "
                            "--num-experts")
        check_routing(self.architecture, self.routing_imbalance, self.expert_loads)
        check_gpu(self.architecture, self.gpu.fp8, self.gpu.name, self.gpu_default)
        if self.overlap_param_gather and not self.overlap_grad_reduce:
            raise SpecError("--overlap-param-gather needs --overlap-grad-reduce (Megatron asserts it: "
                            "arguments.py, 'Must use --overlap-param-gather with --overlap-grad-reduce')")
        for unswept, what, why in _NOT_SWEPT:
            if unswept(self.architecture):
                raise SpecError(f"plan does not sweep {what} yet ({why}): size one with `actmem estimate`")
        object.__setattr__(self, "vocab_divisible_by", self.architecture.code.stored_padding(
            self.vocab_divisible_by, defaults.VOCAB_DIVISIBLE_BY))
        sizes = {name: getattr(self, name, None) for name in LIMITS} | vars(self.model)
        for name, limit in LIMITS.items():
            if sizes[name] > limit:
                raise SpecError(f"plan: {name} ({sizes[name]:,}) is above the largest the planner "
                                f"sweeps ({limit:,})")
        whole = first_stage_parameters(self.model.hidden, self.model.layers, 1, 1, self.model.vocab,
                                       self.model.seq_len, self.architecture, self.model.heads) \
            + self.model.layers * expert_parameters(self.model.hidden, self.architecture, 1, 1)
        per_parameter = WEIGHT_BYTES + GRADIENT_BYTES + OPTIMIZER_BYTES
        if whole * per_parameter >= 2**62:      # Python ints here; the sweep counts in int64
            raise SpecError(f"plan: the model has {whole:,} parameters, more than the planner "
                            f"counts in int64 ({2**62 // per_parameter:,})")
        if not 0 <= self.reserve_bytes < self.gpu_memory_bytes:
            raise SpecError(f"reserve ({self.reserve_bytes:,} B) must be less than the GPU memory "
                            f"({self.gpu_memory_bytes:,} B)")
        if self.efficiency is not None and not (math.isfinite(self.efficiency) and 0 < self.efficiency <= 1):
            raise SpecError(f"efficiency must be in (0, 1], got {self.efficiency}")

    @property
    def budget_bytes(self) -> int:
        return self.gpu_memory_bytes - self.reserve_bytes


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending (trial division up to sqrt n)."""
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return sorted(set(small + [n // k for k in small]))


def _frame(column: str, values) -> pd.DataFrame:
    return pd.DataFrame({column: list(values)})


def tensor_parallel_sizes(req: PlanRequest) -> list[int]:
    """t dividing heads and hidden, at most a node."""
    return [t for t in divisors(math.gcd(req.model.heads, req.model.hidden)) if t <= req.gpus_per_node]


def context_parallel_sizes(req: PlanRequest) -> list[int]:
    """c with 2c | s (Megatron's 2c chunks a sequence), under the cuDNN flash core only; 1
    otherwise (actmem models context parallelism there alone), and where the implementation has none."""
    if req.architecture.attention_core != "flash" or "context" not in req.architecture.code.runs:
        return [1]
    return [c for c in divisors(req.model.seq_len) if req.model.seq_len % (2 * c) == 0 or c == 1]


STAGE_LAYERS = ("first_stage_layers", "stage_layers", "last_stage_layers")
"""A configuration's pipeline (pipeline.stage_split): the layers of its first stage, of each
stage between, and of its last; all L/p in an even pipeline."""


def pipeline_sizes(req: PlanRequest) -> list[int]:
    """The p the planner sweeps for L layers: those that split them (pipeline.stage_split),
    evenly (p | L) or as Llama 3 does; 1 where the implementation runs no pipeline (torch-native)."""
    if "pipeline" not in req.architecture.code.runs:
        return [1]
    layers = req.model.layers
    return [p for p in range(1, layers + 1) if stage_split(layers, p) is not None]


def _parallel_sizes(req: PlanRequest) -> pd.DataFrame:
    """(t, c, p, d) with t | heads, t | hidden, t <= a node, 2c | s, p splitting the layers
    (evenly, or uneven for p >= 3: pipeline.stage_split) and d = gpus/(t·c·p) | batch; with
    each p's stage layers."""
    model = req.model
    pipelines = set(pipeline_sizes(req))
    triples = [(t, c, p) for t in tensor_parallel_sizes(req) for c in context_parallel_sizes(req)
               for p in divisors(req.gpus // (t * c)) if req.gpus % (t * c) == 0 and p in pipelines]
    if not triples:
        raise SpecError(f"no t (dividing heads {model.heads} and hidden {model.hidden}, at most "
                        f"{req.gpus_per_node} a node) times p (splitting the {model.layers} layers) "
                        f"divides {req.gpus} GPUs")
    sizes = pd.DataFrame(triples, columns=["t", "c", "p"])
    splits = {p: stage_split(model.layers, p) for p in set(sizes.p)}
    for i, column in enumerate(STAGE_LAYERS):
        sizes[column] = sizes.p.map(lambda p: splits[p][i])
    sizes["d"] = req.gpus // (sizes.t * sizes.c * sizes.p)
    sizes = sizes[req.global_batch % sizes.d == 0]
    if sizes.empty:
        ds = sorted({req.gpus // (t * c * p) for t, c, p in triples})
        raise SpecError(f"global batch {req.global_batch} is divisible by none of the data-parallel "
                        f"sizes d = gpus/(t·c·p) possible here: {', '.join(map(str, ds))}")
    return sizes


def _switches(req: PlanRequest) -> pd.DataFrame:
    """SP, recompute (techniques.PLAN_RECOMPUTE) and the distributed optimizer: 20 combinations; without
    the MLP's recompute where every layer is a mixture of experts (the mlp module leaves a MoE layer whole:
    the same rows as without it)."""
    unmodelled = unmodelled_recompute(req)           # the rules would drop them: not made at all
    choices = [name for name, choice in PLAN_RECOMPUTE.items() if name not in unmodelled
               and not (req.architecture.moe and not mixed(req) and "mlp" in choice.modules)]
    return (_frame("sequence_parallel", [False, True])
            .merge(_frame("recompute", choices), how="cross")
            .merge(_frame("distributed_optimizer", [False, True]), how="cross"))


def candidates(req: PlanRequest) -> pd.DataFrame:
    """Every valid configuration, one a row: t p d b n m sequence_parallel recompute
    distributed_optimizer. Built in stages, each filtered before the next multiplies it."""
    model = req.model
    grid = _parallel_sizes(req).merge(expert_sizes(req), how="cross")
    grid["etp"] = np.where(grid.etp_is_t, grid.t, 1)
    # ETP 1 at t = 1 is ETP t; ETP 1 < t only where EP > 1: at EP = 1 Megatron reduces the experts' gradients
    # with the dense ones, over d·c (transformer_engine.py: allreduce = not (is_expert and EP > 1)), which would
    # leave whole experts on the t ranks training apart; the experts' ranks fit the GPUs
    grid = grid[(grid.etp_is_t | ((grid.t > 1) & (grid.ep > 1))) & (req.gpus % (grid.etp * grid.ep * grid.p) == 0)]
    grid = grid.drop(columns="etp_is_t")
    grid = grid.merge(_frame("b", range(1, req.max_micro_batch + 1)), how="cross")
    grid = grid[req.global_batch % (grid.b * grid.d) == 0]
    grid = grid.merge(_frame("m", divisors(model.layers)), how="cross")
    # interleaving in even pipelines only (Megatron's uneven split takes m = 1: rules.py)
    grid = grid[(grid.stage_layers % grid.m == 0) & ((grid.m == 1) | ~_uneven(grid))]
    switches = _switches(req)
    if len(grid) * len(switches) > MAX_CONFIGURATIONS:
        raise SpecError(f"the sweep would hold {len(grid) * len(switches):,} configurations, more "
                        f"than the planner evaluates at once ({MAX_CONFIGURATIONS:,}): lower "
                        f"--max-micro-batch ({req.max_micro_batch})")
    grid = grid.merge(switches, how="cross")
    # the distributed optimizer over one data-parallel rank (d·c = 1) shards nothing: Megatron allows
    # it, and its bytes are the plain optimizer's, so the sweep keeps only the plain row (the
    # precision-aware optimizer needs the distributed one: then only that row)
    grid = grid[~((grid.distributed_optimizer != req.optimizer.precision_aware) & (grid.d * grid.c == 1))]
    if req.overlap_param_gather:     # Megatron asserts the distributed optimizer (arguments.py, validate_args);
        grid = grid[grid.distributed_optimizer | (grid.d * grid.c == 1)]    # over one rank: the plain row's bytes
    grid["n"] = req.global_batch // (grid.b * grid.d)
    # where the implementation runs FSDP2 (torch-native) every row over d > 1 ranks is FSDP2's, as torchtitan shards
    # data parallelism (the rules refuse its DDP there); at d = 1, TP alone, as estimate prices it
    grid["fsdp"] = ("fsdp" in req.architecture.code.runs) & (grid.d > 1)
    uneven = _uneven(grid).to_numpy()
    valid = np.zeros(len(grid), dtype=bool)
    checked = []
    for rows, given in ((~uneven, False), (uneven, True)):   # the rules read an uneven split as
        if rows.any():                                      # given first and last stage layers
            values = _values(req, grid[rows], given)
            valid[rows] = rules.valid(values)
            checked.append((grid[rows], values))
    if len(grid) and not valid.any():
        _refuse_the_sweep(*checked[0])
    return grid[valid].reset_index(drop=True)


def _uneven(grid: pd.DataFrame) -> pd.Series:
    """Rows whose pipeline is not split evenly (p does not divide L)."""
    return (grid.first_stage_layers != grid.stage_layers) | (grid.last_stage_layers != grid.stage_layers)


def _values(req: PlanRequest, grid: pd.DataFrame, uneven: bool) -> rules.Values:
    """What the rules read, for rows of the sweep all even or all uneven (whose first and last
    stage layers are then given, as --first-stage-layers/--last-stage-layers give them)."""
    model = req.model
    return rules.Values(heads=model.heads, hidden=model.hidden, layers=model.layers,
                        seq_len=model.seq_len, t=grid.t, p=grid.p, m=grid.m, b=grid.b, c=grid.c,
                        core=req.architecture.attention_core,
                        sequence_parallel=grid.sequence_parallel,
                        distributed_optimizer=grid.distributed_optimizer, gpus=req.gpus,
                        fsdp=grid.fsdp, gradient_bytes=req.gradient_bytes, params_dtype=req.optimizer.params,
                        global_batch=req.global_batch, d=grid.d, n=grid.n,
                        ffn=req.architecture.ffn_hidden, groups=req.architecture.query_groups,
                        recompute=grid.recompute,
                        unmodelled_recompute=unmodelled_recompute(req),
                        code=req.architecture.code,
                        head_dim=req.architecture.head_dim_or(model.hidden, model.heads),
                        first=grid.first_stage_layers if uneven else None,
                        last=grid.last_stage_layers if uneven else None, architecture=req.architecture,
                        latent=True if req.architecture.multi_latent_attention else None,
                        precision_aware=req.optimizer.precision_aware, **expert_values(req, grid))


def _refuse_the_sweep(grid: pd.DataFrame, values: rules.Values) -> None:
    """Every row broke a rule: say which, for the sweep's first row (one SpecError)."""
    first = {name: value.iloc[0] if isinstance(value, pd.Series) else value
             for name, value in vars(values).items()}
    row = grid.iloc[0]
    try:
        rules.check(rules.Values(**first))
    except SpecError as error:
        raise SpecError(f"no configuration of the sweep is one actmem models; the first, t={row.t} "
                        f"p={row.p} b={row.b}: {error}") from None


def unmodelled_recompute(req: PlanRequest) -> dict:
    """{recompute choice: why actmem does not model it here}, by the sweep's names."""
    unmodelled = {}
    for name, choice in PLAN_RECOMPUTE.items():
        values = choice.run_values             # torchtitan's per-op checkpointing: its selective with its option
        why = req.architecture.unmodelled_recompute(req.model.heads, values["recompute_modules"],
                                                    values.get("selective_ac_option"))
        if values["recompute"] in why:
            unmodelled[name] = why[values["recompute"]]
    return unmodelled


STAGES = (("first", 0), ("middle", 1), ("last", None))
"""The stages whose peak the sweep sizes, by their columns' prefix ('' for the first), and
where each is (None: p - 1). Stage 1 holds the most of the stages between the first and the
last (one microbatch more than stage 2, the same layers); in an even pipeline it holds less
than the first (fewer microbatches, no embedding), so it decides only in an uneven one."""


def stage_column(stage: str, part: str) -> str:
    """A stage's column of a part: the first stage's unprefixed ('weights_bytes'), the others'
    with their name ('last_weights_bytes', 'middle_weights_bytes')."""
    return part if stage == "first" else f"{stage}_{part}"


def evaluate(req: PlanRequest, grid: pd.DataFrame) -> pd.DataFrame:
    """Memory per GPU and time per iteration, for every row at once. Memory is the peak floor
    (actmem.memory.peak) by part of the first stage, of the last, which holds the logits and the
    output layer's weights, and where p >= 3 of stage 1; the largest must fit the budget."""
    grid = grid.copy()
    if "recompute_layers" not in grid:
        grid["recompute_layers"] = 0                 # N of PLAN_BLOCK's rows; 0 on the others
    grid["vocab"] = padded_vocab(req.model.vocab, grid.t, req.vocab_divisible_by)
    grid["fused_softmax"] = fused_softmax(req, grid)
    peaks = {}
    grid["middle_stage"] = 1
    for name, stage in STAGES:
        memory = _stage_memory(req, grid, name, stage) if not (name == "middle" and mixed(req)) else \
            _heaviest_middle(req, grid)
        for part in MEMORY_PARTS + ("parameters", "layer_activations"):
            grid[stage_column(name, part)] = memory[part]
        peaks[name] = memory[list(MEMORY_PARTS)].sum(axis=1)
        grid[f"{name}_peak_bytes"] = peaks[name]
    grid["total_bytes"] = grid[list(MEMORY_PARTS[:-1])].sum(axis=1)
    grid["peak_bytes"] = grid[[f"{name}_peak_bytes" for name, _ in STAGES]].max(axis=1)
    grid["peak_stage"] = np.select([peaks["first"] == grid.peak_bytes, peaks["middle"] == grid.peak_bytes],
                                   ["first", "stage " + grid.middle_stage.astype(str)], "last")
    grid["fits"] = grid.peak_bytes <= req.budget_bytes
    _add_time(req, grid)
    return grid


def _heaviest_middle(req: PlanRequest, grid: pd.DataFrame) -> pd.DataFrame:
    """The stage between the first and the last whose peak is the largest, by row, among expert_sweep.middle_stages';
    its index goes to grid.middle_stage (the earliest where two tie)."""
    best, best_peak = None, None
    for stage in middle_stages(req, grid):
        memory = _stage_memory(req, grid, "middle", stage)
        peak = memory[list(MEMORY_PARTS)].sum(axis=1)
        if best is None:
            best, best_peak = memory, peak
            grid["middle_stage"] = stage
            continue
        heavier = peak > best_peak
        best = best.where(~heavier, memory)
        best_peak = best_peak.where(~heavier, peak)
        grid["middle_stage"] = np.where(heavier, stage, grid.middle_stage)
    return best


def _stage_memory(req: PlanRequest, grid: pd.DataFrame, name: str, stage) -> pd.DataFrame:
    """One stage's peak floor by part: the first (0), stage 1 (0 bytes where p < 3: no stage
    between) or the last (p - 1), each with its own layers (STAGE_LAYERS)."""
    model = req.model
    s, h, L = model.seq_len, model.hidden, model.layers
    layers_column = grid[dict(zip((stage for stage, _ in STAGES), STAGE_LAYERS))[name]]
    # numpy columns: the arithmetic below runs once a sweep, and pandas' per-operation overhead was a tenth of
    # the whole command (benchmarks/plan_sweep.py)
    g = SimpleNamespace(**{key: grid[key].to_numpy() for key in ("p", "m", "n", "t", "d", "c", "vocab", "ep", "etp")})
    layers = layers_column.to_numpy()
    stage_index = g.p - 1 if stage is None else stage
    held, embedding = held_counts(L, g.p, g.m, g.n, stage_layers=layers, stage=stage_index)
    last = (stage_index == g.p - 1).astype("int64")
    counts = pd.DataFrame({"layer_activations": held, "microbatches_held": embedding, "holds_output": last,
                           # the multi-token-prediction layers, on the last stage (stages.mtp_layers_held)
                           "mtp_layers": last * req.architecture.mtp_layers,
                           "chunk_layers": layers // g.m, "chunks": chunks_held(g.p, g.m, g.n, stage_index)},
                          index=grid.index)
    moe, last_moe = stage_kinds(req, grid, name, layers_column, grid.p - 1 if stage is None else stage)
    if moe is not None:
        counts["moe_layers"], counts["last_moe"] = moe, last_moe
    memory = pd.DataFrame(index=grid.index)
    memory["layer_activations"] = counts.layer_activations
    memory["activations_bytes"], memory["transient_bytes"] = _activations(req, grid, counts)
    shards = g.d * g.c
    # the multi-token-prediction layers' weights on the last stage, of the model's last layer's kind, beside
    # their own norms and projection (mtp_parameters), as estimate counts them
    mtp = counts.mtp_layers.to_numpy()
    if moe is not None:
        moe = moe + mtp * last_layer_moe(req.architecture, L)
    extra = mtp_parameters(h, g.t, g.vocab, req.architecture, g.p) * (mtp > 0)
    params = stage_state(h, L, g.p, g.t, g.vocab, s, req.architecture, model.heads, stage_layers=layers + mtp,
                         stage=stage_index, shards=shards, expert_shards=expert_shards(shards, req.gpus, g.etp, g.ep,
                                                                                       g.p),
                         distributed_optimizer=grid.distributed_optimizer.to_numpy().astype("int64"),
                         gradient_bytes=req.gradient_bytes, optimizer_bytes=req.optimizer.bytes_per_parameter,
                         ep=g.ep, etp=g.etp, moe_layers=moe, extra=extra,
                         dense_layers_too=False if moe is None else (moe > 0) & (moe < layers + mtp),
                         gpu_fp8=req.gpu.fp8, eh_projections=mtp)
    sharded = grid.fsdp.to_numpy()
    if sharded.any():        # FSDP2's state (fsdp.model_state); its gradients are held at some moments only
        params = _where(sharded, fsdp.model_state(sharded_model(req, g)), params)
    memory["parameters"] = params.count
    memory["weights_bytes"] = params.weights_bytes
    memory["gradients_bytes"] = params.gradients_bytes
    memory["optimizer_bytes"] = params.optimizer_bytes
    memory["dummy_wgrads_bytes"] = params.dummy_wgrads_bytes
    memory["fp8_bytes"] = params.fp8_bytes
    if name == "middle":
        memory = memory.mul(grid.p >= 3, axis=0)
    return memory


def sharded_model(req: PlanRequest, g) -> fsdp.ShardedModel:
    """torchtitan's Llama under FSDP2 for rows of the sweep (``g``: their d, t, vocab and n, as arrays): FSDP2
    over all d data-parallel ranks, torchtitan's default resharding, n microbatches a step (estimate's
    _sharded_model, over arrays)."""
    model = req.model
    return fsdp.sharded_model(model.hidden, g.t, g.vocab, req.architecture, model.heads, model.layers, g.d, g.n)


def _where(rows, sharded, plain):
    """FSDP2's ParameterBytes where ``rows`` (a boolean array), the plain (DDP) ones elsewhere."""
    return ParameterBytes(*(np.where(rows, getattr(sharded, part), getattr(plain, part))
                            for part in ("count", "weights_bytes", "gradients_bytes", "optimizer_bytes",
                                         "dummy_wgrads_bytes", "fp8_bytes")))


def fused_softmax(req: PlanRequest, grid: pd.DataFrame) -> np.ndarray:
    """Whether Megatron's fused softmax kernel runs at each row's b and t (rules.fused_softmax_runs):
    where it does not, the local core's rows are torch's fallback softmax's
    (Architecture.with_fused_softmax), evaluated as a group of their own."""
    shape = SimpleNamespace(seq_len=req.model.seq_len, heads=req.model.heads, b=grid.b.to_numpy(), t=grid.t.to_numpy())
    return np.broadcast_to(rules.fused_softmax_runs(shape), len(grid))


def _activations(req: PlanRequest, grid: pd.DataFrame, counts: pd.DataFrame) -> tuple:
    """(activations, transient): the stage model (actmem.memory.stage_model) over the sweep, its
    expressions lambdified on float64 columns (no int64 overflow), a group of rows at a time
    (SP, recompute, whether the fused softmax runs: fused_softmax, and FSDP2, whose moments hold its
    groups' weights and gradients: fsdp.stage_moments). Rows of PLAN_BLOCK are Megatron's block method
    with N = recompute_layers, a count of the model like the others."""
    held = pd.Series(0, index=grid.index, dtype="int64")
    transient = pd.Series(0, index=grid.index, dtype="int64")
    kind = counts.last_moe if "last_moe" in counts else pd.Series(True, index=grid.index)
    columns = {name: counts[name].to_numpy(dtype="float64") for name in counts}     # numpy: .loc a call was slow
    for (sp, recompute, fused, last_moe, fsdp_rows), rows in grid.assign(last_moe=kind).groupby(
            ["sequence_parallel", "recompute", "fused_softmax", "last_moe", "fsdp"]):
        model_arch = req.architecture.with_fused_softmax(bool(fused))
        choice = PLAN_CHOICES[recompute]
        technique = run_technique(bool(sp), choice)
        where = grid.index.get_indexer(rows.index)
        values = lambda name: columns[name][where] if name in columns else rows[name].to_numpy(dtype="float64")
        args = _numeric_args(req, values)
        per_chunk, arch, others = values("chunk_layers"), model_arch, ()
        if "moe_layers" in counts:        # dense layers among the MoE layers: the stage's last layer's kind and the other
            moe = values("moe_layers")
            dense = dense_twin(model_arch)
            arch, other = (model_arch, dense) if last_moe else (dense, model_arch)
            per_chunk, other_layers = (moe, per_chunk - moe) if last_moe else (per_chunk - moe, moe)
            others = ((other, other_layers),)
        # the multi-token-prediction layers, of the last stage's last layer's kind, held as its layers are; none under
        # full recompute, where Megatron checkpoints each whole (stages.mtp_layers_held)
        per_chunk = per_chunk + values("mtp_layers") * (choice.granularity is not Recompute.FULL)
        value = lambda expr: engine.numeric(expr)(*args)
        stage = stage_activations(technique, arch, value, StageCounts(
            per_chunk, values("chunks"), values("recompute_layers") if recompute == PLAN_BLOCK else None), others)
        gradients = 0
        if fsdp_rows:        # the moments hold FSDP2's gradients where they are live; the total counts them all
            model = sharded_model(req, SimpleNamespace(**{key: values(key) for key in ("t", "vocab", "d", "n")}))
            stage = replace(stage, moments=fsdp.stage_moments(stage, technique, arch, value, model))
            gradients = fsdp.model_state(model).gradients_bytes
        held[rows.index] = _whole_bytes(stage.held_bytes, len(rows))
        transient[rows.index] = _whole_bytes(largest_bytes(stage) - stage.held_bytes - gradients, len(rows))
    return held, transient


def _numeric_args(req: PlanRequest, values) -> tuple:
    """engine.NUMERIC_ARGS for rows of the sweep (values: a column by name, as float64)."""
    s, h, a, L = (float(x) for x in (req.model.seq_len, req.model.hidden, req.model.heads, req.model.layers))
    # context parallelism: each rank keeps s/c of every sequence (spec.bindings does the same)
    return (s / values("c"), values("b"), h, a, L, values("t"), values("p"), values("vocab"), values("m"),
            values("layer_activations"), values("microbatches_held"), values("holds_output"), values("c"),
            values("etp"), imbalance(req, values("ep")), values("ep"),
            capacity(req.architecture, s / values("c") * values("b") / values("t")),
            expert_padding_rows(req.architecture, values("ep")), expert_block_rows(req.architecture, values("ep")))


def _whole_bytes(values, rows: int) -> np.ndarray:
    values = np.minimum(np.broadcast_to(values, rows), SATURATED_BYTES)
    return np.rint(values).astype("int64")   # exact: whole bytes below 2^53


def _add_time(req: PlanRequest, grid: pd.DataFrame) -> None:
    model, gpu = req.model, req.gpu
    s, h, L = model.seq_len, model.hidden, model.layers
    # the pipeline goes at its slowest stage's pace: the most layers a stage has (L/p when even)
    paced = grid[list(STAGE_LAYERS)].max(axis=1)
    # block N reruns N of each chunk's layers, of the pacing stage's too (at most all of them);
    # every other choice all it recomputes
    chunk = paced // grid.m
    share = np.where(grid.recompute == PLAN_BLOCK, np.minimum(grid.recompute_layers, chunk) / chunk, 1.0)
    efficiency = _efficiencies(req, grid)
    for part, values in zip(EFFICIENCY_PARTS, efficiency):
        grid[part] = values
    grid["compute_s"] = iteration.compute_seconds(req.global_batch, s, L, h, grid.vocab, grid.recompute,
                                                  req.gpus, gpu.peak_flops, efficiency,
                                                  req.architecture, model.heads, share) * (grid.p * paced / L)
    # the forwards alone: a third of the compute without recompute; a recompute's rerun is in the backward
    forward_s = iteration.compute_seconds(req.global_batch, s, L, h, grid.vocab, "none", req.gpus, gpu.peak_flops,
                                          efficiency, req.architecture, model.heads) * (grid.p * paced / L) / 3
    s_rank = s // grid.c                                      # tokens of a sequence a rank holds
    grid["tensor_parallel_s"] = iteration.tensor_parallel_seconds(
        s_rank, grid.b, h, paced, grid.t, grid.n, grid.recompute, gpu.intra_node_bandwidth, share,
        mlp_tensor_parallel_share(req.architecture, L))
    grid["bubble"] = iteration.bubble_factor(grid.p, grid.m, grid.n)
    across_nodes = gpu.inter_node_bandwidth if req.gpus > req.gpus_per_node else gpu.intra_node_bandwidth
    ring = np.where(grid.t * grid.c <= req.gpus_per_node, gpu.intra_node_bandwidth, gpu.inter_node_bandwidth)
    grid["context_parallel_s"] = iteration.context_parallel_seconds(
        s_rank, grid.b, paced, grid.t, grid.c, grid.n, grid.recompute,
        req.architecture.kv_width(h, model.heads), ring, share)
    arch = req.architecture
    # the dispatcher's group: ETP·EP consecutive ranks (parallel_state.py orders the experts' ranks etp-ep-dp-pp)
    grid["expert_parallel_s"] = 0.0 if not arch.moe else iteration.expert_parallel_seconds(
        s_rank, grid.b, h, paced, grid.t, grid.ep, grid.etp, grid.n, arch.moe_topk, arch.moe_dispatcher, grid.recompute,
        np.where(grid.etp * grid.ep <= req.gpus_per_node, gpu.intra_node_bandwidth, gpu.inter_node_bandwidth), share)
    grid["pipeline_p2p_s"] = iteration.pipeline_p2p_seconds(s_rank, grid.b, h, grid.t, grid.p, grid.m,
                                                             grid.n, across_nodes)
    # each stage reduces its own gradients at once: the one with the most parameters finishes last
    reduced = grid[["parameters", "middle_parameters", "last_parameters"]].max(axis=1)
    reduce, gather = iteration.data_parallel_seconds(reduced, grid.d * grid.c, grid.distributed_optimizer,
                                                     across_nodes, req.gradient_bytes)
    grid["data_parallel_s"] = iteration.exposed_data_parallel_seconds(
        reduce, gather, reduced, grid.d * grid.c, grid.m, forward_s / grid.n, (grid.compute_s - forward_s) / grid.n,
        req.overlap_grad_reduce, req.overlap_param_gather, embedding=grid.vocab * h / grid.t)
    if grid.fsdp.any():          # FSDP2's collectives a microbatch in place of DDP's all-reduce (p = 1: torch-native)
        g = SimpleNamespace(**{key: grid[key].to_numpy() for key in ("t", "vocab", "d", "n")})
        shards = sharded_model(req, g)
        grid["data_parallel_s"] = np.where(grid.fsdp, iteration.fsdp_seconds(
            shards.shard, shards.embedding.sharded(g.d), g.d, g.n, forward_s / grid.n,
            (grid.compute_s - forward_s) / grid.n, across_nodes), grid.data_parallel_s)
    grid["iteration_s"] = ((grid.compute_s + grid.tensor_parallel_s + grid.context_parallel_s
                            + grid.expert_parallel_s + grid.pipeline_p2p_s) * grid.bubble + grid.data_parallel_s)
    flops = model_flops(req.global_batch, s, L, h, model.vocab, req.architecture, model.heads)
    grid["mfu"] = flops / (grid.iteration_s * req.gpus * gpu.peak_flops)


EFFICIENCY_PARTS = ("layers_efficiency", "scores_efficiency", "logits_efficiency")
"""The share of the peak compute_seconds takes each part at: the layers' matmuls, the attention
scores, the logits."""


def _efficiencies(req: PlanRequest, grid: pd.DataFrame) -> tuple:
    """compute_seconds' (layers, scores, logits) efficiencies, one a row: --efficiency for all where
    given, else the GPU's measured kernels at each row's shapes (iteration.kernel_efficiencies,
    evaluated once a distinct shape), else DEFAULT_EFFICIENCY."""
    if req.efficiency is not None or req.gpu.kernel_tables is None:
        flat = np.full(len(grid), DEFAULT_EFFICIENCY if req.efficiency is None else req.efficiency)
        return flat, flat, flat
    keys = ["t", "c", "b", "ep", "etp", "vocab", "sequence_parallel"]
    shapes, which = np.unique(grid[keys].to_numpy(dtype=float), axis=0, return_inverse=True)
    model = req.model
    parts = iteration.kernel_efficiencies(req.gpu.kernel_tables, req.architecture, model.seq_len, model.hidden,
                                          model.heads, shapes[:, 5], model.layers, *shapes[:, :5].T,
                                          req.gpu.peak_flops, shapes[:, 6].astype(bool))
    return tuple(np.broadcast_to(part, len(shapes))[which.ravel()] for part in parts)


@dataclass(frozen=True)
class Plan:
    request: PlanRequest
    evaluated: pd.DataFrame
    """Every configuration, fitting ones first, each group fastest first."""

    @property
    def fitting(self) -> pd.DataFrame:
        return self.evaluated[self.evaluated.fits]

    @property
    def block_rows(self) -> int:
        """Rows of block=N (block_recompute), derived from the swept configurations."""
        return int((self.evaluated.recompute == PLAN_BLOCK).sum())

    @property
    def swept(self) -> int:
        """The configurations the sweep evaluated (candidates), without the block=N rows."""
        return len(self.evaluated) - self.block_rows

    def why_not(self) -> pd.DataFrame:
        """For each t: its leanest configuration, and for a t where nothing fits, the part of
        the memory that is largest (what broke the budget)."""
        leanest = self.evaluated.loc[self.evaluated.groupby("t").peak_bytes.idxmin()].copy()
        leanest["over_bytes"] = leanest.peak_bytes - self.request.budget_bytes
        largest = {}
        for name, _ in STAGES:
            part = leanest[[stage_column(name, part) for part in MEMORY_PARTS]].idxmax(axis=1)
            largest[name] = part.str.removeprefix(stage_column(name, "")).str.removesuffix("_bytes")
        leanest["largest_part"] = np.select(
            [leanest.peak_stage == "first", leanest.peak_stage.str.startswith("stage ")],
            [largest["first"], largest["middle"] + " (" + leanest.peak_stage + ")"], largest["last"] + " (last stage)")
        any_fit = self.evaluated.groupby("t").fits.any()
        leanest["t_fits"] = leanest.t.map(any_fit)
        return leanest.reset_index(drop=True)


def plan(req: PlanRequest) -> Plan:
    evaluated = evaluate(req, candidates(req))
    evaluated = pd.concat([evaluated, block_recompute(req, evaluated)], ignore_index=True)
    ranked = evaluated.sort_values(["fits", "iteration_s", "peak_bytes"], ascending=[False, True, True])
    return Plan(req, ranked.reset_index(drop=True))


#: what a configuration is, beside its recompute: the columns its rows share
_CONFIGURATION = ["t", "c", "p", "ep", "etp", "m", "b", "sequence_parallel", "distributed_optimizer", "fsdp"]
CANDIDATE_COLUMNS = ["t", "c", "p", *STAGE_LAYERS, "d", "ep", "etp", "b", "m", "sequence_parallel", "recompute",
                     "distributed_optimizer", "fsdp", "n"]
"""A configuration as candidates() gives it, before evaluate()."""


def _per_layer_bytes(req: PlanRequest, rows: pd.DataFrame) -> tuple:
    """(a layer kept whole, its checkpoint) of one microbatch, by row, under full recompute."""
    layer = pd.Series(0.0, index=rows.index)
    checkpoint = pd.Series(0.0, index=rows.index)
    for (sp, fused), group in rows.groupby(["sequence_parallel", "fused_softmax"]):
        technique = run_technique(bool(sp), PLAN_RECOMPUTE["full"])
        arch = req.architecture.with_fused_softmax(bool(fused))
        counts = {"layer_activations", "microbatches_held", "holds_output"}     # a layer's bytes use none
        args = _numeric_args(req, lambda name: 0.0 if name in counts else group[name].to_numpy(dtype="float64"))
        checkpoint[group.index] = engine.numeric(engine.per_layer_bytes(technique, arch))(*args)
        layer[group.index] = engine.numeric(engine.per_layer_bytes(technique.whole(), arch))(*args)
    return layer, checkpoint


def block_recompute(req: PlanRequest, evaluated: pd.DataFrame) -> pd.DataFrame:
    """Megatron's partial full recompute (--recompute-method block --recompute-num-layers N),
    one row a configuration: the least N that fits, where nothing recomputed does not fit.
    On a stage whose chunks have more than N layers, the floor is full recompute's with the
    chunks in flight keeping their other layers whole rather than as checkpoints, and, as
    nothing is rerun before those are freed and the last layer is a whole one, the transient
    of the run without recompute (actmem.memory.peak): each layer more recomputed saves the stage
    its chunks in flight times a whole layer less its checkpoint, so it fits from
    N = ⌈(floor with every layer whole - budget) / saving⌉. On a stage whose chunks have N
    or fewer layers, every layer is checkpointed: full recompute's floor, which may be over
    the budget where N one short fits (a stage holding one chunk: 2sbh/t more, the rerun's
    output). So each stage fits on an interval of N, and the row takes the least N of all
    of them, at most the first stage's chunk (rules.py) and short of the largest chunk
    (else it is full recompute). A larger N may fit too but recomputes more, which the time
    model charges."""
    if "partial_recompute" not in req.architecture.code.runs or mixed(req) or req.architecture.mtp_layers:
        # dense layers among MoE layers, or multi-token prediction: no block method (rules.py)
        return evaluated.iloc[:0]
    transients = [stage_column(name, "transient_bytes") for name, _ in STAGES]
    none = evaluated.loc[evaluated.recompute == "none", _CONFIGURATION + ["fits"] + transients]
    full = evaluated[evaluated.recompute == "full"].merge(none, on=_CONFIGURATION, suffixes=("", "_none"))
    full = full[~full.fits_none]
    layer, checkpoint = (np.rint(part).astype("int64") for part in _per_layer_bytes(req, full))
    least, most = pd.Series(1, index=full.index), pd.Series(np.iinfo("int64").max, index=full.index)
    largest = pd.Series(0, index=full.index)
    for (name, _), column, transient in zip(STAGES, STAGE_LAYERS, transients):
        there = (full.p >= 3) if name == "middle" else pd.Series(True, index=full.index)
        per_chunk = full[column] // full.m
        held = full[stage_column(name, "layer_activations")]
        saved = held // per_chunk * (layer - checkpoint)               # a layer more recomputed
        every_layer_whole = full[f"{name}_peak_bytes"] - full[transient] + full[f"{transient}_none"] + held * (
            layer - checkpoint)
        linear = np.where(saved > 0, -(-(every_layer_whole - req.budget_bytes) // saved.clip(lower=1)), per_chunk)
        full_fits = full[f"{name}_peak_bytes"] <= req.budget_bytes
        low = np.where(linear < per_chunk, linear, np.where(full_fits, per_chunk, np.iinfo("int64").max))
        high = np.where(full_fits, np.iinfo("int64").max, per_chunk - 1)
        least = least.where(~there, np.maximum(least, low))
        most = most.where(~there, np.minimum(most, high))
        largest = largest.where(~there, np.maximum(largest, per_chunk))
    ok = (least <= most) & (least <= full.first_stage_layers // full.m) & (least < largest)
    rows = full.loc[ok, CANDIDATE_COLUMNS].assign(recompute=PLAN_BLOCK, recompute_layers=least[ok])
    if rows.empty:
        return evaluated.iloc[:0]
    block = evaluate(req, rows)
    return block[block.fits]


def config_label(row) -> str:
    """'t=8 p=8 m=3 b=1 sp sel' (+ ' dopt', or ' fsdp' for FSDP2 under torch-native; 'c=2' after t with context parallelism, then a mixture of
    experts' 'ep=8' where EP > 1 and 'etp=1' where ETP is not t; an uneven
    pipeline's layers as p, 'p=7+8x14+7', and no m; full recompute of N layers a chunk by
    Megatron's block method as 'block=N'): what --explain takes back (a recompute the plan
    does not sweep is written as given)."""
    short = (row_policy(row.recompute, row.recompute_layers).word if row.recompute in PLAN_CHOICES
             else row.recompute)                                    # a run's own word (run_label)
    cp = f" c={row.c}" if getattr(row, "c", 1) > 1 else ""
    pipeline = f"p={row.p} m={row.m}"
    between = getattr(row, "stage_layers", None)
    first, last = getattr(row, "first_stage_layers", between), getattr(row, "last_stage_layers", between)
    if (first, last) != (between, between):                 # uneven, so m = 1: Llama 3's 7+8x14+7
        pipeline = f"p={split_text(first, between, last, row.p)}"
    experts = (f" ep={row.ep}" if getattr(row, "ep", 1) > 1 else "") + (
        f" etp={row.etp}" if getattr(row, "etp", row.t) != row.t else "")
    label = f"t={row.t}{cp}{experts} {pipeline} b={row.b} {'sp' if row.sequence_parallel else 'nosp'} {short}"
    return label + (" dopt" if row.distributed_optimizer else "") + (" fsdp" if getattr(row, "fsdp", False) else "")
