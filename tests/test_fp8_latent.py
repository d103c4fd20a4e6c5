"""FP8 beside multi-latent attention (issues 27 and 29): what TE 2.11's linears keep in Megatron-Core 0.16.1's
MLASelfAttention under FP8 (actmem/model/fp8.py and memory/terms_latent.py have the source lines). Numbers by hand.

DeepSeek-V3's attention, one rank (its preset is the model alone; its multi-token prediction left out, priced
at the end): h = 7168, a = 128, q_r = 1536, kv_r = 512, d_qk = 128, d_rope = 64, d_v = 128, s = 4096,
b = 1, latent norms on (--qk-layernorm).
- the q and kv down projections (TE Linears, replicated) each keep their own FP8 copy of the input norm's output,
  s·h + 4 = 29,360,132 (16 bits: one storage, 2·s·h = 58,720,256);
- the latents' fused norms keep their 16-bit inputs (the q latent 2·s·q_r = 12,582,912, the kv latent's contiguous
  copy 2·s·kv_r = 4,194,304) and their outputs quantized: s·q_r + 4 = 6,291,460, s·kv_r + 4 = 2,097,156;
- q, k, v and the core's output stay 16-bit; under delayed scaling the projection keeps its input quantized too,
  s·a·d_v + 4 = 4096·16,384 + 4 = 67,108,868;
- blockwise: no scale_inv, fp32 scales a 128 rows of each copy: 4·32·7168 = 917,504 for each of the two copies,
  4·32·1536 = 196,608 and 4·32·512 = 65,536 for the latents.
"""

import pytest

from tests.conftest import assert_one_line_error

DEEPSEEK = ("--model", "deepseek-v3", "--gpu", "h100", "--mtp-num-layers", "0")
TENSORWISE = ("--fp8-format", "e4m3", "--fp8-recipe", "tensorwise")
ATTENTION = ("qkv_input", "qkv_input_q_fp8", "qkv_input_scales", "qkv_input_q_scales", "mla_q_latent",
             "mla_q_latent_normed", "mla_q_latent_scales", "mla_kv_latent", "mla_kv_latent_normed",
             "mla_kv_latent_scales", "projection_input_fp8")


def _attention(out) -> dict:
    return {row["term"]: row["bytes_each"] for row in out["run_terms"]
            if row["scope"] == "layer" and row["term"] in ATTENTION}


@pytest.mark.parametrize("recipe, rows", [
    ((), {"qkv_input": 58_720_256, "mla_q_latent": 12_582_912, "mla_q_latent_normed": 12_582_912,
          "mla_kv_latent": 4_194_304, "mla_kv_latent_normed": 4_194_304}),
    (TENSORWISE, {"qkv_input": 29_360_132, "qkv_input_q_fp8": 29_360_132, "mla_q_latent": 12_582_912,
                  "mla_q_latent_normed": 6_291_460, "mla_kv_latent": 4_194_304, "mla_kv_latent_normed": 2_097_156}),
    (("--fp8-format", "hybrid"), {"qkv_input": 29_360_132, "qkv_input_q_fp8": 29_360_132, "mla_q_latent": 12_582_912,
                                  "mla_q_latent_normed": 6_291_460, "mla_kv_latent": 4_194_304,
                                  "mla_kv_latent_normed": 2_097_156, "projection_input_fp8": 67_108_868}),
    (("--fp8-format", "e4m3", "--fp8-recipe", "blockwise"),
     {"qkv_input": 29_360_128, "qkv_input_q_fp8": 29_360_128, "qkv_input_scales": 917_504,
      "qkv_input_q_scales": 917_504, "mla_q_latent": 12_582_912, "mla_q_latent_normed": 6_291_456,
      "mla_q_latent_scales": 196_608, "mla_kv_latent": 4_194_304, "mla_kv_latent_normed": 2_097_152,
      "mla_kv_latent_scales": 65_536}),
])
def test_deepseek_v3_s_attention_under_each_recipe(actmem, recipe, rows):
    assert _attention(actmem.json("estimate", *DEEPSEEK, *recipe)) == rows


