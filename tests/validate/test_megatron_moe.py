"""megatron-core's own MoE layer measured against the MoE rows of actmem's table (issue 27):
`actmem validate --grid moe` runs megatron-core 0.16.1's MoELayer over real gloo ranks."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from actmem_validate.compare import judge, term_rows  # noqa: E402
from actmem_validate.megatron_moe import _layer_terms, formula, measure, moe_grid, moe_spec  # noqa: E402
from actmem.memory.terms import MOE_TERMS as TERMS_OF_MOE  # noqa: E402
from actmem.model.symbols import r  # noqa: E402
from tests.conftest import assert_one_line_error  # noqa: E402
from tests.validate.cli_grid import validate_grid  # noqa: E402

#: every row of the table's MoE layer: the grid must measure each on some layout
MOE_TERMS = {term.name for term in TERMS_OF_MOE}


@pytest.fixture(scope="module")
def grid_rows():
    return validate_grid("moe")        # CI's run of `actmem validate --grid moe` (tests/validate/cli_grid.py)


def test_every_row_of_megatrons_moe_layer_is_counted_to_the_byte(grid_rows):
    """Seven layouts (the alltoall and allgather dispatchers; EP = 2; t = ETP = 2; t = 2 beside EP = 2 and
    ETP = 1; the softmax router over the top-k, over every expert at top-1, and the sigmoid router with and
    without the expert bias; the router in fp32 and fp64; shared experts, gated and overlapping; the aux loss
    at Megatron's default coefficient 0; selective recompute of the whole layer, moe, and of the shared experts
    (under both dispatchers);
    inside a TransformerLayer after its pre-MLP norm, as it is and with layernorm recomputed; a capacity factor
    of 0.5 dropping by probability under alltoall and by position under allgather, of 1.5 dropping beside EP = 2,
    padded to capacity under both dispatchers; TE's grouped GEMM (TEGroupedMLP over a GroupedLinear stand-in),
    with moe_act recomputed; TE's fused permutation (its stand-in) under both dispatchers, padded too; beside
    context parallelism c = 2 under both dispatchers, the sequence-wise aux loss too; FP8 experts under the
    tensorwise and delayed recipes, over both dispatchers, beside EP = 2, at t = 2, with moe_act recomputed, beside
    shared experts under both recipes, overlapping the dispatcher too, and under MXFP8 and blockwise scaling,
    their bulk buffers, and recomputed through TE's checkpoint, the whole layer and the shared experts; a bf16
    layer of an FP8 run, its rows padded to 16 beside EP = 2 and to 32 at t = 2), every
    rank: each row measured equals its formula, nothing unnamed, the totals equal; and every MoE row of the
    table is measured, non-zero, on some layout."""
    assert judge(grid_rows, 0.0) == []
    assert len({row["config"] for row in grid_rows}) == 42
    measured = {row["term"] for row in grid_rows if row["kind"] == "paper" and row["measured_bytes"] > 0}
    assert MOE_TERMS - measured == set()


def test_the_experts_rows_are_what_the_rank_received(grid_rows):
    """At t = ETP = 2, EP = 1 the dispatcher all-gathers the tokens over the expert-tensor-parallel group,
    so both ranks' experts receive every routed row, balanced whatever the routing: T = k·s·b = 2·16·2 = 64,
    the experts' input 2·h·T = 2·16·64 = 2048 B on each rank."""
    gathered = [row for row in grid_rows if "t=2 EP=1 ETP=2 alltoall" in row["config"]
                and "selective" not in row["config"] and "in a layer" not in row["config"] and "fp8" not in row["config"]
                and row["term"] == "experts_input"]
    assert [row["measured_bytes"] for row in gathered] == [2048, 2048]


def _kept(grid_rows, fragment: str, term: str) -> list:
    """A term's measured bytes on each rank of the layouts whose label holds ``fragment`` (ending it, where the
    fragment ends in '$')."""
    return [row["measured_bytes"] for row in grid_rows if row["term"] == term and (
        row["config"].endswith(fragment[:-1]) if fragment.endswith("$") else fragment in row["config"])]


