"""Megatron's unfused rope (--no-rope-fusion, rope_utils.py): the 16-bit cos and sin it makes
at each call are kept, for q and for k, whole on every rank. Bytes derived by hand below."""

import pytest

from tests.conftest import assert_one_line_error
from tests.test_llama import LLAMA_8B, LLAMA_8B_LAYER

# Llama 3 8B: s = 8192, d = 128. cos_ and sin_ are (s, 1, 1, d) 16-bit, made for q and again
# for k: 4 x 2·8192·128 = 8,388,608 B a layer, not divided by t (the attention sees the whole
# sequence on every rank, SP or not).
ROPE_COS_SIN = 4 * 2 * 8192 * 128


def _per_layer(out) -> dict:
    return {row["term"]: row["bytes_each"] for row in out["run_terms"] if row["scope"] == "layer"}


def test_unfused_rope_keeps_cos_and_sin_on_every_rank(actmem):
    out = actmem.json("estimate", "--megatron-args", LLAMA_8B + " --no-rope-fusion")
    assert _per_layer(out) == LLAMA_8B_LAYER | {"rope_cos_sin": ROPE_COS_SIN}
    assert sum(_per_layer(out).values()) == 142_745_600 + 8_388_608
    row = next(row for row in out["run_terms"] if row["term"] == "rope_cos_sin")
    assert row["region"] == "replicated"
    assert "rope (unfused)" in actmem("estimate", "--megatron-args", LLAMA_8B + " --no-rope-fusion").output


def test_under_context_parallelism_each_rank_makes_its_own_positions(actmem):
    """c = 2: each rank rotates s/c = 4,096 positions: 4 x 2·4096·128 = 4,194,304 B."""
    args = (LLAMA_8B.replace("--use-flash-attn", "--attention-backend fused")
            + " --no-rope-fusion --context-parallel-size 2 --no-create-attention-mask-in-dataloader")
    assert _per_layer(actmem.json("estimate", "--megatron-args", args))["rope_cos_sin"] == 4 * 2 * 4096 * 128


def test_the_flag_and_the_paste_agree(actmem):
    pasted = actmem.json("estimate", "--megatron-args", LLAMA_8B + " --no-rope-fusion")
    flagged = actmem.json("estimate", "--megatron-args", LLAMA_8B, "--no-rope-fusion")
    assert pasted["run_terms"] == flagged["run_terms"]
    assert_one_line_error(actmem("estimate", "--megatron-args", LLAMA_8B + " --no-rope-fusion", "--rope-fusion"),
                          "disagree: two values of one setting (rope fusion)")


def test_a_partial_rotation_keeps_narrower_cos_and_sin(actmem):
    """--rotary-percent 0.5: Megatron's RotaryEmbedding rotates int(128·0.5) = 64 dims, so the
    unfused rope's cos and sin are 64 wide: 4 x 2·8192·64 = 4,194,304 B a layer; TE's fused
    rope keeps only its frequency table either way (no layer byte moves)."""
    half = actmem.json("estimate", "--megatron-args", LLAMA_8B + " --no-rope-fusion --rotary-percent 0.5")
    assert _per_layer(half)["rope_cos_sin"] == 4 * 2 * 8192 * 64 == 4_194_304
    fused = actmem.json("estimate", "--megatron-args", LLAMA_8B + " --rotary-percent 0.5")
    whole = actmem.json("estimate", "--megatron-args", LLAMA_8B)
    assert fused["run_terms"] == whole["run_terms"]
    flagged = actmem.json("estimate", "--megatron-args", LLAMA_8B, "--no-rope-fusion", "--rotary-percent", "0.5")
    assert flagged["run_terms"] == half["run_terms"]


@pytest.mark.parametrize("args, fragment", [
    (("--model", "22b", "--rotary-percent", "0.5"),
     "--rotary-percent 0.5 shapes Megatron's rotary positions; this model's positions are learned"),
    (("--model", "llama-3.1-8b", "--implementation", "hf", "--rotary-percent", "0.5"),
     "this model's positions are rope under hf"),
    (("--model", "llama-3.1-8b", "--rotary-percent", "0"), "rotary_percent must be in (0, 1]"),
])
def test_a_partial_rotation_where_it_means_nothing_is_refused(actmem, args, fragment):
    assert_one_line_error(actmem("estimate", *args), fragment)


@pytest.mark.parametrize("args, fragment", [
    (("--model", "22b", "--no-rope-fusion"),
     "--no-rope-fusion chooses how rotary positions are applied; this model's positions are learned"),
    (("--model", "llama-3.1-8b", "--implementation", "hf", "--no-rope-fusion"),
     "transformers' own rotary embedding (--no-rope-fusion is Megatron's)"),
    (("--model", "22b", "--implementation", "hf", "--no-rope-fusion"),
     "--no-rope-fusion chooses how rotary positions are applied; this model's positions are learned"),
])
def test_no_rope_fusion_where_it_means_nothing_is_refused(actmem, args, fragment):
    assert_one_line_error(actmem("estimate", *args), fragment)
