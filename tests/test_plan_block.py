"""The planner's partial full recompute: Megatron's block method with the least N that fits,
sized and timed as the estimate sizes it, offered only where it is the answer."""

from dataclasses import replace

import pytest

from actmem.model.architecture import Architecture
from actmem.memory.estimate import estimate
from actmem.planner.explain import parse_config
from actmem.model.hardware import GPUS
from actmem.planner.plan import PlanRequest, config_label, plan
from actmem.sources.presets import load_preset
from actmem.model.spec import Model, build_spec
from tests.conftest import assert_one_line_error, plan_row_run

#: 530B, t = 8 with SP, s = 2048, b = 1, in bytes (tests/test_peak.py derives them): a layer
#: kept whole 34sbh/t + 5as²b/t, its checkpoint 2sbh/t, and the fc1 moment of a whole last
#: layer, 27 sbh/t above everything held
WHOLE, CHECKPOINT, FC1 = 513_802_240, 10_485_760, 141_557_760


def request(name, **overrides) -> PlanRequest:
    preset = load_preset(name)
    values = dict(model=Model(**preset.model), gpus=preset.run.get("gpus"), global_batch=preset.run.get("global_batch"),
                  gpu=GPUS["a100"], gpu_memory_bytes=80 * 2**30, architecture=Architecture(**preset.architecture))
    return PlanRequest(**values | overrides)


@pytest.fixture(scope="module")
def plan_530b():
    return plan(request("530b")).evaluated


def _row(frame, recompute, recompute_layers=0, **config):
    config = dict(t=8, c=1, p=35, m=1, b=1, sequence_parallel=True, distributed_optimizer=False) | config
    match = frame[(frame.recompute == recompute) & (frame.recompute_layers == recompute_layers)]
    for name, value in config.items():
        match = match[match[name] == value]
    assert len(match) == 1, (recompute, recompute_layers, config)
    return match.iloc[0]


def test_block_1_is_full_recompute_with_two_thirds_of_each_chunk_kept_whole(plan_530b):
    """530B on 280 A100s, t = 8 p = 35 m = 1 b = 1 with SP: 3 layers a chunk, 35 microbatches
    in flight on the first stage. Nothing recomputed needs more than the budget; full
    recompute fits. Block 1 keeps 2 of each chunk's 3 layers whole: 35 x 2 layers holding
    WHOLE - CHECKPOINT more each, and where full recompute's floor is its rerun (the layer
    less its checkpoint, its output again: WHOLE, then its fc1 moment, FC1), block's reruns
    nothing first and its last layer's fc1 moment is FC1."""
    none, full = _row(plan_530b, "none"), _row(plan_530b, "full")
    block = _row(plan_530b, "full:block", 1)
    assert not none.fits and full.fits and block.fits
    assert config_label(block) == "t=8 p=35 m=1 b=1 sp block=1"
    assert block.peak_bytes - full.peak_bytes == 35 * 2 * (WHOLE - CHECKPOINT) + FC1 - (WHOLE + FC1)
    assert block.peak_stage == full.peak_stage == "first"


def test_block_time_reruns_its_share_of_each_chunk(plan_530b):
    """Block 1 of 3 layers a chunk reruns a third of what full recompute reruns: compute
    none + (full - none)/3, and of the two forward all-reduces a layer full recompute repeats,
    a third: 4 + 2/3 collectives a layer where none has 4."""
    none, full, block = (_row(plan_530b, "none"), _row(plan_530b, "full"), _row(plan_530b, "full:block", 1))
    assert block.compute_s == pytest.approx(none.compute_s + (full.compute_s - none.compute_s) / 3)
    assert block.tensor_parallel_s == pytest.approx(none.tensor_parallel_s * (4 + 2 / 3) / 4)
    assert none.iteration_s < block.iteration_s < full.iteration_s


#: (preset, GPUs, global batch, GiB a GPU, GPU): even pipelines (530B, 1T, Llama 70B), and
#: uneven ones, where each stage's chunk is its own (Llama 8B's 32 layers on 96 GPUs: p = 3,
#: 6, 12 ...; Llama 405B's 126 on 16,384)
SWEEPS = [("530b", 280, 280, 80, "a100"), ("1t", 512, 512, 80, "a100"), ("llama-3.1-70b", 64, 64, 80, "a100"),
          ("llama-3.1-8b", 96, 96, 24, "h100"), ("llama-3.1-405b", 16384, 2048, 80, "h100")]