def test_padded_to_capacity_every_expert_receives_c_rows_from_each_rank(grid_rows):
    """Alltoall beside EP = 2, factor 1.5, h = 16, N = s·b = 32, k = 2, E = 8: C = ⌈2·32/8·1.5⌉ = 12, so each of a
    rank's 4 experts receives C·EP = 24 rows, 96 a rank whatever the routing: the experts' input 2·16·96 = 3072 B;
    the permute keeps two int64 [E·C] = [96] index vectors, 768 B each, and no [E, N] map. Allgather at t = 2,
    factor 0.5: N = 16 a rank, C = ⌈2·16/8·0.5⌉ = 2, T = E·C·ETP = 8·2·2 = 32 rows, 2·16·32 = 1024 B."""
    assert _kept(grid_rows, "EP=2 ETP=1 alltoall router bf16 capacity 1.5 by probs padded", "experts_input") == [3072] * 2
    assert _kept(grid_rows, "EP=2 ETP=1 alltoall router bf16 capacity 1.5 by probs padded", "permute_probs_indices") \
        == [768] * 2
    assert _kept(grid_rows, "allgather router bf16 capacity 0.5 by probs padded", "experts_input") == [1024] * 2


def test_above_factor_1_a_rank_receives_more_than_k_n_and_the_old_cap_fails(grid_rows):
    """Factor 1.5 beside EP = 2 (drop only): each expert takes up to C = 12 rows from each of 2 ranks, so a rank's 4
    experts up to 96, above the balanced k·N = 64: this routing gives one rank more than 64 (measured), which the
    table's cap E·min(C, N)·ETP admits; the cap an earlier table had, min(k·N, E·C)·ETP = 64, fails the gate."""
    config = next(c for c in moe_grid() if "capacity 1.5 by probs aux" in c.label)
    ranks = measure(config)
    assert max(received for _, received, _, _, _, _ in ranks) > 64
    for rank, received, kept, _, named, _ in ranks:
        assert judge(term_rows(config, rank, formula(config.spec, config.technique, received, kept_copies=kept),
                               named), 0.0) == []
    rank, received, kept, _, named, _ = max(ranks, key=lambda r: r[1])
    capped = formula(config.spec, config.technique, min(received, 64), kept_copies=kept)
    assert judge(term_rows(config, rank, capped, named), 0.0)


def test_moe_act_frees_the_experts_fc2_input(grid_rows):
    """TEGroupedMLP (its GroupedLinear a stand-in keeping TE's split views) at t = ETP = 2: T = k·s·b = 64 rows, f_e/ETP
    = 5; without recompute fc2 keeps its input 2·5·T = 640 B (the SequentialMLP rows, test above); under
    --recompute-modules moe_act it is freed once fc2 has run (0 B), fc1's output 4·5·64 = 1280 and the
    probabilities 2·64 = 128 kept by the checkpoint."""
    act = "grouped shared aux 0.01 selective:moe_act$"
    assert _kept(grid_rows, act, "experts_fc2_input") in ([], [0, 0])
    assert _kept(grid_rows, act, "experts_fc1_output") == [1280] * 2 and _kept(grid_rows, act, "experts_probs") == [128] * 2


def test_the_fused_permutation_keeps_tes_row_map(grid_rows):
    """TE's fused permute (its stand-in) at EP = 1, N = 32, E = 8: the int32 row map [N, 2E+1], 4·32·17 = 2176 B, and
    the two chunk sorts' int32 [T] maps of the 8 local experts, 2·4·64 = 512 B, in place of the [E, N] map, the
    probabilities and the int64 indices (0 B); under allgather beside EP = 2 the map of the 64 gathered tokens
    over the 4 local experts, 4·64·9 = 2304 B, the dispatcher's own map and probabilities kept."""
    fused = "t=1 EP=1 ETP=1 alltoall router bf16 fused aux"
    assert _kept(grid_rows, fused, "permute_row_id_map") == [2176] and _kept(grid_rows, fused, "permute_chunk_maps") == [512]
    assert not [n for n in _kept(grid_rows, fused, "permute_sorted_indices") + _kept(grid_rows, fused, "permute_probs") if n]
    assert _kept(grid_rows, "allgather router bf16 fused", "permute_row_id_map") == [2304] * 2


