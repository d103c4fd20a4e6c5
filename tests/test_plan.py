"""`actmem plan`: the sweep and the paper's sanity checks (each row the exact estimate's:
tests/test_stage_model.py)."""

import json

import pytest

from actmem.model.hardware import GPUS
from actmem.planner.explain import parse_config
from actmem.planner.plan import PlanRequest, candidates, config_label, plan
from actmem.sources.presets import load_preset
from actmem.model.spec import Model
from tests.conftest import assert_one_line_error

# Table 3, and m from section 6: (p, m, b) of the paper's run; t = 8 for all
PAPER_RUNS = {"22b": (1, 1, 4), "175b": (8, 3, 1), "530b": (35, 3, 1), "1t": (64, 1, 1)}


def request(preset: str, **overrides) -> PlanRequest:
    pr = load_preset(preset)
    values = dict(model=Model(**pr.model), gpus=pr.run["gpus"], global_batch=pr.run["global_batch"],
                  gpu=GPUS["a100"], gpu_memory_bytes=80 * 2**30, efficiency=0.6)
    return PlanRequest(**values | overrides)


def row_of(frame, t, p, m, b, sp, recompute, dopt=False):
    match = frame[(frame.t == t) & (frame.p == p) & (frame.m == m) & (frame.b == b)
                  & (frame.sequence_parallel == sp) & (frame.recompute == recompute)
                  & (frame.distributed_optimizer == dopt)]
    assert len(match) == 1
    return match.iloc[0]


@pytest.mark.parametrize("preset", PAPER_RUNS)
def test_paper_configuration_fits_and_without_the_techniques_does_not(preset):
    """Section 6: t = 8, SP + selective fits an 80 GB A100; the same t and p with neither
    technique does not ("without these techniques the models do not fit")."""
    evaluated = plan(request(preset)).evaluated
    p, m, b = PAPER_RUNS[preset]
    assert row_of(evaluated, 8, p, m, b, True, "selective").fits
    assert not row_of(evaluated, 8, p, m, b, False, "none").fits


def test_530b_best_is_the_papers_own_configuration():
    best = plan(request("530b")).fitting.iloc[0]
    assert config_label(best) == "t=8 p=35 m=3 b=1 sp sel"


def test_time_parts_by_hand():
    """GPT-3, t = 8, p = 8, m = 3, b = 1, SP + selective, 64 GPUs (d = 1), n = 64:
    compute = 72·64·2048·96·12288²·(1 + 2048/(3·12288) + 51200/(12·12288·96)) / (64·0.6·312e12);
    tp comm = 64·12 layers·4 all-reduces·2·(7/8)·2·2048·12288 B / 230 GB/s;
    pipeline sends = 64·2·3·2·2048·12288/8 B / 25 GB/s;
    bubble = 1 + 7/(3·64); no data parallelism."""
    row = row_of(plan(request("175b")).evaluated, 8, 8, 3, 1, True, "selective")
    s, h, L = 2048, 12288, 96
    compute = 72 * 64 * s * L * h * h * (1 + s / (3 * h) + 51200 / (12 * h * L)) / (64 * 0.6 * 312e12)
    tp = 64 * 12 * 4 * 2 * 7 / 8 * 2 * s * h / 230e9
    p2p = 64 * 2 * 3 * 2 * s * h / 8 / 25e9
    assert row.compute_s == pytest.approx(compute)
    assert row.tensor_parallel_s == pytest.approx(tp)
    assert row.pipeline_p2p_s == pytest.approx(p2p)
    assert row.bubble == pytest.approx(1 + 7 / 192)
    assert row.data_parallel_s == 0
    assert row.iteration_s == pytest.approx((compute + tp + p2p) * (1 + 7 / 192))


def test_data_parallel_time_by_hand():
    """GPT-3 on 128 GPUs with t = 8, p = 8: d = 2, fp32 gradients all-reduced: 2·(1/2)·4 B a
    parameter at 25 GB/s; the distributed optimizer moves (1/2)·(4 + 2) B instead."""
    req = request("175b", gpus=128, global_batch=128)
    evaluated = plan(req).evaluated
    plain = row_of(evaluated, 8, 8, 3, 1, True, "selective")
    sharded = row_of(evaluated, 8, 8, 3, 1, True, "selective", dopt=True)
    assert plain.data_parallel_s == pytest.approx(plain.parameters * 4 / 25e9)
    assert sharded.data_parallel_s == pytest.approx(sharded.parameters * 3 / 25e9)
    assert sharded.total_bytes < plain.total_bytes


