"""DeepSpeed's ZeRO as the Hugging Face Trainer runs it (--zero-stage, --deepspeed; issue 30; actmem.memory.zero):
the model state rank 0 keeps, the moments of its peak, the config file as the Trainer reads it, and what is
refused. Numbers by hand, from DeepSpeed 0.19.8's rules (actmem/memory/zero.py's docstring)."""

import json

import pytest
from click.testing import CliRunner

from actmem.cli.main import cli
from actmem.errors import SpecError
from actmem.memory.estimate import estimate
from actmem.sources.deepspeed_config import from_dict
from actmem.model.spec import build_spec
from actmem.sources.presets import load_preset

# Llama 3.1 8B (h = 4096, a = 32, g = 8, d_h = 128, f = 14,336, v = 128,256, L = 32) as LlamaForCausalLM lists it:
# the embedding and lm_head 525,336,576 each; a layer's q and o 16,777,216, k and v 4,194,304, gate, up and down
# 58,720,256 (218,103,808 decayed a layer), its two norms 4096; the final norm 4096.
PSI_8B = 8_030_261_248
DECAYED_8B = 2 * 525_336_576 + 32 * 218_103_808           # 8,029,995,008
NORMS_8B = 65 * 4096                                       # 266,240, the Trainer's undecayed group
BUCKET = 500_000_000                                       # reduce_bucket_size, DeepSpeed's default


def _spec(name: str, gpus: int, seq_len: int | None = None, **run):
    preset = load_preset(name)
    model = preset.model | ({"seq_len": seq_len} if seq_len else {})
    return build_spec(model, {"gpus": gpus} | run, name=name,
                      architecture=preset.architecture | {"implementation": "hf"})


def _moments(spec) -> dict:
    return {moment.name: {row.name: row.bytes for row in moment.parts} for moment in estimate(spec).run.moments}


def test_the_two_groups_are_the_trainers():
    assert DECAYED_8B + NORMS_8B == PSI_8B


def test_llama_8b_zero_1_and_2_on_8_gpus():
    """Stages 1 and 2: each group's bf16 flat buffer padded to a multiple of 2N = 16 (both divide: 8,029,995,008 =
    16 · 501,874,688 and 266,240 = 16 · 16,640), whole on every rank: 2Ψ; the partitions S = 1,003,749,376 and
    33,280; fp32 master and AdamW's moments 12 B an element of them, a 4-B step a group, the 4-B fp32 norm."""
    for stage in (1, 2):
        params = estimate(_spec("llama-3.1-8b", 8, zero_stage=stage)).parameters
        assert params.count == PSI_8B
        assert params.weights_bytes == 2 * PSI_8B == 16_060_522_496
        assert params.optimizer_bytes == 12 * (1_003_749_376 + 33_280) + 2 * 4 + 4 == 12_045_391_884
        assert params.held_bytes == params.weights_bytes + params.optimizer_bytes     # gradients: the moments'


def test_zero_2_gradient_partition_holds_whole_straddlers():
    """Rank 0's gradient partition: every parameter that begins inside its partition, whole. Decayed group, S =
    1,003,749,376: the embedding (525,336,576) and two layers (436,207,616) end at 961,544,192; layer 2's q, k, v and
    o end at 1,003,487,232, its gate begins there, inside, and counts whole (58,720,256): 1,062,207,488. The norms'
    group, S = 33,280: nine norms of 4096 begin below it (0 ... 32,768): 36,864."""
    params = estimate(_spec("llama-3.1-8b", 8, zero_stage=2)).parameters
    assert 525_336_576 + 2 * 218_103_808 + 2 * 16_777_216 + 2 * 4_194_304 == 1_003_487_232 < 1_003_749_376
    assert params.gradients_bytes == 2 * (1_003_487_232 + 58_720_256 + 9 * 4096) == 2_124_488_704


