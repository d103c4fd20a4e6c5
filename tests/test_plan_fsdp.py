"""FSDP2 in the planner (issue 30): under --implementation torch-native every configuration is FSDP2's as torchtitan
applies it ('fsdp'), which is how torchtitan runs data parallelism beside TP (its DDP runs alone, under AMP, not
modelled). The rows are the estimate's (test_stage_model's property test draws torch-native sweeps too); here,
numbers by hand."""

import json

import numpy as np
from click.testing import CliRunner

from actmem.cli.main import cli
from actmem.planner import iteration
from actmem.planner.plan import PlanRequest, config_label, plan
from actmem.model.architecture import Architecture
from actmem.model.hardware import GPUS
from actmem.sources.presets import load_preset
from tests.test_fsdp import P_O, S_8B, TENSORS_8B

GIB = 2**30


def _plan_8b(gpus: int = 8, batch: int = 8):
    preset = load_preset("llama-3.1-8b")
    from actmem.model.spec import Model

    architecture = Architecture(**(preset.architecture | {"implementation": "torch-native"}))
    return plan(PlanRequest(model=Model(**preset.model), gpus=gpus, global_batch=batch, gpu=GPUS["h100"],
                            gpu_memory_bytes=80 * GIB, architecture=architecture))


def test_llama_8b_on_8_gpus_one_microbatch_peaks_at_the_loss_as_measured():
    """Llama 3.1 8B, t = 1, b = 1, s = 8192, d = 8, one microbatch, no recompute: the fp32 shard 4S and AdamW's
    8S + 4 B a tensor (S = 1,003,782,656: test_fsdp), then the loss's backward: a layer keeps 2sbh six times (the
    two norms' inputs, the q/k/v input, q, the projection's input, fc1's input: 6·67,108,864), k and v repeated to
    a heads 2·2sbh = 134,217,728, the log-sum-exp 4·s·a = 1,048,576, the norms' rstd 2·4s = 65,536, SwiGLU's
    inputs 2·2sf = 469,762,048, silu's output and fc2's input 2sf each (234,881,024): 1,477,509,120 B, 32 layers;
    the final norm's input 2sbh and rstd 4s, the output layer's input 2sbh, the fp32 logits 4sv = 4,202,692,608;
    the cross entropy's fp32 gradients 8sv = 8,405,385,216; the output group's gathered bf16 weights 2·8·P_O.
    On an H200 (torch 2.11, --mode rank0) the allocator's peak was 34,304 B above this."""
    layer = 6 * 67_108_864 + 134_217_728 + 1_048_576 + 65_536 + 469_762_048 + 2 * 234_881_024
    activations = 32 * layer + 67_108_864 + 32_768 + 67_108_864 + 4_202_692_608
    assert activations == 51_617_234_944
    peak = 4 * S_8B + 8 * S_8B + 4 * TENSORS_8B + activations + 8 * 8192 * 128_256 + 2 * 8 * P_O
    assert peak == 73_118_694_540
    rows = _plan_8b().evaluated
    labels = rows.apply(config_label, axis=1)
    row = rows[labels == "t=1 p=1 m=1 b=1 nosp none fsdp"].iloc[0]
    assert row.peak_bytes == peak and row.weights_bytes == row.gradients_bytes == 4 * S_8B
    assert (rows.fsdp == (rows.d > 1)).all()                # no DDP row: torchtitan runs none beside d > 1


def test_fsdp_rows_need_more_than_one_rank_to_shard():
    """At t = 8 on 8 GPUs d = 1: TP alone, not FSDP2 (torchtitan applies none over one rank), priced as estimate
    prices it; at t = 4, d = 2, FSDP2."""
    labels = set(_plan_8b().evaluated.apply(config_label, axis=1))
    assert "t=8 p=1 m=1 b=1 sp none" in labels and "t=8 p=1 m=1 b=1 sp none fsdp" not in labels
    assert "t=4 p=1 m=1 b=1 sp none fsdp" in labels and "t=4 p=1 m=1 b=1 sp none" not in labels


def test_fsdps_collectives_a_step():
    """S = 10^9 elements on rank 0, its embedding 10^8, d = 8 over 100 GB/s, 2 microbatches of a 10 ms forward and
    a 20 ms backward: (d - 1)/bandwidth = 7·10^-11 s a byte; a microbatch gathers 2S B twice (0.14 s each) and
    reduce-scatters 4S (0.28 s). The forward waits 0.14 - 0.01 = 0.13 s (more than the embedding's 0.014), the
    backward 0.14 + 0.28 - 0.02 = 0.40 s (more than its 0.028): 0.53 s a microbatch, 1.06 s. Where the compute is
    long, the embedding's: (0.014 + 0.028)·2 = 0.084 s."""
    seconds = iteration.fsdp_seconds(np.array([1e9, 1e9]), np.array([1e8, 1e8]), np.array([8, 8]), 2,
                                     np.array([0.01, 10.0]), np.array([0.02, 10.0]), 1e11)
    assert np.allclose(seconds, [1.06, 0.084])


