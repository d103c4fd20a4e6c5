"""Megatron's whole-layer CPU offloading (--cpu-offloading-num-layers, issue 29), as Transformer Engine v2.11 runs it
(actmem.memory.offload): what the GPU keeps, what the host needs, what is refused. Numbers by hand."""

import json

import pytest
from click.testing import CliRunner

from actmem.cli.main import cli
from actmem.errors import SpecError
from actmem.memory.estimate import estimate
from actmem.model.spec import build_spec
from actmem.sources.presets import load_preset

# Llama 3.1 8B (s = 8192, h = 4096, a = 32, g = 8, d = 128, f = 14,336, v = 128,256, RMSNorm, SwiGLU, rope, no
# dropout) at t = 1, b = 1: a layer saves 2sh = 67,108,864 B for each of the attention norm's input, the QKV input,
# q, the projection's input, the MLP norm's input and fc1's input (402,653,184), k and v 2s·gd = 16,777,216 each,
# the log-sum-exp 4as = 1,048,576, the norms' rsigma 4s = 32,768 each, SwiGLU's input 2s·2f = 469,762,048 and
# fc2's 2sf = 234,881,024: 1,141,964,800 B. The output layer's rows: the final norm's input 67,108,864 and rsigma
# 32,768, the output layer's input 67,108,864, fp32 logits 4sv = 4,202,692,608: 4,336,943,104 B.
LAYER, OUTPUT = 1_141_964_800, 4_336_943_104
FREQS = 4 * 8192 * 128                   # the fused rope's fp32 freqs [s, 1, 1, d], one copy an offloaded layer
LOGITS_GRADIENT = 2 * 8192 * 128_256     # the loss's 16-bit logits gradient
LAYER_INPUT = 2 * 8192 * 4096            # the embedding's output, GPTModel.forward's decoder_input


def _llama_8b(n: int, **run):
    preset = load_preset("llama-3.1-8b")
    return build_spec(preset.model, {"tensor_parallel": 1, "offload_layers": n} | run, name="llama-3.1-8b",
                      architecture=preset.architecture)


def test_the_gpu_keeps_l_minus_n_layers_and_the_host_n():
    """N = 16 of 32: the GPU keeps 16 layers and the output layer's rows; the host 16 layers and 16 freqs copies."""
    est = estimate(_llama_8b(16))
    assert est.activations_bytes == 16 * LAYER + OUTPUT == 22_608_379_904
    assert est.host_bytes == 16 * (LAYER + FREQS) == 18_338_545_664
    assert estimate(_llama_8b(0)).host_bytes == 0
    assert estimate(_llama_8b(0)).activations_bytes - est.activations_bytes == 16 * LAYER


def test_the_moments_of_an_offloaded_stage():
    """The forward's end keeps the embedding's output beside the 16 layers; the loss's backward its logits gradient
    (larger: v > h), which is the peak. In the last layer's backward TE v2.11 frees none of the layer's rows before
    fc1's backward, where without offloading SwiGLU's and fc2's inputs (704,643,072 B) are freed by then."""
    moments = {moment.name: moment.bytes for moment in estimate(_llama_8b(16)).run.moments}
    held = 16 * LAYER + OUTPUT
    assert moments["forward_end"] == held + LAYER_INPUT
    assert moments["loss"] == held + LOGITS_GRADIENT
    assert max(moments, key=moments.get) == "loss"
    plain = {moment.name: moment.bytes for moment in estimate(_llama_8b(0)).run.moments}
    assert "forward_end" not in plain
    assert plain["fc1"] - moments["fc1"] == 16 * LAYER - 704_643_072


def test_rows_with_recompute_are_not_offloaded():
    """Megatron refuses offloading beside recompute, so the technique rows that recompute are those of the run
    without offloading; the rows that do not are offloaded."""
    rows = {row.technique.name: row.first_stage_bytes for row in estimate(_llama_8b(16)).techniques}
    plain = {row.technique.name: row.first_stage_bytes for row in estimate(_llama_8b(0)).techniques}
    assert rows["tp-sel"] == plain["tp-sel"] and rows["full"] == plain["full"]
    assert plain["none"] - rows["none"] == 16 * LAYER