def test_the_moe_modules_checkpoint_keeps_the_routers_input_alone(grid_rows):
    """--recompute-modules moe at t = 2 (SP), h = 16, s = 16, b = 2: each rank keeps the router's input,
    2·(s/t)·b·h = 512 B, and nothing else of the layer; so under FP8 (h = 32: 1024 B), where Megatron checkpoints
    through TE's checkpoint (its stand-in)."""
    def kept(fp8: bool):
        return [(row["term"], row["measured_bytes"]) for row in grid_rows if row["config"].endswith("selective:moe")
                and ("fp8" in row["config"]) == fp8 and row["measured_bytes"] and row["kind"] != "rerun"]
    assert kept(False) == [("router_input", 512), ("total", 512)] * 2
    assert kept(True) == [("router_input", 1024), ("total", 1024)] * 2


def test_layernorm_frees_the_norms_output_the_router_keeps(grid_rows):
    """Inside a TransformerLayer at t = 2 (SP), h = 16, s = 16, b = 2: the pre-MLP norm keeps its input 2·8·2·16
    = 512 B and rsigma 4·8·2 = 64, and the router its output, 512; with --recompute-modules layernorm the norm's
    output is freed once the MoE layer has run, and its statistics are not kept: the input alone stays."""
    def kept(suffix):
        return {row["term"]: row["measured_bytes"] for row in grid_rows if row["config"].endswith(suffix)
                and row["rank"] == 0 and row["term"] in ("mlp_layernorm_input", "mlp_norm_statistics", "router_input")}
    assert kept("aux 0.01 in a layer") == {"mlp_layernorm_input": 512, "mlp_norm_statistics": 64, "router_input": 512}
    assert kept("selective:layernorm in a layer") == {"mlp_layernorm_input": 512, "mlp_norm_statistics": 0,
                                                      "router_input": 0}


def test_the_gate_fails_a_row_left_out_of_the_formula_or_a_tensor_no_row_names():
    """Inject the failures: the formula without the aux loss's scores (measured, not in the formula),
    the formula with a row the layer does not keep, and a saved tensor named by no row."""
    config = moe_grid()[0]
    rank, received, kept, _, named, _ = measure(config)[0]
    expected = formula(config.spec, config.technique, received, kept_copies=kept)
    assert judge(term_rows(config, rank, expected, named), 0.0) == []
    missing = {name: n for name, n in expected.items() if name != "aux_loss_scores"}
    assert any("aux_loss_scores measured" in line for line in judge(term_rows(config, rank, missing, named), 0.0))
    extra = expected | {"experts_fc1_output": expected["experts_fc1_output"] + 2}
    assert judge(term_rows(config, rank, extra, named), 0.0)
    stray = named | {"unnamed bfloat16 [3, 5]": 30}
    assert any("no term or named residual" in line for line in judge(term_rows(config, rank, expected, stray), 0.0))


def test_dims_that_would_make_two_expert_tensors_alike_are_refused():
    """The saved tensors are named by their shape: h = 16 beside 2f_e/ETP = 16 could not be told apart."""
    from dataclasses import replace

    spec = moe_spec()
    alike = replace(spec, architecture=replace(spec.architecture, moe_ffn_hidden=8))
    with pytest.raises(ValueError, match="two expert tensors one width"):
        from actmem_validate.megatron_moe import _named

        _named([], alike, 0)


@pytest.mark.parametrize("args, fragments", [
    (["--grid", "moe", "--mode", "fake"], ["--grid moe runs megatron-core's MoE layer on real CPU ranks"]),
    (["--grid", "moe", "--tp", "2"], ["--grid moe sets the model, run and techniques itself; drop --tp"]),
    (["--model", "llama-3.1-8b", "--layers", "2", "--num-experts", "8", "--moe-token-dispatcher-type", "alltoall"],
     ["validate measures mixture-of-experts layers with --grid moe"]),
])
def test_validate_refuses_a_moe_run_it_cannot_measure(actmem, args, fragments):
    assert_one_line_error(actmem("validate", *args), *fragments)