def test_without_latent_norms_the_up_projections_keep_the_latents_quantized(actmem):
    """--qk-layernorm off: the q and kv up projections are plain TE Linears, keeping the latents' FP8 copies
    alone, s·q_r + 4 = 6,291,460 and s·kv_r + 4 = 2,097,156; recomputing mla_up_proj, its checkpoint keeps the
    16-bit q latent instead (12,582,912), and the kv down projection's whole output, 2·s·(kv_r + d_rope) =
    4,718,592, as in 16 bits."""
    plain = ("--no-qk-norm",)
    out = actmem.json("estimate", *DEEPSEEK, *TENSORWISE, *plain)
    layer = {row["term"]: row["bytes_each"] for row in out["run_terms"] if row["scope"] == "layer"}
    assert (layer["mla_q_latent_fp8"], layer["mla_kv_latent"]) == (6_291_460, 2_097_156)
    assert "mla_q_latent" not in layer and "mla_q_latent_normed" not in layer
    up = actmem.json("estimate", *DEEPSEEK, *TENSORWISE, *plain, "--recompute", "selective",
                     "--recompute-modules", "mla_up_proj")
    layer = {row["term"]: row["bytes_each"] for row in up["run_terms"] if row["scope"] == "layer"}
    assert (layer["mla_q_latent_checkpointed"], layer["mla_kv_down_output"]) == (12_582_912, 4_718_592)
    assert "mla_q_latent_fp8" not in layer and "mla_kv_latent" not in layer


def test_the_fp8_weight_state_of_a_latent_attention_layer():
    """DeepSeek-V3's dense layer (its first three): q_down [1536, 7168] = 11,010,048, q_up [128·192, 1536] =
    37,748,736, kv_down [512 + 64, 7168] = 4,128,768, kv_up [128·256, 512] = 16,777,216, proj [7168, 128·128] =
    117,440,512; fc1 [2·18,432, 7168] = 264,241,152, fc2 [7168, 18,432] = 132,120,576: 583,467,008 elements, 2 B on
    Hopper, and 7 modules' tensorwise state, 44 B each: 1,166,934,324."""
    from actmem.memory.parameters import fp8_state
    from actmem.model.architecture import Architecture
    from actmem.model.experts import dense_twin
    from actmem.sources.presets import load_preset

    preset = load_preset("deepseek-v3")
    fp8 = {"fp8_format": "e4m3", "fp8_recipe": "tensorwise", "mtp_layers": 0}
    arch = dense_twin(Architecture(**preset.architecture | fp8))
    assert fp8_state(7168, 1, arch, 128, 1, "hopper") == (0, 2 * 583_467_008 + 7 * 44) == (0, 1_166_934_324)


@pytest.mark.parametrize("args, fragment", [
    (("--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--tp", "2", "--sp", "--q-lora-rank", "1552"),
     "MLA's latents, q_r = 1552"),
    (TENSORWISE + ("--kv-lora-rank", "520"), "divisible by 8"),
])
def test_what_fp8_latent_attention_does_not_price_is_refused(actmem, args, fragment):
    assert_one_line_error(actmem("estimate", *DEEPSEEK, *args), fragment)


