"""The implementation axis: the same Llama layer under Megatron's code and under PyTorch-native
DTensor tensor + sequence parallelism (torchtitan's plan). The torch-native bytes are derived
by hand below from torchtitan's Llama 3 block (actmem/memory/terms.py and actmem/model/implementation.py
cite the lines); the harness measures them (tests/validate/test_torch_native.py)."""

import pytest

from actmem.model.architecture import Architecture
from actmem.model.spec import Model, Run, Spec
from tests.conftest import assert_one_line_error
from tests.test_llama import LLAMA_8B_LAYER, SBH_T

TORCH_NATIVE = ("--model", "llama-3.1-8b", "--implementation", "torch-native", "--tp", "8", "--sp")

# Llama 3.1 8B at t = 8 with SP, s = 8192, b = 1: what torchtitan's block keeps.
F_T = 2 * 8192 * 14336 // 8                  # one 16-bit (s, b, f/t) tensor: 29,360,128 B
TORCH_NATIVE_LAYER = {
    "attention_layernorm_input": 2 * SBH_T,  # nn.RMSNorm under SequenceParallel: its shard
    "attention_norm_statistics": 4 * 8192 // 8,   # a fused RMSNorm's fp32 rstd of its shard
    "qkv_input": 2 * 8192 * 4096,            # PrepareModuleInput all-gathers: 2sbh, not 2sbh/t
    "query": 2 * 8192 * 32 * 128 // 8,       # after rope (type_as: a copy), 2sb·ad/t
    "repeated_key_value": 2 * 2 * 8192 * 8 * 128 // 8,    # t = g: repeat_kv is a view, g wide
    "softmax_lse": 4 * 32 * 8192 // 8,
    "projection_input": 2 * 8192 * 32 * 128 // 8,
    "mlp_layernorm_input": 2 * SBH_T,
    "mlp_norm_statistics": 4 * 8192 // 8,
    "fc1_input": 2 * 8192 * 4096,            # gathered again before w1 and w3
    "swiglu_input": 2 * F_T,                 # w1 x and w3 x
    "silu_output": F_T,                      # silu(w1 x), the product's first factor
    "fc2_input": F_T,                        # the product, w2's input
}


def test_torchtitan_swiglu_backward_by_hand(actmem):
    """t = 8 with SP, full recompute, v = 1,024 (the loss holds little): the last block's SwiGLU backward decides.
    Every block's checkpoint, 32 x 2sbh/t; the rerun block (TORCH_NATIVE_LAYER's rows) less its input (its norm
    keeps it: the checkpoint's own storage) and the product (w2's saved input, freed); w2's input gradient and
    mul's two (3 x 2sbf/t) beside the residual stream's shard (2sbh/t)."""
    peak = actmem.json("estimate", *TORCH_NATIVE, "--recompute", "full", "--vocab", "1024")["peak_floor"]
    assert peak["moment"] == "the last layer's SwiGLU backward"
    rows = {row["name"]: row["bytes"] for row in peak["rows"]}
    assert rows["activations_in_flight"] == 32 * 2 * SBH_T == 268_435_456
    assert rows["rematerialised"] == sum(TORCH_NATIVE_LAYER.values()) - 2 * SBH_T - F_T == 251_797_504
    assert rows["swiglu_backward"] == 3 * F_T + 2 * SBH_T == 96_468_992


def _per_layer(out) -> dict:
    return {row["term"]: row["bytes_each"] for row in out["run_terms"] if row["scope"] == "layer"}


def test_torchtitan_llama_8b_layer_by_hand(actmem):
    out = actmem.json("estimate", *TORCH_NATIVE)
    assert _per_layer(out) == TORCH_NATIVE_LAYER
    # 4 x 8,388,608 + 8,192 + 2 x 67,108,864 + 4,194,304 + 131,072 + 2 x 29,360,128 + 2 x 29,360,128
    assert sum(TORCH_NATIVE_LAYER.values()) == 289_546_240
    # against Megatron's 142,745,600: the two gathered inputs (2 x 7/8 of 2sbh) and silu's output
    extra = 2 * (2 * 8192 * 4096 - 2 * SBH_T) + F_T
    assert sum(TORCH_NATIVE_LAYER.values()) - sum(LLAMA_8B_LAYER.values()) == extra


