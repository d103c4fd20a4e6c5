"""Selective recompute of the attention core under flash, as Megatron-Core runs it.

attention.py, _checkpointed_attention_forward: tensor_parallel.checkpoint(custom_forward, False,
query, key, value, ...) around TE's core attention. CheckpointFunction saves its inputs: q and k
after rope (tensors of their own) and v, a view of the QKV linear's output (SplitAlongDim), which
keeps that whole output. TE's contiguous copy of v, the log-sum-exp and flash-attn's output copy
are made under no_grad and again in the backward. The numbers below are derived by hand.
"""

from actmem.memory import engine
from actmem.memory.techniques import BY_NAME
from tests.conftest import assert_one_line_error
from tests.test_llama import LLAMA_8B, LLAMA_8B_LAYER

# Llama 3.1 8B, s = 8192, b = 1, a = 32, g = 8, d = 128, t = 8, SP on
QKV_OUTPUT = 2 * 8192 * (32 + 2 * 8) * 128 // 8         # 2sb·(a + 2g)d/t = 12,582,912
VALUE_COPY = 2 * 8192 * 8 * 128 // 8                     # TE's copy of v, 2sb·gd/t = 2,097,152
LSE = 4 * 32 * 8192 // 8                                 # fp32 log-sum-exp, 4b·as/t = 131,072
# none keeps 142,745,600 B a layer (tests/test_llama.py); selective trades v's copy and the
# log-sum-exp for the QKV output: 142,745,600 - 2,097,152 - 131,072 + 12,582,912
SELECTIVE_LAYER = 153_100_288


def _layer(out, technique="tp-sp-sel"):
    return next(row["per_layer_bytes"] for row in out["techniques"] if row["technique"] == technique)


def _run_layer_terms(out):
    return {row["term"]: row["bytes_each"] for row in out["run_terms"] if row["scope"] == "layer"}


def test_llama_3_8b_pasted_with_recompute_activations_keeps_the_qkv_output(actmem):
    out = actmem.json("estimate", "--megatron-args", LLAMA_8B + " --recompute-activations")
    terms = _run_layer_terms(out)
    expected = {name: size for name, size in LLAMA_8B_LAYER.items() if name not in ("value", "softmax_lse")}
    assert terms == expected | {"qkv_output": QKV_OUTPUT}
    assert sum(terms.values()) == _layer(out) == SELECTIVE_LAYER
    assert SELECTIVE_LAYER - _layer(out, "tp-sp") == 10_354_688       # 2sb·(a + g)d/t - 4b·as/t: more kept
    assert any("keeps 2sb·(a + g)d/t more" in note for note in out["assumptions"])


def test_the_granularity_flag_and_the_config_json_agree(actmem):
    """The paste has Megatron's dataloader mask (no --no-create-attention-mask-in-dataloader);
    the config, a model alone, says so with --attention-mask."""
    pasted = actmem.json("estimate", "--megatron-args", LLAMA_8B + " --recompute-granularity selective")
    config = actmem.json("estimate", "--model", "tests/data/hf/llama-3.1-8b/config.json", "--seq-len", "8192",
                         "--tp", "8", "--sp", "--micro-batch", "1", "--recompute", "selective", "--attention-mask")
    assert _layer(pasted) == _layer(config) == SELECTIVE_LAYER
    assert config["run_terms"] == pasted["run_terms"]


def test_flash_attn_at_b_2_drops_its_output_copy_too(actmem):
    """--use-flash-attn at b = 2: no recompute keeps flash-attn's own output beside the
    projection's copy, 2sb·ad/t = 2·8192·2·4096/8 = 16,777,216 B, on top of twice b = 1's
    142,745,600; the checkpoint drops it with v's copy and the log-sum-exp and keeps the QKV
    output: twice b = 1's selective layer, 306,200,576, only 3,932,160 B above none."""
    out = actmem.json("estimate", "--megatron-args",
                      LLAMA_8B.replace("--micro-batch-size 1", "--micro-batch-size 2") + " --recompute-activations")
    assert _layer(out, "tp-sp") == 2 * 142_745_600 + 16_777_216 == 302_268_416
    assert _layer(out) == 2 * SELECTIVE_LAYER == 306_200_576
    assert "flash_output" not in _run_layer_terms(out)


def test_the_rerun_makes_what_the_checkpoint_dropped():
    """The peak's rerun moment: the last layer's core rerun makes v's copy, the log-sum-exp and
    its output again (the projection freed the first output before), 2,097,152 + 131,072 +
    2sb·ad/t = 8,388,608: 10,616,832 B."""
    from actmem.sources.presets import load_preset
    from actmem.model.spec import build_spec

    preset = load_preset("llama-3.1-8b")
    spec = build_spec(preset.model, {"tensor_parallel": 8, "sequence_parallel": True, "micro_batch": 1},
                      architecture=preset.architecture)
    rerun = engine.rematerialised_bytes(BY_NAME["tp-sp-sel"], spec.architecture, module="core_attn")
    assert engine.exact(rerun, spec.bindings()) == VALUE_COPY + LSE + 8_388_608 == 10_616_832


def test_q_and_k_norms_without_rope_make_the_checkpoint_s_q_and_k(actmem):
    """Learned positions with --qk-layernorm: the norms' outputs are q and k, tensors of their
    own; 22B's dims (h 6144, a 64, s 2048, d 96) at t = 8 with SP, b = 1: the QKV output is
    2sb·3h/t = 2·2048·18432/8 = 9,437,184 B a layer, v's copy 2sbh/t = 3,145,728, the
    log-sum-exp 4b·as/t = 65,536. The norms run before the checkpoint, so their inputs stay:
    2sb·(a + a)d/t = 2·2048·128·96/8 = 6,291,456."""
    args = ("--model", "22b", "--tp", "8", "--sp", "--micro-batch", "1", "--attention-core", "flash",
            "--attention-dropout", "0", "--qk-norm")
    none, sel = (actmem.json("estimate", *args, "--recompute", mode) for mode in ("none", "selective"))
    terms = _run_layer_terms(sel)
    assert (terms["qkv_output"], terms["qk_norm_input"]) == (9_437_184, 6_291_456)
    assert "value" not in terms and "value" in _run_layer_terms(none)
    assert _layer(sel) - _layer(sel, "tp-sp") == 9_437_184 - 3_145_728 - 65_536


def test_without_rope_or_qk_norms_it_is_refused(actmem):
    """q and k would be views (or the reshape's copy) of the QKV output: not counted yet."""
    assert_one_line_error(
        actmem("estimate", "--model", "22b", "--attention-core", "flash", "--attention-dropout", "0",
               "--recompute", "selective"),
        "(Megatron's core_attn) under flash attention is modelled with rotary positions or q and k norms")
    out = actmem.json("estimate", "--model", "22b", "--attention-core", "flash", "--attention-dropout", "0",
                      "--recompute", "none")
    assert "tp-sp-sel" not in {row["technique"] for row in out["techniques"]}
