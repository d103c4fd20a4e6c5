"""The appendix FLOPs formulas against Table 5 of the paper (present work: SP + selective)."""

import pytest

from actmem.planner.flops import hardware_flops, model_flops, utilization
from actmem.model.recompute import Recompute

A100_PEAK = 312e12
# Table 3 dims, Table 5: iteration time (s, present work), MFU %, HFU %
TABLE_5 = {
    "22b": (dict(B=4, s=2048, L=48, h=6144, v=51200), 8, 1.10, 41.5, 43.7),
    "175b": (dict(B=64, s=2048, L=96, h=12288, v=51200), 64, 13.75, 51.4, 52.8),
    "530b": (dict(B=280, s=2048, L=105, h=20480, v=51200), 280, 37.83, 56.0, 57.0),
    "1t": (dict(B=512, s=2048, L=128, h=25600, v=51200), 512, 71.49, 56.3, 57.0),
}


@pytest.mark.parametrize("name", TABLE_5)
def test_table_5_mfu_and_hfu_within_0_2_points(name):
    dims, gpus, seconds, mfu, hfu = TABLE_5[name]
    model = model_flops(**dims)
    hardware = hardware_flops(**dims, recompute=Recompute.SELECTIVE)
    assert abs(100 * utilization(model, seconds, gpus, A100_PEAK) - mfu) < 0.2
    assert abs(100 * utilization(hardware, seconds, gpus, A100_PEAK) - hfu) < 0.2


def test_22b_by_hand():
    """72·4·2048·48·6144²·(1 + 2048/36864 + 51200/3538944) = 1.1436e15 FLOPs."""
    expected = 72 * 4 * 2048 * 48 * 6144**2 * (1 + 2048 / 36864 + 51200 / 3538944)
    assert model_flops(4, 2048, 48, 6144, 51200) == pytest.approx(expected)
    assert expected == pytest.approx(1.1436e15, rel=1e-4)


@pytest.mark.parametrize("name, percent", [("175b", 2.7), ("530b", 1.6)])
def test_selective_recompute_flops_overhead(name, percent):
    dims = TABLE_5[name][0]
    overhead = hardware_flops(**dims, recompute=Recompute.SELECTIVE) / model_flops(**dims) - 1
    assert round(100 * overhead, 1) == percent


def test_full_recompute_is_one_more_forward_of_the_layers():
    """Full recompute adds a forward pass of the layers, a third of their 72BsLh²(1 + s/6h)."""
    dims = TABLE_5["175b"][0]
    B, s, L, h = dims["B"], dims["s"], dims["L"], dims["h"]
    extra = hardware_flops(**dims, recompute=Recompute.FULL) - model_flops(**dims)
    assert extra == pytest.approx(24 * B * s * L * h * h * (1 + s / (6 * h)))
    assert hardware_flops(**dims, recompute=Recompute.NONE) == model_flops(**dims)


def test_flops_cli(actmem):
    result = actmem("flops", "--model", "530b", "--iteration-time", "37.83", "--format", "json")
    assert result.exit_code == 0, result.output
    import json

    out = json.loads(result.stdout)
    assert abs(100 * out["mfu"] - 56.0) < 0.2
    selective = next(r for r in out["hardware"] if r["recompute"] == "selective")
    assert abs(100 * selective["hfu"] - 57.0) < 0.2
    assert "MFU 56.0%" in actmem("flops", "--model", "530b", "--iteration-time", "37.83").stdout


def test_flops_bad_input(actmem):
    from tests.conftest import assert_one_line_error

    assert_one_line_error(actmem("flops", "--model", "530b", "--iteration-time", "-1"), "iteration-time")
    assert_one_line_error(actmem("flops", "--model", "530b", "--peak-tflops", "-3"), "peak-tflops")
    assert_one_line_error(actmem("flops", "--model", "530b", "--peak-tflops", "0"), "peak-tflops")
    assert_one_line_error(actmem("flops", "--model", "530b", "--global-batch", "0"), "--global-batch")
