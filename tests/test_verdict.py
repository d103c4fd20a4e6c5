"""The verdict's margin: a GPU at the memory its allocator can reach, a reserve kept free, and
estimate and plan agreeing on every configuration."""

from types import SimpleNamespace

import pytest

from actmem.memory.estimate import FITS, NO_FIT, TIGHT, estimate, verdict_of
from actmem.planner.explain import parse_config
from actmem.model.hardware import GPUS
from actmem.planner.plan import PlanRequest, candidates, config_label, evaluate
from actmem.sources.presets import load_preset
from actmem.model.spec import Model, build_spec
from tests.conftest import assert_one_line_error

GIB = 2**30


@pytest.mark.parametrize("peak, verdict", [(90, FITS), (91, TIGHT), (100, TIGHT), (101, NO_FIT)])
def test_fits_needs_the_reserve_tight_eats_into_it(peak, verdict):
    """A 100-byte GPU with a 10-byte reserve: the peak and the reserve fit up to 90; above,
    the floor alone fits up to 100."""
    assert verdict_of(peak, SimpleNamespace(gpu_memory_bytes=100, reserve_bytes=10)) == verdict


@pytest.mark.parametrize("preset, memory", [
    ("530b", 85_056_798_720),                  # an A100-SXM4-80GB's total_memory, the paper's GPU
    ("llama-3.1-8b", 84_932_978_278),          # H100: 79.10 GiB = 79.10 x 2^30 = 84,932,978,278.4 B
])
def test_the_gpu_is_the_presets_at_the_memory_its_allocator_reaches(actmem, preset, memory):
    args = ("--tp", "1", "--pp", "1", "--micro-batch", "1") if preset.startswith("llama") else ()
    out = actmem.json("estimate", "--model", preset, *args)
    assert out["gpu_memory_bytes"] == memory
    assert out["reserve_bytes"] == 8 * GIB
    # the spare is what the GPU has beyond the peak floor and the reserve
    assert out["spare_bytes"] == memory - 8 * GIB - out["verdict_bytes"]


def test_gpu_memory_and_reserve_flags(actmem):
    out = actmem.json("estimate", "--model", "530b", "--gpu", "h200", "--reserve", "0GiB")
    assert (out["gpu_memory_bytes"], out["reserve_bytes"]) == (round(139.72 * GIB), 0)
    out = actmem.json("estimate", "--model", "530b", "--gpu-memory", "60GiB")
    assert out["gpu_memory_bytes"] == 60 * GIB and out["verdict"] == TIGHT   # 59.50 GiB floor: fits bare


@pytest.mark.parametrize("args, fragment", [
    (("--model", "530b", "--model", "22b"), "--model is given more than once and the values disagree"),
    (("--model", "530b", "--gpu", "h100", "--gpu", "h200"), "--gpu is given more than once"),
    (("--model", "530b", "--gpu-memory", "80GiB", "--gpu-memory", "40GiB"), "--gpu-memory is given more than once"),
    (("--model", "530b", "--reserve", "8GiB", "--reserve", "1GiB"), "--reserve is given more than once"),
    (("--model", "530b", "--gpu", "gb200"), "unknown GPU 'gb200'"),
    (("--model", "530b", "--reserve", "80GiB"), "reserve (85,899,345,920 B) must be less than the GPU memory"),
])
def test_a_setting_given_twice_or_out_of_range_is_refused(actmem, args, fragment):
    assert_one_line_error(actmem("estimate", *args), fragment)
    assert_one_line_error(actmem("plan", *args), fragment)


def test_the_same_option_twice_with_one_value_is_fine(actmem):
    assert actmem("estimate", "--model", "530b", "--model", "530b", "--gpu", "h100", "--gpu", "h100").exit_code == 0


@pytest.mark.parametrize("preset", ["175b", "22b"])
def test_estimate_and_plan_agree_on_every_configuration_they_both_see(preset):
    """Every row near the budget (within 6 GiB either side, where a reserve read differently
    would show) and a sample of the rest: estimate's 'fits' is the planner's."""
    pr = load_preset(preset)
    gpu = GPUS["h100"]
    req = PlanRequest(model=Model(**pr.model), gpus=pr.run["gpus"], global_batch=pr.run["global_batch"], gpu=gpu,
                      gpu_memory_bytes=gpu.memory_bytes, reserve_bytes=8 * GIB)
    rows = evaluate(req, candidates(req))
    near = rows[(rows.peak_bytes - req.budget_bytes).abs() < 6 * GIB]
    assert near.fits.any() and not near.fits.all()          # both sides of the line are checked
    checked = near if len(near) <= 60 else near.sample(60, random_state=0)
    for row in list(checked.itertuples()) + list(rows.sample(20, random_state=1).itertuples()):
        run = parse_config(config_label(row)) | {"gpus": req.gpus, "global_batch": req.global_batch}
        spec = build_spec(vars(req.model), run, gpu_memory_bytes=gpu.memory_bytes, reserve_bytes=8 * GIB)
        assert estimate(spec).fits == bool(row.fits), config_label(row)


def test_every_command_s_own_options_refuse_two_values(actmem, tmp_path):
    assert_one_line_error(actmem("plot", "memory", "--model", "530b", "-o", str(tmp_path / "a.png"),
                                 "-o", str(tmp_path / "b.png")), "-o is given more than once and the values disagree")
    assert_one_line_error(actmem("plan", "--model", "530b", "--top", "3", "--top", "5"),
                          "--top is given more than once and the values disagree")
    assert_one_line_error(actmem("flops", "--model", "530b", "--format", "json", "--format", "rich"),
                          "--format is given more than once and the values disagree")


def test_a_verdict_says_when_model_state_alone_is_over_the_gpu(actmem):
    """Llama 3.1 8B on one GPU (t = 1, p = 1, no distributed optimizer): 8,030,261,248 parameters x 18 B
    (2 B weight, 4 B fp32 gradient, 12 B Adam) + TE's dummy weight gradients 1,486,880,768 B = 146,031,583,232 B,
    136.00 GiB, over an H100's 79.10 with nothing of the activations counted: the verdict says no activation
    technique can help. The 530B's Table 3 run, whose state fits, says nothing of the kind."""
    assert 8_030_261_248 * 18 + 1_486_880_768 == 146_031_583_232
    text = " ".join(actmem("estimate", "--model", "llama-3.1-8b", "--tp", "1", "--pp", "1").stdout.split())
    assert "Model state alone (weights, gradients, optimizer state and TE's caches: 136.00 GiB on the first stage)" \
        in text and "no activation recompute or offloading makes it fit" in text
    assert "Model state alone" not in actmem("estimate", "--model", "530b").stdout
