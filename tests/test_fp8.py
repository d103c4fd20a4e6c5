"""FP8 training through Transformer Engine (issue 29, its first step): what TE 2.11's linears keep under the
delayed and tensorwise recipes, and the FP8 weight state (actmem/model/fp8.py has the source lines). Numbers
by hand, Llama 3 8B at s = 8192, b = 1, t = 1: h = 4096, a = 32, g = 8, d = 128, f = 14,336, L = 32.

A layer's 16-bit rows (tp, no recompute): the two norms' inputs 2sh = 67,108,864 each, their rsigma 4s =
32,768 each, the QKV input 67,108,864, q 67,108,864, k and v 2s·gd = 16,777,216 each, the softmax
statistics 4·s·a = 1,048,576, the projection's input 67,108,864, fc1's input 67,108,864, SwiGLU's input
2s·2f = 469,762,048 and fc2's input 2sf = 234,881,024: 5 x 67,108,864 + 67,108,864 + 2 x 32,768 + 2 x
16,777,216 + 1,048,576 + 469,762,048 + 234,881,024 = 1,141,964,800 B.
Under FP8 the QKV's and fc1's inputs (the norms' outputs) become sh + 4 = 33,554,436 (one byte an element and a
4-byte fp32 scale_inv), fc2's s·f + 4 = 117,440,516; under delayed scaling the projection keeps its input
quantized too, 33,554,436 more; the rest stays 16-bit.
"""

import pytest

from tests.conftest import assert_one_line_error
from tests.test_megatron_examples import EXAMPLES

LLAMA = ("--model", "llama-3.1-8b", "--gpu", "h100")
BF16_LAYER = 1_141_964_800
FP8_DELTA = -2 * (67_108_864 - 33_554_436) - (234_881_024 - 117_440_516)        # QKV's, fc1's, fc2's inputs


def _layer(out) -> dict:
    return {row["term"]: row["bytes_each"] for row in out["run_terms"] if row["scope"] == "layer"}


@pytest.mark.parametrize("recipe, extra", [("delayed", 33_554_436), ("tensorwise", 0)])
def test_a_layer_keeps_its_gemm_inputs_in_one_byte(actmem, recipe, extra):
    """delayed: 1,141,964,800 - 2·33,554,428 - 117,440,508 + 33,554,436 = 990,969,872 B a layer (0.87 of bf16);
    tensorwise, whose projection keeps the 16-bit input alone (Megatron's save_original_input): 957,415,436."""
    assert sum(_layer(actmem.json("estimate", *LLAMA)).values()) == BF16_LAYER
    layer = _layer(actmem.json("estimate", *LLAMA, "--fp8-format", "hybrid", "--fp8-recipe", recipe))
    assert (layer["qkv_input"], layer["fc1_input"], layer["fc2_input"]) == (33_554_436, 33_554_436, 117_440_516)
    assert layer.get("projection_input_fp8", 0) == extra and layer["swiglu_input"] == 469_762_048
    assert sum(layer.values()) == BF16_LAYER + FP8_DELTA + extra
    assert BF16_LAYER + FP8_DELTA + 33_554_436 == 990_969_872 and BF16_LAYER + FP8_DELTA == 957_415_436


