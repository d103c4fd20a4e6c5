"""q and k normalised per head (Megatron's --qk-layernorm; Qwen3's q_norm and k_norm), as
Megatron-Core runs it with Transformer Engine: TENorm after the QKV split, before rope. TE's
op-based norm saves its input made contiguous and fp32 statistics a row (ops/basic/rmsnorm.py,
op_forward): a copy of q (its reshape out of the QKV output's groups) and of k (a strided view
of it), a·d and g·d wide. Bytes derived by hand below."""

from pathlib import Path

import pytest

from tests.conftest import assert_one_line_error
from tests.test_llama import HF

# Qwen3 8B (presets/qwen3-8b.toml): s = 4096, b = 1, h = 4096, a = 32, g = 8, d = 128,
# f = 12288, t = 8 with SP, flash, fused rope, RMSNorm, no biases, no dropout.
SBH_T = 4096 * 4096 // 8                          # 2,097,152 elements: one (s/t, b, h) shard
QK_NORM_INPUT = 2 * 4096 * (32 + 8) * 128 // 8    # 2sb·(a + g)d/t = 5,242,880
QK_NORM_STATISTICS = 4 * 4096 * (32 + 8) // 8     # fp32 rsigma a head a token: 81,920
QWEN3_8B_LAYER = {
    "attention_layernorm_input": 2 * SBH_T,       # 4,194,304
    "attention_norm_statistics": 4 * 4096 // 8,   # 2,048
    "qkv_input": 2 * SBH_T,
    "qk_norm_input": QK_NORM_INPUT,
    "qk_norm_statistics": QK_NORM_STATISTICS,
    "query": 2 * 4096 * 32 * 128 // 8,            # after rope: 4,194,304
    "key": 2 * 4096 * 8 * 128 // 8,               # after rope: 1,048,576
    "value": 2 * 4096 * 8 * 128 // 8,             # TE's copy: 1,048,576
    "softmax_lse": 4 * 32 * 4096 // 8,            # 65,536
    "projection_input": 2 * 4096 * 32 * 128 // 8,
    "mlp_layernorm_input": 2 * SBH_T,
    "mlp_norm_statistics": 4 * 4096 // 8,
    "fc1_input": 2 * SBH_T,
    "swiglu_input": 2 * 2 * 4096 * 12288 // 8,    # 25,165,824
    "fc2_input": 2 * 4096 * 12288 // 8,           # 12,582,912
}
RUN = ("--tp", "8", "--sp", "--micro-batch", "1")


def _per_layer(out) -> dict:
    return {row["term"]: row["bytes_each"] for row in out["run_terms"] if row["scope"] == "layer"}


def test_qwen3_8b_keeps_a_copy_of_q_and_k_and_their_statistics(actmem):
    out = actmem.json("estimate", "--model", "qwen3-8b", *RUN)
    assert _per_layer(out) == QWEN3_8B_LAYER
    assert sum(QWEN3_8B_LAYER.values()) == 70_406_144          # the QK norms: 7.6% of it
    assert {row["region"] for row in out["run_terms"] if row["term"].startswith("qk_norm")} == {"block"}
    assert "QK norm" in actmem("estimate", "--model", "qwen3-8b", *RUN).output


def test_qwen3_config_json_gives_the_preset_numbers(actmem):
    """The published config.json (max_position_embeddings 40,960) at the preset's s = 4096."""
    config = actmem.json("estimate", "--model", f"{HF}/qwen3/config.json", "--seq-len", "4096", *RUN)
    assert _per_layer(config) == QWEN3_8B_LAYER
    assert config["architecture"]["qk_norm"] is True