def test_zero_1_reduces_after_the_backward_with_every_gradient_held():
    """Stage 1's reduce walks the decayed group in order: its first parameter, the embedding (525,336,576
    elements), does not fit the bucket (5e8) and is reduced in place, so at that first reduce every gradient is
    still held beside the bucket, and then the gradient partition it makes (the embedding lies inside rank 0's
    partition: one slice, so the all-reduce flattens no copy)."""
    moments = _moments(_spec("llama-3.1-8b", 8, zero_stage=1))
    partition = 2 * (1_062_207_488 + 36_864)
    assert moments["backward_end"] == {"gradients": 2 * PSI_8B, "gradient_bucket": 2 * BUCKET}
    assert moments["first_partition"] == {"gradients": 2 * PSI_8B, "gradient_bucket": 2 * BUCKET,
                                          "gradient_partition": partition}
    # the step: the partition of gradients and the largest group's bf16 flatten beside its fp32 copy
    assert moments["optimizer_step"] == {"gradient_partition": partition, "step_gradient": 6 * 1_003_749_376}
    # the gradient norm's fp64 copy of the largest piece: the embedding, whole inside rank 0's partition
    assert moments["gradient_norm"] == {"gradient_partition": partition, "norm_copy": 8 * 525_336_576}
    assert "gradients" not in moments["loss"]                  # one microbatch: nothing carried into it


def test_a_first_bucket_that_fits_frees_its_gradients_before_the_first_reduce():
    """With a bucket of 6e8 elements the embedding (525,336,576) fits; q of layer 0 (16,777,216) ends at
    542,113,792, k and v at 550,502,400, o at 567,279,616, gate at 625,999,872 > 6e8: the first bucket takes
    567,279,616 elements, whose gradients are the bucket's, not held apart."""
    config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1, "reduce_bucket_size": 6e8}}
    spec = build_spec(load_preset("llama-3.1-8b").model, dict(gpus=8, zero=from_dict(config, 4096)),
                      architecture=load_preset("llama-3.1-8b").architecture | {"implementation": "hf"})
    assert _moments(spec)["backward_end"]["gradients"] == 2 * (PSI_8B - 567_279_616)


def test_zero_2_last_reduce_holds_the_embeddings_gradient_and_both_partitions():
    """Stage 2 with four microbatches, at the last reduce: the bucket, the partition and the earlier microbatches'
    (all_grad_tensors), and the embedding's gradient, too large for the bucket, reduced alone in place."""
    moments = _moments(_spec("llama-3.1-8b", 8, zero_stage=2, global_batch=32))
    assert moments["backward_end"] == {"gradient_bucket": 2 * BUCKET, "gradient_partition": 2_124_488_704,
                                       "gradient_partition_accumulated": 2_124_488_704,
                                       "oversized_gradient": 2 * 525_336_576}


def test_stage_1_under_overlap_comm_has_no_earlier_partition():
    """Stage 1 under overlap_comm reduces in the last microbatch's backward, as stage 2 does, but never before the
    step's boundary: the earlier microbatches' gradients are in param.grad, not in a partition of their own."""
    config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1, "overlap_comm": True}}
    preset = load_preset("llama-3.1-8b")
    spec = build_spec(preset.model, dict(gpus=8, global_batch=32, zero=from_dict(config, 4096)),
                      architecture=preset.architecture | {"implementation": "hf"})
    end = _moments(spec)["backward_end"]
    assert end["gradient_bucket"] == 2 * 2 * BUCKET and "gradient_partition_accumulated" not in end


def test_a_partition_inside_one_parameter_casts_without_a_flatten():
    """On 16 GPUs rank 0's partition of the decayed group, 8,029,995,008/16 = 501,874,688 elements, lies inside
    the embedding (525,336,576): flattening one piece is a view, so the step holds the fp32 copy alone."""
    step = _moments(_spec("llama-3.1-8b", 16, zero_stage=1))["optimizer_step"]
    assert step["step_gradient"] == 4 * 501_874_688


def test_gradient_accumulation_carries_gradients_into_the_last_microbatch():
    """Stage 1 reduces only at the step's boundary: the earlier microbatches' bf16 gradients and the bucket are
    held through the last one's backward; stage 2 holds its gradient partition."""
    one = _moments(_spec("llama-3.1-8b", 8, zero_stage=1, global_batch=32))["loss"]     # 32/(1·8) = 4 microbatches
    assert one["gradients"] == 2 * PSI_8B and one["gradient_bucket"] == 2 * BUCKET
    two = _moments(_spec("llama-3.1-8b", 8, zero_stage=2, global_batch=32))["loss"]
    assert two["gradient_partition"] == 2_124_488_704