def test_multi_token_prediction_under_fp8(actmem):
    """DeepSeek-V3 with its one prediction layer, EP 64 over 64 H100s, p = 1: eh_proj keeps its [s, b, 2h] input's
    one-byte copy, 2·4096·7168 + 4 = 58,720,260 (16 bits: 117,440,512); under blockwise 58,720,256 and fp32 scales
    4·32·14,336 = 1,835,008. The prediction layer's FP8 weight state beside the model's: its transformer layer, a
    MoE layer (MLA's five linears 187,105,280 elements, 2 B, 5 x 44 B; the shared experts' fc1 [4096, 7168] and fc2
    [7168, 2048], 44,040,192 elements, 2 B, 2 x 44; four local experts' 4 x 44,040,192 elements, 2 B, 8 x 44:
    814,613,140 B) and eh_proj [7168, 14,336], 102,760,448 elements, 2 B, and 44: 205,520,940 B; the same beside
    --first-last-layers-bf16, under which the model's last layer runs in bf16 and the prediction layer still in FP8
    (Megatron asks its FP8 context for no layer number)."""
    run = ("--model", "deepseek-v3", "--gpu", "h100", "--ep", "64", "--gpus", "64", "--pp", "1")
    bf16, tensorwise, blockwise = (
        {row["term"]: row["bytes_each"] for row in actmem.json("estimate", *run, *recipe)["run_terms"]
         if row["term"].startswith("mtp_eh_proj")}
        for recipe in ((), TENSORWISE, ("--fp8-format", "e4m3", "--fp8-recipe", "blockwise")))
    assert bf16 == {"mtp_eh_proj_input": 117_440_512} and tensorwise == {"mtp_eh_proj_input": 58_720_260}
    assert blockwise == {"mtp_eh_proj_input": 58_720_256, "mtp_eh_proj_input_scales": 1_835_008}
    with_mtp, without = (actmem.json("estimate", *run, *TENSORWISE, *depth)["parameters"]["fp8_bytes"]
                         for depth in ((), ("--mtp-num-layers", "0")))
    assert with_mtp - without == 814_613_140 + 205_520_940
    with_mtp, without = (actmem.json("estimate", *run, *TENSORWISE, "--first-last-layers-bf16", *depth)["parameters"][
        "fp8_bytes"] for depth in ((), ("--mtp-num-layers", "0")))
    assert with_mtp - without == 814_613_140 + 205_520_940


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_plan_prices_fp8_latent_attention_as_the_estimate_does(recipe):
    """The planner over DeepSeek-V3 (its prediction layer too) under FP8 on 1024 H100s: each sampled row's peak is the
    exact estimate's of the same configuration (one stage model, evaluated twice); under blockwise, the rule on
    the gathered latents (divisible by 128) holds over the sweep's columns (it once failed on a column of SP)."""
    from actmem.memory.estimate import estimate
    from actmem.model.architecture import Architecture
    from actmem.model.hardware import GPUS
    from actmem.model.spec import Model, build_spec
    from actmem.planner.explain import parse_config
    from actmem.planner.plan import PlanRequest, config_label, plan
    from actmem.sources.presets import load_preset

    preset = load_preset("deepseek-v3")
    architecture = preset.architecture | {"fp8_format": "e4m3", "fp8_recipe": recipe}
    req = PlanRequest(model=Model(**preset.model), gpus=1024, global_batch=4096, gpu=GPUS["h100"],
                      gpu_memory_bytes=GPUS["h100"].memory_bytes, max_micro_batch=1,
                      architecture=Architecture(**architecture))
    fitting = plan(req).fitting
    assert len(fitting)
    for row in fitting.sample(min(len(fitting), 6), random_state=0).itertuples():
        run = parse_config(config_label(row), layers=61) | {"gpus": 1024, "global_batch": 4096}
        spec = build_spec(preset.model, run, architecture=architecture, gpu_name="h100", gpu_fp8="hopper")
        assert row.peak_bytes == estimate(spec).verdict_bytes, config_label(row)


def test_plan_under_blockwise_runs_for_a_dense_model(actmem):
    """`plan` under --fp8-recipe blockwise once raised a traceback (a rule read a column of SP as one bool)."""
    out = actmem("plan", "--model", "llama-3.1-8b", "--gpus", "8", "--global-batch", "64", "--gpu", "h100",
                 "--fp8-format", "e4m3", "--fp8-recipe", "blockwise")
    assert out.exit_code == 0, out.output
    assert "Fastest that fit" in out.output


def test_fp8_param_gather_makes_eh_proj_s_weight_one_byte_too(actmem):
    """Megatron builds the prediction layers under FP8's init context (multi_token_prediction.py: get_fp8_context
    (is_init=True)), so under --fp8-param-gather eh_proj's weight is FP8 as well: Llama 3.1 8B with one prediction
    layer, the weights shrink by its 33 layers' linears, 33 x 218,103,808 = 7,197,425,664, and eh_proj's [4096,
    8192], 33,554,432: 7,230,980,096 B."""
    run = ("--model", "llama-3.1-8b", "--gpu", "h100", "--mtp-num-layers", "1", "--fp8-format", "hybrid")
    plain = actmem.json("estimate", *run)["parameters"]["weights_bytes"]
    gathered = actmem.json("estimate", *run, "--fp8-param-gather", "--distributed-optimizer", "--gpus", "8",
                           "--global-batch", "8")["parameters"]["weights_bytes"]
    assert plain - gathered == 33 * 218_103_808 + 4096 * 8192 == 7_230_980_096