def test_tensor_parallel_shards_what_the_host_holds_but_not_the_freqs():
    """t = 8 with SP: a layer's saves are 1/8 (142,745,600 B), the freqs whole on every rank; N = 20: the host
    20 x (142,745,600 + 4,194,304) = 2,938,798,080 B (what the harness measured at full scale with fake tensors)."""
    est = estimate(_llama_8b(20, tensor_parallel=8, sequence_parallel=True))
    assert est.host_bytes == 20 * (LAYER // 8 + FREQS) == 2_938_798_080


@pytest.mark.parametrize("run, message", [
    ({"pipeline_parallel": 2}, "no CPU offloading under pipeline parallelism (p = 2)"),
    ({"recompute": "selective"}, "does not work with activation recomputation (this run's is selective)"),
    ({"context_parallel": 2}, "beside context parallelism (c = 2) is not modelled"),
    ({"offload_layers": 32}, "--cpu-offloading-num-layers (32) must be less than the model's layers (32)"),
    ({"offload_layers": -1}, "must be a whole number of layers, 0 or more, got -1"),
])
def test_megatron_s_constraints_and_what_is_not_read_are_refused(run, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _llama_8b(4, **run)


def test_experts_and_other_implementations_are_refused():
    preset = load_preset("mixtral-8x7b")
    with pytest.raises(SpecError, match="beside experts, latent attention or multi-token prediction"):
        build_spec(preset.model, {"expert_parallel": 1, "offload_layers": 2}, architecture=preset.architecture)
    llama = load_preset("llama-3.1-8b")
    with pytest.raises(SpecError, match="not modelled for --implementation torch-native"):
        build_spec(llama.model, {"offload_layers": 2}, architecture=llama.architecture | {"implementation": "torch-native"})


def test_a_pasted_script_offloads_and_plan_refuses_it():
    """Megatron's spelling pastes through to estimate (host line, JSON); plan, which does not sweep offloading,
    refuses it in one line."""
    paste = "--bf16 --cpu-offloading-num-layers 16 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1"
    result = CliRunner().invoke(cli, ["estimate", "--model", "llama-3.1-8b", "--megatron-args", paste,
                                      "--format", "json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["host_bytes"] == 18_338_545_664 and out["run"]["offload_layers"] == 16
    shown = CliRunner().invoke(cli, ["estimate", "--model", "llama-3.1-8b", "--megatron-args", paste])
    text = " ".join(shown.output.split())                 # the terminal's wrapping undone
    assert "16 layers offloaded to the host" in text and "host: 17.08 GiB of pinned memory a GPU" in text
    refused = CliRunner().invoke(cli, ["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--global-batch", "8",
                                       "--megatron-args", paste])
    assert refused.exit_code == 2 and "plan does not sweep CPU offloading yet" in refused.output


def test_a_command_that_takes_no_run_says_so():
    """flops takes no run: a setting estimate reads is named as that, not as an argument actmem does not model."""
    result = CliRunner().invoke(cli, ["flops", "--model", "llama-3.1-8b", "--cpu-offloading-num-layers", "3"])
    assert result.exit_code == 2
    assert "--cpu-offloading-num-layers is a setting that `actmem estimate` reads; `flops` does not take it" \
        in result.output


def test_the_plots_refuse_an_offloaded_run():
    """The plots draw GPU memory alone: an offloaded run is refused, not drawn without its host."""
    result = CliRunner().invoke(cli, ["plot", "memory", "--model", "llama-3.1-8b", "--pp", "1",
                                      "--cpu-offloading-num-layers", "3", "-o", "unused.png"])
    assert result.exit_code == 2 and "the plots do not draw CPU offloading yet" in result.output


def test_what_a_command_does_not_take_is_named_for_what_it_is():
    """A setting estimate reads, given to flops or before the command; a Megatron argument read only inside
    --megatron-args, given as a flag: each says so, not that actmem does not model it."""
    runner = CliRunner()
    assert "--recompute-modules is a setting that `actmem estimate` reads; `flops` does not take it" in \
        runner.invoke(cli, ["flops", "--model", "gpt3", "--recompute-modules", "mlp"]).output
    assert "give it after the command (`actmem estimate --tensor-model-parallel-size ...`)" in \
        runner.invoke(cli, ["--tensor-model-parallel-size", "8"]).output
    assert "--bf16 is a Megatron-LM argument that actmem reads inside --megatron-args" in \
        runner.invoke(cli, ["estimate", "--model", "gpt3", "--bf16"]).output


def test_offloading_beside_bf16_first_and_last_layers_is_refused():
    """The offloaded first layers and --first-last-layers-bf16's overlap: refused until counted by index."""
    preset = load_preset("llama-3.1-8b")
    with pytest.raises(SpecError, match="CPU offloading beside --first-last-layers-bf16 is not modelled yet"):
        build_spec(preset.model, {"tensor_parallel": 1, "offload_layers": 2}, gpu_fp8="hopper",
                   architecture=preset.architecture | {"fp8_format": "hybrid", "fp8_recipe": "tensorwise",
                                                       "fp8_first_last_bf16": True})
