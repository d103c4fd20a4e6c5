"""transformers' mixtures of experts under --implementation hf (issue 27): MixtralForCausalLM and
Qwen3MoeForCausalLM with their default experts implementation, grouped_mm, on one device, priced
from their configs and derived by hand here (measured to the byte in tests/validate/test_hf.py).

A sparse MoE block keeps, for N = s·b tokens, k the top-k, E experts, f_e an expert's width
(transformers 5.23: modeling_mixtral.py, modeling_qwen3_moe.py, integrations/moe.py):
  router: its input 2Nh, the fp32 softmax over every expert 4NE, the top-k's int64 indices 8Nk,
          and where it renormalises (Mixtral; Qwen3-MoE's norm_topk_prob) the in-place division's
          copy of the fp32 top-k values 4Nk and their sum 4N;
  experts: three int64 permutations of the N·k routed copies (the tokens' indices, the sort's
          permutation, its inverse) 3·8Nk, the int32 offsets 4E, the gathered rows 2Nkh, the
          gate_up output 4Nkf_e, silu's output 2Nkf_e, the product 2Nkf_e, the down output 2Nkh,
          and the routing weights in expert order: Mixtral's fp32 4Nk, Qwen3-MoE's 16-bit 2Nk.
"""

import json

import pytest

from tests.conftest import assert_one_line_error

MIXTRAL = "tests/data/hf/mixtral/config.json"
QWEN3_MOE = "tests/data/hf/qwen3-30b-a3b/config.json"


def _moe_block(n, k, e, h, f, weight_bytes, renormalised=True):
    """The sparse MoE block's bytes by hand (the module docstring's list)."""
    router = 2 * n * h + 4 * n * e + 8 * n * k + (4 * n * k + 4 * n if renormalised else 0)
    experts = 3 * 8 * n * k + 4 * e + 2 * n * k * h + 8 * n * k * f + 2 * n * k * h + weight_bytes * n * k
    return router + experts


def _estimate(actmem, config, *args):
    out = actmem.json("estimate", "--model", config, "--implementation", "hf", "--seq-len", "4096", *args)
    terms = {row["term"]: row["bytes_each"] for row in out["run_terms"] if row["scope"] == "layer"}
    run = next(row for row in out["techniques"] if row["technique"] == "none")
    return out, terms, run["per_layer_bytes"]


def test_mixtral_8x7b_layer_by_hand(actmem):
    """Mixtral 8x7B (h = 4096, a = 32, g = 8, d = 128, E = 8, k = 2, f_e = 14,336) at s = 4096, b = 1.
    The attention and norms are Llama's under sdpa (tests/test_implementation.py's HF_SDPA_LAYER
    without its MLP, whose input 2sh is the router's here): 14sh + 8s + 4s·ad + 4s·gd + 4as; the MoE
    block, N = 4096:
    2Nh 33,554,432 + 4NE 131,072 + 8Nk 65,536 + 4Nk 32,768 + 4N 16,384 (router)
    + 3·8Nk 196,608 + 4E 32 + 2Nkh 67,108,864 + 8Nkf 939,524,096 + 2Nkh 67,108,864 + 4Nk 32,768
    = 1,107,771,424."""
    s, h, a, g, d = 4096, 4096, 32, 8, 128
    out, terms, layer = _estimate(actmem, MIXTRAL)
    moe = _moe_block(s, 2, 8, h, 14336, weight_bytes=4)
    assert moe == 1_107_771_424
    assert layer == 14 * s * h + 8 * s + 4 * s * a * d + 4 * s * g * d + 4 * a * s + moe
    assert terms["experts_routing_weights"] == 4 * s * 2          # fp32: Mixtral's router hands them on as made
    assert terms["gate_topk_values_fp32"] == 4 * s * 2 and terms["gate_topk_sum"] == 4 * s
    assert not {"router_input", "experts_fc1_output", "permute_probs"} & set(terms)   # no Megatron rows
    assert any(note.startswith("hf: transformers 5.23 MixtralForCausalLM") for note in out["assumptions"])


