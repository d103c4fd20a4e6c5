"""PyTorch's FSDP2 as torchtitan applies it (--fsdp, issue 30; actmem.memory.fsdp): the model state rank 0 keeps,
what its groups hold at each moment, and what is refused. Numbers by hand."""

import json

import pytest
from click.testing import CliRunner

from actmem.cli.main import cli
from actmem.errors import SpecError
from actmem.memory.estimate import estimate
from actmem.model.spec import build_spec
from actmem.sources.presets import load_preset

# Llama 3.1 8B (h = 4096, a = 32, g = 8, d_h = 128, f = 14,336, v = 128,256, L = 32) at t = 1, as torchtitan's
# model.py has it: a block's wq and wo 4096·4096 = 16,777,216 each, wk and wv 1024·4096 = 4,194,304 each, w1, w2 and
# w3 14,336·4096 = 58,720,256 each, two RMSNorm weights of 4096: N = 218,112,000; the embedding and the output
# layer 128,256·4096 = 525,336,576 each, the final norm 4096. At d = 8 every first dim divides (no padding):
# P_block = 27,264,000, P_E = 65,667,072, P_O = (4096 + 525,336,576)/8 = 65,667,584.
P_BLOCK, P_E, P_O = 27_264_000, 65_667_072, 65_667_584
S_8B = P_E + 32 * P_BLOCK + P_O                    # 1,003,782,656 elements on rank 0
TENSORS_8B = 1 + 9 * 32 + 2                        # AdamW's step tensors, one a parameter


def _llama(name: str, gpus: int, t: int = 1, fsdp: bool = True, seq_len: int | None = None, **run):
    preset = load_preset(name)
    model = preset.model | ({"seq_len": seq_len} if seq_len else {})
    return build_spec(model, {"tensor_parallel": t, "sequence_parallel": t > 1, "gpus": gpus, "fsdp": fsdp}
                      | run, name=name, architecture=preset.architecture | {"implementation": "torch-native"})


def _moments(spec) -> dict:
    return {moment.name: {row.name: row.bytes for row in moment.parts} for moment in estimate(spec).run.moments}


def test_llama_8b_model_state_on_8_gpus():
    """fp32 sharded weights 4S, fp32 gradients 4S, AdamW's two fp32 moments 8S and a 4-B step a tensor."""
    params = estimate(_llama("llama-3.1-8b", 8)).parameters
    assert S_8B == 1_003_782_656
    assert params.count == S_8B
    assert params.weights_bytes == params.gradients_bytes == 4 * S_8B == 4_015_130_624
    assert params.optimizer_bytes == 8 * S_8B + 4 * TENSORS_8B == 8_030_262_412
    assert params.held_bytes == 12 * S_8B + 4 * TENSORS_8B      # the gradients are the moments'


def test_llama_70b_with_tensor_parallelism_pads_the_first_dim():
    """Llama 3.1 70B (h = 8192, a = 64, g = 8, d_h = 128, f = 28,672, v = 128,256, L = 80) at t = 8 on 48 GPUs:
    d = 6. Each rank's TP shard: wq [1024, 8192], wk and wv [128, 8192], wo [8192, 1024], w1 and w3 [3584, 8192],
    w2 [8192, 3584], norms [8192]; the embedding and output [16,032, 8192]. FSDP2 keeps ceil(rows/6) rows of each:
    wq 171·8192, wk and wv 22·8192, wo 1366·1024, w1 and w3 598·8192, w2 1366·3584, norms 1366 each;
    embedding and output 2672·8192, the final norm 1366."""
    block = (171 + 2 * 22 + 2 * 598) * 8192 + 1366 * 1024 + 1366 * 3584 + 2 * 1366
    assert block == 17_856_172
    embedding = output_layer = 2672 * 8192
    shard = embedding + 80 * block + output_layer + 1366
    params = estimate(_llama("llama-3.1-70b", 48, t=8)).parameters
    assert params.count == shard == 1_472_273_174
    assert params.optimizer_bytes == 8 * shard + 4 * (1 + 9 * 80 + 2)


def test_the_loss_moment_holds_the_output_groups_gathered_weights():
    """torchtitan leaves (norm, output) gathered after the forward: 2 B of d padded shards, 2·8·P_O; with one
    microbatch no gradient is held yet. The rest of the moment is the run's without FSDP."""
    fsdp, plain = _moments(_llama("llama-3.1-8b", 8)), _moments(_llama("llama-3.1-8b", 1, fsdp=False))
    assert fsdp["loss"]["gathered_weights"] == 2 * 8 * P_O == 1_050_681_344
    assert "sharded_gradients" not in fsdp["loss"]
    assert {name: size for name, size in fsdp["loss"].items() if name != "gathered_weights"} == plain["loss"]