def _sweep(name, gpus, batch, memory_gib, gpu):
    req = request(name, gpus=gpus, global_batch=batch, gpu_memory_bytes=memory_gib * 2**30, gpu=GPUS[gpu])
    return req, plan(req).evaluated


def _verdict(preset, row, batch, **run):
    run = plan_row_run(row, gpus=row.d * row.t * row.c * row.p, global_batch=batch) | run
    return estimate(build_spec(preset.model, preset.run | run, architecture=preset.architecture)).verdict_bytes


def _sample(rows, each=6):
    """Rows of even and of uneven pipelines alike."""
    uneven = rows.first_stage_layers != rows.stage_layers
    return [*rows[~uneven].sample(min((~uneven).sum(), each), random_state=0).itertuples(),
            *rows[uneven].sample(min(uneven.sum(), each), random_state=0).itertuples()]


@pytest.mark.parametrize("name, gpus, batch, memory_gib, gpu", SWEEPS)
def test_each_block_row_is_the_estimate_s_verdict_and_the_least_n_that_fits(name, gpus, batch, memory_gib, gpu):
    """The sweep's block rows against `actmem estimate` with --recompute-method block: the peak
    to the byte, within the budget, and with N - 1 layers recomputed over it; only where
    nothing recomputed does not fit."""
    req, evaluated = _sweep(name, gpus, batch, memory_gib, gpu)
    block = evaluated[evaluated.recompute == "full:block"]
    assert len(block) > 0
    preset = load_preset(name)
    for row in _sample(block):
        run = parse_config(config_label(row), layers=req.model.layers)
        assert (run["recompute"], run["recompute_method"], run["recompute_layers"]) == ("full", "block",
                                                                                       row.recompute_layers)
        assert row.peak_bytes == _verdict(preset, row, batch) <= req.budget_bytes, config_label(row)
        none = evaluated[(evaluated.recompute == "none") & (evaluated.t == row.t) & (evaluated.c == row.c)
                         & (evaluated.p == row.p) & (evaluated.m == row.m) & (evaluated.b == row.b)
                         & (evaluated.sequence_parallel == row.sequence_parallel)
                         & (evaluated.distributed_optimizer == row.distributed_optimizer)]
        assert not none.fits.any(), config_label(row)
        if row.recompute_layers > 1:
            assert _verdict(preset, row, batch, recompute_layers=row.recompute_layers - 1) > req.budget_bytes


def test_block_fits_where_full_recompute_does_not_on_a_stage_holding_one_chunk():
    """GPT-3 on 64 GPUs, global batch 8: t = 8 p = 8 m = 1 b = 8 gives n = 1 microbatch, so every
    stage holds one chunk of 12 layers. Full recompute's peak is its last layer's rerun: the
    layer as kept whole less its checkpoint, and its output 2sbh/t made again. Block 11 keeps
    that layer whole instead and reruns nothing first: the same bytes less the output again,
    2sbh/t = 2·2048·8·12288/8 = 50,331,648 B under full recompute's peak. A budget between the
    two (61030 MiB less the 8 GiB reserve) fits block 11 and not full, nor block 10."""
    req = request("175b", gpus=64, global_batch=8, gpu_memory_bytes=61030 * 2**20)
    evaluated = plan(req).evaluated
    config = dict(t=8, p=8, m=1, b=8, sequence_parallel=True, distributed_optimizer=False)
    full, block = _row(evaluated, "full", **config), _row(evaluated, "full:block", 11, **config)
    assert full.peak_bytes - block.peak_bytes == 2 * 2048 * 8 * 12288 // 8 == 50_331_648
    assert block.fits and not full.fits
    preset = load_preset("175b")
    ten = parse_config("t=8 p=8 m=1 b=8 sp block=10") | {"gpus": 64, "global_batch": 8}
    assert estimate(build_spec(preset.model, ten)).verdict_bytes > req.budget_bytes


