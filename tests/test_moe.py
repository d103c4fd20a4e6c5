"""Mixture-of-experts layers (issue 27): megatron-core 0.16.1's MoELayer, hand-derived.

The rows a token's trip keeps, per layer and microbatch, N = s·b/t tokens a rank (SP), k the
top-k, E the experts, T = ⌈r·k·N·ETP⌉ the rows the rank's experts receive (terms.py; measured
against megatron-core's own layer in tests/validate/test_megatron_moe.py):
router input 2Nh, top-k indices 8Nk, top-k probabilities 4Nk, aux scores 4NE, tokens per
expert 8E, the aux loss 4 (the aux loss's own top-k indices are freed before the forward ends), routing map NE, permute probabilities
2NE, sorted indices 8Nk; experts' input 2hT, fc1 output 4f_e·T/ETP, probabilities 2T, fc2
input 2f_e·T/ETP.
"""

from pathlib import Path

import pytest

from tests.conftest import assert_one_line_error

MIXTRAL = Path(__file__).parent / "data" / "megatron_examples" / "train_mixtral_8x7b_distributed.sh"
MOE = ["--heads", "32", "--hidden", "4096", "--layers", "32", "--vocab", "32000", "--seq-len", "4096",
       "--ffn", "14336", "--swiglu", "--disable-bias-linear", "--normalization", "rmsnorm",
       "--query-groups", "8", "--attention-core", "flash", "--position-embedding", "rope",
       "--attention-dropout", "0", "--hidden-dropout", "0", "--untie-embeddings-and-output-weights",
       "--num-experts", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
       "--moe-token-dispatcher-type", "alltoall"]


def _with(flag: str, value: str) -> list:
    """MOE with one of its flags at another value."""
    args = list(MOE)
    args[args.index(flag) + 1] = value
    return args


def _terms(out) -> dict:
    return {row["term"]: row["bytes_each"] for row in out["run_terms"]}