def test_gradient_accumulation_holds_every_groups_gradients():
    """global batch 32 on 8 GPUs at b = 1: 4 microbatches. From the second on the sharded gradients (4S) are held,
    so the last microbatch's loss holds them; the peak then holds every part of the model state."""
    spec = _llama("llama-3.1-8b", 8, global_batch=32)
    moments = _moments(spec)
    assert moments["loss"]["sharded_gradients"] == 4 * S_8B
    est = estimate(spec)
    assert est.peak.bytes_of("sharded_gradients") == 4 * S_8B
    assert est.peak.total_bytes == est.parameters.total_bytes + est.run.peak_moment.bytes - 4 * S_8B


def test_the_output_groups_post_backward():
    """(norm, output)'s post-backward: the saved activations less the output layer's, the last block's all-gather
    output the backward prefetched (2·8·P_block), the output group's bf16 gradients (2·N_O, unpadded) and its fp32
    reduce-scatter input (4·8·P_O). At s = 1024 with full recompute its activations are small, and on 64 GPUs
    (every first dim divides 64 too: the same gathered sizes) the gradients 4S of the optimizer's step are 0.5 GB:
    it is the peak."""
    spec = _llama("llama-3.1-8b", 64, recompute="full", seq_len=1024)
    moment = _moments(spec)["output_reduce"]
    assert moment["prefetched_weights"] == 2 * 8 * P_BLOCK == 436_224_000
    assert moment["unsharded_gradients"] == 2 * (4096 + 128_256 * 4096) == 1_050_681_344
    assert moment["reduce_scatter_input"] == 4 * 8 * P_O == 2_101_362_688
    assert "sharded_gradients" not in moment
    est = estimate(spec)
    assert est.run.peak_moment.name == "output_reduce"
    # one layer's checkpoint 2sh = 8,388,608 a layer, 32 layers, and the embedding's nothing: the output layer's
    # rows are freed by then
    assert moment["activations_in_flight"] == 32 * 2 * 1024 * 4096


def test_the_last_blocks_backward():
    """The last block gathered again (2·8·P_block), the block before it prefetched (the same), the output group's
    reduce-scatter input still referenced (4·8·P_O) and its sharded gradient (4·P_O) on a first microbatch."""
    moment = _moments(_llama("llama-3.1-8b", 8))["last_block"]
    assert moment["gathered_weights"] == moment["prefetched_weights"] == 2 * 8 * P_BLOCK
    assert moment["reduce_scatter_input"] == 4 * 8 * P_O
    assert moment["sharded_gradients"] == 4 * P_O


def test_the_backward_ends_at_the_embeddings_post_backward():
    """The root's final callback reduces the embedding last: its bf16 gradient (2·N_E, still referenced when its
    reduce-scatter output is made: measured), its fp32 reduce-scatter input (4·d·P_E) and output (4·P_E), every other
    group's sharded gradient (4(S - P_E)), no activation: more than the optimizer's step after it (4S). Llama 3.1 70B at t = 8 on 16 GPUs (d = 2) with full recompute at s = 1024, where the model
    state is large next to the checkpoints, peaks there. The embedding's rank-0 shard: 16,032 vocabulary rows
    (128,256/8) of 8192, N_E = 131,334,144; d = 2 keeps 8016 rows, P_E = 65,667,072."""
    spec = _llama("llama-3.1-70b", 16, t=8, recompute="full", seq_len=1024)
    est = estimate(spec)
    params = est.parameters
    moments = _moments(spec)
    assert moments["embedding_reduce"] == {"unsharded_gradients": 2 * 131_334_144,
                                           "reduce_scatter_input": 4 * 2 * 65_667_072,
                                           "sharded_gradients": params.gradients_bytes - 4 * 65_667_072,
                                           "reduce_scatter_output": 4 * 65_667_072}
    assert moments["optimizer_step"] == {"sharded_gradients": params.gradients_bytes}
    assert est.run.peak_moment.name == "embedding_reduce"


def test_full_recompute_reruns_the_last_block_beside_fsdps_rows():
    """Under full recompute the last block's backward reruns it from its checkpoint: the layer as kept without
    recompute, less its input, is held with the block's gathered weights. torch-native's rerun moment of its own
    is not there (the loss's fp32 logits it frees first are larger), so the last block's moment carries it."""
    full = _moments(_llama("llama-3.1-8b", 8, recompute="full"))
    plain = estimate(_llama("llama-3.1-8b", 1, fsdp=False))
    layer = plain.run.per_layer_bytes                        # one layer kept whole, at t = 1
    # less the checkpoint (2sh), plus the layer's output made again (2sh): engine.rematerialised_bytes
    assert full["last_block"]["rematerialised"] == layer - 2 * 8192 * 4096 + 2 * 8192 * 4096
    assert "rerun" not in full