def test_the_weight_state_on_hopper_and_blackwell(actmem):
    """A layer's TE linear weights: QKV 4096·6144 = 25,165,824, proj 4096² = 16,777,216, fc1 4096·28,672 =
    117,440,512, fc2 14,336·4096 = 58,720,256: 218,103,808, 6,979,321,856 over 32 layers. Delayed scaling at
    --fp8-amax-history-len 1024 keeps a module (4 a layer) 4 B of weight scale_inv and fp32 scales and amax
    history of 3 forward and 2 backward quantizers, 4·5·(1024 + 1) = 20,500: 20,504, so 128 modules 2,624,512.
    On Hopper TE caches each weight in FP8 and its transpose, 2 B an element: 13,958,643,712 + 2,624,512 =
    13,961,268,224; on Blackwell no transpose, 1 B: 6,979,321,856 + 2,624,512 = 6,981,946,368. Tensorwise keeps
    no history; each of a module's 5 quantizers keeps its own fp32 scale and amax, 4 + 5·8 = 44 B: 128 x 44 = 5632
    beside the copies."""
    fp8 = ("--fp8-format", "hybrid", "--fp8-amax-history-len", "1024")
    hopper = actmem.json("estimate", *LLAMA, *fp8)["parameters"]
    blackwell = actmem.json("estimate", "--model", "llama-3.1-8b", "--gpu", "b200", *fp8)["parameters"]
    tensorwise = actmem.json("estimate", *LLAMA, "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise")["parameters"]
    assert (hopper["fp8_bytes"], blackwell["fp8_bytes"]) == (13_961_268_224, 6_981_946_368)
    assert tensorwise["fp8_bytes"] == 13_958_643_712 + 5632
    assert hopper["weights_bytes"] == 2 * hopper["count"]


def test_fp8_param_gather_makes_the_weights_one_byte(actmem):
    """--fp8-param-gather: the linears' weights are FP8 in DDP's uint8 buffer, 1 B an element: the weights
    8,030,261,248·2 - 6,979,321,856 = 9,081,200,640 B; on Hopper each keeps its transpose (1 B), and TE builds no
    workspace: 6,979,321,856 + 2,624,512 = 6,981,946,368. It needs the distributed optimizer."""
    fp8 = ("--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-param-gather")
    assert_one_line_error(actmem("estimate", *LLAMA, *fp8), "--fp8-param-gather needs the distributed optimizer")
    out = actmem.json("estimate", *LLAMA, *fp8, "--distributed-optimizer", "--gpus", "8", "--global-batch", "8")
    assert out["parameters"]["weights_bytes"] == 9_081_200_640
    assert out["parameters"]["fp8_bytes"] == 6_981_946_368


def test_megatrons_llama3_fp8_example_is_priced_from_the_script_as_it_is(actmem):
    """examples/llama/train_llama3_8b_h100_fp8.sh (DTYPE fp8: --fp8-format hybrid, --fp8-amax-history-len 1024,
    --fp8-amax-compute-algo max, --fp8-param-gather, the distributed optimizer over its 8 GPUs) on an H100:
    its layer the delayed one above (990,969,872 B), its FP8 state 6,981,946,368 B (param gather, Hopper);
    on the script's default GPU, an A100 (the paper's), FP8 is refused."""
    script = f"@{EXAMPLES / 'train_llama3_8b_h100_fp8.sh'}"
    assert_one_line_error(actmem("estimate", "--megatron-args", script), "FP8 needs a GPU with FP8 tensor cores")
    out = actmem.json("estimate", "--megatron-args", script, "--gpu", "h100")
    assert sum(_layer(out).values()) == 990_969_872
    assert out["parameters"]["fp8_bytes"] == 6_981_946_368


@pytest.mark.parametrize("args, fragment", [
    (("--fp8-recipe", "tensorwise"), "--fp8-recipe tensorwise chooses FP8's scaling; Megatron reads it only with "
                                     "--fp8-format"),
    (("--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"), "--fp8-recipe mxfp8 runs on Blackwell"),
    (("--fp8-format", "hybrid", "--fp8-recipe", "custom"), "a custom recipe's quantizers are the user's own"),
    (("--fp8-format", "hybrid", "--fp8-recipe", "blockwise", "--tp", "2"), "is modelled with sequence parallelism"),
    (("--fp8-format", "hybrid", "--fp8-recipe", "blockwise", "--tp", "8", "--sp", "--seq-len", "512"),
     "needs their rows and h divisible by 128"),
    (("--fp8-format", "hybrid", "--seq-len", "8196"), "FP8 GEMMs need their inputs' and weights' rows divisible by 8"),
    (("--fp8-format", "hybrid", "--fp8-recipe", "blockwise", "--fp8-param-gather", "--distributed-optimizer"),
     "--fp8-param-gather under --fp8-recipe blockwise"),
    (("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-amax-history-len", "16"),
     "the tensorwise recipe keeps none"),
    (("--fp8-param-gather",), "give --fp8-format"),
    (("--fp8-format", "hybrid", "--attention-core", "eager", "--position-embedding", "learned"),
     "FP8 runs in Transformer Engine's linears"),
])
def test_fp8_settings_actmem_does_not_model_or_megatron_ignores_are_refused(actmem, args, fragment):
    assert_one_line_error(actmem("estimate", *LLAMA, *args), fragment)