def test_llama_8b_zero_3_on_8_gpus():
    """Stage 3: every parameter partitioned alone, ceil(n/8) (all divide): S = Ψ/8 = 1,003,782,656, 2S of bf16
    partitions and 2S of the gradient partition, the 1 GB bucket for the whole run, the 65 norms (4096 <= 100,000)
    whole: 2·4096 each. The decayed group's partition, 1,003,749,376, reaches sub_group_size 1e9 only at its last
    parameter (lm_head): one sub-group; the norms' another: two 4-B steps, and the fp64 norm and a bool (9 B)."""
    params = estimate(_spec("llama-3.1-8b", 8, zero_stage=3)).parameters
    shard = PSI_8B // 8
    assert shard == 1_003_782_656
    assert params.weights_bytes == 2 * shard + 2 * NORMS_8B == 2_008_097_792
    assert params.gradients_bytes == 2 * shard + 2 * BUCKET == 3_007_565_312
    assert params.optimizer_bytes == 12 * shard + 2 * 4 + 9 == 12_045_391_889
    assert params.held_bytes == params.total_bytes                  # stage 3 keeps its gradient buffers
    loss = _moments(_spec("llama-3.1-8b", 8, zero_stage=3))["loss"]
    assert loss["gathered_weights"] == 2 * 525_336_576             # lm_head, gathered through the loss


def test_zero_3_keeps_the_last_layers_gathered_through_the_turn():
    """stage3_max_reuse_distance 3e9 on Llama 3.1 8B: between layer j's forward and its backward run at most twice
    the weights from layer j on (218,103,808 a layer, 4096 of the final norm, 525,336,576 of lm_head). Twice that is
    under 3e9 for the last four layers (2·(4·218,103,808 + 525,340,672) = 2,795,511,808; five: 3,231,719,424), whose
    matrices (218,103,808 a layer; the norms persist) stay gathered; at the default 1e9 none does, only lm_head."""
    config = from_dict({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 3e9}},
                       4096)
    preset = load_preset("llama-3.1-8b")
    spec = build_spec(preset.model, dict(gpus=8, zero=config), architecture=preset.architecture | {"implementation": "hf"})
    loss = _moments(spec)["loss"]
    assert loss["gathered_weights_kept"] == 2 * 4 * 218_103_808
    assert "gathered_weights_kept" not in _moments(_spec("llama-3.1-8b", 8, zero_stage=3))["loss"]


def test_llama_70b_zero_3_cuts_sub_groups():
    """Llama 3.1 70B (h = 8192, f = 28,672, a = 64, g = 8, L = 80, v = 128,256) on 64 GPUs: every size divides by
    64. Partitions: the embedding 16,416,768, a layer's decayed weights 855,638,016/64 = 13,369,344 (q 1,048,576,
    k and v 131,072, o 1,048,576, gate, up and down 3,670,016 each). The running sum reaches 1e9 inside layer 73:
    16,416,768 + 73·13,369,344 = 992,378,880, then q, k, v, o, gate end at 998,408,192 and up at 1,002,078,208,
    which closes the first sub-group; the rest of the decayed group, 1,102,380,768 - 1,002,078,208 = 100,302,560,
    is the second; the 161 norms (20,608) the third."""
    psi = 70_553_706_496
    shard = psi // 64
    assert shard == 1_102_401_664
    assert 16_416_768 + 73 * 13_369_344 + 1_048_576 + 2 * 131_072 + 1_048_576 + 2 * 3_670_016 == 1_002_078_208
    params = estimate(_spec("llama-3.1-70b", 64, zero_stage=3)).parameters
    assert params.count == psi
    assert params.weights_bytes == 2 * shard + 161 * 2 * 8192
    assert params.gradients_bytes == 2 * shard + 2 * BUCKET
    assert params.optimizer_bytes == 12 * shard + 3 * 4 + 9
    step = _moments(_spec("llama-3.1-70b", 64, zero_stage=3))["optimizer_step"]
    assert step == {"step_gradient": 6 * 1_002_078_208, "persistent_weights_released": -161 * 2 * 8192}