def test_fp8_experts_keep_one_byte_copies_of_padded_rows(grid_rows):
    """Delayed scaling at t = ETP = 2, EP = 1 (h = 32, f_e/ETP = 48): each rank's 8 experts receive T = k·s·b = 64
    rows, each expert's padded to a multiple of 16; fc1 keeps each expert's one-byte copy and its 4-byte
    scale_inv, 32·T_pad + 32, fc2 48·T_pad + 32, the SwiGLU 4·48·T_pad, the probabilities 2·T_pad, and no 16-bit
    input of either. Whatever T_pad the routing made, the four rows agree on it; moe_act (tensorwise) frees fc2's."""
    config = "t=2 EP=1 ETP=2 alltoall router bf16 grouped fp8 delayed aux 0.01"
    fc1, fc2 = (_kept(grid_rows, config, term) for term in ("experts_input", "experts_fc2_input"))
    swiglu, probs = (_kept(grid_rows, config, term) for term in ("experts_fc1_output", "experts_probs"))
    for rank in range(2):
        padded = (fc1[rank] - 32) // 32
        assert padded % 16 == 0 and 64 <= padded <= 64 + 8 * 15
        assert (fc2[rank], swiglu[rank], probs[rank]) == (48 * padded + 32, 4 * 48 * padded, 2 * padded)
    assert _kept(grid_rows, "fp8 tensorwise aux 0.01 selective:moe_act", "experts_fc2_input") in ([], [0, 0])


def test_the_gate_fails_fp8_experts_priced_wrong():
    """Inject the failures on the tensorwise layer beside EP = 2: the rows priced in 16 bits (FP8 not counted), the
    padding at its most rather than what the routing made, the 16-bit padded input held too, a scale_inv missing."""
    from dataclasses import replace

    config = next(c for c in moe_grid() if "EP=2 ETP=1 alltoall router bf16 grouped fp8 tensorwise" in c.label)
    rank, received, kept, padded, named, _ = measure(config)[0]
    expected = formula(config.spec, config.technique, received, kept_copies=kept, padding=padded)
    assert judge(term_rows(config, rank, expected, named), 0.0) == []
    bf16 = replace(config.spec, architecture=config.spec.architecture.bf16_twin())
    assert judge(term_rows(config, rank, formula(bf16, config.technique, received, kept_copies=kept), named), 0.0)
    at_most = formula(config.spec, config.technique, received, kept_copies=kept)
    if at_most != expected:
        assert judge(term_rows(config, rank, at_most, named), 0.0)
    held = named | {"experts_input": named["experts_input"] + 2 * 32 * padded[0]}
    assert judge(term_rows(config, rank, expected, held), 0.0)
    lost = named | {"experts_fc2_input": named["experts_fc2_input"] - 4}
    assert judge(term_rows(config, rank, expected, lost), 0.0)


def test_a_bf16_layer_of_an_fp8_run_keeps_16_bit_padded_rows(grid_rows):
    """--first-last-layers-bf16 beside experts: TEGroupedMLP pads each expert's rows whenever the run is FP8
    (experts.py: config.fp8), so a bf16 layer keeps 16-bit tensors of the padded rows: beside EP = 2 (h = 16,
    f_e = 10, the router in bf16) the experts' input 2·16·T_pad, fc1's output 2·2·10·T_pad, the probabilities
    2·T_pad, fc2's input 2·10·T_pad, T_pad a multiple of 16 and at least the 64 rows a rank receives balanced, at
    most 64 + 4·15 more (4 local experts); at t = ETP = 2, E = 8 experts each padded to 32: T_pad >= 64 (every
    rank receives k·s·b) and fc2's input freed under moe_act."""
    hopper = "EP=2 ETP=1 alltoall router bf16 grouped bf16 layer of an fp8 run (rows padded to 16)"
    inputs = _kept(grid_rows, hopper, "experts_input")
    assert len(inputs) == 2
    for rank, experts_input in enumerate(inputs):
        padded = experts_input // 32
        assert experts_input == 32 * padded and padded % 16 == 0
        assert (_kept(grid_rows, hopper, "experts_fc1_output")[rank], _kept(grid_rows, hopper, "experts_probs")[rank],
                _kept(grid_rows, hopper, "experts_fc2_input")[rank]) == (40 * padded, 2 * padded, 20 * padded)
    assert 128 <= sum(inputs) // 32 <= 128 + 2 * 4 * 15       # k·s·b = 64 rows a rank, 128 over both
    blackwell = "t=2 EP=1 ETP=2 alltoall router bf16 grouped bf16 layer of an fp8 run (rows padded to 32)"
    for experts_input in _kept(grid_rows, blackwell, "experts_input"):
        assert experts_input % (32 * 32) == 0 and 64 <= experts_input // 32 <= 64 + 8 * 31
    assert not [n for n in _kept(grid_rows, blackwell, "experts_fc2_input") if n]


