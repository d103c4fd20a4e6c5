"""The planner's uneven pipelines: Llama 3's split, sized on every stage that can decide,
timed at its fullest stage's pace, and read back by --explain."""

import json

import pytest

from actmem.model.architecture import Architecture
from actmem.memory.estimate import estimate
from actmem.planner.explain import parse_config
from actmem.model.hardware import GPUS
from actmem.memory.pipeline import stage_split
from actmem.planner.plan import PlanRequest, config_label, plan
from actmem.sources.presets import load_preset
from actmem.model.spec import Model, build_spec
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


@pytest.mark.parametrize("name, gpus, batch", [("llama-3.1-405b", 16384, 2048), ("llama-3.1-8b", 96, 96)])
def test_uneven_rows_are_the_estimate_s_verdict_on_the_stage_it_names(name, gpus, batch):
    """Uneven rows of every p and recompute, sampled on each stage the sweep can name (the
    first, stage 1, the last): the sweep's peak is the exact estimate's (every stage sized),
    and the stage it names is the estimate's busiest."""
    preset = load_preset(name)
    req = llama_request(model=Model(**preset.model), gpus=gpus, global_batch=batch,
                        architecture=Architecture(**preset.architecture))
    evaluated = plan(req).evaluated
    uneven = evaluated[evaluated.first_stage_layers != evaluated.stage_layers]
    assert set(uneven.m) == {1} and len(set(uneven.p)) >= 3
    for stage, rows in uneven.groupby("peak_stage"):
        for row in rows.sample(min(len(rows), 8), random_state=1).itertuples():
            run = parse_config(config_label(row), layers=preset.model["layers"]) | {"gpus": gpus, "global_batch": batch}
            est = estimate(build_spec(preset.model, preset.run | run, architecture=preset.architecture))
            assert row.peak_bytes == est.verdict_bytes, config_label(row)
            busiest = {"first": 0, "stage 1": 1, "last": row.p - 1}[stage]
            assert est.busiest_stage.stage == busiest, config_label(row)
    if name == "llama-3.1-8b":                                    # the 128K vocabulary: the last decides
        assert set(uneven.peak_stage) == {"first", "stage 1", "last"}


def test_an_uneven_pipeline_goes_at_its_fullest_stage_s_pace(llama_plan):
    """Compute and tensor-parallel time as if every stage had stage 1's 8 layers: the even
    formula's compute (at the row's measured kernel efficiencies) x 16·8/126, and each of n = 16 microbatches' 8 layers all-reducing
    2sbh four times, 2(t-1)/t of it a GPU, at the H100's 360 GB/s. The data-parallel
    reduction is the stage with the most parameters: stage 1's 8 layers of
    h(ad + 2gd)/t + ad·h/t + 3hf/t + 2h = 37,748,736 + 33,554,432 + 327,155,712 + 32,768
    = 398,491,648, 3,187,933,184 in all (the first: 7 layers and the vocabulary's 16,128 x h),
    with the distributed optimizer's (4 + 2) B x 127/128 at 50 GB/s."""
    from actmem.planner import iteration

    row = _row(llama_plan, **PUBLISHED)
    s, h, arch = 8192, 16384, Architecture(**LLAMA.architecture)
    measured = (row.layers_efficiency, row.scores_efficiency, row.logits_efficiency)     # the H100's kernels
    even = iteration.compute_seconds(2048, s, 126, h, row.vocab, "none", 16384, 989e12, measured, arch, 128)
    assert row.compute_s == pytest.approx(even * 16 * 8 / 126)
    assert row.tensor_parallel_s == pytest.approx(16 * 8 * 4 * 2 * 7 / 8 * 2 * s * h / 360e9)
    assert row.middle_parameters == 8 * 398_491_648 > row.parameters == 7 * 398_491_648 + 16128 * h
    assert row.data_parallel_s == pytest.approx(8 * 398_491_648 * 6 * 127 / 128 / 50e9)