def test_plan_sweeps_fsdp_and_says_how():
    """A torchtitan user's plan: FSDP2's rows, named in the output and its note; json carries the column."""
    args = ["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--global-batch", "8", "--implementation",
            "torch-native"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert " fsdp " in text and "every configuration over d > 1 data-parallel ranks under FSDP2" in text
    rows = json.loads(CliRunner().invoke(cli, args + ["--format", "json", "--top", "0"]).output)["best"]
    assert {row["fsdp"] for row in rows} == {True, False}
    assert all(row["fsdp"] == (row["d"] > 1) for row in rows)       # at d = 1, t = 8: TP alone


def test_explain_reads_fsdp_back():
    result = CliRunner().invoke(cli, ["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--global-batch", "8",
                                      "--implementation", "torch-native", "--explain", "t=1 p=1 b=1 nosp none fsdp"])
    assert result.exit_code == 0, result.output
    assert "FSDP2 over d=8" in result.output and "73,118,694,540" in result.output


def test_a_preset_of_fsdp2_plans_and_one_of_hsdp_is_refused(tmp_path):
    """A torchtitan preset sets fsdp = true (torch-native over d > 1 needs it), which the sweep's rows are: plan
    takes it; HSDP (fsdp_replicate), which plan does not sweep, is refused by its key. plan has no --fsdp flag."""
    from pathlib import Path

    text = (Path(__file__).parents[1] / "presets" / "llama-3.1-8b.toml").read_text()
    text = text.replace('name = "llama-3.1-8b"', 'name = "titan"').replace('aliases = ["llama3-8b", "llama-3-8b"]', "")
    text = text.replace("[architecture]", '[architecture]\nimplementation = "torch-native"')
    for run, code, words in (("", 0, "t=1 p=1 m=1 b=1 nosp none fsdp"),
                             ("fsdp_replicate = 2\n", 2, "plan sweeps FSDP2 itself")):
        preset = tmp_path / "titan.toml"
        preset.write_text(text + f"\n[run]\nfsdp = true\ngpus = 8\nglobal_batch = 8\n{run}")
        result = CliRunner().invoke(cli, ["plan", "--model", str(preset)])
        assert result.exit_code == code and words in result.output, result.output
    result = CliRunner().invoke(cli, ["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--global-batch", "8",
                                      "--implementation", "torch-native", "--fsdp"])
    assert result.exit_code == 2 and "--fsdp" in result.output


def test_every_fsdp_row_of_a_small_sweep_is_the_estimate():
    """Each FSDP2 row of a torch-native sweep (h = 64, 4 heads in 2 groups, v = 1000 that t does not divide, 3
    layers, 8 GPUs, a global batch of 16: t = 1 or 2, so d = 8 or 4, b = 1 or 2, so one, two or four microbatches,
    no recompute, full and torchtitan's per-op checkpointing, SP on and off at t = 2: 18 rows) is `estimate`'s run
    to the byte: state, total and peak."""
    from actmem.memory.estimate import estimate
    from actmem.model.spec import Model, build_spec
    from tests.conftest import plan_row_run

    flash = dict(attention_core="flash", position_embedding="rope", activation="swiglu", normalization="rmsnorm",
                 bias=False, tied_output=False, attention_dropout=0.0, hidden_dropout=0.0, query_groups=2,
                 implementation="torch-native")
    model = Model(heads=4, hidden=64, layers=3, vocab=1000, seq_len=256)
    req = PlanRequest(model=model, gpus=8, global_batch=16, gpu=GPUS["h100"], gpu_memory_bytes=GIB,
                      reserve_bytes=GIB // 8, architecture=Architecture(**flash), max_micro_batch=2)
    rows = plan(req).evaluated
    sharded = rows[rows.fsdp]
    assert len(sharded) == 18 and set(sharded.n) == {1, 2, 4}
    assert set(sharded.recompute) == {"none", "full", "selective:op"}
    for row in sharded.itertuples():
        spec = build_spec(vars(model), plan_row_run(row, gpus=8, global_batch=16), architecture=flash,
                          gpu_memory_bytes=GIB, reserve_bytes=GIB // 8)
        est = estimate(spec)
        assert spec.run.fsdp and est.parameters.weights_bytes == row.weights_bytes
        assert (est.total_bytes, est.verdict_bytes) == (row.total_bytes, row.peak_bytes), config_label(row)


def test_a_run_fsdp2_cannot_shard_is_refused_in_the_rules_words():
    """--grad-dtype bf16 is Megatron's buffer, which FSDP2 does not have: no configuration, and the plan says why
    in the rule's own words."""
    result = CliRunner().invoke(cli, ["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--global-batch", "8",
                                      "--implementation", "torch-native", "--grad-dtype", "bf16"])
    assert result.exit_code == 2
    assert "--grad-dtype sets Megatron's main-gradient buffer" in " ".join(result.output.split())


def test_the_nearest_gpu_count_where_only_fsdp_fits():
    """Llama 3.1 70B on 8 GPUs fits nowhere; on 16, t = 8 and d = 2 under FSDP2 with full recompute does (its fp32
    shards and AdamW's state, 12 B a parameter over d, leave room), so 16 is the nearest count, not 32."""
    result = CliRunner().invoke(cli, ["plan", "--model", "llama-3.1-70b", "--gpus", "8", "--global-batch", "64",
                                      "--implementation", "torch-native"])
    assert result.exit_code == 1
    assert "Nearest GPU counts where a configuration fits: 16 GPUs: t=8 p=1 m=1 b=1 sp full fsdp" in " ".join(
        result.output.split())


def test_a_preset_with_megatrons_optimizer_plans_under_torch_native():
    """Llama 3.1 405B's preset runs Megatron's distributed optimizer; plan chooses the run itself, so under
    torch-native it sweeps FSDP2 rather than refusing the preset's optimizer."""
    result = CliRunner().invoke(cli, ["plan", "--model", "llama-3.1-405b", "--gpus", "1024", "--global-batch",
                                      "1024", "--implementation", "torch-native"])
    assert result.exit_code == 0, result.output
    assert "t=2 p=1 m=1 b=2 sp full fsdp" in result.output