def test_the_gate_fails_a_bf16_layer_of_an_fp8_run_priced_unpadded():
    """Inject the failure: the bf16 layer beside EP = 2 priced as a bf16 run's (no padding) fails wherever routing
    left an expert's rows short of a multiple of 16; padded as measured, it passes."""
    from dataclasses import replace

    config = next(c for c in moe_grid() if "grouped bf16 layer of an fp8 run (rows padded to 16)" in c.label)
    measured = measure(config)
    assert any(padded[0] != received for _, received, _, padded, _, _ in measured)    # the routing leaves rows to pad
    for rank, received, kept, padded, named, _ in measured:
        expected = formula(config.spec, config.technique, received, kept_copies=kept, padding=padded)
        assert judge(term_rows(config, rank, expected, named), 0.0) == []
        unpadded = replace(config.spec, architecture=replace(config.spec.architecture, moe_bf16_padding=None))
        wrong = formula(unpadded, config.technique, received, kept_copies=kept)
        assert (padded[0] == received) == (judge(term_rows(config, rank, wrong, named), 0.0) == [])


def test_fp8_shared_experts_keep_what_te_s_linears_keep(grid_rows):
    """Shared experts of f_s = 128 (h = 32, s·b = 32): fc2 keeps its input's columnwise copy and scale_inv,
    s·b·f_s/t + 4: 32·64 + 4 = 2052 at t = 2, 32·128 + 4 = 4100 at t = 1; fc1 keeps, under tensorwise, the
    router's input (nothing of its own); under delayed scaling its input quantized, 32·32 + 4 = 1028 (the rank's
    whole input at t = 1; overlapping the dispatcher at t = 2, the input it gathered ahead, whose 16-bit copy is
    then freed; not overlapping at t = 2, the rank's shard, 516)."""
    tensorwise = "t=2 EP=1 ETP=2 alltoall router bf16 grouped fp8 tensorwise shared aux 0.01$"
    overlap = "grouped fp8 delayed shared gated overlap"
    whole = "t=1 EP=2 ETP=1 alltoall router bf16 grouped fp8 delayed shared aux"
    assert _kept(grid_rows, tensorwise, "shared_experts_fc2_input") == [2052] * 2
    assert not [n for n in _kept(grid_rows, tensorwise, "shared_experts_fc1_input_fp8") if n]
    assert _kept(grid_rows, overlap, "shared_experts_fc1_input_gathered_fp8") == [1028] * 2
    assert not [n for n in _kept(grid_rows, overlap, "shared_experts_fc1_input_gathered") if n]
    assert _kept(grid_rows, whole, "shared_experts_fc1_input_fp8") == [1028] * 2
    assert _kept(grid_rows, whole, "shared_experts_fc2_input") == [4100] * 2
    # delayed at t = 2 not overlapping: the rank's shard, s·b/t·h + 4 = 16·32 + 4
    shard = "t=2 EP=1 ETP=2 alltoall router bf16 grouped fp8 delayed shared aux"
    assert _kept(grid_rows, shard, "shared_experts_fc1_input_fp8") == [516] * 2


def test_the_gate_fails_a_shared_expert_s_16_bit_input_held_under_delayed_scaling():
    """Overlapping the dispatcher under delayed scaling, fc1's gathered 16-bit input (2·s·b·h = 2048 B) held
    beside its FP8 copy is a row the formula has not: red."""
    config = next(c for c in moe_grid() if "fp8 delayed shared gated overlap" in c.label)
    rank, received, kept, padded, named, _ = measure(config)[0]
    expected = formula(config.spec, config.technique, received, kept_copies=kept, padding=padded)
    assert judge(term_rows(config, rank, expected, named), 0.0) == []
    held = named | {"shared_experts_fc1_input_gathered": 2048}
    assert any("shared_experts_fc1_input_gathered" in line for line in judge(term_rows(config, rank, expected, held), 0.0))


