"""`estimate` and `plan` evaluate one stage model (actmem.memory.stage_model): exactly for one
configuration, over arrays for the sweep. Over random models, architectures, clusters and
budgets, every row of the sweep (even and uneven pipelines, interleaving, every recompute
choice, Megatron's block method with any N, the fused softmax or torch's fallback) is the
estimate of the same configuration to the byte, stage by stage."""

from hypothesis import HealthCheck, assume, given, settings, strategies as st

from actmem.model.architecture import Architecture
from actmem.errors import SpecError
from actmem.memory.estimate import estimate
from actmem.model.hardware import GPUS
from actmem.model.optimizer_state import OptimizerState
from actmem.planner.plan import PLAN_BLOCK, PlanRequest, candidates, evaluate
from actmem.model.spec import Model, build_spec
from tests.conftest import plan_row_run

GIB = 2**30

#: architectures the sweep runs: the paper's eager layer (its fused softmax, or torch's fallback
#: at s > 4096 or an odd b·a/t; the dataloader's mask), today's flash layer (context
#: parallelism, rope fused or not, q and k norms, the mask), the squared ReLU, torchtitan's
#: layer; with and without dropout and gradient accumulation fusion
FLASH = dict(attention_core="flash", position_embedding="rope", activation="swiglu", normalization="rmsnorm",
             bias=False, tied_output=False, attention_dropout=0.0, hidden_dropout=0.0, query_groups=2)
ARCHITECTURES = [
    {},
    dict(attention_dropout=0.0, hidden_dropout=0.0, gradient_accumulation_fusion=False),
    FLASH,
    FLASH | dict(qk_norm=True, attention_mask=True, rope_fusion=False, rotary_percent=0.5),
    dict(attention_core="flash", activation="squared_relu", query_groups=2, attention_dropout=0.0),
    dict(masked_softmax_fusion=False, attention_mask=True, softmax_in_fp32=True),
    FLASH | dict(implementation="torch-native"),
]
#: the model state's dtypes: fp32 or 16-bit main gradients; Megatron's Adam or TE's
#: precision-aware one with bf16 moments
STATES = [dict(), dict(gradient_bytes=2), dict(optimizer=OptimizerState(True, "fp32", "bf16", "bf16"))]


@st.composite
def sweeps(draw):
    heads = draw(st.sampled_from([4, 8, 16]))
    model = Model(heads=heads, hidden=heads * draw(st.sampled_from([16, 32, 64])), layers=draw(st.integers(2, 18)),
                  vocab=draw(st.integers(500, 3000)), seq_len=draw(st.sampled_from([64, 256, 1024, 5120])))
    architecture = draw(st.sampled_from(ARCHITECTURES))
    gpus = draw(st.sampled_from([1, 2, 4, 6, 8, 16, 24]))
    batch = gpus * draw(st.sampled_from([1, 2, 3, 4, 8]))
    memory = draw(st.integers(1, 64)) * GIB // 4
    return model, architecture, gpus, batch, memory, draw(st.sampled_from(STATES))


def _rows(req: PlanRequest, grid, draw):
    """A sample of the sweep's rows, and of block rows made from its full-recompute rows with a
    drawn N within the first stage's chunk (rules.py)."""
    full = grid[(grid.recompute == "full") & (grid.first_stage_layers // grid.m > 1)]
    if "partial_recompute" not in req.architecture.code.runs:       # Megatron's alone (rules.py)
        full = full.iloc[:0]
    block = full.assign(recompute=PLAN_BLOCK,
                        recompute_layers=[draw(st.integers(1, max(1, layers // m - 1)))
                                          for layers, m in zip(full.first_stage_layers, full.m)])
    evaluated = evaluate(req, grid)
    blocks = evaluate(req, block) if len(block) else block
    take = lambda frame, n: frame.sample(min(n, len(frame)), random_state=draw(st.integers(0, 99)))
    return [*take(evaluated, 6).itertuples(), *take(blocks, 3).itertuples()]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(sweep=sweeps(), data=st.data())
def test_the_sweep_is_the_estimate_stage_by_stage(sweep, data):
    model, architecture, gpus, batch, memory, state = sweep
    req = PlanRequest(model=model, gpus=gpus, global_batch=batch, gpu=GPUS["h100"], gpu_memory_bytes=memory,
                      reserve_bytes=memory // 8, architecture=Architecture(**architecture), max_micro_batch=4, **state)
    try:
        grid = candidates(req)
    except SpecError:                              # no configuration of this model is one actmem models
        assume(False)
    for row in _rows(req, grid, data.draw):
        run = plan_row_run(row, gpus=gpus, global_batch=batch)
        spec = build_spec(vars(model), run, architecture=architecture, gpu_memory_bytes=memory,
                          reserve_bytes=memory // 8, **state)
        est = estimate(spec)
        peaks = [load.peak.total_bytes for load in est.stages]
        assert (est.activations_bytes, est.total_bytes) == (row.activations_bytes, row.total_bytes), run
        assert peaks[0] == row.first_peak_bytes and peaks[-1] == row.last_peak_bytes, run
        if row.p >= 3:
            assert peaks[1] == row.middle_peak_bytes, run
        assert est.verdict_bytes == row.peak_bytes and est.fits == bool(row.fits), run
        named = {"first": 0, "stage 1": 1, "last": row.p - 1}[row.peak_stage]
        assert peaks[named] == est.verdict_bytes, run                 # the stage it names is a busiest one


def test_a_moment_under_a_condition_of_the_sweep_holds_where_it_holds():
    """Block N of 3-layer chunks (530B): N = 3 checkpoints every layer, so the first backward
    reruns one (the rerun moment is there); N = 2 keeps the last layer whole (no rerun moment,
    and its fc1 moment is a whole layer's): the same arithmetic on ints and on arrays."""
    import numpy as np

    from actmem.memory import engine
    from actmem.memory.stage_model import StageCounts, largest_bytes, stage_activations
    from actmem.model.recompute import RecomputePolicy
    from actmem.memory.techniques import run_technique
    from actmem.model.recompute import Recompute
    from actmem.sources.presets import load_preset

    preset = load_preset("530b")
    spec = build_spec(preset.model, preset.run | dict(interleave=1, pipeline_parallel=35))
    bindings = spec.bindings() | {engine.holds_output: 0, engine.microbatches_held: 35}
    exact = lambda expr: engine.exact(expr, bindings)
    technique = run_technique(True, RecomputePolicy(Recompute.FULL, method="block"))
    ints = [stage_activations(technique, spec.architecture, exact, StageCounts(3, 35, n)) for n in (2, 3)]
    reruns = [[moment.name for moment in stage.moments if moment.present] for stage in ints]
    assert "rerun" not in reruns[0] and "rerun" in reruns[1]
    arrays = stage_activations(technique, spec.architecture, lambda expr: float(exact(expr)),
                               StageCounts(np.array([3.0, 3.0]), np.array([35.0, 35.0]), np.array([2.0, 3.0])))
    for i, stage in enumerate(ints):
        assert arrays.held_bytes[i] == stage.held_bytes
        assert largest_bytes(arrays)[i] == max(moment.bytes for moment in stage.moments if moment.present)
