"""Today's Llama-style run, as a user gives it: pasted Megatron arguments. The per-layer
bytes are derived by hand below from what Transformer Engine's kernels and flash attention
keep (actmem/memory/terms.py cites the sources)."""

import json
from pathlib import Path

import pytest

from tests.conftest import assert_one_line_error

LLAMA_8B = ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention "
            "--num-query-groups 8 --ffn-hidden-size 14336 --swiglu --normalization RMSNorm "
            "--disable-bias-linear --untie-embeddings-and-output-weights --position-embedding-type rope "
            "--rotary-base 500000 --max-position-embeddings 131072 --seq-length 8192 "
            "--vocab-size 128256 --attention-dropout 0.0 --hidden-dropout 0.0 "
            "--tensor-model-parallel-size 8 --sequence-parallel --micro-batch-size 1 --bf16 "
            "--use-flash-attn")

# s = 8192, b = 1, h = 4096, a = 32, g = 8, d = 128, f = 14336, t = 8, SP on, no recompute.
SBH_T = 8192 * 4096 // 8                      # 4,194,304 elements: one (s/t, b, h) shard
LLAMA_8B_LAYER = {
    "attention_layernorm_input": 2 * SBH_T,   # 2sbh/t, each boundary tensor under SP
    "qkv_input": 2 * SBH_T,
    "query": 2 * 8192 * 32 * 128 // 8,        # 2sb·ad/t = 8,388,608 (after rope)
    "key": 2 * 8192 * 8 * 128 // 8,           # k after rope: 2sb·gd/t = 2,097,152
    "value": 2 * 8192 * 8 * 128 // 8,         # TE's contiguous copy of v: 2,097,152
    "softmax_lse": 4 * 32 * 8192 // 8,        # fp32, b·(a/t)·s = 131,072
    "projection_input": 2 * 8192 * 32 * 128 // 8,   # flash's output, 8,388,608
    "mlp_layernorm_input": 2 * SBH_T,
    "fc1_input": 2 * SBH_T,
    "swiglu_input": 2 * 2 * 8192 * 14336 // 8,     # the 2f-wide input: 58,720,256
    "fc2_input": 2 * 8192 * 14336 // 8,            # 29,360,128
    "attention_norm_statistics": 4 * 8192 // 8,    # each RMSNorm's fp32 rsigma: 4,096
    "mlp_norm_statistics": 4 * 8192 // 8,
}


def test_llama_3_8b_pasted_as_megatron_arguments_gives_the_te_flash_accounting(actmem):
    out = actmem.json("estimate", "--megatron-args", LLAMA_8B)
    per_layer = {row["term"]: row["bytes_each"] for row in out["run_terms"] if row["scope"] == "layer"}
    assert per_layer == LLAMA_8B_LAYER
    run = next(row for row in out["techniques"] if row["technique"] == "tp-sp")
    assert run["per_layer_bytes"] == sum(LLAMA_8B_LAYER.values()) == 142_745_600
    assert "softmax_output" not in per_layer                 # flash keeps no s² term
    assert {row["technique"] for row in out["techniques"]} == {"none", "tp", "tp-sp", "tp-sel", "tp-sp-sel",
                                                               "full", "tp-sp-full"}


def test_llama_3_8b_backends(actmem):
    """TE's cuDNN kernel (fused) and auto (which picks it on Hopper) keep one storage for the
    output; flash-attn through TE (flash, --use-flash-attn) keeps its own bshd output and
    hands the projection a contiguous copy, which at b = 1 is the same storage and at b = 2
    is a second 2sb·ad/t = 2·8192·2·4096/8 = 16,777,216 B a layer."""
    def layer(text, b):
        out = actmem.json("estimate", "--megatron-args", text.replace("--micro-batch-size 1", f"--micro-batch-size {b}"))
        return next(row["per_layer_bytes"] for row in out["techniques"] if row["technique"] == "tp-sp")

    fused, auto = (LLAMA_8B.replace("--use-flash-attn", f"--attention-backend {name}") for name in ("fused", "auto"))
    flash = LLAMA_8B.replace("--use-flash-attn", "--attention-backend flash")
    assert layer(fused, 1) == layer(auto, 1) == layer(flash, 1) == layer(LLAMA_8B, 1) == 142_745_600
    assert layer(flash, 2) == layer(LLAMA_8B, 2) == layer(fused, 2) + 16_777_216
    assert layer(auto, 2) == layer(fused, 2)