def test_fp8_on_a_gpu_without_fp8_is_refused(actmem):
    assert_one_line_error(actmem("estimate", "--model", "llama-3.1-8b", "--gpu", "a100", "--fp8-format", "hybrid"),
                          "FP8 needs a GPU with FP8 tensor cores")


def test_every_sampled_plan_row_is_the_estimate_s_verdict_under_fp8():
    """The sweep's peak of a row equals the exact estimate's of the same run under delayed FP8 with
    --fp8-param-gather on H100s (its weight state and 1-byte inputs evaluated twice: one stage model)."""
    from actmem.memory.estimate import estimate
    from actmem.model.architecture import Architecture
    from actmem.model.hardware import GPUS
    from actmem.model.spec import Model, build_spec
    from actmem.planner.explain import parse_config
    from actmem.planner.plan import PlanRequest, config_label, plan
    from actmem.sources.presets import load_preset

    llama = load_preset("llama-3.1-8b")
    fp8 = {"fp8_format": "hybrid", "fp8_amax_history_len": 1024, "fp8_param_gather": True}
    req = PlanRequest(model=Model(**llama.model), gpus=64, global_batch=128, gpu=GPUS["h100"],
                      gpu_memory_bytes=GPUS["h100"].memory_bytes, max_micro_batch=2,
                      architecture=Architecture(**llama.architecture | fp8))
    evaluated = plan(req).evaluated
    assert evaluated.distributed_optimizer.all()          # --fp8-param-gather needs it: a rule of the sweep too
    for row in evaluated.sample(12, random_state=5).itertuples():
        run = parse_config(config_label(row), layers=32) | {"gpus": 64, "global_batch": 128}
        spec = build_spec(llama.model, run, architecture=llama.architecture | fp8, gpu_name=GPUS["h100"].name,
                          gpu_fp8="hopper")
        assert row.peak_bytes == estimate(spec).verdict_bytes, config_label(row)


def test_under_delayed_scaling_the_projection_keeps_no_16_bit_input(actmem):
    """TE refuses save_original_input under delayed scaling: the projection keeps its quantized copy alone, so the
    16-bit input is the core's own output, which the core's checkpoint does not keep (selective core_attn):
    the row goes (67,108,864 B a layer), the quantized copy stays (33,554,436); tensorwise keeps the 16-bit input
    (its save_original_input) and no copy. flash-attn hands the projection a copy at b > 1, which nothing keeps
    under delayed scaling: b = 2 keeps its own bshd output (flash_output, 2·s·b·ad = 2·8192·2·4096 = 134,217,728 B)
    and the quantized copy alone (s·b·ad + 4 = 67,108,868)."""
    sel = ("--recompute", "selective")
    delayed = _layer(actmem.json("estimate", *LLAMA, *sel, "--fp8-format", "hybrid"))
    tensorwise = _layer(actmem.json("estimate", *LLAMA, *sel, "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"))
    assert "projection_input" not in delayed and delayed["projection_input_fp8"] == 33_554_436
    assert tensorwise["projection_input"] == 67_108_864 and "projection_input_fp8" not in tensorwise
    attn = _layer(actmem.json("estimate", *LLAMA, "--attention-core", "flash-attn", "--micro-batch", "2",
                              "--fp8-format", "hybrid"))
    assert "projection_input" not in attn and attn["flash_output"] == 134_217_728
    assert attn["projection_input_fp8"] == 67_108_868


def test_plan_explains_an_fp8_configuration(actmem):
    """--explain builds its spec on the plan's GPU (an H100 here), not the paper's A100."""
    out = actmem("plan", *LLAMA, "--fp8-format", "hybrid", "--gpus", "8", "--global-batch", "64",
                 "--explain", "t=8 p=1 b=1 sp none dopt")
    assert out.exit_code == 0, out.output
    assert "projection_input_fp8" in out.stdout


