"""FP8 beside experts (issues 27 and 29): Megatron's TEGroupedMLP over TE 2.11's GroupedLinear under the delayed
and tensorwise recipes (actmem/model/fp8.py has the source lines). Numbers by hand.

Mixtral 8x7B as Megatron-LM's example runs it, on an H100: h = 4096, a = 32, g = 8, d = 128, E = 8, k = 2,
f_e = 14,336, s = 4096, b = 1, L = 32 over p = 4 stages (8 layers a stage).

Beside t = 2 with SP and EP = 2 (so ETP = t = 2, and G = E/EP = 4 local experts): a rank routes
N = s·b/t = 2048 tokens; balanced, its experts receive T = k·N·ETP = 8192 rows. Under FP8 each expert's rows are
padded to a multiple of 16; at their most that adds G·15 = 60 rows, so T_pad = 16·floor((8192 + 60)/16) =
16·515 = 8240. F = f_e/ETP = 7168.
- experts_input: fc1's GroupedLinear keeps each expert's columnwise copy, one byte an element, and its fp32
  scale_inv: 4096·8240 + 4·4 = 33,751,040 + 16 = 33,751,056 (16 bits: 2·4096·8192 = 67,108,864);
- experts_fc1_output: the weighted SwiGLU's 16-bit input over the padded rows, 2·2·7168·8240 = 236,257,280;
- experts_probs: 2·8240 = 16,480;
- experts_fc2_input: 7168·8240 + 16 = 59,064,336 (16 bits: 2·7168·8192 = 117,440,512).

The FP8 weight state a MoE layer (Hopper: each weight's FP8 copy and its transpose, 2 B an element):
- attention: QKV [(32 + 2·8)·128/2, 4096] = 3072·4096 = 12,582,912, proj [4096, 4096/2] = 8,388,608: 20,971,520
  elements, 41,943,040 B;
- experts: G·(fc1 [2·7168, 4096] + fc2 [4096, 7168]) = 4·(58,720,256 + 29,360,128) = 352,321,536 elements,
  704,643,072 B;
- scaling state: 2 attention modules + 2·G experts' worth = 10 modules; tensorwise 44 B a module (4 B of weight
  scale_inv, 5 quantizers' scale and amax, 8 B each): 440 B; delayed at a history of 1024, 4 + 4·5·1025 = 20,504
  a module: 205,040 B.
So tensorwise 41,943,040 + 704,643,072 + 440 = 746,586,552 B a layer, 5,972,692,416 B over the stage's 8.
"""

import pytest

from tests.conftest import assert_one_line_error

MIXTRAL = ("--model", "mixtral-8x7b", "--tp", "2", "--sp", "--ep", "2", "--gpus", "32")
TENSORWISE = ("--fp8-format", "e4m3", "--fp8-recipe", "tensorwise")


def _experts(out) -> dict:
    return {row["term"]: row["bytes_each"] for row in out["run_terms"] if row["term"].startswith("experts_")}


def test_the_experts_keep_their_gemm_inputs_in_one_byte_over_padded_rows(actmem):
    bf16 = _experts(actmem.json("estimate", *MIXTRAL))
    assert bf16 == {"experts_input": 67_108_864, "experts_fc1_output": 2 * 2 * 7168 * 8192,
                    "experts_probs": 2 * 8192, "experts_fc2_input": 117_440_512}
    fp8 = _experts(actmem.json("estimate", *MIXTRAL, *TENSORWISE))
    assert fp8 == {"experts_input": 33_751_056, "experts_fc1_output": 236_257_280, "experts_probs": 16_480,
                   "experts_fc2_input": 59_064_336}


def test_delayed_scaling_keeps_the_same_expert_rows(actmem):
    """The experts' GroupedLinear keeps the same copies under delayed scaling (no save_original_input there)."""
    delayed = _experts(actmem.json("estimate", *MIXTRAL, "--fp8-format", "hybrid"))
    assert delayed == _experts(actmem.json("estimate", *MIXTRAL, *TENSORWISE))