def test_rope_under_the_eager_core_is_refused(actmem):
    text = LLAMA_8B.replace("--use-flash-attn", "--attention-backend local")
    assert_one_line_error(actmem("estimate", "--megatron-args", text),
                          "rotary position embedding is modelled under the flash attention core only")


HF = "tests/data/hf"


def test_the_hugging_face_config_gives_the_same_numbers_as_the_pasted_arguments(actmem):
    """Llama 3.1 8B's published config.json (rope scaling and theta change no byte) with the
    same run: the same terms, byte for byte; s defaults to the config's context, so --seq-len."""
    pasted = actmem.json("estimate", "--megatron-args", LLAMA_8B)
    config = actmem.json("estimate", "--model", f"{HF}/llama-3.1-8b/config.json", "--seq-len", "8192",
                         "--tp", "8", "--sp", "--micro-batch", "1")
    assert config["run_terms"] == pasted["run_terms"]
    assert config["parameters"] == pasted["parameters"]
    assert not any("from the config" in note for note in config["assumptions"])


def test_a_config_without_a_sequence_length_says_where_s_came_from(actmem):
    out = actmem.json("estimate", "--model", f"{HF}/mistral-7b/config.json", "--tp", "8", "--sp")
    assert out["model"]["seq_len"] == 32768
    assert any("s = max_position_embeddings (32,768) from the config" in note for note in out["assumptions"])
    assert any("sliding window 4,096" in note for note in out["assumptions"])


def test_qwen2_7b_parameters_by_hand():
    """h 3584, L 28, a 28, g 4, d 128, f 18944, v 152064, untied; q, k, v biases only.
    A layer: QKV h·(ad + 2gd) = 3584·4608 = 16,515,072 + its bias 4,608; o_proj 3584² =
    12,845,056; MLP 3hf = 203,685,888; two RMSNorms 7,168: 233,057,792. x 28 = 6,525,618,176;
    embedding and output 2vh = 1,089,994,752; final norm 3,584: 7,615,616,512, the count
    Qwen2-7B publishes."""
    from actmem.memory.estimate import estimate
    from actmem.sources.presets import load_preset
    from actmem.model.spec import build_spec

    preset = load_preset(f"{HF}/qwen2-7b/config.json")
    spec = build_spec(preset.model, {}, architecture=preset.architecture)
    assert estimate(spec).parameters.count == 7_615_616_512