@pytest.mark.parametrize("gpu, recipe, weight_state", [("b200", "mxfp8", 14_394_851_328),
                                                       ("h100", "blockwise", 13_962_051_584),
                                                       ("b200", "blockwise", 13_962_051_584)])
def test_the_block_scaled_recipes(actmem, gpu, recipe, weight_state):
    """MXFP8 (Blackwell) keeps the saved inputs' columnwise copies with E8M0 scales a 32 elements, [roundup(M/32, 4),
    roundup(K, 128)]: the norms' outputs 33,554,432 + 256·4096 = 1,048,576 each, fc2's 117,440,512 + 256·14,336 =
    3,670,016; blockwise (Hopper) fp32 scales a 128, [ceil(M/128), K]: 4·64·4096 = 1,048,576 and 4·64·14,336 =
    3,670,016, the same bytes here; neither keeps a scale_inv, and the projection keeps its 16-bit input (Megatron's
    save_original_input). A layer: 1,141,964,800 - 2·33,554,432 - 117,440,512 + 2·1,048,576 + 3,670,016 =
    963,182,592 (0.84 of bf16).
    The weights: rowwise and columnwise copies, 2 B an element, and their scales. MXFP8: QKV [6144, 4096]
    50,331,648 + 6144·128 + 192·4096 = 51,904,512; proj [4096, 4096] 33,554,432 + 2·524,288 = 34,603,008; fc1
    [28,672, 4096] 234,881,024 + 28,672·128 + 896·4096 = 242,221,056; fc2 [4096, 14,336] 117,440,512 + 4096·448 +
    128·14,336 = 121,110,528: 449,839,104 a layer, 14,394,851,328 over 32. Blockwise, 128x128 blocks in fp32 and
    the transpose's: QKV 50,331,648 + 4·(48·32 + 32·48) = 50,343,936; proj 33,554,432 + 4·2·32·32 = 33,562,624;
    fc1 234,881,024 + 4·(224·32 + 32·224) = 234,938,368; fc2 117,440,512 + 4·(32·112 + 112·32) = 117,469,184:
    436,314,112 a layer, 13,962,051,584 over 32. No scaling state."""
    out = actmem.json("estimate", "--model", "llama-3.1-8b", "--gpu", gpu, "--fp8-format", "e4m3",
                      "--fp8-recipe", recipe)
    layer = _layer(out)
    assert (layer["qkv_input"], layer["qkv_input_scales"], layer["fc2_input"], layer["fc2_input_scales"]) == \
        (33_554_432, 1_048_576, 117_440_512, 3_670_016)
    assert layer["projection_input"] == 67_108_864 and "projection_input_fp8" not in layer
    assert sum(layer.values()) == 963_182_592
    assert out["parameters"]["fp8_bytes"] == weight_state


@pytest.mark.parametrize("args, layer", [
    (("--gpu", "h100"), 281_288_704),
    (("--gpu", "h100", "--fp8-format", "hybrid"), 243_539_984),
    (("--gpu", "b200", "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"), 236_593_152),
])
def test_a_llama_70b_layer_under_tensor_and_sequence_parallelism(actmem, args, layer):
    """Llama 3.1 70B at s = 8192, b = 1, t = 8 with SP (h = 8192, a = 64, g = 8, d = 128, f = 28,672): a rank keeps
    the two norms' inputs 2·s·h/t = 16,777,216 each and their rsigma 4·s/t = 4096 each, the QKV input 16,777,216,
    q 2·s·a·d/t = 16,777,216, k and v 2·s·g·d/t = 2,097,152 each, the log-sum-exp 4·s·a/t = 262,144, the
    projection's input 16,777,216, fc1's 16,777,216, SwiGLU's 2·s·2f/t = 117,440,512 and fc2's 2·s·f/t =
    58,720,256: 281,288,704 B in bf16.
    Delayed FP8: the norms' outputs s·h/t + 4 = 8,388,612 each, fc2's s·f/t + 4 = 29,360,132, the projection's
    quantized copy s·a·d/t + 4 = 8,388,612: 281,288,704 - 2·8,388,604 - 29,360,124 + 8,388,612 = 243,539,984.
    MXFP8 on a B200: the norms' outputs 8,388,608 with scales [roundup(1024/32, 4), 8192] = 262,144 each, fc2's
    29,360,128 with [roundup(8192/32, 4), roundup(3584, 128)] = 917,504: 281,288,704 - 2·8,388,608 - 29,360,128 +
    2·262,144 + 917,504 = 236,593,152 (0.84)."""
    out = actmem.json("estimate", "--model", "llama-3.1-70b", "--tp", "8", "--sp", "--micro-batch", "1",
                      "--recompute", "none", *args)
    assert sum(_layer(out).values()) == layer


