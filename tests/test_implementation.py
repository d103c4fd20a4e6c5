"""The implementation axis: the same Llama layer under Megatron's code and under PyTorch-native
DTensor tensor + sequence parallelism (torchtitan's plan). The torch-native bytes are derived
by hand below from torchtitan's Llama 3 block (actmem/terms.py and actmem/implementation.py
cite the lines); the harness measures them (tests/validate/test_torch_native.py)."""

import pytest

from actmem.architecture import Architecture
from actmem.spec import Model, Run, Spec
from actmem.terms import Recompute
from tests.conftest import assert_one_line_error
from tests.test_llama import LLAMA_8B_LAYER, SBH_T

TORCH_NATIVE = ("--model", "llama-3.1-8b", "--implementation", "torch-native", "--tp", "8", "--sp")

# Llama 3.1 8B at t = 8 with SP, s = 8192, b = 1: what torchtitan's block keeps.
F_T = 2 * 8192 * 14336 // 8                  # one 16-bit (s, b, f/t) tensor: 29,360,128 B
TORCH_NATIVE_LAYER = {
    "attention_layernorm_input": 2 * SBH_T,  # nn.RMSNorm under SequenceParallel: its shard
    "norm_statistics": 2 * 4 * 8192 // 8,    # two fused RMSNorms' fp32 rstd of their shard
    "qkv_input": 2 * 8192 * 4096,            # PrepareModuleInput all-gathers: 2sbh, not 2sbh/t
    "query": 2 * 8192 * 32 * 128 // 8,       # after rope (type_as: a copy), 2sb·ad/t
    "repeated_key_value": 2 * 2 * 8192 * 8 * 128 // 8,    # t = g: repeat_kv is a view, g wide
    "softmax_lse": 4 * 32 * 8192 // 8,
    "projection_input": 2 * 8192 * 32 * 128 // 8,
    "mlp_layernorm_input": 2 * SBH_T,
    "fc1_input": 2 * 8192 * 4096,            # gathered again before w1 and w3
    "swiglu_input": 2 * F_T,                 # w1 x and w3 x
    "silu_output": F_T,                      # silu(w1 x), the product's first factor
    "fc2_input": F_T,                        # the product, w2's input
}


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
    assert megatron["key_value"] == 8_388_608 and "repeated_key_value" not in megatron


def test_full_recompute_keeps_the_block_input_shard(actmem):
    """torchtitan's full activation checkpointing wraps each block: it keeps the block's input,
    the local (s/t, b, h) shard the previous RowwiseParallel reduce-scattered."""
    out = actmem.json("estimate", *TORCH_NATIVE, "--recompute", "full")
    assert _per_layer(out) == {"layer_input_checkpoint": 2 * SBH_T}


def test_without_sequence_parallelism_nothing_is_gathered_or_split(actmem):
    """Plain DTensor TP (norms replicated): the boundary tensors are 2sbh under both codes."""
    out = actmem.json("estimate", "--model", "llama-3.1-8b", "--implementation", "torch-native", "--tp", "8")
    layer = _per_layer(out)
    assert layer["qkv_input"] == layer["attention_layernorm_input"] == 2 * 8192 * 4096


def test_the_vocabulary_is_not_padded_under_dtensor():
    """Megatron pads v to a multiple of 128·t; DTensor shards it unevenly, rank 0 holding
    ceil(v/t) rows: 50,257 at t = 8 is 6,283 rows on rank 0, as if v were 50,264."""
    model = Model(heads=32, hidden=4096, layers=2, vocab=50257, seq_len=1024)
    run = Run(tensor_parallel=8, sequence_parallel=True)
    llama = dict(attention_core="flash", activation="swiglu", normalization="rmsnorm", attention_dropout=0,
                 hidden_dropout=0)
    assert Spec(model, run, architecture=Architecture(**llama)).padded_vocab == 51200
    assert Spec(model, run, architecture=Architecture(**llama, implementation="torch-native")).padded_vocab == 50264


@pytest.mark.parametrize("args, fragment", [
    (("--model", "22b", "--implementation", "torch-native"), "attention_core must be flash, got eager"),
    (("--model", "llama-3.1-8b", "--implementation", "torch-native", "--swiglu", "--activation", "gelu"),
     "disagree"),
    (TORCH_NATIVE + ("--cp", "2"), "context parallelism (c = 2) is not modelled for --implementation torch-native"),
    (TORCH_NATIVE + ("--recompute", "selective"), "torchtitan's selective activation checkpointing"),
    (TORCH_NATIVE + ("--recompute", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"),
     "partial full recompute"),
    (TORCH_NATIVE + ("--make-vocab-size-divisible-by", "64"), "pads none"),
    (("--model", "llama-3.1-8b", "--implementation", "dtensor"), "'dtensor' is not one of"),
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
    assert out["best"] and all(row["c"] == 1 and row["recompute"] != "selective" for row in out["best"])
    assert_one_line_error(actmem("plan", "--model", "llama-3.1-8b", "--implementation", "torch-native",
                                 "--gpus", "64", "--global-batch", "256", "--make-vocab-size-divisible-by", "64"),
                          "pads none")


def test_the_output_names_the_code(actmem):
    result = actmem("estimate", *TORCH_NATIVE)
    assert result.exit_code == 0 and "torchtitan" in result.stdout
    assert "Megatron-Core with Transformer Engine" in actmem("estimate", "--model", "22b").stdout
    assert Architecture().implementation == "megatron" and Run().recompute is Recompute.NONE