def test_mistral_7b_has_no_biases_whatever_its_config_says(actmem, tmp_path):
    """MistralAttention and MistralMLP build every linear with bias=False, and MistralConfig has
    no attention_bias or mlp_bias. h 4096, L 32, a 32, g 8, d 128, f 14336, v 32000, untied. A
    layer: QKV h·(ad + 2gd) = 4096·6144 = 25,165,824; o 4096² = 16,777,216; MLP 3hf =
    176,160,768; two RMSNorms 8,192: 218,112,000. x 32 = 6,979,584,000; embedding and output
    2vh = 262,144,000; final norm 4,096: 7,241,732,096, Mistral 7B's published count."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(json.loads((Path(HF) / "mistral-7b/config.json").read_text())
                                 | {"attention_bias": True, "mlp_bias": True}))
    for path in (f"{HF}/mistral-7b/config.json", str(config)):
        out = actmem.json("estimate", "--model", path)
        assert out["parameters"]["count"] == 7_241_732_096
        assert out["architecture"]["bias"] is False and out["architecture"]["qkv_bias"] is None


def test_gpt2_parameters_by_hand(actmem):
    """12 layers of 12h² + 13h (h 768): 85,054,464; word embedding padded as Megatron pads it,
    50257 -> 50304 rows: 38,633,472; positions 1024·768 = 786,432; final LayerNorm 1,536:
    124,475,904 (GPT-2's published 124,439,808 plus the 47 padding rows)."""
    out = actmem.json("estimate", "--model", f"{HF}/gpt2/config.json")
    assert out["parameters"]["count"] == 124_475_904
    assert out["architecture"]["attention_dropout"] == out["architecture"]["hidden_dropout"] == 0.1


@pytest.mark.parametrize("name, fragment", [
    ("pythia", "use_parallel_residual"),
])
def test_configs_actmem_cannot_model_are_refused_in_one_line(actmem, name, fragment):
    assert_one_line_error(actmem("estimate", "--model", f"{HF}/{name}/config.json"), fragment)


def test_broken_configs_are_one_line(actmem, tmp_path):
    broken = tmp_path / "config.json"
    broken.write_text("{not json")
    assert_one_line_error(actmem("estimate", "--model", str(broken)), "not a JSON config")
    broken.write_text('{"model_type": "llama", "hidden_size": "4096"}')
    assert_one_line_error(actmem("estimate", "--model", str(broken)), "num_attention_heads must be a positive integer, got None")
    broken.write_text('{"model_type": "t5"}')
    assert_one_line_error(actmem("estimate", "--model", str(broken)), "model_type 't5' is not supported")
    assert_one_line_error(actmem("estimate", "--model", str(tmp_path / "missing.json")), "cannot read it")


def test_llama_3_1_405b_on_its_published_run_by_hand(actmem):
    """Table 4: t 8, p 16 with 7 layers on the first stage, 16 microbatches in flight (1F1B),
    s 8192, b 1, SP, no recompute. A layer: 2sbh/t = 33,554,432 B for each of the four
    boundary tensors, q and the projection input; k and v 2·2sb·gd/t = 4,194,304; the
    log-sum-exp 4·b·(a/t)·s = 524,288; SwiGLU's input 4sbf/t = 218,103,808 and fc2's 2sbf/t =
    109,051,904; two RMSNorms' rsigma 2·4·sb/t = 8,192: 533,209,088 B. Parameters on the
    first GPU: 7 layers of (h·(ad + 2gd) + ad·h + 3hf)/t + 2h = 398,491,648, and the word
    embedding 129,024·16,384/8: 3,053,682,688."""
    out = actmem.json("estimate", "--model", "llama-3.1-405b")
    run = next(row for row in out["techniques"] if row["technique"] == "tp-sp")
    assert run["per_layer_bytes"] == 6 * 33_554_432 + 4_194_304 + 524_288 + 218_103_808 + 109_051_904 + 8_192
    assert run["layers_bytes"] == 16 * 7 * run["per_layer_bytes"]
    assert out["parameters"]["count"] == 7 * 398_491_648 + 129_024 * 16_384 // 8 == 3_053_682_688


def test_the_busiest_stage_of_an_uneven_pipeline_decides_the_verdict(actmem):
    """Stage 1 of 405B's run holds 8 layers x 15 microbatches (1F1B: p - 1 in flight) =
    120 x 533,209,088 = 63,985,090,560 B, and 8 layers of parameters, 3,187,933,184, at
    2 + 4 + 12/128 B each (distributed optimizer, d = 128): 6,375,866,368 + 12,751,732,736 +
    298,868,736 = 19,426,467,840 B, and TE's 16-bit dummy weight gradients, one a weight
    shape: QKV [(ad + 2gd)/t, h] = 2304 x 16384, projection [h, ad/t] = 16384 x 2048, fc1
    [2f/t, h] = 13312 x 16384, fc2 [h, f/t] = 16384 x 6656: 398,458,880 elements,
    796,917,760 B; model state 20,223,385,600 B: 84,208,476,160 B. Its peak floor is the last layer's fc1
    backward (no recompute, nothing rerun): with sbh/t = 16,777,216 and sbf/t = 54,525,952, it
    makes SwiGLU's input gradient 4sbf/t = 218,103,808, fc1's input gathered again and its input
    gradient, 2sbh each = 268,435,456 x 2, that gradient's shard 2sbh/t and the gradient at the
    layer's output 2sbh/t, 33,554,432 each: 822,083,584; it has freed SwiGLU's input 4sbf/t and
    fc2's 2sbf/t, 327,155,712 (no dropout, no mask): 84,703,404,032 B = 78.89 GiB, more than
    the first stage's; the verdict and the headroom are stage 1's. The preset's GPU is the
    H100 Meta trained on, 79.10 GiB to its allocator (84,932,978,278 B): the floor fits with
    229,574,246 B left, inside the 8 GiB reserve, so the verdict is 'tight' (at 78 GiB: does not
    fit)."""
    out = actmem.json("estimate", "--model", "llama-3.1-405b")
    assert out["busiest_stage"] == 1
    stage = out["stages"][1]
    assert {key: stage[key] for key in ("stage", "layers", "layer_activations", "activations_bytes",
                                        "parameters_bytes", "total_bytes")} == {
        "stage": 1, "layers": 8, "layer_activations": 120, "activations_bytes": 120 * 533_209_088,
        "parameters_bytes": 19_426_467_840 + 796_917_760, "total_bytes": 84_208_476_160}
    assert 2304 * 16384 + 16384 * 2048 + 13312 * 16384 + 16384 * 6656 == 398_458_880
    assert stage["peak_floor"]["total_bytes"] == 84_208_476_160 + 822_083_584 - 327_155_712 == 84_703_404_032
    assert stage["peak_floor"]["moment"] == "the last layer's fc1 backward"
    assert out["verdict_bytes"] == 84_703_404_032
    assert out["headroom_bytes"] == 84_932_978_278 - 84_703_404_032 == 229_574_246
    assert (out["verdict"], out["fits"]) == ("tight", False)
    assert actmem.json("estimate", "--model", "llama-3.1-405b", "--gpu-memory", "78GiB")["verdict"] == "does not fit"
    text = actmem("estimate", "--model", "llama-3.1-405b").output
    assert "Stage 1 holds the most" in text and "78.89 of 79.10 GiB" in text


@pytest.mark.parametrize("args, fragment", [
    (["--first-stage-layers", "7", "--interleave", "2"], "an uneven pipeline (first or last stage layers given) "
                                                         "needs p > 1 and no interleave"),
    (["--first-stage-layers", "6"], "share the other layers evenly: 113 layers over 14 stages"),
    (["--pp", "1", "--first-stage-layers", "7", "--gpus", "1024", "--global-batch", "1024"], "needs p > 1"),
])
def test_uneven_pipelines_that_do_not_add_up_are_refused(actmem, args, fragment):
    assert_one_line_error(actmem("estimate", "--model", "llama-3.1-405b", *args), fragment)


def test_a_new_pp_lays_the_presets_layers_out_again(actmem):
    """--pp 1 on the 405B preset (p = 16, 7-layer first and last stages): the preset's uneven layout goes with its p,
    and a note says so; the one stage holds all 126 layers."""
    out = actmem.json("estimate", "--model", "llama-3.1-405b", "--pp", "1", "--gpus", "1024", "--global-batch", "1024")
    assert out["stage"]["layers"] == 126
    assert any("uneven pipeline (first_stage_layers 7, last_stage_layers 7) left out: --pp 1" in note
               for note in out["assumptions"])


def test_partial_full_recompute_on_22b_by_hand(actmem):
    """22B (s 2048, b 4, h 6144, a 64), t 8, SP, one stage of 48 layers, one microbatch.
    sbh/t = 6,291,456. A checkpoint is 2sbh/t = 12,582,912 B; a whole layer sbh/t·(34 + 5as/h)
    = 6,291,456 · (34 + 320/3) = 884,998,144 B. Block 24: 24 of each = 21,541,945,344 B.
    Uniform 4: 12 groups, each keeping its input: 150,994,944 B."""
    base = ("estimate", "--model", "22b", "--recompute", "full", "--recompute-method")
    block = actmem.json(*base, "block", "--recompute-num-layers", "24")
    run = next(row for row in block["techniques"] if row["is_run"])
    assert run["layers_bytes"] == 24 * 12_582_912 + 24 * 884_998_144 == 21_541_945_344
    uniform = actmem.json(*base, "uniform", "--recompute-num-layers", "4")
    run = next(row for row in uniform["techniques"] if row["is_run"])
    assert run["layers_bytes"] == 12 * 12_582_912 == 150_994_944
    checkpoints = next(row for row in uniform["run_terms"] if row["term"] == "layer_input_checkpoint")
    assert checkpoints["count"] == 12


def test_recompute_shape_needs_full_recompute(actmem):
    assert_one_line_error(actmem("estimate", "--model", "22b", "--recompute-method", "block",
                                 "--recompute-num-layers", "2"),
                          "shape full recompute; this run's recompute is selective")


def test_no_position_embedding_means_what_megatron_says(actmem):
    """Megatron refuses --no-position-embedding unless the positions are rotary; 'none' is
    its own position type, shown as such."""
    assert actmem.json("estimate", "--megatron-args", LLAMA_8B + " --no-position-embedding")["run_terms"] == \
        actmem.json("estimate", "--megatron-args", LLAMA_8B)["run_terms"]
    learned = LLAMA_8B.replace("--position-embedding-type rope", "")
    assert_one_line_error(actmem("estimate", "--megatron-args", learned + " --no-position-embedding"),
                          "Megatron refuses --no-position-embedding unless the positions are rotary")
    shown = actmem("estimate", "--model", "llama-3.1-8b", "--position-embedding", "none").output
    assert "no positions ·" in shown and "rope ·" not in shown


def test_config_values_are_checked_not_coerced(actmem, tmp_path):
    """A string "false" is not a switch, a null dropout not a probability, 0 groups not MHA."""
    base = json.loads((Path(HF) / "llama-3.1-8b/config.json").read_text())
    for change, fragment in (({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
                             ({"attention_dropout": None}, "attention_dropout must be a probability"),
                             ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer"),
                             ({"sliding_window": "4k"}, "sliding_window must be a positive integer"),
                             ({"attention_bias": True}, "attention_bias and mlp_bias differ")):
        config = tmp_path / "config.json"
        config.write_text(json.dumps(base | change))
        assert_one_line_error(actmem("estimate", "--model", str(config)), fragment)


def test_gpt2_position_table_and_tying_follow_the_config(actmem, tmp_path):
    """GPT-2's learned table has n_positions = 1,024 rows whatever --seq-len reads of it: at s =
    512 the parameters are the same (124,475,904 at s = 1,024, tied); more than 1,024 positions
    are refused; tie_word_embeddings false unties the output layer (+ v·h = 50304·768)."""
    short = actmem.json("estimate", "--model", f"{HF}/gpt2/config.json", "--seq-len", "512")
    assert short["parameters"]["count"] == actmem.json("estimate", "--model", f"{HF}/gpt2/config.json")[
        "parameters"]["count"] == 124_475_904
    assert_one_line_error(actmem("estimate", "--model", f"{HF}/gpt2/config.json", "--seq-len", "2048"),
                          "the learned position table has 1,024 rows", "fewer than the sequence's 2,048")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(json.loads((Path(HF) / "gpt2/config.json").read_text())
                                 | {"tie_word_embeddings": False}))
    assert actmem.json("estimate", "--model", str(config))["parameters"]["count"] == 124_475_904 + 50_304 * 768


def test_a_paste_keeps_the_config_s_notes(actmem):
    out = actmem.json("estimate", "--model", f"{HF}/mistral-7b/config.json", "--tp", "8",
                      "--megatron-args", "--bf16 --lr 3e-4")
    assert any("from the config" in note for note in out["assumptions"])
    assert any("ignored" in note and "--lr" in note for note in out["assumptions"])


def test_qkv_bias_off_with_other_biases_on_is_refused():
    """Megatron's QKV bias is add_bias_linear or add_qkv_bias: it cannot be off alone."""
    from actmem.model.architecture import Architecture
    from actmem.errors import SpecError

    with pytest.raises(SpecError, match="Megatron cannot express"):
        Architecture(qkv_bias=False)


def test_context_parallelism_by_hand(actmem):
    """c = 2 beside t = 8 with SP: each rank keeps s/c = 4,096 tokens of every sequence and
    every term of the flash layer is linear in s, so each halves: 142,745,600 / 2 =
    71,372,800 B a layer (the log-sum-exp 4·b·(a/t)·(s/c) = 65,536, k and v 2 x 1,048,576). The
    GPUs split as t·c·p·d: 64 = 8·2·1·4; the distributed optimizer shards over d·c = 8."""
    cudnn = LLAMA_8B.replace("--use-flash-attn", "--attention-backend fused")
    out = actmem.json("estimate", "--megatron-args", cudnn + " --context-parallel-size 2 --use-distributed-optimizer"
                      " --no-create-attention-mask-in-dataloader",
                      "--gpus", "64", "--global-batch", "64")
    run = next(row for row in out["techniques"] if row["is_run"])
    assert run["per_layer_bytes"] == 71_372_800
    terms = {row["term"]: row["bytes_each"] for row in out["run_terms"]}
    assert terms["softmax_lse"] == 65_536 and terms["key"] + terms["value"] == 2_097_152
    assert out["run"]["data_parallel"] == 4
    params = out["parameters"]
    assert params["optimizer_bytes"] == -(-12 * params["count"] // 8)


def test_405b_at_128k_on_table_4_s_long_context_run(actmem):
    """CP 16 at 131,072 tokens leaves each rank 8,192: the same per-rank terms as the 8K run,
    and d·c = 8·16 = 128 optimizer shards as d = 128 there: the same 84,703,404,032 B at the
    busiest stage's peak (test_the_busiest_stage_of_an_uneven_pipeline_decides_the_verdict)."""
    long = actmem.json("estimate", "--model", "llama-3.1-405b-128k")
    short = actmem.json("estimate", "--model", "llama-3.1-405b")
    assert long["run_terms"] == short["run_terms"]
    assert long["busiest_stage"] == short["busiest_stage"] == 1
    assert long["stages"] == short["stages"] and long["verdict_bytes"] == 84_703_404_032


@pytest.mark.parametrize("args, fragment", [
    (["--model", "22b", "--recompute", "none", "--cp", "2"], "context parallelism runs Transformer Engine's attention"),
    (["--model", "llama-3.1-8b", "--attention-core", "flash-attn", "--cp", "2"], "cuDNN flash core"),
    (["--model", "llama-3.1-8b", "--seq-len", "8194", "--cp", "3"], "2c (6) must divide seq_len (8194)"),
    (["--model", "llama-3.1-8b", "--tp", "8", "--cp", "2", "--gpus", "24"], "t·c·p (8·2·1 = 16) must divide gpus (24)"),
    (["--megatron-args", LLAMA_8B.replace("--use-flash-attn", "") + " --context-parallel-size 2 --cp-comm-type a2a"],
     "--cp-comm-type a2a is not modelled"),
])
def test_context_parallel_runs_actmem_cannot_count_are_refused(actmem, args, fragment):
    assert_one_line_error(actmem("estimate", *args), fragment)


def test_the_planner_sweeps_context_parallelism_and_agrees_with_the_estimate():
    """Llama 3.1 70B on 256 H100s: the sweep holds c > 1 rows (2c | s), and one of them
    evaluated by the planner holds what the estimate of the same run holds, activations at
    s/c and the optimizer sharded over d·c. The paper's eager core gets c = 1 only."""
    from actmem.memory.estimate import estimate
    from actmem.model.hardware import GPUS
    from actmem.planner.plan import PlanRequest, plan
    from actmem.sources.presets import load_preset
    from actmem.model.spec import Model, build_spec

    preset = load_preset("llama-3.1-70b")
    from actmem.model.architecture import Architecture
    request = PlanRequest(model=Model(**preset.model), gpus=256, global_batch=256, gpu=GPUS["h100"],
                          gpu_memory_bytes=80 * 2**30, architecture=Architecture(**preset.architecture))
    rows = plan(request).evaluated
    assert set(rows.c) >= {1, 2, 4, 8}
    row = rows[(rows.t == 8) & (rows.c == 2) & (rows.p == 4) & (rows.m == 1) & (rows.b == 1)
               & rows.sequence_parallel & (rows.recompute == "none") & rows.distributed_optimizer].iloc[0]
    assert row.d == 256 // (8 * 2 * 4) == 4
    spec = build_spec(preset.model, dict(tensor_parallel=8, context_parallel=2, pipeline_parallel=4, micro_batch=1,
                                         sequence_parallel=True, distributed_optimizer=True, gpus=256,
                                         global_batch=256), architecture=preset.architecture)
    est = estimate(spec)
    assert (row.activations_bytes, row.optimizer_bytes) == (est.activations_bytes, est.parameters.optimizer_bytes)
    paper = plan(PlanRequest(model=Model(**load_preset("22b").model), gpus=8, global_batch=8,
                             gpu=GPUS["a100"], gpu_memory_bytes=80 * 2**30)).evaluated
    assert set(paper.c) == {1}


def test_explain_takes_the_context_parallel_size_back(actmem):
    out = actmem("plan", "--model", "llama-3.1-70b", "--gpus", "256", "--global-batch", "256", "--gpu", "h100",
                 "--explain", "t=8 c=2 p=4 m=1 b=1 sp none dopt")
    assert out.exit_code == 0 and "t=8 c=2 p=4" in out.output and "context-parallel ring" in out.output


def test_plan_takes_the_architecture_flags(actmem):
    """The planner reads --attention-core and the other architecture flags as estimate does:
    its best configuration's memory equals the estimate of that run with the same flags."""
    args = ("--model", "22b", "--attention-core", "flash", "--attention-dropout", "0", "--recompute", "none")
    out = actmem.json("plan", "--model", "22b", "--gpus", "8", "--global-batch", "8", "--attention-core", "flash",
                      "--attention-dropout", "0")
    best = out["best"][0]
    est = actmem.json("estimate", *args, "--tp", str(best["t"]), "--cp", str(best["c"]), "--pp", str(best["p"]),
                      "--interleave", str(best["m"]), "--micro-batch", str(best["b"]),
                      "--sp" if best["sequence_parallel"] else "--no-sp", "--recompute", best["recompute"],
                      "--gpus", "8", "--global-batch", "8",
                      *(["--distributed-optimizer"] if best["distributed_optimizer"] else []))
    assert best["activations_bytes"] == est["activations_bytes"]
    assert_one_line_error(actmem("plan", "--model", "22b", "--gpus", "8", "--global-batch", "8",
                                 "--position-embedding", "rope"), "rotary position embedding is modelled under the flash")