def test_one_block_prefetches_the_embedding():
    """With one layer the group before the last block is the embedding: 2·d·P_E."""
    preset = load_preset("llama-3.1-8b")
    spec = build_spec(preset.model | {"layers": 1}, {"gpus": 8, "fsdp": True}, name="one",
                      architecture=preset.architecture | {"implementation": "torch-native"})
    assert _moments(spec)["last_block"]["prefetched_weights"] == 2 * 8 * P_E


def test_the_resharding_policies():
    """torchtitan's fsdp_reshard_after_forward: 'never' leaves every group gathered through the loss (2·8·S, the whole
    model in bf16, d padded shards a parameter) and through the last block's backward (all but the output group's,
    freed at its post-backward: 2·8·(P_E + 32·P_block)), with nothing prefetched; 'always' reshards the output group
    too, so the loss holds no gathered weight."""
    never = _moments(_llama("llama-3.1-8b", 8, fsdp_reshard="never"))
    assert never["loss"]["gathered_weights"] == 2 * 8 * S_8B
    assert never["last_block"]["gathered_weights"] == 2 * 8 * (P_E + 32 * P_BLOCK)
    assert "prefetched_weights" not in never["last_block"] and "prefetched_weights" not in never["output_reduce"]
    always = _moments(_llama("llama-3.1-8b", 8, fsdp_reshard="always"))
    assert "gathered_weights" not in always["loss"]
    assert always["last_block"] == _moments(_llama("llama-3.1-8b", 8))["last_block"]


def test_hsdp_shards_over_d_over_r():
    """--fsdp-replicate 2 on 16 GPUs: 2 replicas of 8 shards, the model state and moments of d = 8."""
    hsdp = estimate(_llama("llama-3.1-8b", 16, fsdp_replicate=2))
    assert hsdp.parameters == estimate(_llama("llama-3.1-8b", 8)).parameters
    assert _moments(_llama("llama-3.1-8b", 16, fsdp_replicate=2))["last_block"]["reduce_scatter_input"] == 4 * 8 * P_O


@pytest.mark.parametrize("run, architecture, message", [
    ({"gpus": 8}, {"implementation": "megatron"}, "modelled under --implementation torch-native only"),
    ({}, {}, "give --gpus"),
    ({"gpus": 1}, {}, "shards nothing"),
    ({"gpus": 8, "tensor_parallel": 8, "sequence_parallel": True}, {}, "shards nothing"),
    ({"gpus": 8, "distributed_optimizer": True}, {}, "distributed optimizer is not modelled for --implementation torch"),
    ({"gpus": 8}, {"bias": True}, "torchtitan's Llama model, whose linears have no bias"),
    ({"gpus": 8}, {"tied_output": True}, "whose output layer is its own.*--untie-embeddings-and-output-weights"),
    ({"gpus": 8, "fsdp_replicate": 8}, {}, "R = d is DDP"),
    ({"gpus": 8, "fsdp_replicate": 3}, {}, "must divide the d = 8"),
])
def test_refused(run, architecture, message):
    preset = load_preset("llama-3.1-8b")
    with pytest.raises(SpecError, match=message):
        build_spec(preset.model, {"fsdp": True} | run, name="x",
                   architecture=preset.architecture | {"implementation": "torch-native"} | architecture)


@pytest.mark.parametrize("run", [{"fsdp_replicate": 2}, {"fsdp_reshard": "never"}])
def test_fsdps_settings_need_fsdp(run):
    preset = load_preset("llama-3.1-8b")
    with pytest.raises(SpecError, match="give --fsdp too"):
        build_spec(preset.model, {"gpus": 1} | run, name="x",
                   architecture=preset.architecture | {"implementation": "torch-native"})


def test_data_parallelism_without_fsdp_is_refused_under_torch_native():
    """torchtitan 018740b7 shards data parallelism with FSDP2; its DDP runs alone, under AMP (fp32 weights), which
    actmem does not model, and beside TP it raises: d > 1 without --fsdp is refused, naming both; d = 1 is not."""
    preset = load_preset("llama-3.1-8b")
    native = preset.architecture | {"implementation": "torch-native"}
    for run in ({"gpus": 8}, {"gpus": 16, "tensor_parallel": 2, "sequence_parallel": True}):
        with pytest.raises(SpecError, match="over d = 8 data-parallel ranks is torchtitan's FSDP2: give --fsdp "
                                            r"\('fsdp' in a plan's label; torchtitan 018740b7 runs DDP only alone"):
            build_spec(preset.model, run, name="x", architecture=native)
    assert build_spec(preset.model, {"gpus": 8, "tensor_parallel": 8, "sequence_parallel": True}, name="x",
                      architecture=native).data_parallel == 1