def test_one_local_expert_pads_nothing_the_balanced_rows_do_not_need(actmem):
    """The preset's EP = 8, t = 1: G = 1, T = 2·4096 = 8192, T_pad = 16·floor((8192 + 15)/16) = 8192:
    experts_input 4096·8192 + 4 = 33,554,436, fc2's 14,336·8192 + 4 = 117,440,516."""
    rows = _experts(actmem.json("estimate", "--model", "mixtral-8x7b", *TENSORWISE))
    assert (rows["experts_input"], rows["experts_fc2_input"]) == (33_554_436, 117_440_516)
    assert rows["experts_fc1_output"] == 2 * 2 * 14336 * 8192


def test_an_imbalance_grows_the_padded_rows(actmem):
    """r = 5/4: T = ⌈5/4·8192⌉ = 10,240, T_pad = 16·floor((10,240 + 60)/16) = 16·643 = 10,288:
    experts_input 4096·10,288 + 16 = 42,139,664."""
    rows = _experts(actmem.json("estimate", *MIXTRAL, *TENSORWISE, "--moe-imbalance", "1.25"))
    assert rows["experts_input"] == 42_139_664 and rows["experts_probs"] == 2 * 10_288


def test_the_fp8_weight_state_of_the_experts(actmem):
    tensorwise = actmem.json("estimate", *MIXTRAL, *TENSORWISE)["parameters"]
    assert tensorwise["fp8_bytes"] == 8 * 746_586_552 == 5_972_692_416
    delayed = actmem.json("estimate", *MIXTRAL, "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024")
    assert delayed["parameters"]["fp8_bytes"] == 8 * (41_943_040 + 704_643_072 + 205_040)
    assert actmem.json("estimate", *MIXTRAL)["parameters"]["fp8_bytes"] == 0


SHARED = MIXTRAL + ("--moe-shared-expert-intermediate-size", "4096")


@pytest.mark.parametrize("recipe, overlap, fc1", [
    (TENSORWISE, (), {}),
    (("--fp8-format", "hybrid"), (), {"shared_experts_fc1_input_fp8": 8_388_612}),
    (("--fp8-format", "hybrid"), ("--moe-shared-expert-overlap",), {"shared_experts_fc1_input_gathered_fp8": 16_777_220}),
    (TENSORWISE, ("--moe-shared-expert-overlap",), {"shared_experts_fc1_input_gathered": 33_554_432}),
])
def test_shared_experts_under_fp8(actmem, recipe, overlap, fc1):
    """Shared experts of f_s = 4096 beside t = 2 (SP): fc2 (TE's row-parallel Linear) keeps its input's
    columnwise copy, s·f_s/t + 4 = 4096·2048 + 4 = 8,388,612 (16 bits: 16,777,216); their SwiGLU its 16-bit input,
    2·s·2f_s/t = 33,554,432. fc1 keeps, under tensorwise, its original input, the router's (nothing more); under
    delayed scaling its input quantized, the rank's shard s/t·h + 4 = 8,388,612; overlapping the dispatcher, the
    input gathered ahead, quantized whole under delayed (s·h + 4 = 16,777,220, the 16-bit one freed), 16-bit
    under tensorwise (2·s·h = 33,554,432). Their FP8 weight state a layer: fc1 [2·4096/2, 4096] + fc2
    [4096, 4096/2] = 25,165,824 elements, 2 B on Hopper, and two modules' 44 B: 50,331,736 beside the 746,586,552
    above, so 8 x 796,918,288 = 6,375,346,304 a stage."""
    out = actmem.json("estimate", *SHARED, *recipe, *overlap)
    rows = {row["term"]: row["bytes_each"] for row in out["run_terms"] if row["term"].startswith("shared")}
    assert rows == {"shared_experts_swiglu_input": 33_554_432, "shared_experts_fc2_input": 8_388_612} | fc1
    assert out["parameters"]["fp8_bytes"] == 8 * (746_586_552 + 50_331_736) == 6_375_346_304


