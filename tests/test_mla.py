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


@pytest.mark.parametrize("extra, fragments", [
    (["--no-rope-fusion"], ["the unfused rope (--no-rope-fusion"]),
    (["--rope-type", "rope"], ["modelled with Megatron's fused YaRN rope"]),
    (["--query-groups", "8"], ["--num-query-groups with multi-latent attention"]),
    (["--recompute", "selective"], ["selective recompute of a multi-latent attention layer"]),
    (["--cp", "2"], ["context parallelism (c = 2) with multi-latent attention"]),
    (["--qk-pos-emb-head-dim", "66"], ["must be a multiple of 4"]),
])
def test_what_mla_does_not_model_is_refused(actmem, extra, fragments):
    args = list(V3)
    if extra[0] in args:                                   # another value of one of V3's own flags
        args[args.index(extra[0]) + 1] = extra[1]
        extra = []
    assert_one_line_error(actmem("estimate", *args, *extra), *fragments)


@pytest.mark.parametrize("args, fragments", [
    (["--kv-lora-rank", "512"], ["kv_lora_rank shape multi-latent attention: give --multi-latent-attention"]),
    (["--rope-type", "yarn"], ["--rope-type yarn applies to multi-latent attention only"]),
])
def test_an_mla_setting_without_mla_is_refused(actmem, args, fragments):
    dense = [arg for arg in V3[:V3.index("--multi-latent-attention")]]
    assert_one_line_error(actmem("estimate", *dense, *args), *fragments)


def test_plan_and_flops_refuse_mla(actmem):
    assert_one_line_error(actmem("plan", *V3, "--gpus", "8", "--global-batch", "8"), "multi-latent attention")
    megatron = ("--num-layers 4 --hidden-size 7168 --num-attention-heads 128 --seq-length 4096 --vocab-size 129280 "
                "--ffn-hidden-size 18432 --swiglu --disable-bias-linear --normalization RMSNorm --bf16 "
                "--position-embedding-type rope --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 "
                "--attention-dropout 0 --hidden-dropout 0 --micro-batch-size 1 --global-batch-size 8")
    assert_one_line_error(actmem("flops", "--megatron-args", megatron), "multi-latent attention's down and up")


def test_kv_channels_is_named_as_not_read(actmem):
    """Megatron's DeepSeek-V3 scripts pass --kv-channels 128 beside MLA, which MLASelfAttention never reads:
    accepted, the same bytes, and said so."""
    plain = actmem.json("estimate", *V3)
    out = actmem.json("estimate", *V3, "--kv-channels", "128")
    assert _terms(out) == _terms(plain) and out["parameters"] == plain["parameters"]
    assert any("--kv-channels 128 is not read by multi-latent attention" in note for note in out["assumptions"])
