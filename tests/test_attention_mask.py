"""Megatron's dataloader attention mask, as the recompute checkpoints keep it.

gpt_dataset.py (_get_ltor_masks_and_position_ids) makes a [1, s, s] bool causal mask a sample
unless --no-create-attention-mask-in-dataloader; get_batch_on_this_tp_rank puts the batch's
[b, 1, s, s] on the GPU of every tensor-parallel rank of the first and last stages. TE's causal
kernels never read it, but every layer hands it to its checkpoint (core_attn's and full
recompute's), whose CheckpointFunction saves it: one mask a microbatch in flight. The numbers
below are derived by hand.
"""

import pytest

from tests.conftest import assert_one_line_error
from tests.test_llama import LLAMA_8B

MASK_8K = 8192 * 8192                  # b·s² bytes of bool at s = 8192, b = 1: 67,108,864
NO_MASK = " --no-create-attention-mask-in-dataloader"


def _rows(out):
    return {row["technique"]: row["first_stage_bytes"] for row in out["techniques"]}


def test_a_pasted_script_has_the_mask_unless_it_says_not_to(actmem):
    """Llama 3 8B at p = 1: one microbatch in flight, one mask, under selective and full
    recompute; none without recompute (it lives only during the forward)."""
    with_mask = actmem.json("estimate", "--megatron-args", LLAMA_8B + " --recompute-activations")
    without = actmem.json("estimate", "--megatron-args", LLAMA_8B + " --recompute-activations" + NO_MASK)
    for technique in ("tp-sel", "tp-sp-sel", "full", "tp-sp-full"):
        assert _rows(with_mask)[technique] - _rows(without)[technique] == MASK_8K, technique
    for technique in ("none", "tp", "tp-sp"):
        assert _rows(with_mask)[technique] == _rows(without)[technique], technique
    mask = next(row for row in with_mask["run_terms"] if row["term"] == "attention_mask")
    assert (mask["bytes_each"], mask["count"], mask["region"]) == (MASK_8K, 1, "replicated")
    assert any("the dataloader's causal attention mask" in note for note in with_mask["assumptions"])
    assert any("no dataloader attention mask counted" in note for note in without["assumptions"])


def test_the_mlp_checkpoint_alone_does_not_keep_it(actmem):
    """Megatron's MLP checkpoint takes the norm's output only: the run (tp-sp-sel·mlp) holds
    the same bytes with the mask as without."""
    args = LLAMA_8B + " --recompute-granularity selective --recompute-modules mlp"
    run = [next(row for row in actmem.json("estimate", "--megatron-args", text)["techniques"] if row["is_run"])
           for text in (args, args + NO_MASK)]
    assert run[0]["technique"] == "tp-sp-sel·mlp" and run[0] == run[1]


def test_each_stage_holds_the_masks_of_its_microbatches_in_flight(actmem):
    """Llama 3.1 70B, t = 8, p = 4, full recompute, 1F1B: the first stage holds p = 4
    microbatches' masks, 268,435,456 B (its 1,342,177,280 B of checkpoints grow by 20%); the
    last stage, whose batch comes from the dataloader too, one; the stages between none."""
    args = ("--model", "llama-3.1-70b", "--tp", "8", "--sp", "--pp", "4", "--recompute", "full")
    with_mask = actmem.json("estimate", *args, "--attention-mask")
    without = actmem.json("estimate", *args)
    extra = [a["activations_bytes"] - b["activations_bytes"] for a, b in zip(with_mask["stages"], without["stages"])]
    assert extra == [4 * MASK_8K, 0, 0, MASK_8K]
    assert _rows(with_mask)["tp-sp-full"] - _rows(without)["tp-sp-full"] == 268_435_456


@pytest.mark.parametrize("args, fragment", [
    (["--model", "llama-3.1-8b", "--implementation", "torch-native", "--attention-mask"],
     "--implementation torch-native builds no such mask"),
    (["--megatron-args", LLAMA_8B + NO_MASK, "--attention-mask"],
     "disagree: two values of one setting (attention mask)"),
])
def test_what_actmem_cannot_count_is_refused(actmem, args, fragment):
    assert_one_line_error(actmem("estimate", *args), fragment)


def test_a_flag_beside_a_paste_decides_over_megatron_s_default(actmem):
    """The paste's mask is only Megatron's default: --no-attention-mask (or Megatron's own
    switch) given beside it turns it off."""
    cp = LLAMA_8B.replace("--use-flash-attn", "--attention-backend fused") + " --context-parallel-size 2"
    for flag in ("--no-attention-mask", "--no-create-attention-mask-in-dataloader"):
        out = actmem.json("estimate", "--megatron-args", cp, flag)
        assert out["architecture"]["attention_mask"] is False and not any(
            row["term"] == "attention_mask" for row in out["run_terms"])


def test_interleaved_stages_by_hand(actmem):
    """Llama 3.1 70B, t = 8, p = 4, m = 2 (10 layers a chunk), 16 microbatches, full recompute:
    the first stage holds the masks of 2p = 8 microbatches (its chunk-0 forwards in flight, as
    the embedding's dropout masks are counted), the last one, those between none."""
    args = ("--model", "llama-3.1-70b", "--tp", "8", "--sp", "--pp", "4", "--interleave", "2", "--recompute",
            "full", "--gpus", "32", "--global-batch", "16")
    with_mask, without = (actmem.json("estimate", *args, *flag) for flag in (("--attention-mask",), ()))
    extra = [a["activations_bytes"] - b["activations_bytes"] for a, b in zip(with_mask["stages"], without["stages"])]
    assert extra == [8 * MASK_8K, 0, 0, MASK_8K]


def test_under_context_parallelism_each_rank_keeps_its_rows_of_the_mask(actmem):
    """c = 2: get_batch_on_this_cp_rank keeps a rank's s/c = 4,096 rows of all 8,192 columns
    (index_select, a copy): b·(s/c)·s = 33,554,432 B a microbatch, half of c = 1's."""
    cp = LLAMA_8B.replace("--use-flash-attn", "--attention-backend fused") + " --context-parallel-size 2"
    out = actmem.json("estimate", "--megatron-args", cp + " --recompute-activations")
    mask = next(row for row in out["run_terms"] if row["term"] == "attention_mask")
    assert (mask["bytes_each"], mask["count"]) == (4096 * 8192, 1) == (MASK_8K // 2, 1)