def test_repeat_kv_copies_where_a_rank_holds_several_groups(actmem):
    """At t = 4 each rank holds g/t = 2 groups: repeat_kv's reshape copies k and v to a/t = 8
    heads, 2 x 2sb·(a/t)·d = 2 x 2·8192·8·128 = 33,554,432 B, where Megatron keeps the g/t
    groups, 2 x 2·8192·2·128 = 8,388,608 B."""
    layer = _per_layer(actmem.json("estimate", "--model", "llama-3.1-8b", "--implementation", "torch-native",
                                   "--tp", "4", "--sp"))
    assert layer["repeated_key_value"] == 33_554_432
    megatron = _per_layer(actmem.json("estimate", "--model", "llama-3.1-8b", "--tp", "4", "--sp"))
    assert megatron["key"] + megatron["value"] == 8_388_608 and "repeated_key_value" not in megatron


def test_full_recompute_keeps_the_block_input_shard(actmem):
    """torchtitan's full activation checkpointing wraps each block: it keeps the block's input,
    the local (s/t, b, h) shard the previous RowwiseParallel reduce-scattered."""
    out = actmem.json("estimate", *TORCH_NATIVE, "--recompute", "full")
    assert _per_layer(out) == {"layer_input_checkpoint": 2 * SBH_T}


def test_without_sequence_parallelism_nothing_is_gathered_or_split(actmem):
    """Plain DTensor TP (norms replicated; --no-sp, since torch-native turns SP on at t > 1 by default): the
    boundary tensors are 2sbh under both codes."""
    out = actmem.json("estimate", "--model", "llama-3.1-8b", "--implementation", "torch-native", "--tp", "8",
                      "--no-sp")
    layer = _per_layer(out)
    assert layer["qkv_input"] == layer["attention_layernorm_input"] == 2 * 8192 * 4096


def test_the_vocabulary_is_not_padded_under_dtensor():
    """Megatron pads v to a multiple of 128·t; DTensor shards it unevenly, rank 0 holding
    ceil(v/t) rows: 50,257 at t = 8 is 6,283 rows on rank 0, as if v were 50,264."""
    model = Model(heads=32, hidden=4096, layers=2, vocab=50257, seq_len=1024)
    run = Run(tensor_parallel=8, sequence_parallel=True)
    llama = dict(attention_core="flash", activation="swiglu", normalization="rmsnorm", attention_dropout=0,
                 hidden_dropout=0, position_embedding="rope", bias=False, tied_output=False)
    assert Spec(model, run, architecture=Architecture(**llama)).padded_vocab == 51200
    assert Spec(model, run, architecture=Architecture(**llama, implementation="torch-native")).padded_vocab == 50264


