"""Parameter counts, checked against the models' names and by hand."""

import pytest

from actmem.memory.parameters import first_stage_parameters, layer_parameters, parameter_bytes

TABLE_3 = {  # name: (a, h, L), v = 51200, s = 2048; the name is the size in parameters
    "22b": (64, 6144, 48, 22e9),
    "175b": (96, 12288, 96, 175e9),
    "530b": (128, 20480, 105, 530e9),
    "1t": (160, 25600, 128, 1.0e12),
}


@pytest.mark.parametrize("name", TABLE_3)
def test_whole_model_count_matches_the_name(name):
    """On one GPU (t = p = 1) the first stage is the whole model, and its size is the model's
    name within 2%. (The count per GPU under t and p is checked against the parameters of
    the stage the harness builds: tests/validate/test_parameters_built.py.)"""
    _, h, layers, size = TABLE_3[name]
    count = first_stage_parameters(h, layers, 1, 1, 51200, 2048)
    assert abs(count / size - 1) < 0.02


def test_tensor_parallel_split_adds_back_up():
    """t ranks hold (12h² + 7h)/t each of the split part and 6h each of the replicated part."""
    h, t = 4096, 8
    assert t * layer_parameters(h, t) - (t - 1) * 6 * h == 12 * h * h + 13 * h


def test_mixed_precision_adam_is_18_bytes_a_parameter():
    params = parameter_bytes(1000, data_parallel=4, distributed_optimizer=False)
    assert (params.weights_bytes, params.gradients_bytes, params.optimizer_bytes) == (2000, 4000, 12000)
    assert params.total_bytes == 18 * 1000


def test_distributed_optimizer_is_6_plus_12_over_d():
    assert parameter_bytes(1000, data_parallel=4, distributed_optimizer=True).total_bytes == 1000 * (6 + 3)
    # 12·1001/4 = 3003; 12·1001/8 = 1501.5, so the largest shard holds 1502 bytes
    assert parameter_bytes(1001, data_parallel=8, distributed_optimizer=True).optimizer_bytes == 1502


def test_distributed_optimizer_flag_uses_the_data_parallel_size(actmem):
    """GPT-3 on 128 GPUs, t·p = 64: d = 2, so 6 + 12/2 = 12 bytes a parameter, beside TE's
    dummy weight gradients, which the optimizer does not shard: 12h²/t 16-bit elements
    (h = 12288, t = 8; the first of p = 8 stages has no output layer)."""
    out = actmem.json("estimate", "--model", "gpt3", "--gpus", "128", "--global-batch", "128",
                      "--distributed-optimizer")
    params = out["parameters"]
    assert out["run"]["data_parallel"] == 2
    assert params["dummy_wgrads_bytes"] == 2 * 12 * 12288**2 // 8
    assert params["total_bytes"] == 12 * params["count"] + params["dummy_wgrads_bytes"]