def test_an_odd_model_pads_stage_1_and_stage_3_differently():
    """h = 64, f = 97, v = 511, a = 8 (d_h = 8), g = 4, L = 2 over d = 3. A layer's decayed weights: q and o 4096,
    k and v 2048, gate, up and down 6208: 30,912; with the embedding and lm_head (32,704 each) the decayed group is
    127,232, the norms' 5·64 = 320. Stage 1 pads each group to a multiple of 2N = 6: 127,236 and 324, partitions of
    42,412 and 108. Stage 3 partitions each parameter: ceil(n/3) = 10,902 (v·h), 1366 (q, o), 683 (k, v),
    2070 (gate, up, down), 22 (a norm): S = 2·10,902 + 2·(2·1366 + 2·683 + 3·2070) + 5·22 = 42,530; at the default
    threshold (100,000) every parameter of this model is kept whole too, in its padded gather 2·3·ceil(n/3)."""
    model = dict(heads=8, hidden=64, vocab=511, seq_len=32, layers=2)
    arch = dict(implementation="hf", attention_core="flash", activation="swiglu", normalization="rmsnorm",
                position_embedding="rope", bias=False, attention_dropout=0.0, hidden_dropout=0.0, tied_output=False,
                ffn_hidden=97, query_groups=4)
    assert 2 * 32_704 + 2 * (2 * 4096 + 2 * 2048 + 3 * 6208) == 127_232
    one = estimate(build_spec(model, dict(gpus=3, zero_stage=1), architecture=arch)).parameters
    assert one.weights_bytes == 2 * (127_236 + 324)
    assert one.optimizer_bytes == 12 * (42_412 + 108) + 2 * 4 + 4
    three = estimate(build_spec(model, dict(gpus=3, zero_stage=3), architecture=arch)).parameters
    shard = 2 * 10_902 + 2 * (2 * 1366 + 2 * 683 + 3 * 2070) + 5 * 22
    assert shard == 42_530
    assert three.weights_bytes == 2 * shard + 2 * 3 * shard
    assert three.gradients_bytes == 2 * shard + 2 * BUCKET
    assert three.optimizer_bytes == 12 * shard + 2 * 4 + 9


# --- the config file -------------------------------------------------------------------------------------------

HF_ZERO3 = {   # transformers' documented ds_config_zero3.json (the DeepSpeed integration page), "auto" throughout
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                  "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"},
                          "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                          "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def _write(tmp_path, config: dict) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_auto_resolves_as_the_trainer_does():
    """trainer_config_finalize: reduce_bucket_size h², stage3_param_persistence_threshold 10h; an optimizer section
    is DeepSpeed's FusedAdam over one group, its step a Python int (no step tensors)."""
    config = from_dict(HF_ZERO3, hidden=4096)
    assert (config.stage, config.reduce_bucket_size, config.persistence_threshold) == (3, 4096 ** 2, 40_960)
    assert config.optimizer == "deepspeed"
    spec = build_spec(load_preset("llama-3.1-8b").model, dict(gpus=8, zero=config),
                      architecture=load_preset("llama-3.1-8b").architecture | {"implementation": "hf"})
    params = estimate(spec).parameters
    assert params.gradients_bytes == 2 * PSI_8B // 8 + 2 * 4096 ** 2
    assert params.optimizer_bytes == 12 * PSI_8B // 8 + 9          # one group, under 1e9 a rank: no step tensor


def test_a_config_file_sets_the_batch(tmp_path):
    """train_micro_batch_size_per_gpu 2 and gradient_accumulation_steps 4 over 8 GPUs: b = 2, a global batch of 64,
    four microbatches; a flag that disagrees is refused."""
    from actmem.sources.deepspeed_config import read

    path = read(_write(tmp_path, HF_ZERO3 | {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}),
                4096)
    spec = build_spec(load_preset("llama-3.1-8b").model, dict(gpus=8, deepspeed=path),
                      architecture=load_preset("llama-3.1-8b").architecture | {"implementation": "hf"})
    assert (spec.run.micro_batch, spec.run.global_batch, spec.microbatches) == (2, 64, 4)
    with pytest.raises(SpecError, match="--micro-batch-size 1 and --deepspeed .* disagree"):
        build_spec(load_preset("llama-3.1-8b").model, dict(gpus=8, deepspeed=path, micro_batch=1),
                   architecture=load_preset("llama-3.1-8b").architecture | {"implementation": "hf"})