def test_megatrons_mixtral_example_is_priced_from_the_script_as_it_is(actmem):
    """examples/mixtral/train_mixtral_8x7b_distributed.sh, given the vocabulary its Llama 2
    tokenizer file holds (32,000) and the 32 GPUs its t·EP·p = 1·8·4 layout needs (the script's
    one node of 8 is refused as Megatron refuses it). s = 4096, b = 1, t = 1 (Megatron turns SP off):
    N = 4096 tokens, k = 2, T = k·N = 8192 rows a rank, E/EP = 1 expert a rank, f_e = f = 14,336.
    - experts' input 2·h·T = 2·4096·8192 = 67,108,864 B; fc1 output 4·f_e·T = 469,762,048 B;
      fc2 input 2·f_e·T = 234,881,024 B; probabilities 2T = 16,384 B;
    - router input 2Nh = 33,554,432; aux scores 4NE = 131,072; sorted indices 8Nk = 65,536;
    - parameters of the first stage (8 layers): a layer's QKV 4096·(4096 + 2·8·128) = 25,165,824,
      projection 4096² = 16,777,216, two norms 8,192, router 8·4096 = 32,768 (41,984,000), one
      expert 3·4096·14,336 = 176,160,768; 8 x (41,984,000 + 176,160,768) + the embedding
      32,000·4096 = 131,072,000: 1,876,230,144;
    - the distributed optimizer: the experts over gpus/(ETP·EP·p) = 32/32 = 1 rank, the rest over
      d = 32/4 = 8: 12·(1,409,286,144 + 466,944,000/8) = 17,611,849,728 B."""
    assert_one_line_error(actmem("estimate", "--megatron-args", f"@{MIXTRAL}", "--vocab-size", "32000"),
                          "ETP·EP·p (1·8·4 = 32) must divide gpus (8)",
                          "(gpus: 8 from the script's launcher, torchrun --nproc-per-node 8 x --nnodes 1)")
    out = actmem.json("estimate", "--megatron-args", f"@{MIXTRAL}", "--vocab-size", "32000", "--gpus", "32")
    terms = _terms(out)
    assert (terms["experts_input"], terms["experts_fc1_output"], terms["experts_fc2_input"],
            terms["experts_probs"]) == (67_108_864, 469_762_048, 234_881_024, 16_384)
    assert (terms["router_input"], terms["aux_loss_scores"], terms["permute_sorted_indices"]) == \
        (33_554_432, 131_072, 65_536)
    assert "fc1_input" not in terms and "swiglu_input" not in terms and "fc2_input" not in terms
    assert out["parameters"]["count"] == 1_876_230_144
    assert out["parameters"]["optimizer_bytes"] == 12 * (8 * 176_160_768 + 466_944_000 // 8) == 17_611_849_728
    assert (out["run"]["expert_parallel"], out["run"]["expert_tensor_parallel"], out["run"]["expert_data_parallel"]) \
        == (8, 1, 1)
    assert out["architecture"]["moe_grouped_gemm"] is True
    notes = " ".join(out["assumptions"])
    assert "megatron-core 0.16.1's MoELayer" in notes and "not in the peak floor yet" in notes


def test_a_layer_under_tensor_and_expert_parallelism(actmem):
    """t = 2 with SP, EP = 2, s = 4096, b = 1: N = 2048 tokens a rank.
    ETP = t = 2 (Megatron's default): T = k·N·ETP = 2·2048·2 = 8192, fc1 output 2·(2·14,336/2)·8192
    = 234,881,024 B, the experts' input 2·4096·8192 = 67,108,864 B (whole: all-gathered over ETP).
    ETP = 1: T = k·N = 4096, fc1 output 2·(2·14,336)·4096 = 234,881,024 B, input 33,554,432 B.
    The router's rows split with the tokens: input 2Nh = 16,777,216, aux scores 4NE = 65,536."""
    run = ["--tp", "2", "--sp", "--ep", "2", "--gpus", "8", "--global-batch", "16"]
    default = _terms(actmem.json("estimate", *MOE, *run))
    one = _terms(actmem.json("estimate", *MOE, *run, "--etp", "1"))
    assert (default["experts_input"], default["experts_fc1_output"]) == (67_108_864, 234_881_024)
    assert (one["experts_input"], one["experts_fc1_output"]) == (33_554_432, 234_881_024)
    for terms in (default, one):
        assert (terms["router_input"], terms["aux_loss_scores"], terms["experts_fc2_input"]) == \
            (16_777_216, 65_536, 117_440_512)


def test_the_routing_imbalance_scales_the_expert_rows_only(actmem):
    """--moe-imbalance 1.25 at t = 1, EP = 8, s = 4096: T = ⌈1.25·2·4096⌉ = 10,240 rows, the experts'
    input 2·4096·10,240 = 83,886,080 B; 1.0001 rounds up: ⌈1.0001·8192⌉ = 8193 rows, 67,117,056 B.
    The router's rows are per token: unchanged. At EP = 1 a rank holds every expert and receives its own
    k·N rows whatever the routing: r is capped at min(EP, E/k), so 1.25 changes nothing there; at EP = 2 a
    rank receives at most both ranks' copies, 2x: 8 is read as 2; at EP = 8, E/k = 4 caps it."""
    ep8 = [*MOE, "--ep", "8", "--gpus", "8"]
    balanced = _terms(actmem.json("estimate", *ep8))
    heavy = _terms(actmem.json("estimate", *ep8, "--moe-imbalance", "1.25"))
    assert heavy["experts_input"] == 83_886_080 and balanced["experts_input"] == 67_108_864
    assert _terms(actmem.json("estimate", *ep8, "--moe-imbalance", "1.0001"))["experts_input"] == 67_117_056
    assert heavy["router_input"] == balanced["router_input"] and heavy["aux_loss_scores"] == balanced["aux_loss_scores"]
    assert _terms(actmem.json("estimate", *MOE, "--moe-imbalance", "1.25"))["experts_input"] == 67_108_864
    ep2 = _terms(actmem.json("estimate", *MOE, "--ep", "2", "--gpus", "2", "--moe-imbalance", "8"))
    assert ep2["experts_input"] == 2 * 67_108_864
    # at EP = 8 a token sends at most min(k, E/EP) = 1 of its copies to a rank: at most 8·N
    # rows against k·N = 2N, r at most E/k = 4
    assert _terms(actmem.json("estimate", *ep8, "--moe-imbalance", "8"))["experts_input"] == 4 * 67_108_864


def test_without_the_aux_loss_its_rows_go(actmem):
    """Load balancing none, or aux_loss at Megatron's default coefficient 0: the router computes no
    aux loss (router.py, TopKRouter.routing: only above 0), so none of its four rows is kept."""
    terms = _terms(actmem.json("estimate", *MOE, "--moe-router-load-balancing-type", "none"))
    assert not {name for name in terms if name.startswith("aux_loss")}
    assert terms["router_topk_indices"] == 8 * 4096 * 2
    default = _terms(actmem.json("estimate", *_with("--moe-aux-loss-coeff", "0")))
    assert not {name for name in default if name.startswith("aux_loss")} and "router_topk_probs" in default


def test_at_ep_1_the_experts_state_shards_with_the_dense_parameters(actmem):
    """Megatron puts expert weights in the dense buffers at EP = 1 (transformer_engine.py: allreduce =
    not (is_expert and EP > 1)), so the distributed optimizer shards them over d·c, not gpus/(ETP·EP·p):
    t = 2, ETP = 1, 8 GPUs: d = 4, where gpus/(ETP·EP·p) would be 8."""
    out = actmem.json("estimate", *MOE, "--tp", "2", "--sp", "--etp", "1", "--gpus", "8", "--global-batch", "16",
                      "--distributed-optimizer")
    assert out["run"]["expert_data_parallel"] == out["run"]["data_parallel"] == 4


@pytest.mark.parametrize("args, fragments", [
    (_with("--moe-token-dispatcher-type", "flex"), ["--moe-token-dispatcher-type flex: the flex dispatcher (DeepEP or "
                                                     "HybridEP)"]),
    ([a for a in MOE if a != "--swiglu"], ["modelled with SwiGLU experts"]),
    (MOE + ["--ep", "3"], ["EP (3) must divide the experts (8)"]),
    (MOE + ["--tp", "2"], ["a mixture-of-experts layer at t = 2 needs sequence parallelism"]),
    (MOE + ["--tp", "2", "--sp", "--etp", "3"], ["ETP (3) must divide the experts' hidden size f_e (14336)"]),
    (MOE + ["--moe-imbalance", "0.9"], ["routing imbalance must be at least 1"]),
    (MOE + ["--moe-router-load-balancing-type", "global_aux_loss"], ["global_aux_loss: its global aux loss"]),
    (_with("--moe-router-topk", "9"), ["--moe-router-topk (9) must be at most --num-experts (8)"]),
    (MOE[:MOE.index("--num-experts")] + ["--ep", "2"], ["give --num-experts"]),
    (MOE[:MOE.index("--num-experts")] + ["--moe-ffn-hidden-size", "512"], ["give --num-experts"]),
    (MOE + ["--recompute", "selective", "--recompute-modules", "shared_experts"],
     ["--recompute-modules shared_experts: this MoE layer has no shared experts"]),
    (_with("--moe-router-topk", "1"), ["top-1 routing with a softmax router needs --moe-router-pre-softmax"]),
    (_with("--attention-core", "eager") + ["--moe-grouped-gemm"], ["legacy GroupedMLP"]),
    (MOE + ["--recompute", "selective", "--recompute-modules", "moe_act"],
     ["--recompute-modules moe_act recomputes the experts' activation", "give --moe-grouped-gemm"]),
    (_with("--moe-aux-loss-coeff", "-1"), ["moe_aux_loss_coeff must be a number >= 0"]),
])
def test_what_is_not_modelled_or_not_possible_is_refused(actmem, args, fragments):
    assert_one_line_error(actmem("estimate", *args), *fragments)


def test_the_formulas_show_the_moe_rows_in_the_papers_symbols(actmem):
    result = actmem("formulas", "--latex")
    assert result.exit_code == 0, result.output
    assert "% term experts_fc1_output" in result.stdout and "f_{e}" in result.stdout


def test_recompute_modules_mlp_leaves_a_moe_layer_whole(actmem):
    """--recompute-modules mlp recomputes a dense layer's MLP only (transformer_layer.py: recompute_mlp is set
    where not is_moe_layer; a MoE layer's own modules are moe, moe_act and shared_experts): a model whose every
    layer is MoE keeps under it what it keeps without recompute, row for row, the pre-MLP norm's too."""
    plain = _terms(actmem.json("estimate", *MOE))
    mlp = _terms(actmem.json("estimate", *MOE, "--recompute", "selective", "--recompute-modules", "mlp"))
    assert mlp == plain and plain["router_input"] and plain["mlp_norm_statistics"]


def test_recompute_modules_moe_and_shared_experts(actmem):
    """--recompute-modules moe checkpoints the whole MoE layer (moe_layer.py, forward: tensor_parallel.checkpoint):
    it keeps the router's input, 2Nh = 2·4096·4096 = 33,554,432 at t = 1, and no other MoE row; the attention
    and the norms keep theirs. With Qwen2-MoE-like gated shared experts of f_s = 5632, shared_experts keeps their
    input (the same storage) and drops SwiGLU's input 4·5632·4096 = 92,274,688, fc2's 46,137,344, the gate's score
    and the output it scales; the routed rows stay."""
    plain = _terms(actmem.json("estimate", *MOE))
    moe = _terms(actmem.json("estimate", *MOE, "--recompute", "selective", "--recompute-modules", "moe"))
    assert moe["router_input"] == 33_554_432
    assert not [name for name in moe if name.startswith(("router_t", "aux_", "permute", "experts"))]
    assert moe["qkv_input"] == plain["qkv_input"] and moe["mlp_layernorm_input"] == plain["mlp_layernorm_input"]
    gated = MOE + ["--moe-shared-expert-intermediate-size", "5632", "--moe-shared-expert-gate"]
    whole = _terms(actmem.json("estimate", *gated))
    shared = _terms(actmem.json("estimate", *gated, "--recompute", "selective", "--recompute-modules", "shared_experts"))
    assert (whole["shared_experts_swiglu_input"], whole["shared_experts_fc2_input"]) == (92_274_688, 46_137_344)
    assert not [name for name in shared if name.startswith("shared_experts")]
    assert shared["experts_fc1_output"] == whole["experts_fc1_output"]


def test_recompute_modules_moe_act_frees_the_experts_fc2_input(actmem):
    """--recompute-modules moe_act (TEGroupedMLP: the activation under CheckpointWithoutOutput, its output freed
    once fc2 has saved it, made again in fc2's backward) drops the experts' fc2 input alone: at t = 1, k = 2,
    N = 4096, T = k·N = 8192 rows, f_e = 14,336: 2·f_e·T = 234,881,024 B; the checkpoint keeps fc1's output and
    the probabilities, which the SwiGLU kept before (4·f_e·T = 469,762,048 and 2T = 16,384). The rerun in the
    last layer's fc2 backward makes the input again into the freed storage and keeps its own output too
    (random.py, _recompute: ctx.outputs) until the checkpoint's backward: 2 x 234,881,024 = 469,762,048 B beside
    what is held. moe (the whole layer's checkpoint) drops it too."""
    from actmem.memory import engine
    from actmem.memory.techniques import run_technique
    from actmem.model.recompute import RecomputePolicy
    from actmem.model.spec import build_spec
    from actmem.sources.presets import load_preset

    grouped = MOE + ["--moe-grouped-gemm"]
    plain = _terms(actmem.json("estimate", *grouped))
    act = _terms(actmem.json("estimate", *grouped, "--recompute", "selective", "--recompute-modules", "moe_act"))
    assert plain["experts_fc2_input"] == 234_881_024 and "experts_fc2_input" not in act
    assert act == {name: value for name, value in plain.items() if name != "experts_fc2_input"}
    assert (act["experts_fc1_output"], act["experts_probs"]) == (469_762_048, 16_384)
    both = _terms(actmem.json("estimate", *grouped, "--recompute", "selective", "--recompute-modules", "moe,moe_act"))
    assert not [name for name in both if name.startswith("experts")]

    preset = load_preset("mixtral-8x7b")        # the same layer: h 4096, f_e 14,336, k 2, t 1, s 4096, b 1
    spec = build_spec(preset.model, {"micro_batch": 1}, architecture=preset.architecture)
    technique = run_technique(False, RecomputePolicy.parse("selective:moe_act"))
    rerun = engine.rematerialised_bytes(technique, spec.architecture, module="moe_act")
    assert engine.exact(rerun, spec.bindings()) == 2 * 234_881_024


def test_recompute_modules_layernorm_frees_the_pre_mlp_norms_output(actmem):
    """A MoE layer's pre-MLP norm is a TENorm of its own: --recompute-modules layernorm reruns it and frees its
    output, the router's input (2Nh = 33,554,432 at t = 1), once the layer has run, and keeps no statistics; the
    norm's input (the checkpoint's) stays."""
    plain = _terms(actmem.json("estimate", *MOE))
    norm = _terms(actmem.json("estimate", *MOE, "--recompute", "selective", "--recompute-modules", "layernorm"))
    assert plain["router_input"] == 33_554_432 and "router_input" not in norm
    assert "mlp_norm_statistics" in plain and "mlp_norm_statistics" not in norm
    assert norm["mlp_layernorm_input"] == plain["mlp_layernorm_input"] == 33_554_432


def test_a_capacity_factor_bounds_the_busiest_ranks_rows(actmem):
    """--moe-expert-capacity-factor 1.0 at t = 1, EP = 8, k = 2, E = 8, N = 4096: each expert takes at most ⌈2·4096/8·1.0⌉ =
    1024 tokens from a rank, so a rank's experts at most 8·1024 = 8192 rows, whatever --moe-imbalance says: at 1.5
    the experts' input is 2·4096·8192 = 67,108,864 B (dropless: 2·4096·12,288 = 100,663,296); the router keeps
    the capacity's bool map, N·E = 32,768 B."""
    ep8 = [*MOE, "--ep", "8", "--gpus", "8"]
    dropless = _terms(actmem.json("estimate", *ep8, "--moe-imbalance", "1.5"))
    capped = _terms(actmem.json("estimate", *ep8, "--moe-imbalance", "1.5", "--moe-expert-capacity-factor", "1.0"))
    assert dropless["experts_input"] == 100_663_296 and capped["experts_input"] == 67_108_864
    assert capped["router_capacity_map"] == 32_768 and "router_capacity_map" not in dropless


def test_beside_context_parallelism_a_rank_routes_its_s_over_c_tokens(actmem):
    """Megatron's MoE layer gathers nothing over the context-parallel group (its aux losses all-reduce their
    counts over t·c, which keeps nothing; the dispatchers use the EP and ETP groups alone), so a rank's rows are
    the c = 1 rows of its s/c tokens (measured: tests/validate/test_megatron_moe.py). t = 2 (SP), c = 2:
    N = 4096/(2·2) = 1024 tokens; the router's input 2Nh = 8,388,608 B, the aux scores 4NE = 32,768, the routing
    map NE = 8192, the sorted indices 8Nk = 16,384; at ETP = t = 2 the experts receive k·N·ETP = 4096 rows,
    2·4096·4096 = 33,554,432 B."""
    out = _terms(actmem.json("estimate", *MOE, "--tp", "2", "--sp", "--cp", "2", "--gpus", "4"))
    assert (out["router_input"], out["aux_loss_scores"], out["permute_routing_map"], out["permute_sorted_indices"],
            out["experts_input"]) == (8_388_608, 32_768, 8192, 16_384, 33_554_432)


def test_above_a_capacity_factor_of_1_the_busiest_rank_receives_more_than_k_n(actmem):
    """Each expert takes at most C = ⌈k·N/E·factor⌉ tokens from each rank, so a rank's E/EP experts at most
    E·C·ETP rows: at factor 1.5, t = 1, EP = 8, k = 2, E = 8, N = 4096, C = ⌈2·4096/8·1.5⌉ = 1536 and the cap
    8·1536 = 12,288 rows, above the balanced k·N = 8192. At --moe-imbalance 2 (r·k·N = 16,384) the cap holds:
    the experts' input 2·4096·12,288 = 100,663,296 B (not the 67,108,864 of k·N rows)."""
    out = _terms(actmem.json("estimate", *MOE, "--ep", "8", "--gpus", "8", "--moe-imbalance", "2",
                             "--moe-expert-capacity-factor", "1.5"))
    assert out["experts_input"] == 100_663_296


def test_padding_to_capacity_gives_every_expert_c_rows_whatever_the_routing(actmem):
    """--moe-pad-expert-input-to-capacity (Megatron's drop and pad): every expert's column of the map holds C
    tokens, so a rank's experts receive E/EP·C·EP·ETP = E·C·ETP rows, balanced or not. At factor 1.5, t = 1,
    EP = 8: C = 1536 (above), T = 12,288, the experts' input 100,663,296 B at r = 1 too. Under alltoall the
    permute selects by index: its token indices and the probabilities' flat indices, int64 [E·C] each,
    8·12,288 = 98,304 B, in place of the routing map and probabilities it keeps unpadded (N·E = 32,768 and
    2·N·E = 65,536); the router's capacity map N·E = 32,768 stays. Under allgather the rows are the same
    (its local experts' map of the gathered tokens, [E/EP, N·EP] = [1, 32,768], kept as before) and its local
    indices 8T = 98,304."""
    padded = ["--ep", "8", "--gpus", "8", "--moe-expert-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity"]
    alltoall = _terms(actmem.json("estimate", *MOE, *padded))
    assert alltoall["experts_input"] == 100_663_296
    assert alltoall["permute_sorted_indices"] == alltoall["permute_probs_indices"] == 98_304
    assert alltoall["router_capacity_map"] == 32_768
    assert "permute_routing_map" not in alltoall and "permute_probs" not in alltoall
    allgather = _terms(actmem.json("estimate", *_with("--moe-token-dispatcher-type", "allgather"), *padded))
    assert allgather["experts_input"] == 100_663_296 and allgather["permute_local_indices"] == 98_304
    assert (allgather["permute_routing_map"], allgather["permute_probs"]) == (32_768, 65_536)
    assert "permute_probs_indices" not in allgather


def test_the_capacity_is_megatrons_floating_point_ceiling(actmem):
    """get_capacity takes ceil((N·k / E) · factor) in floating point: at s = 400, t = 1, b = 1, k = 2, E = 8 and factor
    1.1, (400·2/8)·1.1 = 110.00000000000001 in doubles, so C = 111 (not the exact 110): padded, the experts receive
    E·C = 888 rows, 2·4096·888 = 7,274,496 B, and the permute's indices 8·888 = 7104 B each."""
    out = _terms(actmem.json("estimate", *_with("--seq-len", "400"), "--moe-expert-capacity-factor", "1.1",
                             "--moe-pad-expert-input-to-capacity"))
    assert (out["experts_input"], out["permute_sorted_indices"], out["permute_probs_indices"]) == (7_274_496, 7104, 7104)


def test_a_recomputed_module_inside_the_moe_modules_rerun_is_not_made_again_by_it():
    """The moe module's rerun runs the layer again with grad, and inside it the shared experts' own checkpoint
    keeps only its input and moe_act frees fc2's input once fc2 has run: with those recomputed too, the moe
    rerun holds less by their rows. Gated shared experts of f_s = 5632 at t = 1, N = 4096 (the rows of
    test_recompute_modules_moe_and_shared_experts): SwiGLU's input 92,274,688 + fc2's 46,137,344 + the gate's
    score 2N = 8192 + the output it scales 2Nh = 33,554,432 = 171,974,656 B; the experts' fc2 input 2·f_e·k·N =
    234,881,024 B."""
    from actmem.memory import engine
    from actmem.memory.techniques import run_technique
    from actmem.model.recompute import RecomputePolicy
    from actmem.model.spec import build_spec
    from actmem.sources.presets import load_preset

    preset = load_preset("mixtral-8x7b")
    arch = preset.architecture | {"moe_shared_ffn": 5632, "moe_shared_gate": True}
    spec = build_spec(preset.model, {"micro_batch": 1}, architecture=arch)

    def moe_rerun(label):
        technique = run_technique(False, RecomputePolicy.parse(label))
        return engine.exact(engine.rematerialised_bytes(technique, spec.architecture, module="moe"), spec.bindings())

    alone = moe_rerun("selective:moe")
    assert alone - moe_rerun("selective:moe+shared_experts") == 171_974_656
    assert alone - moe_rerun("selective:moe+moe_act") == 234_881_024


@pytest.mark.parametrize("args, fragment", [
    (["--moe-expert-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity", "--moe-imbalance", "2", "--ep", "8",
      "--gpus", "8"], "--moe-imbalance 2 with --moe-pad-expert-input-to-capacity: padded, every expert receives C rows"),
    (["--moe-pad-expert-input-to-capacity"], "--moe-pad-expert-input-to-capacity pads each expert's input to its "
                                              "capacity: give --moe-expert-capacity-factor"),
    (["--moe-expert-capacity-factor", "5", "--moe-pad-expert-input-to-capacity"],
     "C = ⌈k·N/E·factor⌉ (5120) at most the N = 4096 tokens a rank routes"),
])
def test_padding_that_megatron_refuses_or_fails_on_is_refused(actmem, args, fragment):
    """Megatron raises padding without a capacity factor (transformer_config.py); under alltoall a capacity
    above N, here ⌈2·4096/8·5⌉ = 5120 > 4096, fails in its permute (view(E, C) of E·N indices)."""
    assert_one_line_error(actmem("estimate", *MOE, *args), fragment)


def test_the_sequence_wise_aux_loss_counts_its_experts_a_sequence(actmem):
    """--moe-router-load-balancing-type seq_aux_loss (DeepSeek-V2/V3): the router views its routing map
    [s, b·E] (router.py, _apply_seq_aux_loss), so switch_load_balancing_loss_func keeps tokens_per_expert
    int64 [b·E]: at b = 2, 8·2·8 = 128 B against the batch-wide aux loss's 8E = 64; its scores are the same
    4NE = 4·8192·8 = 262,144 B (N = s·b = 8192)."""
    args = _with("--micro-batch", "2") if "--micro-batch" in MOE else MOE + ["--micro-batch", "2"]
    plain = _terms(actmem.json("estimate", *args))
    seq = _terms(actmem.json("estimate", *args, "--moe-router-load-balancing-type", "seq_aux_loss"))
    assert (plain["aux_loss_tokens_per_expert"], seq["aux_loss_tokens_per_expert"]) == (64, 128)
    assert plain["aux_loss_scores"] == seq["aux_loss_scores"] == 262_144


def test_a_pasted_load_balancing_list_is_read_as_megatron_reads_it(actmem, tmp_path):
    """Megatron's --moe-router-load-balancing-type takes a list; a list of one is its element
    (arguments.py), so Megatron's Mixtral script with `none` drops the aux loss's rows; two types
    are refused."""
    script = tmp_path / "mixtral.sh"
    text = MIXTRAL.read_text()
    assert "--moe-router-load-balancing-type aux_loss" in text
    script.write_text(text.replace("--moe-router-load-balancing-type aux_loss", "--moe-router-load-balancing-type none"))
    terms = _terms(actmem.json("estimate", "--megatron-args", f"@{script}", "--vocab-size", "32000", "--gpus", "32"))
    assert not {name for name in terms if name.startswith("aux_loss")} and "router_topk_indices" in terms
    script.write_text(text.replace("--moe-router-load-balancing-type aux_loss",
                                   "--moe-router-load-balancing-type seq_aux_loss aux_loss"))
    assert_one_line_error(actmem("estimate", "--megatron-args", f"@{script}", "--vocab-size", "32000", "--gpus", "32"),
                          "several load-balancing types")
    script.write_text(text.replace("--moe-aux-loss-coeff 1e-2", "--moe-aux-loss-coeff 1e-2 1e-3"))
    assert_one_line_error(actmem("estimate", "--megatron-args", f"@{script}", "--vocab-size", "32000", "--gpus", "32"),
                          "--moe-aux-loss-coeff 1e-2 1e-3: several load-balancing types")


HF = Path(__file__).parent / "data" / "hf"


def test_mixtrals_config_json_is_its_published_46_7b_parameters(actmem):
    """Mixtral-8x7B's config.json at t = 1: a layer's QKV 4096·(4096 + 2·8·128) = 25,165,824,
    projection 16,777,216, two RMSNorms 8,192, router 8·4096 = 32,768 and 8 experts of
    3·4096·14,336 = 176,160,768: 1,451,270,144; x 32 layers = 46,440,644,608; the embedding and the
    untied output 2·32,000·4096 = 262,144,000; the final norm 4,096: 46,702,792,704 (the model card's
    46.7B)."""
    out = actmem.json("estimate", "--model", f"{HF}/mixtral/config.json", "--seq-len", "4096")
    assert out["parameters"]["count"] == 46_702_792_704
    assert (out["architecture"]["num_experts"], out["architecture"]["moe_topk"]) == (8, 2)
    assert any("Megatron's default allgather" in note for note in out["assumptions"])


def test_qwen3_moes_config_json_is_its_published_30_5b_parameters(actmem):
    """Qwen3-30B-A3B's config.json at t = 1: a layer's QKV 2048·(32·128 + 2·4·128) = 10,485,760,
    projection 4096·2048 = 8,388,608, two RMSNorms 4,096, the q and k norms 2·128 = 256, router
    128·2048 = 262,144 and 128 experts of 3·2048·768 = 603,979,776: 623,120,640; x 48 =
    29,909,790,720; embedding and output 2·151,936·2048 = 622,329,856 (151,936 = 1187·128, no
    padding); final norm 2,048: 30,532,122,624 (the model card's 30.5B). At s = 4096, t = 1, k = 8:
    T = 8·4096 = 32,768 rows, the experts' fc1 output 4·768·32,768 = 100,663,296 B a layer."""
    out = actmem.json("estimate", "--model", f"{HF}/qwen3-30b-a3b/config.json", "--seq-len", "4096")
    assert out["parameters"]["count"] == 30_532_122_624
    assert _terms(out)["experts_fc1_output"] == 100_663_296


@pytest.mark.parametrize("changes, fragment", [
    ({"model_type": "dbrx"}, "a mixture-of-experts model (dbrx) is not supported yet"),
    ({"mlp_only_layers": [0, 1]}, "dense layers among the MoE layers"),
    ({"decoder_sparse_step": 2}, "dense layers among the MoE layers"),
])
def test_moe_configs_actmem_does_not_model_are_refused(actmem, tmp_path, changes, fragment):
    import json

    config = json.loads((HF / "qwen3-30b-a3b" / "config.json").read_text()) | changes
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert_one_line_error(actmem("estimate", "--model", str(path)), fragment)


def test_the_allgather_dispatcher_megatrons_default_keeps_its_local_experts_columns(actmem):
    """Without --moe-token-dispatcher-type Megatron runs allgather: it gathers the tokens of the
    ETP·EP ranks and keeps, for its E/EP experts, the map and probabilities of every gathered token,
    [E/EP, N·ETP·EP], and the indices of the rows its experts receive, int64 [T]. At t = 2 (SP),
    ETP = 2, EP = 2, s = 4096, b = 1: N = 2048, the map E·N·ETP = 8·2048·2 = 32,768 B, the
    probabilities twice that, 65,536 B; T = k·N·ETP = 8192 rows, the indices 8T = 65,536 B (alltoall
    keeps 8Nk = 32,768 B of sorted indices and an [E, N] map, 16,384 B)."""
    run = ["--tp", "2", "--sp", "--ep", "2", "--gpus", "8", "--global-batch", "16"]
    allgather = _terms(actmem.json("estimate", *MOE[:-2], *run))
    alltoall = _terms(actmem.json("estimate", *MOE, *run))
    assert (allgather["permute_routing_map"], allgather["permute_probs"], allgather["permute_local_indices"]) == \
        (32_768, 65_536, 65_536)
    assert "permute_sorted_indices" not in allgather and "permute_local_indices" not in alltoall
    assert (alltoall["permute_routing_map"], alltoall["permute_sorted_indices"]) == (16_384, 32_768)
    assert allgather["experts_input"] == alltoall["experts_input"]


def test_the_routers_dtype_widens_the_probabilities_the_layer_keeps(actmem):
    """--moe-router-dtype fp32 (Qwen3's and DeepSeek's Megatron scripts): the logits, and so the
    probabilities permute keeps ([E, N]) and the experts scale by ([T, 1]), are fp32: 4·E·N =
    4·8·4096 = 131,072 B and 4T = 4·8192 = 32,768 B at t = 1, s = 4096; fp64 twice that. The softmax's
    own outputs are fp32 either way (unchanged)."""
    bf16 = _terms(actmem.json("estimate", *MOE))
    fp32 = _terms(actmem.json("estimate", *MOE, "--moe-router-dtype", "fp32"))
    fp64 = _terms(actmem.json("estimate", *MOE, "--moe-router-dtype", "fp64"))
    assert (bf16["permute_probs"], fp32["permute_probs"], fp64["permute_probs"]) == (65_536, 131_072, 262_144)
    assert (bf16["experts_probs"], fp32["experts_probs"], fp64["experts_probs"]) == (16_384, 32_768, 65_536)
    assert bf16["router_topk_probs"] == fp32["router_topk_probs"] == fp64["router_topk_probs"]


def test_shared_experts_keep_a_tensor_parallel_mlps_rows_and_their_gate(actmem):
    """Shared experts of f_s = 2048 (one MLP every token passes), gated, at t = 2 with SP, s = 4096:
    the SwiGLU's input 2·2f_s·s·b/t = 2·4096·4096/2 = 16,777,216 B and fc2's 2·f_s·s·b/t = 8,388,608 B
    (split over t, the whole sequence: a tensor-parallel MLP); the gate's score 2·s·b/t = 4,096 B and
    the output it scales 2·s·b·h/t = 16,777,216 B (the tokens' shard). Overlapping the dispatcher,
    fc1 keeps its input gathered, 2·s·b·h = 33,554,432 B. Parameters a layer grow by the shared MLP's
    3·h·f_s/t = 3·4096·2048/2 = 12,582,912 and the gate's h = 4096."""
    run = ["--tp", "2", "--sp", "--gpus", "8", "--global-batch", "16"]
    plain = actmem.json("estimate", *MOE, *run)
    gated = actmem.json("estimate", *MOE, *run, "--moe-shared-expert-intermediate-size", "2048",
                        "--moe-shared-expert-gate")
    terms = _terms(gated)
    assert (terms["shared_experts_swiglu_input"], terms["shared_experts_fc2_input"]) == (16_777_216, 8_388_608)
    assert (terms["shared_experts_gate_score"], terms["shared_experts_output"]) == (4_096, 16_777_216)
    assert "shared_experts_fc1_input_gathered" not in terms
    assert gated["parameters"]["count"] - plain["parameters"]["count"] == 32 * (12_582_912 + 4096)
    overlap = _terms(actmem.json("estimate", *MOE, *run, "--moe-shared-expert-intermediate-size", "2048",
                                 "--moe-shared-expert-overlap"))
    assert overlap["shared_experts_fc1_input_gathered"] == 33_554_432
    assert "shared_experts_gate_score" not in overlap


@pytest.mark.parametrize("args, fragment", [
    (MOE + ["--moe-shared-expert-gate"], "give --moe-shared-expert-intermediate-size"),
    (MOE[:-2] + ["--moe-shared-expert-intermediate-size", "512", "--moe-shared-expert-overlap"],
     "--moe-shared-expert-overlap only works with the alltoall dispatcher"),
])
def test_shared_expert_settings_that_cannot_be_are_refused(actmem, args, fragment):
    assert_one_line_error(actmem("estimate", *args), fragment)


def test_the_qwen3_moe_preset_is_its_config_json(actmem):
    """The preset's numbers are the published config.json's: the same parameters and rows."""
    preset = actmem.json("estimate", "--model", "qwen3-30b-a3b")
    config = actmem.json("estimate", "--model", f"{HF}/qwen3-30b-a3b/config.json", "--seq-len", "4096")
    assert preset["parameters"]["count"] == config["parameters"]["count"] == 30_532_122_624
    assert _terms(preset) == _terms(config)


def test_qwen15_moes_config_json_is_its_published_14_3b_with_a_gated_shared_expert(actmem):
    """Qwen1.5-MoE-A2.7B (qwen2_moe): a layer's QKV 2048·6144 = 12,582,912 and its biases 6,144,
    projection 2048² = 4,194,304, two norms 4,096, router 60·2048 = 122,880, the shared expert's gate
    2,048 and MLP 3·2048·5632 = 34,603,008, 60 experts of 3·2048·1408: 519,045,120: 570,560,512 a layer;
    x 24 = 13,693,452,288; embedding and output 2·151,936·2048 = 622,329,856; final norm 2,048:
    14,315,784,192 (the model card's 14.3B). norm_topk_prob false: the softmax over every expert comes
    first (Megatron's --moe-router-pre-softmax), keeping its fp32 [N, E]: 4·60·4096 = 983,040 B at s = 4096."""
    out = actmem.json("estimate", "--model", f"{HF}/qwen1.5-moe-a2.7b/config.json", "--seq-len", "4096")
    assert out["parameters"]["count"] == 14_315_784_192
    terms = _terms(out)
    assert terms["router_softmax_probs"] == 983_040 and "router_topk_probs" not in terms
    assert terms["shared_experts_gate_score"] == 2 * 4096 and terms["shared_experts_output"] == 2 * 4096 * 2048


def test_top1_routing_is_priced_with_the_softmax_over_every_expert(actmem):
    """--moe-router-topk 1 --moe-router-pre-softmax (Megatron requires both): T = N = 4096 rows at t = 1,
    the experts' input 2·4096·4096 = 33,554,432 B; the router's fp32 softmax [N, E] 4·8·4096 = 131,072 B."""
    terms = _terms(actmem.json("estimate", *_with("--moe-router-topk", "1"), "--moe-router-pre-softmax"))
    assert (terms["experts_input"], terms["router_softmax_probs"]) == (33_554_432, 131_072)


def test_the_sigmoid_router_keeps_its_scores_their_sum_and_the_chosen_ones(actmem):
    """--moe-router-score-function sigmoid with the expert bias (DeepSeek-V3's router), t = 1, s = 4096,
    E = 8, k = 2, 16-bit logits: sigmoid's fp32 output 4·N·E = 4·4096·8 = 131,072 B; the gather's 16-bit
    scores 2NE = 65,536 B (the bias); their sum 2N = 8,192 B and the chosen scores 2Nk = 16,384 B (k > 1);
    the aux loss's sigmoid scores in 16 bits, 2NE = 65,536 B, their sum 8,192 B and the loss 2 B; no
    softmax row. In fp32 the gather's scores are sigmoid's own storage: no row."""
    sigmoid = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
    terms = _terms(actmem.json("estimate", *MOE, *sigmoid))
    assert (terms["router_sigmoid"], terms["router_sigmoid_scores"], terms["router_score_sum"],
            terms["router_topk_scores"]) == (131_072, 65_536, 8_192, 16_384)
    assert (terms["aux_loss_scores"], terms["aux_loss_score_sum"], terms["aux_loss_value"]) == (65_536, 8_192, 2)
    assert "router_topk_probs" not in terms
    fp32 = _terms(actmem.json("estimate", *MOE, *sigmoid, "--moe-router-dtype", "fp32"))
    assert "router_sigmoid_scores" not in fp32 and fp32["aux_loss_value"] == 4 and fp32["router_score_sum"] == 16_384
    assert_one_line_error(actmem("estimate", *MOE, "--moe-router-enable-expert-bias"),
                          "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")


def test_group_limited_routing_keeps_its_mask_where_its_top_k_gives_the_probabilities(actmem):
    """--moe-router-num-groups 4 --moe-router-group-topk 2: masked_fill keeps the bool mask of the groups
    not chosen, [N, E]: 4096·8 = 32,768 B at t = 1, s = 4096 (softmax, or sigmoid without the bias); with
    the expert bias the top-k's values are discarded and the mask with them: no row."""
    groups = ["--moe-router-num-groups", "4", "--moe-router-group-topk", "2"]
    assert _terms(actmem.json("estimate", *MOE, *groups))["router_group_mask"] == 32_768
    biased = _terms(actmem.json("estimate", *MOE, *groups, "--moe-router-score-function", "sigmoid",
                                "--moe-router-enable-expert-bias"))
    assert "router_group_mask" not in biased
    assert_one_line_error(actmem("estimate", *MOE, "--moe-router-num-groups", "4"),
                          "give --moe-router-num-groups and --moe-router-group-topk together")
    assert_one_line_error(actmem("estimate", *MOE, "--moe-router-num-groups", "3", "--moe-router-group-topk", "2"),
                          "--moe-router-num-groups (3) must divide the experts (8)")


def test_the_sigmoid_router_ignores_pre_softmax_as_megatron_does(actmem):
    """DeepSeek-R1's and Kimi K2's Megatron scripts pass --moe-router-pre-softmax beside the sigmoid
    router, whose branch never reads it (moe_utils.py): the same rows as without it."""
    sigmoid = ["--moe-router-score-function", "sigmoid"]
    assert _terms(actmem.json("estimate", *MOE, *sigmoid, "--moe-router-pre-softmax")) == \
        _terms(actmem.json("estimate", *MOE, *sigmoid))


def test_shared_experts_split_over_t_need_t_to_divide_them(actmem):
    assert_one_line_error(actmem("estimate", *MOE, "--tp", "2", "--sp", "--moe-shared-expert-intermediate-size",
                                 "1001"), "t (2) must divide the shared experts' hidden size f_s (1001)")


def test_flops_counts_dense_layers_among_moe_layers_at_their_own_weights():
    """--moe-layer-freq '([0]*1+[1]*3)' at L = 4 with Mixtral's dims: a MoE layer's token multiplies
    W_e = 394,297,344 weights (attention 41,943,040, the router 32,768, two experts of 3h·f_e =
    176,160,768), the dense layer's W = 41,943,040 + 3h·f = 218,103,808: 6·B·s·(3·W_e + W) beside the
    scores 12·B·s²·L·ad and the logits 6·B·s·h·v, B = 8."""
    from actmem.model.architecture import Architecture
    from actmem.model.spec import Model
    from actmem.planner.flops import flops_report
    from actmem.sources.presets import load_preset

    preset = load_preset("mixtral-8x7b")
    arch = Architecture(**preset.architecture | {"moe_layer_freq": "([0]*1+[1]*3)"})
    out = flops_report(Model(**preset.model | {"layers": 4}), 8, None, 989e12, None, arch)
    B, s, h, v = 8, 4096, 4096, 32000
    assert out["model_flops"] == pytest.approx(6 * B * s * (3 * 394_297_344 + 218_103_808)
                                               + 12 * B * s * s * 4 * 4096 + 6 * B * s * h * v)
    assert "L_e = 3, L_d = 1" in out["model_flops_formula"]["where"]


def test_dense_layers_among_moe_layers_are_counted_by_kind(actmem):
    """--moe-layer-freq '([0]*1+[1]*3)' (DeepSeek-V3's first-k-dense, k = 1) at L = 4, p = 2, 1F1B: the
    first stage holds layers 0 (dense) and 1 (MoE) for its p = 2 microbatches in flight. At t = 1,
    s = 4096, b = 1, f = f_e = 14,336, E = 8, k = 2 (T = 8192 rows):
    - attention and the MLP's norm, alike in both: 4 x 2sbh + 2 x 2sb·gd + 4bas + 2 x 4sb (RMSNorm's rsigma)
      + 2sbh = 5·33,554,432 + 2·8,388,608 + 524,288 + 2·16,384;
    - the dense MLP: fc1's input 2sbh, SwiGLU's 4sbf, fc2's 2sbf;
    - the MoE MLP: router 2sbh + 8Nk + 4Nk, aux 4NE + 8E + 4, permute NE + 2NE + 8Nk, experts 2hT + 4f_e·T
      + 2T + 2f_e·T.
    Parameters of the first stage: the dense layer 25,165,824 + 16,777,216 + 8,192 + 3·4096·14,336 =
    218,112,000; the MoE layer 41,984,000 and its 8 experts 1,409,286,144; the embedding 131,072,000."""
    s, h, g_d, f, N, k, E, T = 4096, 4096, 1024, 14336, 4096, 2, 8, 8192
    shared = 5 * 2 * s * h + 2 * 2 * s * g_d + 4 * 32 * s + 2 * 4 * s
    dense = shared + 2 * s * h + 4 * s * f + 2 * s * f
    moe = (shared + 2 * s * h + 8 * N * k + 4 * N * k + 4 * N * E + 8 * E + 4 + N * E + 2 * N * E + 8 * N * k
           + 2 * h * T + 4 * f * T + 2 * T + 2 * f * T)
    args = [*_with("--layers", "4"), "--moe-layer-freq", "([0]*1+[1]*3)", "--pp", "2", "--gpus", "2",
            "--global-batch", "8"]
    out = actmem.json("estimate", *args)
    assert out["activations_bytes"] == 2 * (dense + moe)
    assert out["parameters"]["count"] == 218_112_000 + 41_984_000 + 1_409_286_144 + 131_072_000
    counts = {row["term"]: row["count"] for row in out["run_terms"]}
    assert (counts["qkv_input"], counts["fc1_input"], counts["router_input"], counts["experts_input"]) == (4, 2, 2, 2)
    last = actmem.json("estimate", *args, "--stage", "1")            # two MoE layers, one microbatch in flight
    assert {row["term"]: row["count"] for row in last["run_terms"]}["experts_input"] == 2
    assert "fc1_input" not in {row["term"] for row in last["run_terms"]}


@pytest.mark.parametrize("args, fragment", [
    (_with("--layers", "4") + ["--moe-layer-freq", "([0]*1+[1]*2)"], "--moe-layer-freq lists 3 layers; the model has 4"),
    (_with("--layers", "4") + ["--moe-layer-freq", "2", "--pp", "2", "--interleave", "2"],
     "dense layers among MoE layers (--moe-layer-freq) are modelled without interleaving"),
    (MOE + ["--moe-layer-freq", "[0]*2+[2]*30"], "--moe-layer-freq must list 0 (dense) and 1 (MoE) layers"),
    (MOE[:MOE.index("--num-experts")] + ["--moe-layer-freq", "2"], "give --num-experts"),
])
def test_layer_patterns_that_cannot_be_are_refused(actmem, args, fragment):
    assert_one_line_error(actmem("estimate", *args), fragment)


def test_the_run_line_names_the_experts_layout(actmem):
    """The header's run line writes EP and ETP as plan does: ep= where EP > 1, etp= where ETP is not t."""
    assert "run    t=1 ep=8 p=4 m=1 b=1" in actmem("estimate", "--model", "mixtral-8x7b").stdout
    out = actmem("estimate", "--model", "mixtral-8x7b", "--ep", "4", "--etp", "1", "--tp", "2", "--sp", "--gpus", "32")
    assert "run    t=2 ep=4 etp=1 p=4 m=1 b=1" in out.stdout


def test_forced_load_balancing_is_named_and_changes_nothing(actmem):
    """--moe-router-force-load-balancing (Megatron's DeepSeek-V3 recipe) replaces the router's logits by random
    ones through RandomSTE, which saves nothing (moe_utils.py): the same rows, balanced, and the argument is
    named as ignored."""
    plain = actmem.json("estimate", "--model", "mixtral-8x7b", "--megatron-args", "--bf16")
    forced = actmem.json("estimate", "--model", "mixtral-8x7b", "--megatron-args",
                         "--bf16 --moe-router-force-load-balancing")
    assert forced["activations_bytes"] == plain["activations_bytes"]
    assert any("--moe-router-force-load-balancing" in line for line in forced["assumptions"])


def test_a_rerun_holds_what_the_reruns_before_it_still_hold():
    """The order Megatron's backward runs the reruns of one layer in (DeepSeek-V3, t = 1, s = 4096; a review of
    megatron-core 0.16.1's source, and measured for the CheckpointWithoutOutput reruns: tests/validate, the rerun
    rows):
    - mla_up_proj's rerun (hooked on the core's output gradient) comes before the core's, whose checkpoint then
      reruns on the q, k and v it restored: the core's rerun holds all of mla_up_proj's (q, k, v twice, the
      latents' norms) on top of its own;
    - moe_act's rerun runs inside the moe checkpoint's backward: it holds all that moe's rerun made;
    - the shared experts' checkpoint runs backward after the routed experts and the router: its rerun finds their
      rows freed, every one of them (the router's input, one storage with the checkpoint's, stays)."""
    from actmem.memory import engine
    from actmem.memory.techniques import run_technique
    from actmem.model.recompute import RecomputePolicy
    from actmem.model.spec import build_spec
    from actmem.sources.presets import load_preset

    preset = load_preset("deepseek-v3")
    spec = build_spec(preset.model, {"micro_batch": 1, "expert_parallel": 64, "gpus": 64},
                      architecture=preset.architecture | {"mtp_layers": 0})
    arch, bindings = spec.architecture_at(1), spec.bindings()

    def rerun(modules, unit):
        technique = run_technique(False, RecomputePolicy.parse(f"selective:{modules}"))
        return engine.exact(engine.rematerialised_bytes(technique, arch, module=unit), bindings)

    up = rerun("core_attn+mla_up_proj", "mla_up_proj")
    assert up > 6 * 2 * 4096 * 128 * 128         # q, k and v twice: 128 heads of d 192, 192 and 128
    assert rerun("core_attn+mla_up_proj", "core_attn") == rerun("core_attn", "core_attn") + up
    assert rerun("moe+moe_act", "moe_act") == rerun("moe_act", "moe_act") + rerun("moe+moe_act", "moe")
    shared = run_technique(False, RecomputePolicy.parse("selective:shared_experts"))
    freed = {term.name for term in engine.freed_layer_rows(shared, arch, "shared_experts")}
    routed = {term.name for term in engine.layer_terms(arch) if term.module_of(arch) == "moe"}
    assert routed - {"router_input"} <= freed and "router_input" not in freed


def test_the_dispatchers_sorted_indices_are_held_at_the_shared_experts_rerun_with_one_chunk_in_flight():
    """The token dispatcher keeps the permutation's sorted indices as its own attribute until the layer's next
    forward (token_dispatcher.py: reversed_local_input_permutation_mapping; measured: tests/validate, the shared
    experts' rerun row). With one chunk in flight the backward's microbatch made them, and they are held when the
    shared experts rerun; with two, a later forward has replaced them and the backward freed them (but on the
    stage with the output layer, whose first backward is of the microbatch its last chunk just ran). DeepSeek-V3,
    t = 1, s = 4096, b = 1, top-8: int64 [N·k] = 8·4096·8 = 262,144 B. The rerun itself (one ungated shared expert
    of f_s = 2048) holds the SwiGLU's input 2·2·2048·4096 = 33,554,432, fc2's input 2·2048·4096 = 16,777,216 and
    the output it made again, 2Nh = 2·4096·7168 = 58,720,256 B (CheckpointFunction.backward holds what it made)."""
    from actmem.memory import engine
    from actmem.memory.stage_model import StageCounts, stage_activations
    from actmem.memory.techniques import run_technique
    from actmem.model.recompute import RecomputePolicy
    from actmem.model.spec import build_spec
    from actmem.sources.presets import load_preset

    preset = load_preset("deepseek-v3")
    spec = build_spec(preset.model, {"micro_batch": 1, "expert_parallel": 64, "gpus": 64},
                      architecture=preset.architecture | {"mtp_layers": 0})
    arch = spec.architecture_at(1)
    shared = run_technique(False, RecomputePolicy.parse("selective:shared_experts"))

    def freed(chunks, last=0):
        bindings = spec.bindings() | {engine.microbatches_held: 1, engine.holds_output: last}
        moments = stage_activations(shared, arch, lambda expr: engine.exact(expr, bindings), StageCounts(4, chunks)
                                    ).moments
        start, rerun = (next(m for m in moments if m.name == name) for name in ("start", "rerun"))
        return start.bytes - rerun.parts[0].bytes, rerun.parts[1].bytes

    assert not arch.moe_shared_gate and arch.moe_shared_ffn == 2048
    (one, remade), (two, same) = freed(1), freed(2)
    assert two - one == 8 * 4096 * 8 == 262_144 and remade == same
    # on the stage with the output layer the first backward follows its last chunk's forward of the same microbatch,
    # interleaved too (five chunks in flight): held
    assert freed(5, last=1)[0] == freed(1, last=1)[0]
    assert remade == 33_554_432 + 16_777_216 + 58_720_256 == 109_051_904


def test_the_peak_names_the_rerun_that_decides_it_and_mlp_says_it_changes_nothing_beside_experts(actmem):
    """DeepSeek-V3 with every module recomputed (t = 1, s = 4096): the experts' activation's rerun decides, and the
    moment says so. It runs inside the moe checkpoint's backward, which holds all that moe's rerun made and the
    layer's output it made again, 2·4096·7168 = 58,720,256 B; without that output it held 17 MB less than the
    attention core's rerun (which holds the up projections' q, k and v twice and the input norm's output) and the
    core's decided. Mixtral, whose every layer
    has experts: --recompute-modules mlp changes no byte (Megatron recomputes a dense layer's MLP only), and says so
    rather than describe a checkpoint that does not run."""
    every = actmem.json("estimate", "--model", "deepseek-v3", "--pp", "8", "--last-stage-layers", "5", "--recompute",
                        "selective", "--recompute-modules", "layernorm,mla_up_proj,core_attn,moe,moe_act,shared_experts")
    assert every["stages"][0]["peak_floor"]["moment"] == "the first backward, the experts' activation's (moe_act) rerun done"
    mlp = actmem.json("estimate", "--model", "mixtral-8x7b", "--recompute", "selective", "--recompute-modules", "mlp")
    plain = actmem.json("estimate", "--model", "mixtral-8x7b")
    assert mlp["verdict_bytes"] == plain["verdict_bytes"]
    notes = " ".join(mlp["assumptions"])
    assert "recompute module mlp changes no byte here" in notes and "so the MLP keeps only" not in notes
    assert "saves memory instead" not in notes
