"""`actmem validate` measures one data-parallel rank: the preset's GPU count and global batch,
which it does not run, neither refuse a run nor can be fixed by a flag it refuses."""

import json

import pytest

pytest.importorskip("torch")

from tests.conftest import assert_one_line_error  # noqa: E402


def test_a_preset_whose_data_parallel_batch_a_flag_breaks_is_measured(actmem):
    """22B at t = 2, b = 2: the preset's 8 GPUs and global batch 4 would make d = 4 and
    b·d = 8, which does not divide 4; validate runs d = 1 and n = 1 microbatch (p = 1), so it
    measures."""
    result = actmem("validate", "--model", "22b", "--tp", "2", "--micro-batch", "2", "--mode", "fake",
                    "--techniques", "tp-sp-sel", "--format", "json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert {row["technique"] for row in rows} == {"tp-sp-sel"}
    assert {row["config"] for row in rows} == {"22b t=2 p=1 m=1 b=2 n=1 tp-sp-sel"}


def test_a_pipeline_the_presets_gpus_do_not_divide_is_measured(actmem):
    """22B at p = 3: t·p = 24 does not divide the preset's 8 GPUs; validate runs t·p ranks."""
    result = actmem("validate", "--model", "22b", "--pp", "3", "--mode", "fake", "--techniques", "tp-sp-sel",
                    "--format", "json")
    assert result.exit_code == 0, result.output
    assert {row["config"] for row in json.loads(result.stdout)} == {"22b t=8 p=3 m=1 b=4 n=3 tp-sp-sel"}


@pytest.mark.parametrize("args, fragment", [
    # rules of the run validate measures still refuse it, in one line
    (["--tp", "3", "--micro-batch", "2"], "t (3) must divide heads (64)"),
    (["--seq-len", "2052"], "t (8) must divide seq_len (2052)"),
    # torch's fallback softmax (s > 4096, at the measured b and t) beside the dataloader's mask on 3 stages
    (["--seq-len", "4104", "--pp", "3", "--attention-mask"], "the layers that mask does not reach"),
    (["--layers", "1000000000"], "layers (1,000,000,000) must be at most 100,000"),
    # and the flags that would set the data-parallel batch are still its own, refused
    (["--tp", "2", "--micro-batch", "2", "--gpus", "2", "--global-batch", "2"], "on one data-parallel rank"),
])
def test_a_run_validate_cannot_measure_is_one_line(actmem, args, fragment):
    result = actmem("validate", "--model", "22b", *args, "--mode", "fake", "--techniques", "tp-sp-sel")
    assert_one_line_error(result, fragment)


def test_a_pasted_script_s_run_settings_are_the_script_s_not_a_dead_end(actmem, tmp_path):
    """A launch script carries its batch, GPUs, SP and recompute; validate measures each
    technique with its own, as it does a preset's run, rather than asking the user to edit the
    script. The same settings given as flags beside it are still refused."""
    script = tmp_path / "args.txt"
    script.write_text("--num-layers 2 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --vocab-size 512 "
                      "--bf16 --tensor-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 64 "
                      "--sequence-parallel --recompute-activations --use-distributed-optimizer "
                      "--attention-backend local --no-create-attention-mask-in-dataloader")
    result = actmem("validate", "--megatron-args", f"@{script}", "--mode", "fake", "--techniques", "tp-sp-sel")
    assert result.exit_code == 0, result.output
    refused = actmem("validate", "--megatron-args", f"@{script}", "--mode", "fake", "--global-batch", "64")
    assert refused.exit_code == 2 and "drop --global-batch" in refused.stderr


def test_fsdp2s_gpus_are_measured_not_refused(actmem):
    """Under --fsdp, --gpus sets the d ranks FSDP2 shards over, which the harness measures (fsdp.py): Llama 3.1 8B's
    dims cut to 2 layers of h = 64 on 4 GPUs are measured at d = 4; without --fsdp, --gpus is still refused."""
    small = ["--model", "llama-3.1-8b", "--heads", "8", "--query-groups", "4", "--hidden", "64",
             "--ffn-hidden-size", "128", "--layers", "2", "--vocab", "512", "--seq-len", "32",
             "--implementation", "torch-native", "--gpus", "4", "--mode", "fake", "--techniques", "none"]
    result = actmem("validate", *small, "--fsdp", "--format", "json")
    assert result.exit_code == 0, result.output
    assert {row["config"] for row in json.loads(result.stdout)} == {
        "llama-3.1-8b · torch-native t=1 fsdp d=4 p=1 m=1 b=1 n=1 none"}
    assert_one_line_error(actmem("validate", *small), "on one data-parallel rank")