#: Llama 3.1 8B's output layer rows at t = 1: the final norm's input 2sh and rsigma 4s, the output layer's input 2sh,
#: fp32 logits 4sv (v = 128,256)
OUTPUT_ROWS = 67_108_864 + 32_768 + 67_108_864 + 4 * 8192 * 128_256
TENSORWISE_LAYER = BF16_LAYER + FP8_DELTA          # 957,415,436


def test_first_and_last_layers_in_bf16_keep_their_16_bit_inputs(actmem):
    """--first-last-layers-bf16 (tensorwise), t = 1: at p = 1 the first and last layers are bf16, the other 30 FP8:
    30 x 957,415,436 + 2 x 1,141,964,800 + the output layer's rows; the FP8 weight state 30/32 of the all-FP8
    run's. At p = 2 the first stage holds 2 microbatches of layer 0 (bf16) and layers 1-15 (FP8):
    2 x (15 x 957,415,436 + 1,141,964,800) = 31,006,392,680."""
    args = (*LLAMA, "--tp", "1", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise")
    assert TENSORWISE_LAYER == 957_415_436
    one = actmem.json("estimate", *args, "--pp", "1", "--first-last-layers-bf16")
    assert one["activations_bytes"] == 30 * TENSORWISE_LAYER + 2 * BF16_LAYER + OUTPUT_ROWS
    every = actmem.json("estimate", *args, "--pp", "1")
    assert one["parameters"]["fp8_bytes"] * 32 == every["parameters"]["fp8_bytes"] * 30
    qkv = [(row["bytes_each"], row["count"]) for row in one["run_terms"] if row["term"] == "qkv_input"]
    assert sorted(qkv) == [(33_554_436, 30), (67_108_864, 2)]
    two = actmem.json("estimate", *args, "--pp", "2", "--first-last-layers-bf16")
    assert two["activations_bytes"] == 2 * (15 * TENSORWISE_LAYER + BF16_LAYER) == 31_006_392_680
    wider = actmem.json("estimate", *args, "--pp", "1", "--first-last-layers-bf16", "--num-layers-at-start-in-bf16",
                        "3", "--num-layers-at-end-in-bf16", "0")
    assert wider["activations_bytes"] == 29 * TENSORWISE_LAYER + 3 * BF16_LAYER + OUTPUT_ROWS


@pytest.mark.parametrize("args, fragment", [
    (("--fp8-format", "hybrid", "--first-last-layers-bf16"), "Delayed scaling does not support first / last layer"),
    (("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--num-layers-at-start-in-bf16", "2"),
     "Megatron reads it only with that switch"),
    (("--first-last-layers-bf16",), "--first-last-layers-bf16 keeps layers out of FP8 training: give --fp8-format"),
    (("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--first-last-layers-bf16", "--pp", "4",
      "--num-layers-at-start-in-bf16", "9"), "must each be at most the layers of a pipeline stage, L/p = 8"),
    (("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--first-last-layers-bf16", "--pp", "4",
      "--interleave", "2"), "--first-last-layers-bf16 is modelled without interleaving"),
])
def test_first_last_bf16_layers_refused_where_megatron_or_actmem_does(actmem, args, fragment):
    assert_one_line_error(actmem("estimate", *LLAMA, *args), fragment)