def test_the_mixtral_preset_runs_under_hf_without_its_megatron_layout(actmem):
    """The mixtral-8x7b preset is Megatron-LM's example run (p = 4, EP = 8, the distributed optimizer, the alltoall
    dispatcher, grouped GEMM): under hf those are left out, named in one note, and the layer is the config.json's
    (Mixtral 8x7B's dims), by hand above."""
    s, h, a, g, d = 4096, 4096, 32, 8, 128
    out = actmem.json("estimate", "--model", "mixtral-8x7b", "--implementation", "hf")
    run = next(row for row in out["techniques"] if row["technique"] == "none")
    assert run["per_layer_bytes"] == 14 * s * h + 8 * s + 4 * s * a * d + 4 * s * g * d + 4 * a * s \
        + _moe_block(s, 2, 8, h, 14336, weight_bytes=4)
    assert out["run"]["pipeline_parallel"] == 1 and out["run"]["distributed_optimizer"] is False
    # its 32 GPUs were p·d = 4·8: its 8 data-parallel ranks are kept, and its 256 sequences are 32 microbatches
    assert (out["run"]["gpus"], out["run"]["global_batch"]) == (8, 256)
    assert any("its GPUs 32 become 8, its d data-parallel ranks" in note for note in out["assumptions"])
    assert any("left out under --implementation hf, which has no use for them: pipeline_parallel 4, expert_parallel "
               "8, distributed_optimizer True, moe_dispatcher alltoall, moe_grouped_gemm True" in note
               for note in out["assumptions"])
    assert_one_line_error(actmem("estimate", "--model", "mixtral-8x7b", "--implementation", "hf", "--pp", "4"),
                          "pipeline parallelism (p = 4) is not modelled for --implementation hf")


def test_a_preset_under_hf_takes_the_trainers_batch_and_its_explain(actmem):
    """--gradient_accumulation_steps over the preset's 8 ranks sets the global batch, 1 · 4 · 8 = 32, leaving the
    preset's 256 out (named); plan's --explain starts from the same pruned run."""
    out = actmem.json("estimate", "--model", "mixtral-8x7b", "--implementation", "hf", "--gradient_accumulation_steps",
                      "4")
    assert out["run"]["global_batch"] == 32
    assert any("the preset's global batch 256 left out" in note for note in out["assumptions"])
    assert actmem("plan", "--model", "mixtral-8x7b", "--implementation", "hf", "--explain",
                  "t=1 p=1 m=1 b=1 none").exit_code == 0


def test_qwen3_30b_a3b_moe_rows_by_hand(actmem):
    """Qwen3-30B-A3B (h = 2048, E = 128, k = 8, f_e = 768, norm_topk_prob) at s = 4096: the block's rows
    are the hand list's, its routing weights 16-bit (router_top_value.to(router_logits.dtype)):
    2Nk = 65,536; the gate_up output 4Nkf_e = 4·4096·8·768 = 100,663,296."""
    _, terms, _ = _estimate(actmem, QWEN3_MOE)
    n, k, e, h, f = 4096, 8, 128, 2048, 768
    moe_rows = {name: size for name, size in terms.items() if name.startswith(("gate_", "experts_"))}
    assert sum(moe_rows.values()) == _moe_block(n, k, e, h, f, weight_bytes=2)
    assert terms["experts_routing_weights"] == 65_536 and terms["experts_gate_up_output"] == 100_663_296
    assert terms["experts_offsets"] == 4 * 128


def test_qwen3_moe_without_renormalising_keeps_no_division(actmem, tmp_path):
    """norm_topk_prob false: the top-k values go on as the softmax made them; no division, so neither
    the copy of the values nor their sum is kept (4Nk + 4N = 131,072 + 16,384 fewer bytes a layer)."""
    config = json.loads(open(QWEN3_MOE).read()) | {"norm_topk_prob": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    _, renormalised, with_division = _estimate(actmem, QWEN3_MOE)
    _, terms, without = _estimate(actmem, str(path))
    assert "gate_topk_values_fp32" not in terms and "gate_topk_sum" not in terms
    assert with_division - without == 4 * 4096 * 8 + 4 * 4096


def test_megatron_prices_the_same_config_with_its_own_rows(actmem):
    """The predicates part the two codes: Megatron's MoELayer rows under megatron, none of transformers'."""
    out = actmem.json("estimate", "--model", MIXTRAL, "--seq-len", "4096")
    terms = {row["term"] for row in out["run_terms"]}
    assert {"router_input", "experts_fc1_output"} <= terms and not any(t.startswith("gate_") for t in terms)


@pytest.mark.parametrize("args, fragment", [
    (("--moe-imbalance", "1.25"), "every expert sits on the one device, whose expert rows are k·N whatever the routing"),
    (("--ep", "2", "--gpus", "2"), "expert parallelism (EP = 2) is not modelled for --implementation hf"),
    (("--moe-token-dispatcher-type", "alltoall"), "moe_dispatcher must be allgather, got alltoall "
                                                  "(--moe-token-dispatcher-type)"),
    (("--moe-router-score-function", "sigmoid"), "moe_score_function must be softmax"),
    (("--moe-expert-capacity-factor", "1.0"), "which drops no tokens"),
    (("--moe-shared-expert-intermediate-size", "1024"), "which have no shared experts"),
    (("--moe-permute-fusion",), "which permute with torch's own ops"),
])
def test_what_transformers_experts_do_not_do_is_refused(actmem, args, fragment):
    assert_one_line_error(actmem("estimate", "--model", MIXTRAL, "--implementation", "hf", *args), fragment)


@pytest.mark.parametrize("change, fragment", [
    ({"output_router_logits": True}, "output_router_logits: transformers then adds the aux loss"),
    ({"router_jitter_noise": 0.01}, "router_jitter_noise"),
    ({"sliding_window": 4096}, "a sliding window"),
    ({"experts_implementation": "batched_mm"}, "experts_implementation 'batched_mm'"),
])
def test_unmeasured_mixtral_configs_are_refused_under_hf(actmem, tmp_path, change, fragment):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(json.loads(open(MIXTRAL).read()) | change))
    assert_one_line_error(actmem("estimate", "--model", str(path), "--implementation", "hf"), fragment)
    assert actmem("estimate", "--model", str(path)).exit_code == 0       # Megatron reads it as before