@pytest.mark.parametrize("change, message", [
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, "offload_optimizer .* change"),
    ({"zero_optimization": {"stage": 2, "round_robin_gradients": 1}}, "round_robin_gradients must be true or false"),
    ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sise": 10, "mics_shard_size": 2}},
     "mics_shard_size, zero_optimization.stage3_prefetch_bucket_sise: not settings of DeepSpeed"),
    ({"zero_optimization": {"stage": 3, "max_live_parameters": 5, "stage3_max_live_parameters": 6}}, "twice"),
    ({"zero_optimization": {"stage": 2, "stage3_prefetch_bucket_size": "auto"}}, "fills them only at stage 3"),
    ({"fp16": {"enabled": True}}, "enables fp16"),
    ({"bf16": {"enabled": False}}, "bf16.enabled is false"),
    ({"bf16": {}}, "bf16.enabled is false"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, "bf16.bf16_master_weights_and_grads"),
    ({"amp": {"enabled": False}}, "amp is not a setting"),
    ({"tensor_parallel": {"autotp_size": 2}}, "AutoTP"),
    ({"optimizer": {"type": "Lamb"}}, "optimizer 'Lamb' is not modelled"),
    ({"zero_optimization": {"stage": 0}}, "stage 0 is DeepSpeed without ZeRO"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "zero_quantized_weights true change"),
    ({"zero_optimization": {"stage": 1, "use_multi_rank_bucket_allreduce": False}}, "use_multi_rank_bucket_allreduce"),
    ({"zero_optimization": {"stage": 3, "stage3_module_granularity_threshold": 100}}, "module_granularity_threshold 100"),
    ({"data_types": {"grad_accum_dtype": "fp32"}}, "grad_accum_dtype 'fp32'"),
    ({"zero_optimization": {"reduce_bucket_size": 5e8}}, "sets no zero_optimization.stage"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 2.5}}, "reduce_bucket_size must be a whole number"),
])
def test_a_config_actmem_cannot_price_is_refused_by_name(change, message):
    base = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    with pytest.raises(SpecError, match=message):
        from_dict(base | change, hidden=4096)


def test_keys_that_change_no_memory_are_accepted():
    config = from_dict(HF_ZERO3 | {"bf16": {"enabled": True}, "fp16": {"enabled": False}, "tensorboard": {},
                                   "zero_allow_untested_optimizer": True}, hidden=64)
    assert config.stage == 3 and config.notes == ()


def test_what_the_file_leaves_to_the_trainer_is_named():
    """No bf16 section: the Trainer's --bf16 adds one (accelerate); keys DeepSpeed does not read (LLaMA-Factory's
    comms_config) are accepted and named; DeepSpeed's own field names stand for the stage3_ aliases; a
    sub_group_size of 0 makes every parameter its own sub-group."""
    config = from_dict({"fp16": {"enabled": "auto"}, "comms_config": {"verbose": False},
                        "zero_optimization": {"stage": 3, "max_reuse_distance": 0, "sub_group_size": 0}}, hidden=64)
    assert config.reuse_distance == 0 and config.sub_group_size == 0
    assert "no bf16 section" in config.notes[0] and "comms_config" in config.notes[1]


# --- refusals and output ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--model", "llama-3.1-8b", "--gpus", "8", "--zero-stage", "3"], "modelled under --implementation hf only"),
    (["--model", "llama-3.1-8b", "--implementation", "hf", "--zero-stage", "3"], "give --gpus"),
    (["--model", "llama-3.1-8b", "--implementation", "hf", "--gpus", "8", "--zero-stage", "3", "--grad-dtype",
      "bf16"], "--grad-dtype sets Megatron's main-gradient buffer"),
])
def test_refusals_name_the_constraint(argv, message):
    result = CliRunner().invoke(cli, ["estimate", *argv])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())


def test_the_estimate_names_zero_and_its_peak(tmp_path):
    result = CliRunner().invoke(cli, ["estimate", "--model", "llama-3.1-8b", "--implementation", "hf", "--gpus", "8",
                                      "--zero-stage", "3", "--seq-length", "4096"], terminal_width=200)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "DeepSpeed ZeRO-3 over d=8" in text
    assert "3,007,565,312" in text                     # the gradient partition and the bucket
    assert "gathered weights" in text                  # the peak's rows
    assert "DeepSpeed 0.19.8's ZeRO-3 as the Hugging Face Trainer runs it" in text


def test_json_report_carries_the_zero_config():
    result = CliRunner().invoke(cli, ["estimate", "--model", "llama-3.1-8b", "--implementation", "hf", "--gpus", "8",
                                      "--zero-stage", "2", "--format", "json"])
    assert result.exit_code == 0, result.output
    run = json.loads(result.output)["run"]
    assert run["zero_stage"] == 2 and run["zero_reduce_bucket_size"] == BUCKET


# --- the parameter list against transformers' own classes --------------------------------------------------------