def test_constraints_of_the_space():
    frame = candidates(request("175b"))
    assert set(frame.t) <= {1, 2, 4, 8}                       # t | 96 heads, one node
    assert (96 % frame.p == 0).all() and ((96 // frame.p) % frame.m == 0).all()
    assert (frame.n % frame.p == 0)[frame.m > 1].all()         # Megatron's interleave rule
    assert not (frame.sequence_parallel & (frame.t == 1)).any()
    assert not (frame.distributed_optimizer & (frame.d == 1)).any()
    assert (frame.t * frame.p * frame.d == 64).all()


def test_config_label_round_trip():
    assert parse_config("t=8 p=35 m=3 b=1 sp sel") == {
        "tensor_parallel": 8, "context_parallel": 1, "pipeline_parallel": 35, "interleave": 3, "micro_batch": 1,
        "sequence_parallel": True, "recompute": "selective", "recompute_modules": None,
        "recompute_method": None, "recompute_layers": None, "distributed_optimizer": False,
        "expert_parallel": 1, "expert_tensor_parallel": None, "fsdp": False}
    assert parse_config("t=8 p=35 m=3 b=1 sp sel+mlp")["recompute_modules"] == ("core_attn", "mlp")
    assert {key: value for key, value in parse_config("t=2 ep=8 etp=1 p=4 b=1 sp none").items() if "expert" in key} \
        == {"expert_parallel": 8, "expert_tensor_parallel": 1}
    mlp = parse_config("t=8 mlp")
    assert (mlp["recompute"], mlp["recompute_modules"]) == ("selective", ("mlp",))
    assert parse_config("t=8 c=4 p=2")["context_parallel"] == 4
    assert parse_config("t=2,p=4,nosp,full,dopt")["distributed_optimizer"] is True
    assert parse_config("t=2 b=1 nosp none fsdp")["fsdp"] is True          # FSDP2, under torch-native


def test_why_not_names_the_part_that_broke_the_budget():
    """530B on one node (8 GPUs): no t fits; at t = 8 the leanest needs the whole model's
    optimizer state on 8 GPUs, 12 B x 530e9/8 ≈ 740 GiB, its largest part."""
    why = plan(request("530b", gpus=8, global_batch=8)).why_not()
    assert not why.t_fits.any()
    t8 = why[why.t == 8].iloc[0]
    assert t8.largest_part == "optimizer"
    assert t8.over_bytes > 700 * 2**30


def test_plan_cli_json(actmem):
    result = actmem("plan", "--model", "530b", "--top", "3", "--format", "json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["best"][0]["config"] == "t=8 p=35 m=3 b=1 sp sel"
    assert len(out["best"]) == 3 and out["fitting"] <= out["evaluated"]
    assert {row["t"] for row in out["why_not"]} == {1, 2, 4, 8}


def test_plan_cli_rich_csv_and_explain(actmem):
    assert "t=8 p=35 m=3 b=1 sp sel" in actmem("plan", "--model", "530b").stdout
    csv = actmem("plan", "--model", "22b", "--format", "csv", "--top", "0").stdout
    assert csv.splitlines()[0].startswith("config,t,c,p,first_stage_layers,stage_layers,last_stage_layers,m,b,d,n")
    explained = actmem("plan", "--model", "gpt3", "--explain", "t=8 p=8 m=3 b=1 sp sel")
    assert explained.exit_code == 0
    assert "pipeline bubble" in explained.stdout and "tp-sp-sel" in explained.stdout


def test_explain_names_what_it_took_from_the_preset(actmem):
    """Mixtral's preset trains with the distributed optimizer; a plan's label of a row without it writes no
    'nodopt', so --explain of that label explains the dopt twin: it says so, and 'nodopt' explains the row."""
    taken = " ".join(actmem("plan", "--model", "mixtral-8x7b", "--explain", "t=2 p=4 ep=4 b=1 sp none").stdout.split())
    assert "--explain took from the preset's run what 't=2 p=4 ep=4 b=1 sp none' leaves out: dopt" in taken
    named = " ".join(actmem("plan", "--model", "mixtral-8x7b", "--explain", "t=2 p=4 ep=4 b=1 sp none nodopt")
                     .stdout.split())
    assert "--explain took" not in named
    whole = " ".join(actmem("plan", "--model", "gpt3", "--explain", "t=8 p=8 m=3 b=1 sp sel").stdout.split())
    assert "--explain took" not in whole                  # the label names every setting the preset has


def test_nothing_fits_exits_1_and_says_why(actmem):
    result = actmem("plan", "--model", "530b", "--gpus", "8", "--global-batch", "8")
    assert result.exit_code == 1
    text = " ".join(result.stdout.split())          # rich wraps the verdict column
    assert "Nothing fits" in text and "largest part: optimizer" in text


@pytest.mark.parametrize("args, fragments", [
    # 131 is prime and above 1T's 128 layers: t = p = 1, d = 131
    (["--model", "1t", "--gpus", "131", "--global-batch", "64"],
     ["divisible by none of the data-parallel sizes", "131"]),
    # 530B, 105 layers: on 1024 GPUs p is a power of 2 that splits them: 1, 2 (no: 105 is odd),
    # 4 (25 + 27 x 2 + 26), 8 (10 + 14 x 6 + 11), 16 (3 + 7 x 14 + 4); p = 32 leaves
    # 105 - 30 x 4 < 2 for the first and last. So t·p <= 8 x 16 and d = 1024/(t·p) is 8 to
    # 1024, even: none divides 7
    (["--model", "530b", "--gpus", "1024", "--global-batch", "7"],
     ["global batch 7 is divisible by none", "8, 16, 32, 64, 128, 256, 512, 1024"]),
    (["--model", "gpt3", "--gpus", "0"], ["gpus must be a positive integer, got 0"]),
    (["--model", "gpt3", "--reserve", "90GiB"], ["reserve", "must be less than the GPU memory"]),
    (["--model", "gpt3", "--efficiency", "0"], ["efficiency must be in (0, 1]"]),
    (["--model", "gpt3", "--gpu", "tpu-v5"], ["unknown GPU 'tpu-v5'", "b200", "mi300x"]),
    (["--model", "gpt3", "--explain", "t=8 q=2"], ["cannot read 'q=2'"]),
    (["--model", "gpt3", "--explain", "t=5"], ["t (5) must divide hidden (12288)"]),
    (["--heads", "8", "--hidden", "512", "--layers", "4", "--vocab", "100", "--seq-len", "64"],
     ["plan needs --gpus and --global-batch"]),
    (["--model", "gpt3", "--gpus-per-node", "x"], ["'x' is not a valid integer"]),
])
def test_plan_bad_input(actmem, args, fragments):
    assert_one_line_error(actmem("plan", *args), *fragments)


def test_a_prime_gpu_count_larger_than_a_node():
    """13 GPUs: t = 1 (13 is prime, above a node); p = 1, d = 13, or p = 13 splitting 1T's
    128 layers as Llama 3 does: ⌈128/13⌉ = 10 on each of the 11 stages between and
    128 - 110 = 18 shared by the first and last, 9 + 10 x 11 + 9; d = 1."""
    req = request("1t", gpus=13, global_batch=13 * 4)
    frame = candidates(req)
    assert set(zip(frame.t, frame.p, frame.d)) == {(1, 1, 13), (1, 13, 1)}
    split = frame[frame.p == 13]
    assert set(zip(split.first_stage_layers, split.stage_layers, split.last_stage_layers)) == {(9, 10, 9)}
    assert set(split.m) == {1}


def test_a_trillion_parameter_sweep_counts_flops_without_overflow():
    """1T on 3072 GPUs at batch 3072 (the sweep benchmark): 72·3072·2048·128·25600² = 3.80e19,
    times (1 + 2048/153600 + 51200/(12·25600·128)) = 1.0144: 3.86e19 FLOPs an iteration, past
    int64's 9.2e18."""
    import numpy as np

    evaluated = plan(request("1t", gpus=3072, global_batch=3072)).evaluated
    assert len(evaluated) > 3000
    assert np.isfinite(evaluated.compute_s).all() and (evaluated.compute_s > 0).all()
    expected = 72 * 3072 * 2048 * 128 * 25600**2 * (1 + 2048 / 153600 + 51200 / (12 * 25600 * 128))
    from actmem.planner.flops import model_flops
    assert model_flops(3072, 2048, 128, 25600, 51200) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(3.86e19, rel=1e-2) and expected > 2**63


def test_a_model_too_large_to_count_in_int64_is_refused():
    """d = 2^40 would make QKV h·3ad ~ 10^18 parameters a layer: refused before the sweep."""
    from actmem.model.architecture import Architecture
    from actmem.errors import SpecError

    with pytest.raises(SpecError, match="more than the planner counts in int64"):
        request("530b", architecture=Architecture(head_dim=2**40))



def test_a_grouped_query_model_plans(actmem, tmp_path):
    """A rule of the model alone (g divides a) is one boolean, not one per configuration: it
    used to crash the sweep. Llama 2 70B's shape on 64 GPUs."""
    path = tmp_path / "gqa.toml"
    path.write_text("[model]\nheads = 64\nhidden = 8192\nlayers = 80\nvocab = 32000\nseq_len = 4096\n"
                    "[architecture]\nquery_groups = 8\nhead_dim = 128\nactivation = 'swiglu'\n"
                    "ffn_hidden = 28672\nnormalization = 'RMSNorm'\nbias = false\ntied_output = false\n")
    result = actmem("plan", "--model", str(path), "--gpus", "64", "--global-batch", "64", "--format", "json")
    assert result.exit_code in (0, 1), result.output
    out = __import__("json").loads(result.stdout)
    assert out["evaluated"] > 0 and out["request"]["architecture"]["query_groups"] == 8
