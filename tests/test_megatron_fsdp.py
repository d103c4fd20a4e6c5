"""Megatron-FSDP (megatron-core's own FSDP: --use-megatron-fsdp, --data-parallel-sharding-strategy): the model state
a rank keeps under each strategy, by hand, and Megatron-LM's own FSDP example as it prices.

Llama 3.1 8B at t = 1: N = 2·128,256·4096 (embedding, untied output) + 4096 (final norm) + 32 layers of
4096·(4096 + 2·8·128) (QKV) + 4096² (projection) + 3·4096·14,336 (SwiGLU) + 2·4096 (norms) = 218,112,000 each:
N = 1,050,673,152 + 4096 + 6,979,584,000 = 8,030,261,248."""

import pytest

from tests.conftest import assert_one_line_error

N = 8_030_261_248
EXAMPLE = "tests/data/megatron_examples/train_llama3_8b_fsdp_h100_fp8.sh"
#: TE's dummy weight gradients (fusion on): QKV [6144, 4096], projection [4096, 4096], fc1 [28,672, 4096],
#: fc2 [4096, 14,336], output [128,256, 4096], 2 B an element
DUMMIES = 2 * (6144 * 4096 + 4096 * 4096 + 28_672 * 4096 + 4096 * 14_336 + 128_256 * 4096)


def _state(actmem, *args):
    out = actmem.json("estimate", "-m", "llama-3.1-8b", "--use-megatron-fsdp", *args)
    params = out["parameters"]
    return params["weights_bytes"], params["gradients_bytes"], params["optimizer_bytes"], params["dummy_wgrads_bytes"]