def test_qwen3_8b_parameters_match_its_published_non_embedding_count():
    """A layer: QKV 4096·(4096 + 2·1024) = 25,165,824, projection 16,777,216, SwiGLU's
    2·4096·12288 + 12288·4096 = 150,994,944, two norms 8,192, the q and k norms 2·128 = 256:
    192,946,432. 36 layers and the final norm: 6,946,075,648, the 6.95B non-embedding
    parameters the Qwen3-8B model card gives."""
    from actmem.memory.parameters import layer_parameters
    from actmem.sources.presets import load_preset
    from actmem.model.spec import build_spec

    spec = build_spec(load_preset("qwen3-8b").model, {}, architecture=load_preset("qwen3-8b").architecture)
    arch = spec.architecture
    assert layer_parameters(4096, 1, arch, 32) == 192_946_432
    assert 36 * layer_parameters(4096, 1, arch, 32) + 4096 == 6_946_075_648
    # t = 8: the linears' 192,937,984 split, the norms' 8,192 + 256 whole on every rank (each
    # normalises its own heads with the same q and k norms): 24,117,248 + 8,448
    assert layer_parameters(4096, 8, arch, 32) == 24_125_696


def test_layernorm_keeps_two_statistics_and_a_bias(actmem):
    """--normalization LayerNorm: mu and rsigma a head a token (8sb·(a + g)/t), and each norm a
    weight and a bias (2 x 2d parameters)."""
    rms = actmem.json("estimate", "--model", "qwen3-8b", *RUN)
    ln = actmem.json("estimate", "--model", "qwen3-8b", "--normalization", "layernorm", *RUN)
    assert _per_layer(ln)["qk_norm_statistics"] == 2 * QK_NORM_STATISTICS
    assert _per_layer(ln)["qk_norm_input"] == QK_NORM_INPUT
    # 36 layers: the hidden norms' biases 2·4096 and the q and k norms' 2·128, and the final
    # norm's 4096, replicated over t
    assert ln["parameters"]["count"] - rms["parameters"]["count"] == 36 * (2 * 4096 + 2 * 128) + 4096


def test_context_parallelism_halves_and_full_recompute_drops_them(actmem):
    cp = actmem.json("estimate", "--model", "qwen3-8b", *RUN, "--cp", "2")
    assert _per_layer(cp)["qk_norm_input"] == QK_NORM_INPUT // 2
    assert _per_layer(cp)["qk_norm_statistics"] == QK_NORM_STATISTICS // 2
    full = actmem.json("estimate", "--model", "qwen3-8b", *RUN, "--recompute", "full")
    assert not {"qk_norm_input", "qk_norm_statistics"} & set(_per_layer(full))
    mlp = actmem.json("estimate", "--model", "qwen3-8b", *RUN, "--recompute", "selective",
                      "--recompute-modules", "mlp")
    assert _per_layer(mlp)["qk_norm_input"] == QK_NORM_INPUT      # outside the MLP's checkpoint


def test_the_megatron_switch_the_flag_and_the_preset_agree(actmem):
    from tests.test_llama import LLAMA_8B

    pasted = actmem.json("estimate", "--megatron-args", LLAMA_8B + " --qk-layernorm")
    flagged = actmem.json("estimate", "--megatron-args", LLAMA_8B, "--qk-norm")
    assert pasted["run_terms"] == flagged["run_terms"]
    # Llama 3 8B's s = 8192, d = 128: 2·8192·(32 + 8)·128/8 = 10,485,760
    assert _per_layer(pasted)["qk_norm_input"] == 10_485_760
    assert "qk_norm_input" not in _per_layer(actmem.json("estimate", "--model", "qwen3-8b", *RUN, "--no-qk-norm"))
    assert_one_line_error(actmem("estimate", "--megatron-args", LLAMA_8B + " --qk-layernorm", "--no-qk-norm"),
                          "disagree: two values of one setting (qk norm)")


@pytest.mark.parametrize("args, fragment", [
    (("--model", "22b", "--qk-norm"), "--qk-layernorm is modelled under the flash attention core only"),
    (("--model", "qwen3-8b", "--implementation", "torch-native"), "which has no q and k norms"),
    (("--model", "22b", "--implementation", "hf", "--qk-norm", "--attention-dropout", "0"),
     "GPT2LMHeadModel, for transformers' GPT2Attention, which has no q and k norms"),
    (("--model", "qwen3-8b", "--implementation", "hf", "--disable-bias-linear", "--add-qkv-bias"),
     "Qwen3ForCausalLM, for transformers' Qwen3 layer, whose attention_bias puts biases on q, k, v and o alike"),
])
def test_qk_norms_where_they_are_not_modelled_are_refused(actmem, args, fragment):
    assert_one_line_error(actmem("estimate", *args), fragment)