@pytest.mark.parametrize("architecture", [
    dict(),                                              # LlamaForCausalLM
    dict(qkv_bias=True),                                 # Qwen2ForCausalLM: q, k and v biases
    dict(qk_norm=True),                                  # Qwen3ForCausalLM
    dict(tied_output=True),
    "gpt2",                                              # GPT2LMHeadModel: tied, biases, LayerNorms, positions
    dict(num_experts=8, moe_topk=2, moe_ffn_hidden=48),                                   # MixtralForCausalLM
    dict(num_experts=8, moe_topk=2, moe_ffn_hidden=48, qk_norm=True),                     # Qwen3MoeForCausalLM
    dict(num_experts=8, moe_topk=2, moe_ffn_hidden=48, qkv_bias=True, moe_shared_ffn=40,  # Qwen2MoeForCausalLM
         moe_shared_gate=True),
])
def test_the_parameter_list_is_the_model_classes(architecture):
    """actmem's list (names, sizes, order, decayed or not) against named_parameters() of the class itself, built
    on the meta device, and the Trainer's own get_decay_parameter_names."""
    pytest.importorskip("transformers")
    import torch
    from transformers import Trainer

    from actmem.model.hf_parameters import hf_parameters
    from actmem_validate.hf import build_model

    model = dict(heads=8, hidden=64, vocab=511, seq_len=32, layers=2)
    llama = dict(implementation="hf", attention_core="flash", activation="swiglu", normalization="rmsnorm",
                 position_embedding="rope", bias=False, attention_dropout=0.0, hidden_dropout=0.0, tied_output=False,
                 ffn_hidden=97, query_groups=4)
    arch = dict(implementation="hf", attention_core="flash", attention_dropout=0.0, hidden_dropout=0.0) \
        if architecture == "gpt2" else llama | architecture
    spec = build_spec(model, dict(gpus=2, zero_stage=1), architecture=arch)
    with torch.device("meta"):
        real = build_model(spec)
    decayed = set(Trainer.get_decay_parameter_names(None, real))
    expected = [(name, p.numel(), name in decayed) for name, p in real.named_parameters()]
    a = spec.architecture
    listed = hf_parameters(a.code.model_class(a).name, 64, 511, 32, 2, a, 8)
    assert [(p.name, p.numel, p.decays) for p in listed] == expected


def test_plan_under_hf_says_its_state_is_ddps_and_where_zero_is_priced():
    """Llama 3.1 8B on 8 B200s at s = 2048: DDP's 134.6 GiB of model state and a microbatch's activations fit."""
    result = CliRunner().invoke(cli, ["plan", "--model", "llama-3.1-8b", "--implementation", "hf", "--gpus", "8",
                                      "--global-batch", "64", "--gpu", "b200", "--seq-len", "2048"], terminal_width=200)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "model state is DDP's" in text and "actmem estimate --zero-stage N" in text


def test_plan_under_hf_that_nothing_fits_points_to_zero():
    """On 8 H100s DDP's 8B model state alone (18 B a parameter, 134.6 GiB) is over the GPU: nothing fits, and the
    verdict names ZeRO, which `estimate` prices (ZeRO-3 over 8: 30.86 GiB at s = 8192, docs/models.md)."""
    result = CliRunner().invoke(cli, ["plan", "--model", "llama-3.1-8b", "--implementation", "hf", "--gpus", "8",
                                      "--global-batch", "64", "--gpu", "h100"], terminal_width=200)
    assert result.exit_code == 1, result.output         # plan's exit code when nothing fits
    text = " ".join(result.output.split())
    assert "Nothing fits" in text
    assert "These price DDP" in text and "actmem estimate --implementation hf --gpus 8 --zero-stage 3" in text


def test_zero3_state_over_the_gpu_names_what_is_not_modelled():
    """Llama 3.1 70B under ZeRO-3 over 8 H100s (the preset's GPU): (2 + 2 + 12) B a parameter over 8, about 132 GiB
    of model state, is over the GPU whatever the activations: the advice shards it further and says that
    ZeRO-Offload, the usual fix, is not modelled (not that nothing could help)."""
    result = CliRunner().invoke(cli, ["estimate", "--model", "llama-3.1-70b", "--implementation", "hf", "--gpus", "8",
                                      "--zero-stage", "3", "--recompute", "full", "--seq-len", "4096"],
                                terminal_width=200)
    text = " ".join(result.output.split())
    assert "no activation recompute or offloading makes it fit; shard it over more GPUs (--gpus)" in text
    assert "ZeRO-Offload (offload_optimizer, offload_param), which moves it to the host, is not modelled yet" in text