@pytest.mark.parametrize("strategy, args, expected", [
    # the default, optim_grads_params, over d = 8: 2 + 2 (bf16 gradients: auto, the weights' dtype) + 12 B, all / 8
    (None, ("--gpus", "8"), (2 * N // 8, 2 * N // 8, 12 * N // 8)),
    # optim: the main weights and Adam's moments alone sharded
    ("optim", ("--gpus", "8"), (2 * N, 2 * N, 12 * N // 8)),
    # optim_grads: and the gradients, here fp32 (--megatron-fsdp-main-grads-dtype fp32)
    ("optim_grads", ("--gpus", "8", "--megatron-fsdp-main-grads-dtype", "fp32"), (2 * N, 4 * N // 8, 12 * N // 8)),
    # no_shard over d·c = 8·2: nothing sharded, 2 + 4 + 12 = 18 B a parameter, DDP's
    ("no_shard", ("--gpus", "16", "--cp", "2", "--megatron-fsdp-main-grads-dtype", "fp32"), (2 * N, 4 * N, 12 * N)),
])
def test_each_strategy_shards_what_its_buffers_shard(actmem, strategy, args, expected):
    """param_and_grad_buffer.py (_init_each_parameter_group_buffers): which of the weight, gradient and main-weight
    buffers a strategy distributes; Adam's moments live on the main weights' shards. 8,030,261,248 is divisible by
    8, so no shard is rounded up."""
    chosen = ("--data-parallel-sharding-strategy", strategy) if strategy else ()
    assert _state(actmem, *args, *chosen) == (*expected, DUMMIES)
    assert DUMMIES == 1_486_880_768


def test_the_state_is_held_at_every_moment_and_named(actmem):
    """The buffers are allocated once: the peak counts all of them (and the activations' moment beside them);
    the output names the strategy, what it shards and what is not counted."""
    out = actmem.json("estimate", "-m", "llama-3.1-8b", "--use-megatron-fsdp", "--gpus", "8")
    state = {row["name"]: row["bytes"] for row in out["stages"][0]["peak_floor"]["rows"]}
    assert (state["weights"], state["main_gradients"], state["optimizer_state"]) == (
        2 * N // 8, 2 * N // 8, 12 * N // 8)
    assert out["run"]["megatron_fsdp"] == "optim_grads_params"
    notes = " ".join(out["assumptions"])
    assert ("--data-parallel-sharding-strategy optim_grads_params: 16-bit weights, main gradients, fp32 main "
            "weights and Adam's moments sharded over d = 8") in notes
    assert "not counted under Megatron-FSDP: each bucket's padding" in notes
    text = actmem("estimate", "-m", "llama-3.1-8b", "--use-megatron-fsdp", "--gpus", "8").output
    assert "recompute none · Megatron-FSDP" in text and "optim_grads_params over d=8" in text    # (wrapped)


def _example(tmp_path, strategy=None, fsdp=True):
    """Megatron-LM's Megatron-FSDP example as a user edits it to run in bf16 without NCCL user buffers (whose
    double buffers are not modelled): DTYPE, and the three lines of --use-nccl-ub, --fsdp-double-buffer and
    --fsdp-manual-registration; ``strategy``, its SHARDING_STRATEGY default; ``fsdp`` False, its DDP path
    (USE_MEGATRON_FSDP=0)."""
    text = open(EXAMPLE).read().replace('DTYPE="fp8"', 'DTYPE="bf16"')
    text = "\n".join(line for line in text.splitlines()
                     if line.strip() not in ("--use-nccl-ub", "--fsdp-double-buffer", "--fsdp-manual-registration"))
    if strategy:
        text = text.replace('SHARDING_STRATEGY:-"optim_grads_params"', f'SHARDING_STRATEGY:-"{strategy}"')
    if not fsdp:
        text = text.replace("USE_MEGATRON_FSDP:-1", "USE_MEGATRON_FSDP:-0")
    script = tmp_path / f"fsdp_{strategy}_{fsdp}.sh"
    script.write_text(text)
    return f"@{script}"


def test_megatron_lms_fsdp_example_prices_and_its_optim_strategy_is_its_ddp_path(actmem, tmp_path):
    """The example (8 GPUs, t = 1, optim_grads_params, --no-gradient-accumulation-fusion: no dummy weight
    gradients) keeps 16N/8 = 16,060,522,496 B of model state a rank, and the weights outside its units gathered
    through the step, 2·(2·128,256·4096 + 4096) = 2,101,354,496 B. With SHARDING_STRATEGY=optim and fp32 main
    gradients it keeps what its DDP path (USE_MEGATRON_FSDP=0: DDP with the distributed optimizer, fp32 gradients)
    keeps: 2N + 4N + 12N/8 (the DDP path fuses the weight gradients: its dummies beside)."""
    out = actmem.json("estimate", "--megatron-args", _example(tmp_path))
    gathered = 2 * (2 * 128_256 * 4096 + 4096)
    assert out["parameters"]["gathered_bytes"] == gathered == 2_101_354_496
    notes = " ".join(out["assumptions"])       # its buckets and hooks are Megatron-FSDP's, not DDP's
    assert "--overlap-grad-reduce and --overlap-param-gather read: under Megatron-FSDP" in notes
    assert "Megatron-FSDP's hook adds to main_grad" in notes and "DDP already holds" not in notes
    assert out["parameters"]["total_bytes"] == 16 * N // 8 + gathered == 16_060_522_496 + gathered
    assert out["parameters"]["dummy_wgrads_bytes"] == 0
    optim = actmem.json("estimate", "--megatron-args", _example(tmp_path, "optim"),
                        "--megatron-fsdp-main-grads-dtype", "fp32")
    ddp = actmem.json("estimate", "--megatron-args", _example(tmp_path, fsdp=False))
    state = ("weights_bytes", "gradients_bytes", "optimizer_bytes")
    assert [optim["parameters"][key] for key in state] == [ddp["parameters"][key] for key in state] == [
        2 * N, 4 * N, 12 * N // 8]


@pytest.mark.parametrize("args, fragment", [
    (("--data-parallel-sharding-strategy", "optim"), "--data-parallel-sharding-strategy optim is Megatron-FSDP's"),
    (("--megatron-fsdp-main-grads-dtype", "fp32", "--gpus", "8"),
     "--megatron-fsdp-main-grads-dtype fp32 is Megatron-FSDP's: give --use-megatron-fsdp too"),
    (("--use-megatron-fsdp",), "--use-megatron-fsdp shards the model state over the d·c data-parallel ranks: give --gpus"),
    (("--use-megatron-fsdp", "--gpus", "8", "--grad-reduce-in-bf16"),
     "sets the gradient buffer of Megatron's DDP, which Megatron-FSDP does not read"),
    (("--use-megatron-fsdp", "--gpus", "8", "--pp", "2"), "--use-megatron-fsdp is modelled at p = 1"),
    (("--use-megatron-fsdp", "--gpus", "8", "--fp8-format", "e4m3", "--gpu", "h100"),
     "--use-megatron-fsdp under FP8 keeps its weight buffers in FP8"),
    (("--use-megatron-fsdp", "--gpus", "8", "--implementation", "hf"),
     "--use-megatron-fsdp is megatron-core's own FSDP, modelled under --implementation megatron, not hf"),
])
def test_what_megatron_fsdp_is_not_modelled_beside_is_refused(actmem, args, fragment):
    assert_one_line_error(actmem("estimate", "-m", "llama-3.1-8b", *args), fragment)


def test_plan_refuses_a_megatron_fsdp_paste(actmem, tmp_path):
    assert_one_line_error(actmem("plan", "--megatron-args", _example(tmp_path), "--gpus", "8"),
                          "plan does not sweep Megatron-FSDP yet")


def test_an_fp16_paste_keeps_fp16_gradients_and_turns_the_distributed_optimizer_on(actmem, tmp_path):
    """Under --fp16 Megatron's DDP keeps 16-bit gradient buffers (actmem implies --grad-dtype fp16 for a paste);
    Megatron-FSDP's own follow the weights' dtype, fp16, 2 B: not refused as a DDP setting. Megatron-FSDP v1 turns
    the distributed optimizer on (arguments.py: 'Using DistributedOptimizer')."""
    text = open(EXAMPLE).read().replace('DTYPE="fp8"', 'DTYPE="fp16"').replace("    --bf16\n", "    --fp16\n")
    text = "\n".join(line for line in text.splitlines()
                     if line.strip() not in ("--use-nccl-ub", "--fsdp-double-buffer", "--fsdp-manual-registration"))
    script = tmp_path / "fp16.sh"
    script.write_text(text)
    out = actmem.json("estimate", "--megatron-args", f"@{script}")
    assert out["parameters"]["gradients_bytes"] == 2 * N // 8
    assert out["run"]["distributed_optimizer"] is True
