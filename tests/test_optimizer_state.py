"""Adam's state by dtype: Megatron's fp32 master weight and moments (12 B a parameter), or TE's
precision-aware FusedAdam (--use-precision-aware-optimizer) with its master weight and moments
in the dtypes asked for. Bytes from transformer_engine/pytorch/optimizers/fused_adam.py
(_initialize_state: an int16 remainder beside bf16 weights, else the dtype's width; fp8 moments
are uint8 Float8Tensors) and megatron/core/optimizer/distrib_optimizer.py (no fp32 master copy
under the precision-aware optimizer)."""

import pytest

from actmem.errors import SpecError
from actmem.model.hardware import GPUS
from actmem.model.optimizer_state import OptimizerState
from actmem.planner.plan import PlanRequest, candidates, evaluate
from actmem.sources.presets import load_preset
from actmem.model.spec import Model
from tests.conftest import assert_one_line_error

# 530B's first stage (tests/test_readme_example.py): 2,060,874,240 parameters; its run is t = 8,
# p = 35, and on 2,240 GPUs d = 2240/(8·35) = 8
COUNT, D = 2_060_874_240, 8


@pytest.mark.parametrize("state, per_parameter", [
    (OptimizerState(), 4 + 4 + 4),                                          # Megatron's fp32 master + moments
    (OptimizerState(precision_aware=True), 2 + 4 + 4),                      # the master's 16-bit remainder
    (OptimizerState(precision_aware=True, params="fp16"), 4 + 4 + 4),       # no remainders beside fp16
    (OptimizerState(True, "fp32", "bf16", "bf16"), 2 + 2 + 2),
    (OptimizerState(True, "fp16", "fp8", "fp16"), 2 + 1 + 2),
    (OptimizerState(True, "fp16", "fp8", "fp8", "fp16"), 2 + 1 + 1),
])
def test_bytes_a_parameter_by_dtype(state, per_parameter):
    assert state.bytes_per_parameter == per_parameter


def test_fused_adam_s_step_copies_to_fp32_what_it_cannot_fuse():
    """fused_adam.py, step: bf16 moments together skip the unscale (fuse_unscale); fp16, fp8 and a
    bf16 moment beside an fp32 one are copied with .float(); the remainder master is not."""
    assert OptimizerState(True, "fp32", "bf16", "bf16").unscaled_states == ()
    assert OptimizerState(True, "fp32", "bf16", "fp32").unscaled_states == ("exp_avg",)
    assert OptimizerState(True, "fp16", "fp8", "fp16").unscaled_states == ("master_param", "exp_avg", "exp_avg_sq")
    assert OptimizerState(True).unscaled_states == ()


@pytest.mark.parametrize("field", ["main_params", "exp_avg", "exp_avg_sq"])
def test_lower_dtypes_need_the_precision_aware_optimizer(field):
    with pytest.raises(SpecError, match="needs --use-precision-aware-optimizer"):
        OptimizerState(**{field: "fp16"})


def test_the_estimate_counts_the_dtypes_over_the_shards(actmem):
    base = ("estimate", "--model", "530b", "--distributed-optimizer", "--gpus", "2240", "--global-batch", "2240")
    fp32 = actmem.json(*base)
    low = actmem.json(*base, "--precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16")
    assert fp32["parameters"]["optimizer_bytes"] == -(-12 * COUNT // D)
    assert low["parameters"]["optimizer_bytes"] == -(-6 * COUNT // D)      # 2 + 2 + 2
    assert low["parameters"]["weights_bytes"] == fp32["parameters"]["weights_bytes"] == 2 * COUNT
    assert fp32["verdict_bytes"] - low["verdict_bytes"] == -(-12 * COUNT // D) - -(-6 * COUNT // D)
    assert low["run_terms"] == fp32["run_terms"]


def test_the_precision_aware_optimizer_needs_the_distributed_one(actmem):
    assert_one_line_error(actmem("estimate", "--model", "530b", "--precision-aware-optimizer"),
                          "needs the distributed optimizer")
    assert_one_line_error(actmem("estimate", "--model", "530b", "--exp-avg-dtype", "fp8"),
                          "--exp-avg-dtype fp8 needs --use-precision-aware-optimizer")
    assert_one_line_error(actmem("estimate", "--model", "530b", "--main-grads-dtype", "bf16"),
                          "--main-grads-dtype bf16 needs --use-precision-aware-optimizer")


def test_a_pasted_precision_aware_run():
    """Megatron's spellings; --main-grads-dtype bf16 makes DDP's buffer bf16 (arguments.py leaves
    accumulate_allreduce_grads_in_fp32 off), and --fp16 weights keep a whole fp32 master."""
    from tests.conftest import Cli

    actmem = Cli()
    base = ("--num-layers 2 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --vocab-size 32000 "
            "--micro-batch-size 1 --attention-backend local --no-create-attention-mask-in-dataloader "
            "--use-distributed-optimizer --use-precision-aware-optimizer")
    count = actmem.json("estimate", "--megatron-args", base + " --bf16")["parameters"]["count"]
    for extra, gradient, optimizer in (
            ("--bf16", 4, 2 + 4 + 4),
            ("--bf16 --main-grads-dtype bf16 --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16", 2, 2 + 2 + 2),
            ("--bf16 --main-params-dtype fp16 --exp-avg-dtype fp8 --exp-avg-sq-dtype fp16", 4, 2 + 1 + 2),
            ("--fp16 --accumulate-allreduce-grads-in-fp32", 4, 4 + 4 + 4),
            ("--fp16", 2, 4 + 4 + 4)):
        out = actmem.json("estimate", "--megatron-args", f"{base} {extra}")   # one GPU: d = 1
        assert out["parameters"]["gradients_bytes"] == gradient * count, extra
        assert out["parameters"]["optimizer_bytes"] == optimizer * count, extra


def test_plan_keeps_the_distributed_optimizer_and_its_bytes():
    pr = load_preset("175b")
    adam = OptimizerState(True, "fp32", "bf16", "bf16")
    req = PlanRequest(model=Model(**pr.model), gpus=pr.run["gpus"], global_batch=pr.run["global_batch"],
                      gpu=GPUS["a100"], gpu_memory_bytes=GPUS["a100"].memory_bytes, optimizer=adam)
    rows = evaluate(req, candidates(req))
    assert len(rows) and rows.distributed_optimizer.all()
    shards = rows.d * rows.c
    assert (rows.optimizer_bytes == -(-6 * rows.parameters // shards)).all()   # each the estimate's: test_stage_model


def test_plan_takes_the_optimizer_dtypes(actmem):
    out = actmem.json("plan", "--model", "22b", "--precision-aware-optimizer", "--exp-avg-dtype", "bf16",
                      "--exp-avg-sq-dtype", "bf16", "--top", "3")
    assert out["best"] and all(row["distributed_optimizer"] for row in out["best"])