def test_qwen1_5_moe_a2_7b_with_its_gated_shared_expert_by_hand(actmem):
    """Qwen1.5-MoE-A2.7B (qwen2_moe: h = 2048, a = 16 heads of 128, no query groups, E = 60, k = 4, f_e = 1408,
    no norm_topk_prob, a shared expert of f_s = 5632 gated by sigmoid(shared_expert_gate(x)), biases on q, k, v)
    under transformers' Qwen2MoeForCausalLM at s = 4096, b = 1, N = 4096: the router and experts as the hand
    list's without the division (16-bit routing weights); the shared expert, an unfused SwiGLU on the block's
    input (the router's, one storage), keeps gate_proj's and up_proj's outputs 2·2Nf_s = 92,274,688, silu's
    output and the product 2Nf_s = 46,137,344 each, its gate's sigmoid 2N = 8,192 and the output it scales
    2Nh = 16,777,216: 201,334,784 B a layer beside the routed block (measured to the byte on transformers'
    own class in tests/validate/test_hf.py's grid)."""
    out, terms, layer = _estimate(actmem, "tests/data/hf/qwen1.5-moe-a2.7b/config.json")
    n, f_s, h = 4096, 5632, 2048
    shared = {name: size for name, size in terms.items() if name.startswith("shared_experts_")}
    assert shared == {"shared_experts_swiglu_input": 4 * n * f_s, "shared_experts_silu_output": 2 * n * f_s,
                      "shared_experts_fc2_input": 2 * n * f_s, "shared_experts_gate_score": 2 * n,
                      "shared_experts_output": 2 * n * h}
    assert sum(shared.values()) == 201_334_784
    moe_rows = {name: size for name, size in terms.items() if name.startswith(("gate_", "experts_"))}
    assert sum(moe_rows.values()) == _moe_block(n, 4, 60, h, 1408, weight_bytes=2, renormalised=False)
    assert any(note.startswith("hf: transformers 5.23 Qwen2MoeForCausalLM") for note in out["assumptions"])


def test_qwen3_moe_with_a_sliding_window_is_refused_under_hf(actmem, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(json.loads(open(QWEN3_MOE).read()) | {"use_sliding_window": True}))
    assert_one_line_error(actmem("estimate", "--model", str(path), "--implementation", "hf"), "a sliding window")


def test_top_1_routing_renormalises_under_transformers(actmem, tmp_path):
    """Megatron refuses top-1 with its softmax over the top-k (it needs --moe-router-pre-softmax); transformers
    renormalises one value to 1, in place, keeping the copy and the sum as for k = 2: priced, N = 4096,
    4Nk = 16,384 and 4N = 16,384."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(json.loads(open(MIXTRAL).read()) | {"num_experts_per_tok": 1}))
    _, terms, _ = _estimate(actmem, str(path))
    assert terms["gate_topk_values_fp32"] == 16_384 and terms["gate_topk_sum"] == 16_384
    assert_one_line_error(actmem("estimate", "--model", str(path)), "top-1 routing with a softmax router needs")
