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
    assert out["peak_floor"]["moment"] == "the first backward, its recompute done"
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
    (TENSORWISE + ("--recompute", "selective", "--recompute-modules", "moe"), "te_checkpoint"),
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
