"""The planner's uneven pipelines: Llama 3's split, sized on every stage that can decide,
timed at its fullest stage's pace, and read back by --explain."""

import json

import pytest

from actmem.architecture import Architecture
from actmem.estimate import estimate
from actmem.explain import parse_config
from actmem.hardware import GPUS
from actmem.pipeline import stage_split
from actmem.plan import PlanRequest, config_label, plan
from actmem.presets import load_preset
from actmem.spec import Model, build_spec
from tests.conftest import assert_one_line_error

LLAMA = load_preset("llama-3.1-405b")


def llama_request(**overrides) -> PlanRequest:
    """Table 4's 8K run: 16,384 H100s, global batch 2,048."""
    values = dict(model=Model(**LLAMA.model), gpus=16384, global_batch=2048, gpu=GPUS["h100"],
                  gpu_memory_bytes=80 * 2**30, architecture=Architecture(**LLAMA.architecture))
    return PlanRequest(**values | overrides)


@pytest.mark.parametrize("layers, p, split", [
    (126, 16, (7, 8, 7)),        # Llama 3 paper, section 3.3.2: 7, then 8 on each of 14, then 7
    (96, 8, (12, 12, 12)),       # p | L: even
    (128, 13, (9, 10, 9)),       # ⌈128/13⌉ = 10 on 11 stages, 128 - 110 = 18 = 9 + 9
    (105, 16, (3, 7, 4)),        # 105 - 14 x 7 = 7: the first takes the smaller half
    (126, 64, (1, 2, 1)),        # 126 - 62 x 2 = 2: a layer each
    (105, 2, None),              # no stage between, and 105 is odd
    (128, 24, None),             # 128 - 22 x 6 = -4
    (126, 128, None),            # more stages than layers
])
def test_stage_split_by_hand(layers, p, split):
    assert stage_split(layers, p) == split


@pytest.fixture(scope="module")
def llama_plan():
    return plan(llama_request()).evaluated


def _row(frame, **columns):
    match = frame
    for name, value in columns.items():
        match = match[match[name] == value]
    assert len(match) == 1, columns
    return match.iloc[0]


PUBLISHED = dict(t=8, c=1, p=16, b=1, sequence_parallel=True, recompute="none", distributed_optimizer=True)


def test_the_llama_3_run_is_swept_and_sized_as_the_estimate_sizes_it(llama_plan):
    """Table 4's row (TP 8, PP 16, DP 128 at 8K) with section 3.3.2's 7 + 8 x 14 + 7: p = 16
    does not divide 126, so before this the planner could not see the run the preset
    describes. Its peak is the estimate's verdict to the byte, on stage 1 (8 layers and 15
    microbatches in flight against the first stage's 7 and 16)."""
    row = _row(llama_plan, **PUBLISHED)
    assert (row.first_stage_layers, row.stage_layers, row.last_stage_layers, row.m) == (7, 8, 7, 1)
    assert config_label(row) == "t=8 p=7+8x14+7 b=1 sp none dopt"
    est = estimate(build_spec(LLAMA.model, LLAMA.run, architecture=LLAMA.architecture))
    assert row.peak_bytes == est.verdict_bytes == row.middle_peak_bytes
    assert row.peak_stage == "stage 1" and est.busiest_stage.stage == 1
    assert row.first_peak_bytes < row.peak_bytes and row.last_peak_bytes < row.peak_bytes


def test_uneven_rows_are_the_estimate_s_verdict_on_the_stage_it_names(llama_plan):
    """A sample of uneven rows of every p and recompute: the sweep's peak is the exact estimate's
    (every stage sized), and the stage it names is the estimate's busiest."""
    uneven = llama_plan[llama_plan.first_stage_layers != llama_plan.stage_layers]
    assert set(uneven.m) == {1} and len(set(uneven.p)) >= 5
    for row in uneven.sample(30, random_state=1).itertuples():
        run = parse_config(config_label(row), layers=126) | {"gpus": 16384, "global_batch": 2048}
        est = estimate(build_spec(LLAMA.model, LLAMA.run | run, architecture=LLAMA.architecture))
        assert row.peak_bytes == est.verdict_bytes, config_label(row)
        busiest = {"first": 0, "stage 1": 1, "last": row.p - 1}[row.peak_stage]
        assert est.busiest_stage.stage == busiest, config_label(row)


