"""Megatron's local (eager) attention core is counted with its fused causal softmax, which
keeps only its probabilities. The kernel runs only where FusedScaleMaskSoftmax.is_kernel_available
(megatron/core/fusions/fused_softmax.py) allows: 16 < sk <= 4096, sq and sk multiples of 4,
and b·a/t attention batches a multiple of the kernel's rows a block (get_batch_per_block in
scaled_masked_softmax.h: 128 threads in warps of 32 lanes, two rows a warp while
2^⌈log2 sk⌉ <= 128: 8 rows up to sk = 128, 4 above). Elsewhere Megatron runs torch's softmax,
which keeps other tensors: actmem refuses rather than count the fused kernel's bytes there."""

import pytest

from actmem.plan import candidates
from actmem.spec import Model
from tests.conftest import assert_one_line_error
from tests.test_plan import request

# heads 8, hidden 512, t = 2: 4 heads a rank
SMALL = ["--heads", "8", "--hidden", "512", "--layers", "2", "--vocab", "512", "--tp", "2"]


@pytest.mark.parametrize("s, b", [
    (4096, 1),      # the kernel's largest sk; b·a/t = 4, four rows a block above sk = 128
    (132, 1),       # just above 128: 4 rows a block
    (128, 2),       # up to 128: 8 rows a block, b·a/t = 8
    (20, 2),        # the smallest multiple of 4 above 16
])
def test_where_the_fused_kernel_runs_the_estimate_is_given(actmem, s, b):
    out = actmem.json("estimate", *SMALL, "--seq-len", str(s), "--micro-batch", str(b))
    tp = {row["technique"]: row for row in out["techniques"]}["tp"]
    # the paper's tp row, sbh(10 + 24/t) + 5as²b/t, with h = 512, a = 8, t = 2
    assert tp["per_layer_bytes"] == s * b * 512 * 22 + 5 * 8 * s * s * b // 2


@pytest.mark.parametrize("s, b, t, fragment", [
    (4100, 1, 2, "it needs 16 < s <= 4096 (s = 4100)"),
    (8192, 1, 2, "it needs 16 < s <= 4096 (s = 8192)"),
    (16, 2, 2, "it needs 16 < s <= 4096 (s = 16)"),
    (130, 2, 2, "it needs s a multiple of 4 (s = 130)"),
    (128, 1, 2, "it needs b·a/t a multiple of 8 at s = 128 (b·a/t = 1·8/2 = 4 attention batches a rank)"),
    (256, 1, 4, "it needs b·a/t a multiple of 4 at s = 256 (b·a/t = 1·8/4 = 2 attention batches a rank)"),
])
def test_where_megatron_falls_back_to_torch_s_softmax_the_estimate_is_refused(actmem, s, b, t, fragment):
    args = [*SMALL[:-1], str(t), "--seq-len", str(s), "--micro-batch", str(b)]
    assert_one_line_error(actmem("estimate", *args), "Megatron's local attention core runs its fused softmax only",
                          fragment, "--attention-core flash")


def test_the_rule_is_megatron_s_local_core_s_alone(actmem):
    """TE's flash cores and transformers' eager attention (no fused softmax) are not bound by it."""
    common = [*SMALL, "--seq-len", "8192"]
    for core in ("flash", "flash-attn"):
        assert actmem("estimate", *common, "--attention-core", core, "--attention-dropout", "0").exit_code == 0
    hf = actmem("estimate", *SMALL[:-2], "--seq-len", "8192", "--implementation", "hf",
                "--attention-core", "eager")
    assert hf.exit_code == 0, hf.output


def test_the_planner_leaves_out_the_microbatches_the_kernel_refuses():
    """A 175B-like model with 24 heads at s = 2048 (4 rows a block): at t = 8, 3 heads a rank,
    only b a multiple of 4 runs the fused kernel; at t = 2, 12 heads a rank, every b."""
    frame = candidates(request("175b", model=Model(heads=24, hidden=12288, layers=96, vocab=51200,
                                                   seq_len=2048)))
    at_8 = frame[frame.t == 8]
    assert 4 in set(at_8.b) and (at_8.b % 4 == 0).all()
    assert {1, 2} <= set(frame[frame.t == 2].b)


def test_the_growth_plot_says_which_lengths_it_leaves_out(actmem, tmp_path):
    """530B at s = 2048: s/8 to 8s; 6144 and above are past the kernel's 4096."""
    result = actmem("plot", "growth", "--model", "530b", "--csv", str(tmp_path / "growth.csv"))
    assert result.exit_code == 0, result.output
    assert ("left out seq-len = 6144, 8192, 12288, 16384, which the run refuses; at 6144: Megatron's local "
            "attention core runs its fused softmax only where the kernel allows: it needs 16 < s <= 4096") \
        in result.stdout
    import pandas as pd

    assert pd.read_csv(tmp_path / "growth.csv").seq_len.max() == 4096


PASTE = ("--num-layers 2 --hidden-size 512 --num-attention-heads 8 --seq-length 2048 --vocab-size 512 "
         "--bf16 --micro-batch-size 1 --tensor-model-parallel-size 2 --no-create-attention-mask-in-dataloader")


def test_a_pasted_switch_off_the_fused_softmax_is_refused_under_the_local_core(actmem):
    assert_one_line_error(actmem("estimate", "--megatron-args", f"{PASTE} --attention-backend local "
                                 "--no-masked-softmax-fusion"),
                          "--no-masked-softmax-fusion under Megatron's local attention core runs torch's softmax")


def test_softmax_switches_that_cannot_change_memory_are_listed_as_ignored(actmem):
    """--attention-softmax-in-fp32 beside the local core's fused kernel (16-bit whatever it says),
    and both switches under TE's kernels, which keep no softmax: the same estimate as without."""
    for backend, switches in (("local", "--attention-softmax-in-fp32"),
                              ("fused", "--attention-softmax-in-fp32 --no-masked-softmax-fusion")):
        plain = actmem.json("estimate", "--megatron-args", f"{PASTE} --attention-backend {backend}")
        switched = actmem.json("estimate", "--megatron-args", f"{PASTE} --attention-backend {backend} {switches}")
        assert switched["techniques"] == plain["techniques"]
        assert switched["assumptions"][-1] == ("Megatron arguments ignored, as they cannot change memory: "
                                               + ", ".join(switches.split()))


def test_commands_that_only_read_the_model_s_dims_are_not_bound_by_it(actmem):
    """FLOPs do not depend on the softmax kernel, and the planner sweeps b and t itself: 25 heads
    at t = 1 run the kernel from b = 4 on (b·a = 100)."""
    assert actmem("flops", "--model", "22b", "--seq-len", "8192").exit_code == 0
    planned = actmem.json("plan", "--heads", "25", "--hidden", "1600", "--layers", "48", "--vocab", "50257",
                          "--seq-len", "1024", "--gpus", "8", "--global-batch", "32")
    assert planned["evaluated"] > 0 and planned["best"]      # t = 1 or 5: b·25 or b·5, so b = 4, 8, ...
    assert all(row["b"] % 4 == 0 for row in planned["best"])


def test_a_sweep_the_kernel_refuses_whole_is_one_line(actmem):
    """4 heads at s = 2048 over t = 2 or 4 at b = 1 (global batch 4 on 8 GPUs: d = 4, b = 1):
    never a multiple of 4 attention batches a rank."""
    assert_one_line_error(actmem("plan", "--heads", "4", "--hidden", "512", "--layers", "3", "--vocab", "512",
                                 "--seq-len", "2048", "--gpus", "8", "--global-batch", "4"),
                          "no configuration of the sweep is one actmem models", "fused softmax")