def test_fp8_param_gather_beside_latent_attention_and_experts(actmem):
    """Nothing in megatron-core 0.16.1 or TE 2.11 sets MLA's or the experts' linears apart under --fp8-param-gather:
    each is built under the FP8 init context (multi_latent_attention.py, the q and kv down and up projections and
    the projection; the experts' GroupedLinear weight{i} each quantized, base.py: reset_parameters), an FP8 parameter
    of one byte with, on Hopper, its transpose. DeepSeek-V3 at t = 1, EP 64 (G = 4), p = 1, on its H800s, tensorwise:
    - an attention: q_down [1536, 7168] 11,010,048 + q_up [128·192, 1536] 37,748,736 + kv_down [576, 7168]
      4,128,768 + kv_up [128·256, 512] 16,777,216 + proj [7168, 16,384] 117,440,512 = 187,105,280 elements (the
      down projections whole on every tensor-parallel rank);
    - a dense layer (the first 3): + fc1 [36,864, 7168] 264,241,152 + fc2 [7168, 18,432] 132,120,576 = 583,467,008;
    - a MoE layer (58, and the prediction layer): + the shared expert's fc1 [4096, 7168] 29,360,128 and fc2 [7168,
      2048] 14,680,064 + 4 experts' 3·7168·2048 = 176,160,768: 407,306,240; eh_proj [7168, 14,336] 102,760,448.
    The weights shrink by a byte each: 3·583,467,008 + 59·407,306,240 + 102,760,448 = 25,884,229,632 B; TE keeps
    the same count of transpose bytes beside them, half the 2 B an element of the cached copies without it."""
    run = ("--model", "deepseek-v3", "--pp", "1", "--ep", "64", "--gpus", "64", "--distributed-optimizer",
           "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise")
    cached = actmem.json("estimate", *run)["parameters"]
    gathered = actmem.json("estimate", *run, "--fp8-param-gather")["parameters"]
    assert cached["weights_bytes"] - gathered["weights_bytes"] == 25_884_229_632
    modules = cached["fp8_bytes"] - 2 * 25_884_229_632            # the modules' scaling state, unchanged
    assert gathered["fp8_bytes"] == 25_884_229_632 + modules and 0 < modules < 10**6


@pytest.mark.parametrize("q_rank", [1536, None])
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_layernorm_recompute_beside_fp8_latent_attention(q_rank, recipe):
    """Under FP8 with --recompute-modules layernorm, Megatron has the down projections save the input norm's 16-bit
    output (multi_latent_attention.py, set_for_recompute_input_layernorm), which the norm's checkpoint frees: with a
    q latent neither one-byte copy stays; without one the q projection keeps its own. The norm's rerun restores its
    16-bit output whatever the recipe, so actmem's layernorm rerun under FP8 is bf16's. DeepSeek-V3 at t = 1,
    s = 4096: each norm reruns at its own moment (the input norm as the attention's output gradient arrives, the
    pre-MLP norm as the MoE layer's does) and holds its output 2·4096·7168 = 58,720,256 twice, the storage
    restored and CheckpointWithoutOutput's own (ctx.outputs), with its fp32 statistics 4·4096 = 16,384:
    117,456,896 each (measured at small scale: tests/validate, the rerun rows)."""
    from actmem.memory import engine
    from actmem.memory.estimate import estimate
    from actmem.memory.techniques import run_technique
    from actmem.model.recompute import Recompute, RecomputePolicy
    from actmem.model.spec import build_spec
    from actmem.sources.presets import load_preset

    preset = load_preset("deepseek-v3")
    arch = preset.architecture | {"mtp_layers": 0, "q_lora_rank": q_rank, "fp8_format": "e4m3", "fp8_recipe": recipe}
    run = {"expert_parallel": 64, "gpus": 64, "recompute": "selective", "recompute_modules": ("layernorm",)}
    spec = build_spec(preset.model, run, architecture=arch, gpu_name="h100", gpu_fp8="hopper")
    rows = {row.term.name for row in estimate(spec).run_terms}
    assert not {"qkv_input", "qkv_input_scales"} & rows
    assert ("qkv_input_q_fp8" in rows) == (q_rank is None)
    layernorm = run_technique(False, RecomputePolicy(Recompute.SELECTIVE, frozenset({"layernorm"})))
    for norm in ("input_layernorm", "pre_mlp_layernorm"):
        rerun = engine.rematerialised_bytes(layernorm, spec.architecture_at(1), module=norm)
        assert engine.exact(rerun, spec.bindings()) == 2 * 58_720_256 + 16_384 == 117_456_896
    with pytest.raises(ValueError, match="one part at a time"):
        engine.rematerialised_bytes(layernorm, spec.architecture_at(1), module="layernorm")
