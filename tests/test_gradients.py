"""The main gradients' dtype: fp32 (the paper's 18 B a parameter) or Megatron's 16-bit buffers
(fp16 without --accumulate-allreduce-grads-in-fp32, --grad-reduce-in-bf16): 16 B a parameter."""

import pytest

from actmem.model.hardware import GPUS
from actmem.planner.plan import PlanRequest, candidates, evaluate
from actmem.sources.presets import load_preset
from actmem.model.spec import Model
from tests.conftest import assert_one_line_error

# 530B's first stage (tests/test_readme_example.py): 2,060,874,240 parameters, 1,258,291,200 B
# of TE's dummy weight gradients
COUNT, DUMMIES = 2_060_874_240, 1_258_291_200


@pytest.mark.parametrize("args", [("--grad-dtype", "bf16"), ("--grad-reduce-in-bf16",), ("--grad-dtype", "fp16")])
def test_16_bit_gradients_are_2_bytes_a_parameter(actmem, args):
    fp32 = actmem.json("estimate", "--model", "530b")
    half = actmem.json("estimate", "--model", "530b", *args)
    assert fp32["parameters"]["gradients_bytes"] == 4 * COUNT
    assert half["parameters"]["gradients_bytes"] == 2 * COUNT
    assert half["parameters"]["total_bytes"] == 16 * COUNT + DUMMIES
    assert fp32["verdict_bytes"] - half["verdict_bytes"] == 2 * COUNT
    assert half["run_terms"] == fp32["run_terms"]


def test_two_dtypes_that_disagree_are_refused(actmem):
    assert_one_line_error(actmem("estimate", "--model", "530b", "--grad-dtype", "fp32", "--grad-reduce-in-bf16"),
                          "disagree: two values of one setting (grad dtype)")
    # bf16 and fp16 buffers are both 2 B: the same setting
    assert actmem("estimate", "--model", "530b", "--grad-dtype", "fp16", "--grad-reduce-in-bf16").exit_code == 0


def test_a_pasted_fp16_run_keeps_16_bit_gradients_unless_it_asks_for_fp32(actmem):
    """Megatron's arguments.py turns fp32 accumulation on for bf16 only."""
    base = ("--num-layers 2 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --vocab-size 32000 "
            "--micro-batch-size 1 --attention-backend local --no-create-attention-mask-in-dataloader")
    count = actmem.json("estimate", "--megatron-args", base + " --bf16")["parameters"]["count"]
    for extra, per_parameter in (("--bf16", 4), ("--fp16", 2), ("--fp16 --accumulate-allreduce-grads-in-fp32", 4),
                                 ("--bf16 --grad-reduce-in-bf16", 2),
                                 ("--bf16 --grad-reduce-in-bf16 --accumulate-allreduce-grads-in-fp32", 2)):
        out = actmem.json("estimate", "--megatron-args", f"{base} {extra}")
        assert out["parameters"]["gradients_bytes"] == per_parameter * count, extra


def test_plan_sizes_16_bit_gradients():
    pr = load_preset("175b")
    req = PlanRequest(model=Model(**pr.model), gpus=pr.run["gpus"], global_batch=pr.run["global_batch"],
                      gpu=GPUS["a100"], gpu_memory_bytes=GPUS["a100"].memory_bytes, gradient_bytes=2)
    rows = evaluate(req, candidates(req))
    assert (rows.gradients_bytes == 2 * rows.parameters).all()     # each row the estimate's: test_stage_model


def test_plan_takes_the_gradient_dtype(actmem):
    """The weights are 2 B a parameter: 16-bit gradients are as many bytes as the weights."""
    out = actmem.json("plan", "--model", "22b", "--grad-dtype", "bf16", "--top", "3")
    assert out["best"] and all(row["gradients_bytes"] == row["weights_bytes"] for row in out["best"])
    fp32 = actmem.json("plan", "--model", "22b", "--top", "3")
    assert all(row["gradients_bytes"] == 2 * row["weights_bytes"] for row in fp32["best"])