@pytest.mark.parametrize("args, fragment", [
    (("--model", "22b", "--implementation", "torch-native"), "attention_core must be flash, got eager"),
    # every setting to change in the one refusal, not one a try: 22B's GeLU, LayerNorm and dropout too
    (("--model", "22b", "--implementation", "torch-native"),
     "also activation must be swiglu, got gelu (--activation); normalization must be rmsnorm, got layernorm"),
    (("--model", "llama-3.1-8b", "--implementation", "torch-native", "--swiglu", "--activation", "gelu"),
     "disagree"),
    (TORCH_NATIVE + ("--cp", "2"), "context parallelism (c = 2) is not modelled for --implementation torch-native"),
    (TORCH_NATIVE + ("--recompute", "selective"), "is not torchtitan's selective checkpointing, which actmem models given its option"),
    (TORCH_NATIVE + ("--recompute", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"),
     "partial full recompute"),
    (TORCH_NATIVE + ("--make-vocab-size-divisible-by", "64"), "pads none"),
    (("--model", "llama-3.1-8b", "--implementation", "dtensor"), "'dtensor' is not one of"),
    # torch.distributed.pipelining keeps each microbatch's stage output: not modelled
    (TORCH_NATIVE + ("--pp", "2"), "pipeline parallelism (p = 2) is not modelled"),
    # model state is counted as Megatron's; FSDP2 shards it otherwise
    (TORCH_NATIVE + ("--gpus", "64", "--distributed-optimizer"), "distributed optimizer is not modelled"),
])
def test_what_torch_native_does_not_model_is_refused(actmem, args, fragment):
    assert_one_line_error(actmem("estimate", *args), fragment)


def test_pasted_megatron_arguments_are_megatron(actmem):
    from tests.test_llama import LLAMA_8B

    assert_one_line_error(actmem("estimate", "--megatron-args", LLAMA_8B, "--implementation", "torch-native"),
                          "--megatron-args describes a Megatron-LM run")


def test_the_planner_sweeps_what_torch_native_models(actmem):
    out = actmem.json("plan", "--model", "llama-3.1-8b", "--implementation", "torch-native", "--gpus", "64",
                      "--global-batch", "256", "--top", "0")
    megatron = actmem.json("plan", "--model", "llama-3.1-8b", "--gpus", "64", "--global-batch", "256", "--top", "0")
    assert any(row["c"] > 1 for row in megatron["best"])        # Megatron's sweep has c = 2, 4, ...
    # no context parallelism, and of selective recompute torchtitan's per-op checkpointing alone, not Megatron's modules
    assert out["best"] and all(row["c"] == 1 and row["recompute"] in ("none", "full", "selective:op")
                               for row in out["best"])
    assert "selective:op" in {row["recompute"] for row in out["best"]}
    assert "selective:op" not in {row["recompute"] for row in megatron["best"]}
    assert_one_line_error(actmem("plan", "--model", "llama-3.1-8b", "--implementation", "torch-native",
                                 "--gpus", "64", "--global-batch", "256", "--make-vocab-size-divisible-by", "64"),
                          "pads none")


def test_the_output_names_the_code(actmem):
    result = actmem("estimate", *TORCH_NATIVE)
    assert result.exit_code == 0 and "torchtitan" in result.stdout
    assert "Megatron-Core with Transformer Engine" in actmem("estimate", "--model", "22b").stdout
    assert Architecture().implementation == "megatron"


# transformers' LlamaForCausalLM (5.23.0), Llama 3.1 8B at s = 2048, b = 1, one device. The
# closed forms were measured term by term on transformers' own code (tests/validate/test_hf.py):
#   eager: 16sbh + 8sb + 8sb·ad + 6as²b + 8sbf a layer (fp32 softmax 4as²b and its 16-bit
#          copy; q, k, v repeated to a heads; each RMSNorm an fp32 input copy 4sbh and a
#          16-bit normalized tensor 2sbh; the unfused SwiGLU four f-wide tensors)
#   sdpa:  16sbh + 8sb + 4sb·ad + 4sb·gd + 4as·b + 8sbf (k, v in their g groups: enable_gqa)
#   beside the layers: 8sbh + 4sb + 4sbv + 4sd (the final norm's fp32 copy, normalized tensor
#   and rstd, lm_head's input, the fp32 log-softmax, the rotary cos and sin)
S, H, A, D, G, F_ = 2048, 4096, 32, 128, 8, 14336
HF_EAGER_LAYER = 16 * S * H + 8 * S + 8 * S * A * D + 6 * A * S * S + 8 * S * F_
HF_SDPA_LAYER = 16 * S * H + 8 * S + 4 * S * A * D + 4 * S * G * D + 4 * A * S + 8 * S * F_
HF_STAGE = 8 * S * H + 4 * S + 4 * S * 128256 + 4 * S * D


@pytest.mark.parametrize("core, layer", [("eager", HF_EAGER_LAYER), ("flash", HF_SDPA_LAYER)])
def test_transformers_llama_8b_by_hand(actmem, core, layer):
    out = actmem.json("estimate", "--model", "llama-3.1-8b", "--implementation", "hf", "--attention-core", core,
                      "--seq-len", "2048")
    run = next(row for row in out["techniques"] if row["technique"] == "none")
    assert run["per_layer_bytes"] == layer == {"eager": 1_241_530_368, "flash": 411_320_320}[core]
    stage = sum(row["bytes"] for row in out["run_terms"] if row["scope"] != "layer")
    assert stage == HF_STAGE
    assert out["activations_bytes"] == 32 * layer + HF_STAGE


@pytest.mark.parametrize("args, fragment", [
    (("--tp", "2"), "tensor parallelism (t = 2) is not modelled for --implementation hf"),
    (("--attention-core", "flash-attn"), "attention_core must be eager or flash"),
    (("--attention-dropout", "0.1"), "attention_dropout must be 0"),
    (("--head-dim", "512"), "enable_gqa only for a head dim of at most 256"),
    (("--make-vocab-size-divisible-by", "64"), "transformers keeps the config's vocabulary"),
])
def test_what_hf_does_not_model_is_refused(actmem, args, fragment):
    assert_one_line_error(actmem("estimate", "--model", "llama-3.1-8b", "--implementation", "hf", *args), fragment)


def test_compare_implementations_in_every_format(actmem):
    """Llama 3.1 8B at t = 8 with SP: Megatron's layer is 142,745,600 B (tests/test_llama.py),
    torch-native's 289,546,240 B (above); transformers runs on one device, so at t = 8 its two
    rows say why they are not modelled instead of showing a number."""
    args = ("estimate", "--model", "llama-3.1-8b", "--tp", "8", "--sp", "--compare-implementations")
    rows = {row["implementation"]: row for row in actmem.json(*args)["implementations"]}
    assert list(rows) == ["megatron", "torch-native", "hf · eager", "hf · sdpa"]
    assert rows["megatron"]["per_layer_bytes"] == sum(LLAMA_8B_LAYER.values())
    assert rows["torch-native"]["per_layer_bytes"] == sum(TORCH_NATIVE_LAYER.values())
    assert rows["hf · sdpa"]["per_layer_bytes"] is None
    assert "tensor parallelism (t = 8)" in rows["hf · sdpa"]["not_modelled"]
    csv = actmem(*args, "--format", "csv").stdout
    assert "implementations,,," in csv or ",implementations" in csv or "\nimplementations," in csv
    assert "289546240" in csv
    markdown = actmem(*args, "--format", "markdown").stdout
    assert "## The same model and run under each implementation" in markdown and "289546240" in markdown
    rich = actmem(*args).stdout
    assert "torch-native" in rich and "hf · sdpa:  tensor parallelism (t = 8)" in rich


def test_compare_implementations_on_one_device(actmem):
    """t = 1, s = 2048: every implementation is modelled; the run's own row comes first, and
    transformers' rows are the by-hand layers above."""
    out = actmem.json("estimate", "--model", "llama-3.1-8b", "--seq-len", "2048", "--implementation", "hf",
                      "--attention-core", "eager", "--compare-implementations")
    rows = out["implementations"]
    assert rows[0]["implementation"] == "hf · eager" and rows[0]["per_layer_bytes"] == HF_EAGER_LAYER
    assert {row["implementation"]: row["per_layer_bytes"] for row in rows}["hf · sdpa"] == HF_SDPA_LAYER
    megatron = next(row for row in rows if row["implementation"] == "megatron")
    assert megatron["per_layer_bytes"] < HF_SDPA_LAYER < HF_EAGER_LAYER


def test_a_pasted_megatron_run_keeps_its_dataloader_mask_to_itself(actmem):
    """A paste has Megatron's dataloader mask (actmem.memory.side_by_side): torchtitan and transformers
    build none, so their rows are the same model without it, not refusals. s = 2048, t = 1,
    full recompute: Megatron's first stage holds the mask, b·s² = 4,194,304 B."""
    from tests.test_llama import LLAMA_8B

    paste = (LLAMA_8B.replace("--seq-length 8192", "--seq-length 2048").replace("--tensor-model-parallel-size 8", "")
             .replace("--sequence-parallel", "").replace("--use-flash-attn", "--attention-backend fused")
             + " --recompute-granularity full")
    out = actmem.json("estimate", "--megatron-args", paste, "--compare-implementations")
    rows = {row["implementation"]: row for row in out["implementations"]}
    assert rows["torch-native"]["not_modelled"] is None
    assert "dataloader" not in (rows["hf · sdpa"]["not_modelled"] or "")
    masks = [row for row in out["run_terms"] if row["term"] == "attention_mask"]
    assert [(row["bytes_each"], row["count"]) for row in masks] == [(2048 * 2048, 1)]


def test_estimate_without_the_flag_has_no_implementations(actmem):
    assert "implementations" not in actmem.json("estimate", "--model", "llama-3.1-8b")


# Qwen2-7B's config.json (h = 3584, a = 28, d = 128, g = 4, f = 18944) under transformers' Qwen2ForCausalLM, sdpa,
# s = 4096, b = 1, per layer (as HF_SDPA_LAYER: q, k and v biases keep nothing more; measured in the small grid):
# 16sh + 8s + 4sad + 4sgd + 4as + 8sf
QWEN2_7B_LAYER = 16 * 4096 * 3584 + 8 * 4096 + 4 * 4096 * 28 * 128 + 4 * 4096 * 4 * 128 + 4 * 28 * 4096 \
    + 8 * 4096 * 18944


def test_hf_prices_qwen2_and_mistral_configs_and_refuses_what_it_has_not_measured(actmem, tmp_path):
    """Qwen2ForCausalLM (Llama's classes with q, k, v biases) and MistralForCausalLM without a sliding window
    (modular_mistral.py: LlamaForCausalLM's code, its attention handed sliding_window None) are priced; Mistral 7B
    v0.1's sliding window of 4,096 makes a mask sdpa keeps, and GPT-NeoX is a class the harness has not run:
    refused under hf."""
    out = actmem.json("estimate", "--model", "tests/data/hf/qwen2-7b/config.json", "--implementation", "hf",
                      "--seq-len", "4096")
    assert any("Qwen2ForCausalLM on one device" in note for note in out["assumptions"])
    assert next(row for row in out["techniques"] if row["technique"] == "none")["per_layer_bytes"] \
        == QWEN2_7B_LAYER == 923_238_400
    out = actmem.json("estimate", "--model", "tests/data/hf/mistral-7b-v0.3/config.json", "--implementation", "hf",
                      "--seq-len", "4096")
    assert any("priced and measured as LlamaForCausalLM" in note for note in out["assumptions"])
    assert_one_line_error(actmem("estimate", "--model", "tests/data/hf/mistral-7b/config.json", "--implementation",
                                 "hf"), "a sliding window: MistralModel then makes a sliding-window mask")
    import json

    pythia = json.loads(open("tests/data/hf/pythia/config.json").read()) | {"use_parallel_residual": False}
    (tmp_path / "config.json").write_text(json.dumps(pythia))
    assert_one_line_error(actmem("estimate", "--model", str(tmp_path / "config.json"), "--implementation", "hf"),
                          "gpt_neox is a class of its own in transformers")


def test_compare_implementations_shows_the_stage_shown(actmem):
    """--stage last: every row is the last stage's (the output layer's logits), as the run's."""
    args = ("estimate", "--model", "llama-3.1-8b", "--tp", "8", "--sp", "--pp", "2", "--stage", "last",
            "--compare-implementations")
    out = actmem.json(*args)
    megatron = next(row for row in out["implementations"] if row["implementation"] == "megatron")
    assert megatron["activations_bytes"] == out["activations_bytes"]


# GPT-2 small's config.json (h = 768, a = 12, s = 1024, f = 4h = 3072, dropout 0.1, b = 1) as
# transformers' GPT2LMHeadModel keeps it, eager, per layer, by hand (modeling_gpt2.py 5.23;
# measured term by term at small shapes and 22B's dims in tests/validate/test_hf.py):
SBH_GPT2 = 2 * 1024 * 768                    # one 16-bit (s, b, h) tensor: 1,572,864 B
SBF_GPT2 = 2 * 1024 * 3072                   # one 16-bit (s, b, f) tensor: 6,291,456 B
SOFTMAX_GPT2 = 2 * 12 * 1024 ** 2            # 2·a·s²·b: 25,165,824 B
GPT2_EAGER_LAYER = {
    "attention_layernorm_input": SBH_GPT2, "qkv_input": SBH_GPT2,
    "query_key": 2 * SBH_GPT2, "value": SBH_GPT2,           # q, k, v: views of c_attn's output at b = 1
    "softmax_output": SOFTMAX_GPT2, "softmax_dropout_mask": SOFTMAX_GPT2 // 2,   # a bool mask
    "softmax_dropout_output": SOFTMAX_GPT2, "projection_input": SBH_GPT2,
    "attention_dropout_mask": SBH_GPT2 // 2, "mlp_layernorm_input": SBH_GPT2, "fc1_input": SBH_GPT2,
    "gelu_input": SBF_GPT2, "gelu_tanh_intermediates": 3 * SBF_GPT2,   # tanh, 0.5x, 1 + tanh
    "fc2_input": SBF_GPT2, "mlp_dropout_mask": SBH_GPT2 // 2,
    "attention_norm_statistics": 2 * 4 * 1024,    # a LayerNorm's fp32 mean and rstd (on a GPU)
    "mlp_norm_statistics": 2 * 4 * 1024,
}
GPT2_CONFIG = "tests/data/hf/gpt2/config.json"


def test_gpt2_under_hf_by_hand(actmem):
    """Eager: the paper's layer, 34sbh + 5as²b = 26,738,688 + 62,914,560 = 89,653,248 B (Eq 1),
    plus gelu_new's three f-wide tensors (18,874,368 B) and the norms' statistics (16,384 B):
    108,544,000 B a layer."""
    out = actmem.json("estimate", "--model", GPT2_CONFIG, "--implementation", "hf", "--attention-core", "eager")
    layer = {row["term"]: row["bytes_each"] for row in out["run_terms"] if row["scope"] == "layer"}
    assert layer == GPT2_EAGER_LAYER
    assert sum(layer.values()) == 108_544_000
    assert "GPT2LMHeadModel" in actmem("estimate", "--model", GPT2_CONFIG, "--implementation", "hf",
                                       "--attention-core", "eager").stdout


def test_gpt2_sdpa_without_attention_dropout_by_hand(actmem):
    """sdpa with no attention dropout drops the three s² tensors (62,914,560 B) and keeps the
    fp32 log-sum-exp, 4·a·s = 49,152 B; q and k, v are the same 6sbh: 45,678,592 B a layer."""
    out = actmem.json("estimate", "--model", GPT2_CONFIG, "--implementation", "hf", "--attention-core", "flash",
                      "--attention-dropout", "0")
    layer = {row["term"]: row["bytes_each"] for row in out["run_terms"] if row["scope"] == "layer"}
    assert layer["softmax_lse"] == 49_152 and layer["query"] + layer["key"] + layer["value"] == 3 * SBH_GPT2   # 6sbh: three 2sbh
    assert sum(layer.values()) == 45_678_592


@pytest.mark.parametrize("args, fragment", [
    (("--model", GPT2_CONFIG, "--implementation", "hf", "--attention-core", "flash"),
     "a CPU's SDPA falls back to its math kernel"),
    (("--model", "22b", "--tp", "1", "--no-sp", "--implementation", "hf", "--normalization", "rmsnorm"),
     "the closest: GPT2LMHeadModel, for transformers' GPT2Block (nn.LayerNorm): normalization "
     "must be layernorm"),
    (("--model", "22b", "--tp", "1", "--no-sp", "--implementation", "hf", "--num-query-groups", "8"),
     "query_groups must be unset, got 8 (--query-groups)"),
])
def test_what_hf_gpt2_does_not_model_is_refused(actmem, args, fragment):
    assert_one_line_error(actmem("estimate", *args), fragment)


def test_gpt2_with_another_gelu_is_refused_under_hf(actmem, tmp_path):
    """F.gelu keeps its input only, gelu_new (Python) three more tensors: under hf the config's
    activation_function decides, and only gelu_new, GPT-2's own, is measured."""
    import json
    from pathlib import Path

    config = json.loads(Path(GPT2_CONFIG).read_text()) | {"activation_function": "gelu_pytorch_tanh"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert_one_line_error(actmem("estimate", "--model", str(path), "--implementation", "hf"),
                          "its activation_function is gelu_pytorch_tanh, and only gelu_new")
    assert actmem("estimate", "--model", str(path)).exit_code == 0      # Megatron's GeLU: the same tensors


def test_gpt2_reordered_upcast_attention_is_refused_under_hf(actmem, tmp_path):
    """reorder_and_upcast_attn makes GPT2Attention keep fp32 q, k and softmax: not measured."""
    import json
    from pathlib import Path

    config = json.loads(Path(GPT2_CONFIG).read_text()) | {"reorder_and_upcast_attn": True}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert_one_line_error(actmem("estimate", "--model", str(path), "--implementation", "hf",
                                 "--attention-core", "eager"), "reorder_and_upcast_attn")


def test_the_technique_caption_speaks_of_the_code_it_prices(actmem):
    """Under hf (one device, autograd's weight gradients) the caption names no tensor parallelism at a row's t and
    no Transformer Engine caches; under Megatron it does."""
    hf = " ".join(actmem("estimate", "--model", "llama-3.1-8b", "--implementation", "hf").output.split())
    assert "--implementation hf runs a whole model a GPU" in hf
    assert "TE's dummy weight gradients" not in hf and "at the row's t" not in hf
    megatron = " ".join(actmem("estimate", "--model", "llama-3.1-8b", "--tp", "8", "--sp").output.split())
    assert "TE's dummy weight gradients at the row's t" in megatron