def test_even_rows_keep_their_numbers():
    """Where p divides L the split is L/p everywhere, the pace factor is 1 and stage 1 holds
    less than the first: GPT-3's paper run is as test_plan's hand derivation has it
    (test_time_parts_by_hand checks its time parts)."""
    req = PlanRequest(model=Model(**load_preset("175b").model), gpus=64, global_batch=64, gpu=GPUS["a100"],
                      gpu_memory_bytes=80 * 2**30)
    row = _row(plan(req).evaluated, t=8, p=8, m=3, b=1, sequence_parallel=True, recompute="selective",
               distributed_optimizer=False)
    assert (row.first_stage_layers, row.stage_layers, row.last_stage_layers) == (12, 12, 12)
    assert row.middle_peak_bytes < row.first_peak_bytes == row.peak_bytes
    assert config_label(row) == "t=8 p=8 m=3 b=1 sp sel"


def test_an_untied_output_layer_makes_the_last_stage_reduce_the_most():
    """Llama 3.1 8B (untied) at p = 4: the last stage holds the final RMSNorm's h = 4096
    weights beside an output layer the size of the first stage's embedding, so its
    gradients are the ones the data-parallel reduction waits for: 4 B x (d-1)/d each."""
    preset = load_preset("llama-3.1-8b")
    req = llama_request(model=Model(**preset.model), gpus=64, global_batch=64,
                        architecture=Architecture(**preset.architecture))
    row = _row(plan(req).evaluated, t=8, c=1, p=4, m=1, b=1, sequence_parallel=True, recompute="none",
               distributed_optimizer=False)
    assert row.last_parameters == row.parameters + 4096
    assert row.data_parallel_s == pytest.approx(row.last_parameters * 2 * 4 * (1 / 2) / 50e9)     # d = 2


def test_the_planner_s_json_and_csv_carry_the_split(actmem):
    """The published run's row, each stage's peak as `estimate` sizes that stage."""
    out = actmem.json("plan", "--model", "llama-3.1-405b", "--gpu", "h100", "--top", "0", "--format", "json",
                      "--reserve", "0GiB")
    row = next(r for r in out["best"] if r["config"] == "t=8 p=7+8x14+7 b=1 sp none dopt")
    assert (row["first_stage_layers"], row["stage_layers"], row["last_stage_layers"]) == (7, 8, 7)
    stages = actmem.json("estimate", "--model", "llama-3.1-405b", "--format", "json")["stages"]
    peaks = [stage["peak_floor"]["total_bytes"] for stage in stages]
    assert (row["first_peak_bytes"], row["middle_peak_bytes"], row["last_peak_bytes"]) == (peaks[0], peaks[1], peaks[-1])
    assert row["peak_stage"] == "stage 1" and row["peak_bytes"] == max(peaks)
    csv = actmem("plan", "--model", "llama-3.1-405b", "--gpu", "h100", "--top", "3", "--format", "csv")
    assert csv.exit_code == 0 and "first_stage_layers,stage_layers,last_stage_layers" in csv.stdout


def test_explain_reads_the_split_and_the_preset_s(actmem):
    """'p=7+8x14+7' is p = 16 with its first and last stage's layers; with no p the preset's
    own split comes along; m = 1 goes with a split (the preset 530B has m = 3)."""
    assert parse_config("t=8 p=7+8x14+7 b=1", layers=126) == {
        "tensor_parallel": 8, "context_parallel": 1, "pipeline_parallel": 16, "interleave": 1, "micro_batch": 1,
        "sequence_parallel": False, "recompute": "none", "recompute_modules": None, "recompute_method": None,
        "recompute_layers": None, "distributed_optimizer": False, "first_stage_layers": 7, "last_stage_layers": 7,
        "expert_parallel": 1, "expert_tensor_parallel": None, "fsdp": False}
    inherited = parse_config("t=8 b=1", defaults=dict(LLAMA.run), layers=126)
    assert (inherited["pipeline_parallel"], inherited["first_stage_layers"]) == (16, 7)
    assert "first_stage_layers" not in parse_config("t=8 p=18 b=1", defaults=dict(LLAMA.run), layers=126)
    assert parse_config("p=3+7x14+4", defaults={"interleave": 3}, layers=105)["interleave"] == 1
    assert parse_config("p=60+66", layers=126)["pipeline_parallel"] == 2
    text = actmem("plan", "--model", "llama-3.1-405b", "--gpu", "h100", "--reserve", "1GiB",
                  "--explain", "t=8 b=1 sp none dopt").output
    assert "p=16 (7+8x14+7)" in text and "on stage 1" in text