@pytest.mark.parametrize("recipe, rows, blocks, fc1, fc2", [
    # blockwise (rows padded to 16): T_pad = 8240 as above; Q = G·(128 - 16) = 448, so B = floor((8240 + 448)/128) =
    # floor(67.875) = 67 blocks of 128 rows; fp32 GEMM_READY scales 4·B·roundup(K, 4): fc1 4·67·4096 = 1,097,728,
    # fc2 4·67·7168 = 1,921,024
    (("--fp8-recipe", "blockwise"), 8240, 67, 33_751_040 + 1_097_728, 59_064_320 + 1_921_024),
    # MXFP8 on a B200 (rows padded to 32): P = 4·31 = 124, T_pad = 32·floor((8192 + 124)/32) = 32·259 = 8288;
    # Q = 4·96 = 384, B = floor(8672/128) = 67; E8M0 scales 4·B·roundup(K, 128): fc1 4096·8288 + 1,097,728,
    # fc2 7168·8288 + 1,921,024
    (("--fp8-recipe", "mxfp8", "--gpu", "b200"), 8288, 67, 4096 * 8288 + 1_097_728, 7168 * 8288 + 1_921_024),
])
def test_the_block_recipes_keep_every_expert_s_copy_and_scales_in_one_buffer(actmem, recipe, rows, blocks, fc1, fc2):
    """TE's split_quantize allocates the block recipes' columnwise copies in one buffer (data regions 256-byte
    aligned, scales 16: padded rows fill both exactly); an expert's scales cover its padded rows' 128-row
    blocks, counted at their most. The shared experts' fc2 keeps its block scales, [s, f_s/t] = [4096, 2048]:
    blockwise 4·32·2048, MXFP8 roundup(4096/32, 4)·roundup(2048, 128) = 128·2048, both 262,144."""
    out = actmem.json("estimate", *SHARED, "--fp8-format", "e4m3", *recipe)
    layer = {row["term"]: row["bytes_each"] for row in out["run_terms"] if row["scope"] == "layer"}
    assert (layer["experts_input"], layer["experts_fc2_input"]) == (fc1, fc2)
    assert layer["experts_fc1_output"] == 4 * 7168 * rows and layer["experts_probs"] == 2 * rows
    assert (layer["shared_experts_fc2_input"], layer["shared_experts_fc2_input_scales"]) == (8_388_608, 262_144)
    assert fc1 - 4096 * rows == 4 * blocks * 4096


def test_moe_act_recompute_frees_fc2_s_fp8_copy_and_its_rerun_remakes_16_bits(actmem):
    """--recompute-modules moe_act under tensorwise: fc2 saves its original 16-bit input, which the checkpoint
    frees (experts.py: set_save_original_input), so experts_fc2_input is gone; the rest stays. The rerun (the peak's
    moment here) remakes that 16-bit input and keeps its own output beside it (random.py, CheckpointWithoutOutput):
    2 x 2·7168·8240 = 236,257,280 B, not twice the FP8 copy."""
    out = actmem.json("estimate", *MIXTRAL, *TENSORWISE, "--recompute", "selective", "--recompute-modules", "moe_act")
    rows = _experts(out)
    assert "experts_fc2_input" not in rows and rows["experts_input"] == 33_751_056
    assert out["peak_floor"]["moment"] == "the first backward, the experts' activation's (moe_act) rerun done"
    assert {row["name"]: row["bytes"] for row in out["peak_floor"]["rows"]}["rematerialised"] == 236_257_280


def test_the_preset_s_layer_and_weight_state_by_recipe(actmem):
    """Mixtral 8x7B as its preset runs (t = 1, EP 8, one expert a rank: no padding at balance), docs/models.md's
    table. bf16 990,822,468 B a layer (docs/models.md, Mixture of experts); tensorwise: the QKV's input (the norm's
    output) 2·4096·4096 -> 4096·4096 + 4, the experts' input 2·4096·8192 -> 4096·8192 + 4, fc2's 2·14,336·8192 ->
    14,336·8192 + 4: 990,822,468 - 16,777,212 - 33,554,428 - 117,440,508 = 823,050,320; delayed keeps the
    projection's input quantized too, 4096·4096 + 4: 839,827,540. The weight state: QKV 6144·4096 + proj
    4096·4096 + fc1 28,672·4096 + fc2 4096·14,336 = 218,103,808 elements, 2 B on Hopper, and 4 modules' 44 B:
    436,207,792 a layer, 3,489,662,336 over the stage's 8."""
    for recipe, layer in (((), 990_822_468), (("--fp8-format", "hybrid"), 839_827_540), (TENSORWISE, 823_050_320)):
        out = actmem.json("estimate", "--model", "mixtral-8x7b", *recipe)
        assert sum(row["bytes_each"] for row in out["run_terms"] if row["scope"] == "layer") == layer
        assert out["parameters"]["fp8_bytes"] == (3_489_662_336 if recipe else 0)