def test_the_block_recipes_keep_one_buffer_of_copies_and_scales():
    """Beside EP = 2 (h = 32, f_e = 96; G = 4 experts a rank): each GroupedLinear keeps one buffer, its experts'
    one-byte copies and then their block scales for each 128 of an expert's padded rows; with the rows T_pad and
    the 128-row blocks B the rank's routing made (measured): blockwise (rows padded to 16) fc1 32·T_pad +
    4·B·roundup(32, 4) = 32·T_pad + 128·B, fc2 96·T_pad + 384·B; MXFP8 (padded to 32, E8M0 scales, 4 rows of
    roundup(K, 128) a block) fc1 32·T_pad + 4·B·128, fc2 96·T_pad + 4·B·128."""
    for fragment, (fc1_scale, fc2_scale) in (("grouped fp8 blockwise shared", (128, 384)),
                                             ("grouped fp8 mxfp8 shared", (512, 512))):
        config = next(c for c in moe_grid() if fragment in c.label)
        for rank, received, kept, (padded, blocks), named, _ in measure(config):
            assert padded % (32 if "mxfp8" in fragment else 16) == 0 and blocks >= padded / 128
            assert named["experts_input"] == 32 * padded + fc1_scale * blocks, (fragment, rank)
            assert named["experts_fc2_input"] == 96 * padded + fc2_scale * blocks, (fragment, rank)

def test_fp8_shared_experts_recomputed_through_te_s_checkpoint_keep_nothing(grid_rows):
    """--recompute-modules shared_experts under FP8 (tensorwise, EP = 2, f_s = 128): the shared experts' rows go
    (without it fc2 keeps 32·128 + 4 = 4100 B), the routed experts' FP8 copies stay."""
    recomputed = "t=1 EP=2 ETP=1 alltoall router bf16 grouped fp8 tensorwise shared aux 0.01 selective:shared_experts"
    assert not [n for term in ("shared_experts_fc2_input", "shared_experts_swiglu_input", "shared_experts_fc1_input_fp8")
                for n in _kept(grid_rows, recomputed, term) if n]
    assert all(n > 0 for n in _kept(grid_rows, recomputed, "experts_input"))


def test_each_checkpoint_without_output_rerun_is_measured_as_it_ends(grid_rows):
    """The experts' activation's rerun (moe_act) and the pre-MLP norm's (layernorm, in a layer), measured where
    each ends (gloo.rerun_moments), equal actmem's rerun moments on every rank: the shared experts' rows held
    through moe_act's rerun (the MoE layer ran them first: moe_layer.py, shared_experts_compute before route),
    the norm's output held twice (restored, and ctx.outputs) with its statistics, and through moe_act's rerun
    after it; beside shared experts overlapping the dispatcher, their fc2's rows freed first (made after the
    combine), the gate's score still held. Each layout with moe_act reruns it; the layouts in a layer with layernorm rerun the norm."""
    reruns = [row for row in grid_rows if row["kind"] == "rerun"]
    assert all(row["formula_bytes"] == row["measured_bytes"] > 0 for row in reruns)
    units = {(row["config"].rsplit(" ", 1)[-1] if "in a layer" not in row["config"] else
              row["config"].removesuffix(" in a layer").rsplit(" ", 1)[-1] + " in a layer", row["term"])
             for row in reruns}
    assert units == {("selective:moe_act", "rerun moe_act"), ("selective:layernorm in a layer", "rerun pre_mlp_layernorm"),
                     ("selective:moe_act+layernorm in a layer", "rerun moe_act"),
                     ("selective:moe_act+layernorm in a layer", "rerun pre_mlp_layernorm"),
                     ("selective:moe", "rerun moe"), ("selective:shared_experts", "rerun shared_experts")}
    with_act = {row["config"] for row in grid_rows if "moe_act" in row["config"]}
    assert len(with_act) == 6 and {row["config"] for row in reruns if row["term"] == "rerun moe_act"} == with_act


def _reruns(grid_rows, label: str) -> dict:
    return {(row["rank"], row["term"]): (row["formula_bytes"], row["measured_bytes"])
            for row in grid_rows if row["kind"] == "rerun" and row["config"] == label}


SHARED_BF16 = "moe E=8 k=2 t=2 EP=2 ETP=1 alltoall router bf16 shared gated sigmoid aux 0.01 selective:shared_experts"
SHARED_FP8 = "moe E=8 k=2 t=1 EP=2 ETP=1 alltoall router bf16 grouped fp8 tensorwise shared aux 0.01 selective:shared_experts"
SHARED_ALLGATHER = "moe E=8 k=2 t=2 EP=1 ETP=2 allgather router bf16 shared aux 0.01 selective:shared_experts"


