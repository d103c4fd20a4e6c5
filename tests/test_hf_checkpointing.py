"""transformers' activation checkpointing (the Trainer's --activation_checkpointing, actmem's --recompute full
under --implementation hf): what every layer's checkpoint holds, and the peak of the last layer's backward.

Read off transformers 5.23 (modeling_layers.py, GradientCheckpointingLayer; modeling_utils.py,
_activation_checkpointing_enable) and torch 2.13 (utils/checkpoint.py, non-reentrant with early stop): each
layer's checkpoint keeps its input and, in its recompute closure, the keywords LlamaModel.forward hands it (the
rotary tables, the int64 position ids, under the eager core its 16-bit additive mask). Measured by the harness
(tests/validate/test_hf.py and the zero grid's checkpointing runs); the numbers here are by hand.

Llama 3.1 8B: h = 4096, a = 32, d = 128, g = 8, f = 14,336, L = 32; s = 2048, b = 1.
"""

import pytest

from tests.conftest import assert_one_line_error

S, H, D, F_, L = 2048, 4096, 128, 14336, 32
HF_FULL = ("estimate", "--model", "llama-3.1-8b", "--implementation", "hf", "--recompute", "full", "--seq-len", str(S))

CHECKPOINTS = L * 2 * S * H                  # each layer's 16-bit input: 536,870,912
ROTARY = 2 * 2 * S * D                       # cos and sin, (1, s, d) each, 16-bit: 1,048,576
POSITION_IDS = 8 * S                         # int64 (1, s): 16,384
OUTPUT_ROWS = (4 + 2 + 2) * S * H + 4 * S    # the final LlamaRMSNorm's fp32 copy, its 16-bit normalized tensor and
                                             # rstd, lm_head's input: 67,117,056
LOGITS = 4 * S * 128256                      # the loss's fp32 log-softmax: 1,050,673,152
SDPA_LAYER = 411_320_320                     # a whole sdpa layer (tests/test_implementation.py, HF_SDPA_LAYER)


def _rows(out) -> dict:
    return {row["term"]: row["bytes"] for row in out["run_terms"]}


def test_the_checkpoints_hold_each_layer_input_and_the_layer_call_arguments(actmem):
    rows = _rows(actmem.json(*HF_FULL))
    assert rows["layer_input_checkpoint"] == CHECKPOINTS
    assert rows["rotary_tables"] == ROTARY
    assert rows["checkpoint_position_ids"] == POSITION_IDS
    assert "checkpoint_causal_mask" not in rows          # sdpa runs is_causal: no mask is made
    assert sum(rows.values()) == CHECKPOINTS + ROTARY + POSITION_IDS + OUTPUT_ROWS + LOGITS == 1_655_726_080


def test_the_eager_core_adds_its_mask(actmem):
    """masking_utils.eager_mask: (b, 1, s, s) in the model's dtype, 2bs² = 8,388,608 B, once a forward."""
    rows = _rows(actmem.json(*HF_FULL, "--attention-core", "eager"))
    assert rows["checkpoint_causal_mask"] == 2 * S * S == 8_388_608


def test_the_swiglu_backward_decides_beside_a_small_vocabulary(actmem):
    """v = 1,024: the loss holds little, so the last layer's backward decides, at its SwiGLU product's: every
    checkpoint (the output layer's rows freed); the rerun layer whole (LlamaRMSNorm keeps an fp32 copy, not the
    input, so nothing of it is the checkpoint's storage) less the product, down_proj's saved input, already
    freed: 411,320,320 - 2sf = 352,600,064; and down_proj's input gradient (2sf), mul's two gradients (2 x 2sf)
    and the residual stream's (2sh): 192,937,984. No rerun output is held: torch's non-reentrant checkpoint
    stops its rerun at the layer's last saved tensor."""
    peak = actmem.json(*HF_FULL, "--vocab", "1024")["peak_floor"]
    assert peak["moment"] == "the last layer's SwiGLU backward"
    rows = {row["name"]: row["bytes"] for row in peak["rows"]}
    assert rows["activations_in_flight"] == CHECKPOINTS + ROTARY + POSITION_IDS == 537_935_872
    assert rows["rematerialised"] == SDPA_LAYER - 2 * S * F_ == 352_600_064
    assert rows["swiglu_backward"] == 2 * S * F_ + 2 * 2 * S * F_ + 2 * S * H == 192_937_984


