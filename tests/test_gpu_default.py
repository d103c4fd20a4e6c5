"""The GPU a verdict is measured against is always named, and where the input named none (no --gpu, a preset
without a GPU, a pasted script), the output says it is actmem's default, the paper's A100 80GB; a refusal
that hangs on the GPU says so too."""

import pytest

from actmem.model.hardware import GPUS
from tests.conftest import assert_one_line_error
from tests.test_megatron_examples import EXAMPLES

DEFAULT = "A100 80GB, actmem's default, the paper's GPU; give --gpu for yours"
QWEN = ("--model", "qwen3-30b-a3b")           # a preset that names no GPU (no published run)


def test_a_preset_without_a_gpu_names_the_default_in_its_verdict(actmem):
    result = actmem("estimate", *QWEN)
    assert result.exit_code == 0, result.output
    assert "(A100 80GB, actmem's default, the paper's GPU; give" in result.stdout     # folded at 80 columns
    out = actmem.json("estimate", *QWEN)
    assert (out["gpu"], out["gpu_default"]) == ("A100 80GB", True)


@pytest.mark.parametrize("given", [("--gpu", "a100"), ("--gpu", "h100"), ("--gpu", "h100", "--gpu-memory", "79GiB")])
def test_a_gpu_the_input_names_is_not_the_default(actmem, given):
    out = actmem.json("estimate", *QWEN, *given)
    assert out["gpu_default"] is False
    assert "actmem's default" not in actmem("estimate", *QWEN, *given).stdout


def test_a_named_gpu_stays_named_beside_its_memory(actmem):
    out = actmem.json("estimate", *QWEN, "--gpu", "h100", "--gpu-memory", "70GiB")
    assert (out["gpu"], out["gpu_default"], out["gpu_memory_bytes"]) == ("H100 SXM 80GB at --gpu-memory 70GiB", False,
                                                                          70 * 2**30)


def test_more_memory_than_the_named_gpu_has_is_refused(actmem):
    """An H100's allocator reaches 79.10 GiB (hardware.py): 200 GiB beside --gpu h100 is a contradiction, refused;
    beside a preset's GPU it may stand for another GPU, and the output names it "at --gpu-memory"."""
    assert_one_line_error(actmem("estimate", *QWEN, "--gpu", "h100", "--gpu-memory", "200GiB"),
                          "--gpu-memory 200GiB is more than the H100 SXM 80GB named by --gpu lets its allocator reach "
                          "(79.10 GiB)")
    out = actmem.json("estimate", "--model", "deepseek-v3", "--gpu-memory", "100GiB")
    assert out["gpu"] == "H800 SXM 80GB at --gpu-memory 100GiB" and out["gpu_memory_bytes"] == 100 * 2**30


def test_memory_alone_is_still_the_default_gpu_s_fp8_and_speed(actmem):
    """--gpu-memory replaces the memory, not the GPU: FP8 support and the planner's speed stay the default A100's,
    and the output says so."""
    out = actmem.json("estimate", *QWEN, "--gpu-memory", "80GiB")
    assert (out["gpu"], out["gpu_default"], out["gpu_memory_bytes"]) == ("--gpu-memory 80GiB", True, 80 * 2**30)
    text = " ".join(actmem("estimate", *QWEN, "--gpu-memory", "80GiB").stdout.split())
    assert "(--gpu-memory 80GiB, otherwise A100 80GB, actmem's default, the paper's GPU; give --gpu for yours)" in text
    assert_one_line_error(actmem("estimate", *QWEN, "--gpu-memory", "80GiB", "--fp8-format", "e4m3",
                                 "--moe-grouped-gemm"), "no --gpu was given and actmem's default, the paper's A100 80GB")


def test_a_presets_own_gpu_is_not_the_default(actmem):
    out = actmem.json("estimate", "--model", "530b")        # gpu = "a100" in the preset: the paper's runs
    assert (out["gpu"], out["gpu_default"]) == ("A100 80GB", False)


def test_fp8_on_the_default_gpu_is_refused_saying_the_gpu_was_not_given(actmem):
    """Megatron-LM's FP8 Llama 3 script as it is: its launcher names no GPU model, so actmem's default, an A100
    (no FP8 tensor cores), is refused naming it as the default; with --gpu h100 it is priced."""
    script = f"@{EXAMPLES / 'train_llama3_8b_h100_fp8.sh'}"
    assert_one_line_error(actmem("estimate", "--megatron-args", script),
                          "no --gpu was given and actmem's default, the paper's A100 80GB, has none",
                          "give --gpu h100, h200, h800 or b200")
    assert_one_line_error(actmem("estimate", "--megatron-args", script, "--gpu", "a100"),
                          "A100 80GB has none")
    assert actmem.json("estimate", "--megatron-args", script, "--gpu", "h100")["gpu_default"] is False


def test_deepseek_v3_is_priced_on_the_h800_it_trained_on(actmem):
    """The DeepSeek-V3 report (section 3.1): 2,048 H800s; section 3.2.2: NVLink at 160 GB/s, IB at 50 GB/s.
    The H800 is the H100's chip and 80 GB of HBM3: the same reachable memory, Hopper's FP8."""
    out = actmem.json("estimate", "--model", "deepseek-v3", "--pp", "1")
    assert (out["gpu"], out["gpu_default"], out["gpu_memory_bytes"]) == ("H800 SXM 80GB", False,
                                                                          round(79.10 * 2**30))
    h800 = GPUS["h800"]
    assert (h800.intra_node_bandwidth, h800.inter_node_bandwidth, h800.fp8) == (160e9, 50e9, "hopper")


def test_plan_and_flops_name_the_default_gpu(actmem):
    plan = actmem("plan", *QWEN, "--gpus", "64", "--global-batch", "256")
    assert plan.exit_code == 0, plan.output
    assert "actmem's default, the paper's GPU" in plan.stdout.split("\n\n")[0]
    out = actmem.json("plan", *QWEN, "--gpus", "64", "--global-batch", "256")
    assert (out["request"]["gpu"], out["request"]["gpu_default"]) == ("A100 80GB", True)
    assert actmem.json("plan", *QWEN, "--gpus", "64", "--global-batch", "256", "--gpu", "h100")["request"][
        "gpu_default"] is False
    flops = actmem("flops", *QWEN, "--gpus", "64", "--global-batch", "256", "--iteration-time", "10")
    assert "312 TFLOP/s peak (A100 80GB, actmem's default" in " ".join(flops.stdout.split())
    given = actmem("flops", *QWEN, "--gpus", "64", "--global-batch", "256", "--iteration-time", "10",
                   "--peak-tflops", "400")
    assert "400 TFLOP/s peak (--peak-tflops)" in " ".join(given.stdout.split())