def test_the_moe_layers_and_the_shared_experts_reruns_hold_their_output_through_their_backward(grid_rows):
    """The reruns through megatron-core's own checkpoint (CheckpointFunction.backward: the outputs it made again are
    held while it runs backward through them), measured before that backward, by hand (s = 16, b = 2):
    - shared experts, bf16, gated, t = 2 with SP, EP = 2 (h = 16, f_s = 14): the routed experts' and the router's
      backward done (they ran after the shared experts). Held: the checkpoint's input, the router's, 2·8·2·16 = 512,
      and the permutation's sorted indices, int64 [16·2] = 256, which the dispatcher keeps as its own attribute
      until the layer's next forward (one microbatch: this one's). The rerun: the SwiGLU's input, fc1's output
      over the gathered 32 tokens, 2·32·2·7 = 896; fc2's input 2·16·2·7 = 448; the gate's score 2·8·2 = 32; the
      output it scales 512; the product, the rerun's output, 512: 3168 (actmem said 2400 before: no output, the
      indices freed).
    - the same under FP8 tensorwise, t = 1 (h = 32, f_s = 128): the input 2·32·32 = 2048, the indices int64 [64] =
      512; fc1, which Megatron hands no save_original_input under this recompute, keeps its input quantized
      32·32 + 4 = 1028; the SwiGLU's input 2·32·256 = 16,384; fc2's FP8 copy 32·128 + 4 = 4100; the output 2048:
      26,120 (before: 23,556).
    - the shared experts under the allgather dispatcher, ungated, t = ETP = 2: the input 512; the dispatcher keeps
      the indices of the T = k·N = 64 rows its experts received, int64 [64] = 512, and their probabilities,
      local_probs [64] 16-bit = 128 (the experts' probs row, one storage); the SwiGLU's input 896, fc2's 448, the
      output 512: 3008.
    - the whole MoE layer, bf16 and FP8 (t = ETP = 2): every row of the layer again and its output, 2·8·2·16 = 512
      (bf16, h = 16) beyond them; under FP8 the experts' fc2 keeps its FP8 copies in moe's rerun, not the 16-bit
      input moe_act's rerun remakes (actmem said 54,632 against 49,032 before)."""
    assert 512 + 256 + 896 + 448 + 32 + 512 + 512 == 3168
    assert _reruns(grid_rows, SHARED_BF16) == {(rank, "rerun shared_experts"): (3168, 3168) for rank in (0, 1)}
    assert 2048 + 512 + 1028 + 16_384 + 4100 + 2048 == 26_120
    assert _reruns(grid_rows, SHARED_FP8) == {(rank, "rerun shared_experts"): (26_120, 26_120) for rank in (0, 1)}
    assert 512 + 512 + 128 + 896 + 448 + 512 == 3008
    assert _reruns(grid_rows, SHARED_ALLGATHER) == {(rank, "rerun shared_experts"): (3008, 3008) for rank in (0, 1)}
    moe = [row for row in grid_rows if row["term"] == "rerun moe"]
    assert len(moe) == 4 and all(row["formula_bytes"] == row["measured_bytes"] > 0 for row in moe)


def test_the_gate_fails_a_moe_rerun_priced_wrong(grid_rows):
    """Inject the failures on the shared experts' rerun (bf16): its output not counted (512 B less), the
    dispatcher's sorted indices counted freed (256 B less), the fc1 copy under FP8 left out (1028 B less)."""
    from actmem_validate.compare import rerun_rows

    for label, measured, short in ((SHARED_BF16, 3168, 512), (SHARED_BF16, 3168, 256), (SHARED_FP8, 26_120, 1028)):
        config = next(c for c in moe_grid() if c.label == label)
        rows_of_rank = [row for row in grid_rows if row["config"] == label and row["rank"] == 0]
        expected = {row["term"]: row["formula_bytes"] for row in rows_of_rank
                    if row["kind"] not in ("rerun", "total")}
        arch = config.spec.architecture
        terms = _layer_terms(arch, False)
        bindings = config.spec.bindings_at(config.spec.run.tensor_parallel) | {r: 1}   # the shared experts: any routing

        def gate(moments):
            return judge(rerun_rows(config, 0, config.technique, arch, expected, terms, bindings, moments), 0.0)

        assert gate({"shared_experts": measured}) == []
        assert any("rerun shared_experts" in line for line in gate({"shared_experts": measured - short}))