@pytest.mark.parametrize("config, fragment", [
    ("t=8 p=16 b=1", "p (16) does not divide the 126 layers; the plan splits them as p=7+8x14+7"),
    ("t=8 p=7+8x14+7 m=2 b=1", "needs p > 1 and no interleave (p = 16, m = 2)"),
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
    nearest = data["nothing_fits"]["nearest_fitting"][0]
    assert nearest["gpus"] == 144 and nearest["config"].startswith("t=8 p=4+6x16+5 b=1")


def test_the_nearest_search_bounds_the_fullest_stage_s_parameters(actmem):
    """1T on 128 GPUs: the search skips counts where some stage's parameters alone are over
    the budget. An uneven split's first stage is its lightest (p = 27: 1 + 5 x 25 + 2), so
    bounding by it alone let 24 counts that cannot fit use up the search; bounding by stage
    1 too, the search reaches a count that fits, and that count's plan agrees."""
    data = json.loads(actmem("plan", "--model", "1t", "--gpus", "128", "--global-batch", "3072",
                             "--format", "json").stdout)
    nearest = data["nothing_fits"]["nearest_fitting"]
    assert nearest and all(place["gpus"] > 128 for place in nearest)
    there = json.loads(actmem("plan", "--model", "1t", "--gpus", str(nearest[0]["gpus"]), "--global-batch", "3072",
                              "--format", "json").stdout)
    assert there["fitting"] > 0 and there["best"][0]["config"] == nearest[0]["config"]


def test_the_rule_for_a_split_is_the_same_on_ints_and_on_the_sweep_s_arrays():
    """rules._even_middle: 126 layers as 7 + 8 x 14 + 7 share evenly, 7 + ... + 6 does not; with
    no stage between (p = 2) first + last must be L exactly, over it (100 + 100) is refused."""
    import numpy as np

    from actmem.model import rules

    cases = [(16, 7, 7, True), (16, 7, 6, False), (2, 60, 66, True), (2, 100, 100, False), (2, 60, 60, False)]
    for p, first, last, expected in cases:
        one = rules.Values(heads=128, hidden=16384, layers=126, seq_len=8192, t=8, p=p, m=1, b=1,
                           sequence_parallel=True, distributed_optimizer=False, first=first, last=last)
        assert bool(rules._even_middle(one)) is expected, (p, first, last)
    p, first, last, expected = (np.array(column) for column in zip(*cases))
    many = rules.Values(heads=128, hidden=16384, layers=126, seq_len=8192, t=8, p=p, m=1, b=1,
                        sequence_parallel=True, distributed_optimizer=False, first=first, last=last)
    assert (rules._even_middle(many) == expected).all()


def test_a_split_over_the_model_s_layers_is_refused(actmem):
    """p = 2 has no stage between: 100 + 100 layers of a 126-layer model is one line, exit 2."""
    result = actmem("estimate", "--model", "llama-3.1-405b", "--pp", "2", "--first-stage-layers", "100",
                    "--last-stage-layers", "100")
    assert_one_line_error(result, "the first and last stages' layers (200) are more than the model's 126")