def test_an_uneven_pipeline_goes_at_its_fullest_stage_s_pace(llama_plan):
    """Compute and tensor-parallel time as if every stage had stage 1's 8 layers: the even
    formula's compute x 16·8/126, and each of n = 16 microbatches' 8 layers all-reducing
    2sbh four times, 2(t-1)/t of it a GPU, at the H100's 360 GB/s. The data-parallel
    reduction is the stage with the most parameters: stage 1's 8 layers of
    h(ad + 2gd)/t + ad·h/t + 3hf/t + 2h = 37,748,736 + 33,554,432 + 327,155,712 + 32,768
    = 398,491,648, 3,187,933,184 in all (the first: 7 layers and the vocabulary's 16,128 x h),
    with the distributed optimizer's (4 + 2) B x 127/128 at 50 GB/s."""
    from actmem import iteration

    row = _row(llama_plan, **PUBLISHED)
    s, h, arch = 8192, 16384, Architecture(**LLAMA.architecture)
    even = iteration.compute_seconds(2048, s, 126, h, row.vocab, "none", 16384, 989e12, 0.6, arch, 128)
    assert row.compute_s == pytest.approx(even * 16 * 8 / 126)
    assert row.tensor_parallel_s == pytest.approx(16 * 8 * 4 * 2 * 7 / 8 * 2 * s * h / 360e9)
    assert row.middle_parameters == 8 * 398_491_648 > row.parameters == 7 * 398_491_648 + 16128 * h
    assert row.data_parallel_s == pytest.approx(8 * 398_491_648 * 6 * 127 / 128 / 50e9)


def test_even_rows_keep_their_numbers():
    """Where p divides L the split is L/p everywhere, the pace factor is 1 and stage 1 holds
    less than the first: GPT-3's paper run is as test_plan's hand derivation has it."""
    req = PlanRequest(model=Model(**load_preset("175b").model), gpus=64, global_batch=64, gpu=GPUS["a100"],
                      gpu_memory_bytes=80 * 2**30)
    row = _row(plan(req).evaluated, t=8, p=8, m=3, b=1, sequence_parallel=True, recompute="selective",
               distributed_optimizer=False)
    assert (row.first_stage_layers, row.stage_layers, row.last_stage_layers) == (12, 12, 12)
    assert row.middle_peak_bytes < row.first_peak_bytes == row.peak_bytes
    assert config_label(row) == "t=8 p=8 m=3 b=1 sp sel"


def test_the_planner_s_json_and_csv_carry_the_split(actmem):
    out = actmem.json("plan", "--model", "llama-3.1-405b", "--gpu", "h100", "--top", "3", "--format", "json")
    best = out["best"][0]
    assert {"first_stage_layers", "stage_layers", "last_stage_layers", "middle_peak_bytes"} <= set(best)
    assert best["peak_bytes"] == max(best["first_peak_bytes"], best["middle_peak_bytes"], best["last_peak_bytes"])
    csv = actmem("plan", "--model", "llama-3.1-405b", "--gpu", "h100", "--top", "3", "--format", "csv")
    assert csv.exit_code == 0 and "first_stage_layers,stage_layers,last_stage_layers" in csv.stdout


def test_explain_reads_the_split_and_the_preset_s(actmem):
    """'p=7+8x14+7' is p = 16 with its first and last stage's layers; with no p the preset's
    own split comes along; m = 1 goes with a split (the preset 530B has m = 3)."""
    assert parse_config("t=8 p=7+8x14+7 b=1", layers=126) == {
        "tensor_parallel": 8, "context_parallel": 1, "pipeline_parallel": 16, "interleave": 1, "micro_batch": 1,
        "sequence_parallel": False, "recompute": "none", "recompute_modules": None, "distributed_optimizer": False,
        "first_stage_layers": 7, "last_stage_layers": 7}
    inherited = parse_config("t=8 b=1", defaults=dict(LLAMA.run), layers=126)
    assert (inherited["pipeline_parallel"], inherited["first_stage_layers"]) == (16, 7)
    assert "first_stage_layers" not in parse_config("t=8 p=18 b=1", defaults=dict(LLAMA.run), layers=126)
    assert parse_config("p=3+7x14+4", defaults={"interleave": 3}, layers=105)["interleave"] == 1
    assert parse_config("p=60+66", layers=126)["pipeline_parallel"] == 2
    text = actmem("plan", "--model", "llama-3.1-405b", "--gpu", "h100", "--reserve", "1GiB",
                  "--explain", "t=8 b=1 sp none dopt").output
    assert "p=16 (7+8x14+7)" in text and "on stage 1" in text


@pytest.mark.parametrize("config, fragment", [
    ("t=8 p=7+9x14+7 b=1", "p=7+9x14+7 holds 140 layers, the model 126"),
    ("t=8 p=7+8x0+7 b=1", "has no stage between the first and last; write it 7+7"),
    ("t=8 p=7+8x14+7 p=16", "pipeline_parallel is given twice"),
    ("t=8 p=7+8x14", "cannot read 'p=7+8x14'"),
])
def test_explain_refuses_a_split_that_does_not_add_up(actmem, config, fragment):
    assert_one_line_error(actmem("plan", "--model", "llama-3.1-405b", "--explain", config), fragment)


def test_uneven_pipelines_bring_the_nearest_fitting_count_down(actmem):
    """530B on 64 GPUs, nothing fits (tests/test_new_user_trial.py derives why); the nearest
    count is now 144 = 8 x 18 with 4 + 6 x 16 + 5, where it was 168 = 8 x 21 with p | 105."""
    data = json.loads(actmem("plan", "--model", "530b", "--gpus", "64", "--format", "json").stdout)
    assert data["nothing_fits"]["nearest_fitting"][0] == {"gpus": 144, "config": "t=8 p=4+6x16+5 b=1 sp full"}