def test_zero3_has_released_the_output_weight_by_the_last_layer_backward(actmem):
    """ZeRO-3 keeps lm_head's weight gathered from its forward to its backward (its next use, the backward,
    within stage3_max_reuse_distance), then releases it: the loss's moment holds it, the last layer's backward
    not. s = 16,384 on 8 GPUs: with v = 1,024 the last layer's backward decides, without that row; with the
    model's 128,256 the loss does, with it: 128,256 x 4,096 x 2 B = 1,050,673,152."""
    zero3 = (*HF_FULL[:-2], "--seq-len", "16384", "--gpus", "8", "--zero-stage", "3")
    peak = actmem.json(*zero3, "--vocab", "1024")["peak_floor"]
    assert peak["moment"] == "the last layer's SwiGLU backward"
    assert "gathered_weights" not in {row["name"] for row in peak["rows"]}
    peak = actmem.json(*zero3)["peak_floor"]
    assert peak["moment"] == "the loss's backward, every microbatch held"
    assert {row["name"]: row["bytes"] for row in peak["rows"]}["gathered_weights"] == 1_050_673_152


@pytest.mark.parametrize("args, fragment", [
    (("--recompute", "selective"), "transformers has no selective recompute: choose none or full"),
    (("--recompute", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"),
     "partial full recompute (--recompute-method) is not modelled for --implementation hf"),
])
def test_what_transformers_does_not_checkpoint_is_refused(actmem, args, fragment):
    assert_one_line_error(actmem("estimate", "--model", "llama-3.1-8b", "--implementation", "hf", *args), fragment)


@pytest.mark.parametrize("spelling", ["--activation-checkpointing", "--gradient-checkpointing",
                                      "--activation_checkpointing", "--gradient_checkpointing"])
def test_the_trainers_spellings_are_full_recompute(actmem, spelling):
    out = actmem.json("estimate", "--model", "llama-3.1-8b", "--implementation", "hf", "--seq-len", str(S), spelling)
    assert out["run"]["recompute"] == "full"
    assert _rows(out)["layer_input_checkpoint"] == CHECKPOINTS


def test_a_trainer_spelling_that_disagrees_is_refused(actmem):
    assert_one_line_error(actmem(*HF_FULL[:-4], "--recompute", "none", "--gradient_checkpointing"),
                          "--recompute none and --gradient_checkpointing disagree: two values of one setting (recompute)")


def test_the_trainers_batch_spellings(actmem):
    """--per_device_train_batch_size 2 and --gradient_accumulation_steps 4 on 8 GPUs: a global batch of
    2 · 4 · 8 = 64, four microbatches a step."""
    out = actmem.json("estimate", "--model", "llama-3.1-8b", "--implementation", "hf", "--gpus", "8",
                      "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4")
    assert (out["run"]["micro_batch"], out["run"]["global_batch"]) == (2, 64)


@pytest.mark.parametrize("args, fragment", [
    (("--gradient-accumulation-steps", "4"), "--gradient-accumulation-steps needs --gpus"),
    (("--gpus", "8", "--global-batch", "16", "--gradient-accumulation-steps", "4"),
     "the global batch 16 and --gradient-accumulation-steps 4 disagree: micro batch · steps · d = 1 · 4 · 8 = 32"),
    (("--gpus", "8", "--gradient-accumulation-steps", "0"), "--gradient-accumulation-steps must be a positive integer"),
])
def test_gradient_accumulation_that_cannot_hold_is_refused(actmem, args, fragment):
    assert_one_line_error(actmem("estimate", "--model", "llama-3.1-8b", "--implementation", "hf", *args), fragment)


def test_gradient_accumulation_agrees_with_a_deepspeed_config(actmem, tmp_path):
    """The file's gradient_accumulation_steps 8 and micro batch 2 on 8 GPUs: the flag's 8 agrees (global 128), 4 is
    refused naming both."""
    import json

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
                                "gradient_accumulation_steps": 8, "train_micro_batch_size_per_gpu": 2}))
    base = ("estimate", "--model", "llama-3.1-8b", "--implementation", "hf", "--gpus", "8", "--deepspeed", str(path))
    assert actmem.json(*base, "--gradient-accumulation-steps", "8")["run"]["global_batch"] == 2 * 8 * 8
    assert_one_line_error(actmem(*base, "--gradient-accumulation-steps", "4"),
                          f"--gradient-accumulation-steps 4 and --deepspeed {path} (gradient_accumulation_steps 8) "
                          "disagree")