@pytest.mark.parametrize("args, fragment", [
    (("--fp8-format", "hybrid", "--recompute", "selective", "--recompute-modules", "moe_act"),
     "moe_act or layernorm under FP8 delayed scaling"),
    (TENSORWISE + ("--moe-ffn-hidden-size", "14328"), "divisible by 8"),
])
def test_what_fp8_experts_do_not_price_is_refused(actmem, args, fragment):
    assert_one_line_error(actmem("estimate", *MIXTRAL, *args), fragment)


def test_fp8_experts_need_the_grouped_gemm(actmem):
    """A MoE model without --moe-grouped-gemm runs SequentialMLP: its experts' FP8 saves are not priced."""
    custom = ("--heads", "32", "--hidden", "4096", "--layers", "4", "--vocab", "32000", "--seq-len", "4096",
              "--num-experts", "8", "--moe-router-topk", "2", "--gpu", "h100", "--attention-core", "flash", "--swiglu",
              "--disable-bias-linear")
    assert_one_line_error(actmem("estimate", *custom, *TENSORWISE), "modelled as TE's grouped GEMM")
    assert actmem.json("estimate", *custom, *TENSORWISE, "--moe-grouped-gemm")["parameters"]["fp8_bytes"] > 0


def test_megatron_refuses_layernorm_recompute_under_delayed_scaling_in_a_dense_model_too(actmem):
    """transformer_config.py raises for moe_act and layernorm recompute under delayed FP8, MoE or not."""
    assert_one_line_error(actmem("estimate", "--model", "llama-3.1-8b", "--gpu", "h100", "--fp8-format", "hybrid",
                                 "--recompute", "selective", "--recompute-modules", "layernorm"),
                          "Delayed scaling does not support moe_act and layernorm recompute")


FIRST_LAST = MIXTRAL + TENSORWISE + ("--first-last-layers-bf16",)


def _counted(out, term) -> dict:
    """{bytes each: layers held} of a term's rows (one a kind of layer where the kinds keep different bytes)."""
    return {row["bytes_each"]: row["count"] for row in out["run_terms"] if row["term"] == term}


def test_first_last_layers_bf16_beside_experts_keep_16_bit_padded_rows(actmem):
    """--first-last-layers-bf16: layer 0 (first stage) and layer 31 (last) run in bf16, yet Megatron's TEGroupedMLP
    pads their experts' rows as the FP8 ones' (experts.py: keyed on config.fp8), to TE's Fp8Padding's alignment
    outside an autocast, 16 on a Hopper (fp8.bf16_padding_multiple). The first stage holds 4 microbatches of its 8
    layers (1F1B at p = 4): 4 of layer 0, 28 of the FP8 layers.
    - experts_input: bf16 2·4096·8240 = 67,502,080 (a bf16 run's, unpadded: 67,108,864), FP8 33,751,056;
    - experts_fc2_input: bf16 2·7168·8240 = 118,128,640, FP8 59,064,336;
    - the SwiGLU's input and the probabilities, 16-bit over the padded rows in both: one row of 32.
    The FP8 weight state: 7 FP8 layers' 746,586,552 = 5,226,105,864 B (the bf16 layer keeps none)."""
    out = actmem.json("estimate", *FIRST_LAST)
    assert _counted(out, "experts_input") == {67_502_080: 4, 33_751_056: 28}
    assert _counted(out, "experts_fc2_input") == {118_128_640: 4, 59_064_336: 28}
    assert _counted(out, "experts_fc1_output") == {236_257_280: 32}
    assert _counted(out, "experts_probs") == {16_480: 32}
    assert out["parameters"]["fp8_bytes"] == 7 * 746_586_552 == 5_226_105_864
    last = actmem.json("estimate", *FIRST_LAST, "--stage", "last")       # one microbatch of 8 layers: 31 in bf16
    assert _counted(last, "experts_input") == {67_502_080: 1, 33_751_056: 7}