def test_an_unknown_policy_is_refused():
    preset = load_preset("llama-3.1-8b")
    with pytest.raises(SpecError, match="must be one of default, always, never"):
        build_spec(preset.model, {"gpus": 8, "fsdp": True, "fsdp_reshard": "sometimes"}, name="x",
                   architecture=preset.architecture | {"implementation": "torch-native"})


def test_an_fp16_params_dtype_is_refused():
    from actmem.model.optimizer_state import OptimizerState

    preset = load_preset("llama-3.1-8b")
    with pytest.raises(SpecError, match="leave --params-dtype out"):
        build_spec(preset.model, {"fsdp": True, "gpus": 8}, name="x", optimizer=OptimizerState(params="fp16"),
                   architecture=preset.architecture | {"implementation": "torch-native"})


def test_grad_dtype_is_refused():
    preset = load_preset("llama-3.1-8b")
    with pytest.raises(SpecError, match="leave --grad-dtype out"):
        build_spec(preset.model, {"fsdp": True, "gpus": 8}, name="x", gradient_bytes=2,
                   architecture=preset.architecture | {"implementation": "torch-native"})


def test_torch_native_turns_sp_on_under_tp_and_says_so():
    """torchtitan's plan always has sequence parallelism beside TP: --tp 8 alone is SP on under torch-native, named in
    the assumptions; --no-sp keeps plain DTensor TP; Megatron's default stays as it was."""
    runner = CliRunner()
    base = ["estimate", "--model", "llama-3.1-8b", "--tp", "8", "--gpus", "8", "--format", "json"]
    native = json.loads(runner.invoke(cli, base + ["--implementation", "torch-native"]).output)
    assert native["run"]["sequence_parallel"] is True
    assert any("sequence parallelism on" in note for note in native["assumptions"])
    plain = json.loads(runner.invoke(cli, base + ["--implementation", "torch-native", "--no-sp"]).output)
    assert plain["run"]["sequence_parallel"] is False
    assert json.loads(runner.invoke(cli, base).output)["run"]["sequence_parallel"] is False


def test_a_preset_pipeline_given_up_by_pp_and_its_optimizer_named():
    """Llama 3.1 405B's preset runs p = 16 with 7-layer first and last stages and Megatron's distributed optimizer:
    --pp 1 drops the uneven layout (a note says so); torch-native has no use for the optimizer, which is left out,
    named in a note; asked for by its flag, it is refused."""
    runner = CliRunner()
    base = ["estimate", "--model", "llama-3.1-405b", "--implementation", "torch-native", "--tp", "8", "--gpus", "512",
            "--fsdp", "--pp", "1", "--global-batch", "512"]
    out = json.loads(runner.invoke(cli, base + ["--format", "json"]).output)
    assert out["run"]["pipeline_parallel"] == 1 and out["stage"]["layers"] == 126
    assert out["run"]["distributed_optimizer"] is False
    assert any("uneven pipeline (first_stage_layers 7, last_stage_layers 7) left out" in note
               for note in out["assumptions"])
    assert any("the preset's Megatron settings left out under --implementation torch-native, which has no use for "
               "them: distributed_optimizer True" in note for note in out["assumptions"])
    refused = runner.invoke(cli, base + ["--distributed-optimizer"])
    assert refused.exit_code == 2 and "Megatron's distributed optimizer is not modelled for --implementation " \
        "torch-native" in refused.output


def test_cli_prices_it_and_refuses_it_in_one_line():
    runner = CliRunner()
    result = runner.invoke(cli, ["estimate", "--model", "llama-3.1-8b", "--implementation", "torch-native",
                                 "--gpus", "8", "--fsdp", "--format", "json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["run"]["fsdp"] is True
    assert out["parameters"]["weights_bytes"] == 4 * S_8B
    assert [row["name"] for row in out["peak_floor"]["rows"]][:2] == ["weights", "optimizer_state"]
    result = runner.invoke(cli, ["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--fsdp"])
    assert result.exit_code == 2
    assert "modelled under --implementation torch-native only" in result.output
    result = runner.invoke(cli, ["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--fsdp"])
    assert result.exit_code == 2