@pytest.mark.parametrize("name, gpus, batch, memory_gib, gpu", [("175b", 64, 8, 60, "a100"), *SWEEPS[:1], *SWEEPS[3:]])
def test_no_block_n_fits_where_the_sweep_offers_none(name, gpus, batch, memory_gib, gpu):
    """The other direction: configurations where nothing recomputed does not fit and the sweep
    has no block row: every N it could be (1 up to the first stage's chunk, rules.py, and short
    of the largest chunk) is over the budget by the exact estimate (a sample, each N tried)."""
    req, evaluated = _sweep(name, gpus, batch, memory_gib, gpu)
    key = ["t", "c", "p", "m", "b", "sequence_parallel", "distributed_optimizer"]
    offered = set(map(tuple, evaluated.loc[evaluated.recompute == "full:block", key].to_numpy()))
    none = evaluated[(evaluated.recompute == "none") & ~evaluated.fits]
    without = none[[tuple(row) not in offered for row in none[key].to_numpy()]]
    largest = without[["first_stage_layers", "stage_layers", "last_stage_layers"]].max(axis=1) // without.m
    without = without[largest >= 2]
    assert len(without) > 0
    preset = load_preset(name)
    for row in _sample(without, 4):
        largest = max(row.first_stage_layers, row.stage_layers, row.last_stage_layers) // row.m
        for n in range(1, min(row.first_stage_layers // row.m, largest - 1) + 1):
            assert _verdict(preset, row, batch, recompute="full", recompute_method="block",
                            recompute_layers=n) > req.budget_bytes, (config_label(row), n)


def test_block_on_the_last_stage_and_beside_context_parallelism():
    """Llama 3.1 70B on 64 H100s: block rows whose peak is the last stage's (a 128K vocabulary)
    and rows with c > 1, each the estimate's verdict; the context-parallel ring carries k and
    v 3 times a layer and once more in a rerun: block's N of a chunk's layers, 3 + N/(L/pm)."""
    req = request("llama-3.1-70b", gpus=64, global_batch=64, gpu=GPUS["h100"])
    evaluated = plan(req).evaluated
    block = evaluated[evaluated.recompute == "full:block"]
    preset = load_preset("llama-3.1-70b")
    for row in [*block[block.peak_stage == "last"].head(3).itertuples(), *block[block.c > 1].head(3).itertuples()]:
        run = plan_row_run(row, gpus=64, global_batch=64)
        assert row.peak_bytes == estimate(build_spec(preset.model, preset.run | run,
                                                     architecture=preset.architecture)).verdict_bytes
    row = block[block.c > 1].iloc[0]
    none = _row(evaluated, "none", t=row.t, c=row.c, p=row.p, m=row.m, b=row.b,
                sequence_parallel=row.sequence_parallel, distributed_optimizer=row.distributed_optimizer)
    share = row.recompute_layers / (row.stage_layers // row.m)
    assert row.context_parallel_s == pytest.approx(none.context_parallel_s * (3 + share) / 3)


def test_no_block_rows_where_the_code_does_not_have_them_and_uneven_ones_within_the_first_chunk():
    """torch-native runs no partial recompute (actmem models it for Megatron). In an uneven
    pipeline N is at most the first stage's chunk (rules.py: Megatron's N layers of each
    stage's own chunk; a stage with N or fewer checkpoints them all)."""
    llama_8b = request("llama-3.1-8b", gpus=8, global_batch=8, gpu_memory_bytes=24 * 2**30, reserve_bytes=0)
    assert (plan(llama_8b).evaluated.recompute_layers > 0).any()              # Megatron's: some
    torch_native = replace(llama_8b, architecture=replace(llama_8b.architecture, implementation="torch-native"))
    assert (plan(torch_native).evaluated.recompute_layers == 0).all()
    # Llama 3.1 8B (32 layers) on 96 GPUs: p = 3, 6, 12 ... split it unevenly, and at 24 GiB
    # nothing recomputed fits on some of those
    llama = plan(request("llama-3.1-8b", gpus=96, global_batch=96, gpu=GPUS["h100"],
                         gpu_memory_bytes=24 * 2**30)).evaluated
    uneven = llama[llama.first_stage_layers != llama.stage_layers]
    block = llama[llama.recompute == "full:block"]
    assert len(block) > 0 and not uneven[uneven.recompute == "none"].fits.all()
    split = block[block.first_stage_layers != block.stage_layers]
    assert len(split) > 0 and (split.recompute_layers <= split.first_stage_layers).all()
    assert (block.recompute_layers < block[["first_stage_layers", "stage_layers", "last_stage_layers"]].max(axis=1)
            // block.m).all()


def test_a_block_row_names_itself_and_cannot_be_read_as_plain_full(actmem):
    """JSON and CSV write block rows as recompute 'full:block' with recompute_layers N: the
    family's name alone is not a recompute one can run (no N), never taken for full recompute
    of every layer; with N it is the block method's run values."""
    from actmem.errors import SpecError
    from actmem.model.recompute import RecomputePolicy
    from actmem.memory.techniques import row_policy

    out = actmem.json("plan", "--model", "530b", "--gpus", "280", "--top", "0", "--format", "json")
    row = next(r for r in out["best"] if r["config"] == "t=8 p=35 m=1 b=1 sp block=1")
    assert (row["recompute"], row["recompute_layers"]) == ("full:block", 1)
    with pytest.raises(SpecError, match="full:block"):
        RecomputePolicy.parse(row["recompute"])
    assert row_policy(row["recompute"], row["recompute_layers"]).run_values == {
        "recompute": "full", "recompute_modules": None, "recompute_method": "block", "recompute_layers": 1}


def test_explain_reads_block_and_refuses_it_beside_another_recompute(actmem):
    run = parse_config("t=8 p=35 m=1 block=2")
    assert (run["recompute"], run["recompute_method"], run["recompute_layers"]) == ("full", "block", 2)
    shown = actmem("plan", "--model", "530b", "--explain", "t=8 p=35 m=1 b=1 sp block=1")
    assert shown.exit_code == 0 and "tp-sp-full·block 1" in shown.output
    assert_one_line_error(actmem("plan", "--model", "530b", "--explain", "t=8 p=35 m=1 full block=1"),
                          "recompute is given twice")
    assert_one_line_error(actmem("plan", "--model", "530b", "--explain", "t=8 p=35 m=1 block=4"),
                          "--recompute-num-layers (4) must not exceed")


def test_explain_of_block_as_large_as_the_first_stage_s_chunk_keeps_it_a_block_row():
    """Llama 3.1 405B, 7 + 8 x 14 + 7 with block=7: the first and last stages checkpoint every
    layer, the stages between keep one whole. --explain's row is the planner's block row
    (its time reruns 7 of 8 layers a stage between, not all), the same row as the sweep's."""
    from actmem.planner.explain import explain

    req = request("llama-3.1-405b", gpu=GPUS["h100"])
    _, row = explain(req, "t=8 p=7+8x14+7 b=1 sp block=7 dopt")
    assert (row.recompute, row.recompute_layers) == ("full:block", 7)
    evaluated = plan(req).evaluated
    config = dict(t=8, c=1, p=16, m=1, b=1, sequence_parallel=True, distributed_optimizer=True)
    full = _row(evaluated, "full", **config)
    none = _row(evaluated, "none", **config)
    assert row.compute_s == pytest.approx(none.compute_s + (full.compute_s - none.compute_s) * 7 / 8)


def test_block_time_is_the_pacing_stage_s_share():
    """An uneven split --explain takes though the sweep does not, heavier first and last:
    Llama 3.1 405B as 14 + 7 x 14 + 14, block=7. The pipeline goes at the pace of a 14-layer
    stage, and block 7 reruns 7 of its 14: half of what full recompute reruns there (not 7 of
    the stages between's 7, all of it)."""
    from actmem.planner.explain import explain

    req = request("llama-3.1-405b", gpu=GPUS["h100"])
    times = {config: explain(req, f"t=8 p=14+7x14+14 b=1 sp {config} dopt")[1].compute_s
             for config in ("none", "full", "block=7")}
    assert times["block=7"] == pytest.approx(times["none"] + (times["full"] - times["none"]) / 2)