def test_the_prediction_layer_runs_in_fp8_beside_first_last_layers_bf16(actmem):
    """Megatron runs the multi-token-prediction layers under the global FP8 context, whatever their number
    (multi_token_prediction.py: get_fp8_context(self.config), no layer number), so the last stage's MTP layer is an
    FP8 MoE layer beside its bf16 layer 31: experts_input FP8 for 7 + 1 layers, bf16 for 1. Its weight state: 8 FP8
    MoE layers' 746,586,552 B and eh_proj's [h/t, 2h] = [2048, 8192] weight, 2 B an element on a Hopper, and a
    module's 44 B: 33,554,476; 6,006,246,892 in all."""
    out = actmem.json("estimate", *FIRST_LAST, "--mtp-num-layers", "1", "--stage", "last")
    assert _counted(out, "experts_input") == {67_502_080: 1, 33_751_056: 8}
    assert out["parameters"]["fp8_bytes"] == 8 * 746_586_552 + 2 * 2048 * 8192 + 44 == 6_006_246_892


def test_first_last_layers_bf16_beside_experts_pads_as_the_gpu_does(actmem):
    """On a Blackwell TE's default recipe is MXFP8 (quantization.py, get_default_fp8_recipe), so a bf16 layer's
    experts pad to 32: under --fp8-recipe mxfp8 (32 too) it is priced, T_pad = 32·floor((8192 + 4·31)/32) = 8288,
    the bf16 layer's experts_input 2·4096·8288 = 67,895,296; under tensorwise (FP8 layers padding to 16) it is
    refused."""
    mxfp8 = actmem.json("estimate", *MIXTRAL, "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--first-last-layers-bf16",
                        "--gpu", "b200")
    assert 67_895_296 in _counted(mxfp8, "experts_input")
    assert_one_line_error(actmem("estimate", *FIRST_LAST, "--gpu", "b200"),
                          "its bf16 layers pad each expert's rows to 32", "its FP8 layers to 16")


def test_fp8_param_gather_makes_the_experts_weights_one_byte(actmem):
    """--fp8-param-gather beside experts: each expert's GroupedLinear weight is an FP8 parameter (base.py,
    reset_parameters: quantizer(param); the expert data-parallel buffer uint8), and on Hopper TE keeps its transpose
    beside it and no cached copy (base.py, get_weight_workspace returns the parameter). A Mixtral MoE layer at t = 2,
    EP = 2 has 20,971,520 attention and 352,321,536 expert weight elements: 373,293,056, a byte less each, 8 layers
    on the first stage: 2,986,344,448 B; the FP8 state 1 B an element and the 10 modules' 440 B: 8·373,293,496 =
    2,986,347,968."""
    run = MIXTRAL + TENSORWISE + ("--distributed-optimizer",)
    cached = actmem.json("estimate", *run)["parameters"]
    gathered = actmem.json("estimate", *run, "--fp8-param-gather")["parameters"]
    assert cached["weights_bytes"] - gathered["weights_bytes"] == 8 * 373_293_056 == 2_986_344_448
    assert (cached["fp8_bytes"], gathered["fp8_bytes"]) == (8 * 746_586_552, 8 * 373_293_496)


def test_the_moe_and_shared_experts_modules_recompute_through_te_s_checkpoint(actmem):
    """Under FP8 Megatron checkpoints the MoE layer, or its shared experts, through TE's checkpoint, which saves its
    tensor arguments by reference as Megatron's own does: recomputing moe, a layer keeps of its MLP the router's
    input alone, the rank's shard under SP, 2·(4096/2)·4096 = 16,777,216 B, nothing of its experts or router;
    recomputing shared_experts (f_s = 4096), the shared experts' rows go (fc2's one-byte copy 8,388,612) and the
    experts' FP8 rows stay."""
    moe = actmem.json("estimate", *MIXTRAL, *TENSORWISE, "--recompute", "selective", "--recompute-modules", "moe")
    kept = {row["term"]: row["bytes_each"] for row in moe["run_terms"]}
    assert kept["router_input"] == 16_777_216
    assert not [term for term in kept if term.startswith(("experts_", "permute_", "aux_loss_")) or
                term.startswith("router_") and term != "router_input"]
    shared = actmem.json("estimate", *SHARED, *TENSORWISE, "--recompute", "selective", "--recompute-modules",
                         "shared_experts")
    terms = {row["term"]: row["bytes_each"] for row in shared["run_terms"]}
    assert not [term for term in terms if term.startswith("shared_experts_")]
    assert _experts(shared) == _experts(actmem.json("estimate", *SHARED, *TENSORWISE))
    assert "shared_experts_fc2_input" in {row["term"] for row in actmem.json("estimate", *SHARED, *TENSORWISE)[
        "run_terms"]}