def test_a_qwen3_config_with_attention_biases_is_refused(actmem, tmp_path):
    """Qwen3's attention_bias puts biases on q, k, v and o, never on its MLP: not expressible."""
    import json

    config = json.loads(Path(HF, "qwen3", "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"attention_bias": True}))
    assert_one_line_error(actmem("estimate", "--model", str(tmp_path / "config.json")),
                          "attention_bias and mlp_bias differ (qwen3's attention_bias is on q, k, v and o)")


def test_the_planner_counts_the_qk_norms():
    """Qwen3 8B on 64 H100s: the same sweep without the QK norms holds less on every row (that
    each row is the estimate's: tests/test_stage_model.py)."""
    from dataclasses import replace

    from actmem.model.hardware import GPUS
    from actmem.planner.plan import PlanRequest, plan
    from actmem.sources.presets import load_preset
    from actmem.model.spec import build_spec

    preset = load_preset("qwen3-8b")
    spec = build_spec(preset.model, {}, architecture=preset.architecture)
    req = PlanRequest(model=spec.model, gpus=64, global_batch=64, gpu=GPUS["h100"], gpu_memory_bytes=80 * 2**30,
                      architecture=spec.architecture)
    evaluated = plan(req).evaluated
    without = plan(replace(req, architecture=replace(spec.architecture, qk_norm=False))).evaluated
    key = ["t", "c", "p", "m", "b", "sequence_parallel", "recompute", "distributed_optimizer"]
    swept = evaluated[evaluated.recompute != "full:block"]      # block=N: N is chosen for the budget
    both = swept.merge(without, on=key, suffixes=("", "_without"))
    assert len(both) == len(swept)
    assert (both.parameters > both.parameters_without).all()
    stored = both[both.recompute != "full"]
    assert (stored.activations_bytes > stored.activations_bytes_without).all()


def test_transformers_qwen3_keeps_an_fp32_copy_and_a_normalized_tensor(actmem):
    """Qwen3ForCausalLM under hf (one device, s = 4096, b = 1): Qwen3RMSNorm on q and k, written
    as LlamaRMSNorm is, keeps an fp32 copy of its input, 4sb·(a + g)d = 4·4096·40·128 =
    83,886,080 B, its 16-bit normalized tensor, half that, and the fp32 rsqrt, 4sb·(a + g) =
    655,360 B; not q_proj's and k_proj's outputs (tests/validate/test_hf.py measures it)."""
    out = actmem.json("estimate", "--model", "qwen3-8b", "--implementation", "hf", "--micro-batch", "1")
    layer = _per_layer(out)
    assert (layer["qk_norm_input_fp32"], layer["qk_norm_normalized"], layer["qk_norm_statistics"]) == \
        (83_886_080, 41_943_040, 655_360)
    assert "qk_norm_input" not in layer
    config = actmem.json("estimate", "--model", f"{HF}/qwen3/config.json", "--seq-len", "4096",
                         "--implementation", "hf", "--micro-batch", "1")
    assert _per_layer(config) == layer


def test_qwen3_config_defaults_are_transformers_own(actmem, tmp_path):
    """Qwen3Config's head_dim defaults to 128, not h/a (configuration_qwen3.py): Qwen3 32B's dims
    (h 5120, a 64, g 8) without it keep q 2sb·64·128/t wide, not 2sb·5120/t. Qwen3MLP has no
    biases whatever mlp_bias says, so attention_bias alone is still refused."""
    import json

    config = json.loads(Path(HF, "qwen3", "config.json").read_text())
    del config["head_dim"]
    config |= {"hidden_size": 5120, "num_attention_heads": 64, "num_key_value_heads": 8}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = actmem.json("estimate", "--model", str(tmp_path / "config.json"), "--seq-len", "4096", *RUN)
    assert out["architecture"]["head_dim"] == 128
    assert _per_layer(out)["query"] == 2 * 4096 * 64 * 128 // 8          # 8,388,608, not 5,242,880
    (tmp_path / "config.json").write_text(json.dumps(config | {"attention_bias": True, "mlp_bias": True}))
    assert_one_line_error(actmem("estimate", "--model", str(tmp_path / "config.json")),
                          "attention_bias and mlp_bias differ")
