"""The first stage's peak (section 4.4), including fewer microbatches than p."""

from actmem.memory.pipeline import stage_occupancy


def test_1f1b_full_pipeline_holds_L_layers():
    """Eq 5: p microbatches in flight on L/p layers = L, whatever p is."""
    for p in (1, 2, 8, 32):
        occupancy = stage_occupancy(96, p, 1, microbatches_per_iteration=10 * p)
        assert occupancy.layer_activations == 96
        assert occupancy.microbatches == p


def test_1f1b_with_fewer_microbatches_than_p_holds_fewer():
    """n = 2 < p = 8: only 2 microbatches ever enter the stage: 2 x 96/8 = 24 layers."""
    occupancy = stage_occupancy(96, 8, 1, microbatches_per_iteration=2)
    assert occupancy.layer_activations == 24
    assert occupancy.microbatches == 2
    assert "only 2 microbatches" in occupancy.explanation


def test_interleaved_full_pipeline_matches_the_paper_factor():
    """GPT-3 run: L = 96, p = 8, m = 3: 96·(1 + 7/24) = 124 layers (31 chunks of 4)."""
    occupancy = stage_occupancy(96, 8, 3, microbatches_per_iteration=64)
    assert occupancy.layer_activations == 124
    assert "31 chunks x 4 layers" in occupancy.explanation


def test_interleaved_peak_holds_2p_embedding_masks():
    """Megatron's interleaved order on rank 0, p = 2, m = 2, n = 4 (warm-up 2(p-1) + (m-1)p = 4):
    F(mb0,c0) F(mb1,c0) F(mb0,c1) F(mb1,c1) | F(mb2,c0) B(mb0,c1) | F(mb3,c0) B(mb1,c1) | ...
    After F(mb3,c0): chunks in flight mb0c0 mb1c0 mb1c1 mb2c0 mb3c0 = pm + p - 1 = 5, of which
    chunk 0 (with the embedding) for mb0..mb3 = 2p = 4."""
    occupancy = stage_occupancy(4, 2, 2, microbatches_per_iteration=4)
    assert (occupancy.layer_activations, occupancy.microbatches) == (5, 4)
    # with n = p every forward runs first: p chunk-0 forwards, pm chunks
    occupancy = stage_occupancy(4, 2, 2, microbatches_per_iteration=2)
    assert (occupancy.layer_activations, occupancy.microbatches) == (4, 2)


def test_interleaved_with_n_equal_p_runs_all_forwards_first():
    """n = p = 8, m = 3: the schedule has only n·m = 24 chunk forwards to run, fewer than the
    pm + p - 1 = 31 of a full warm-up, so it holds 24 chunks x 4 layers = 96 = L."""
    occupancy = stage_occupancy(96, 8, 3, microbatches_per_iteration=8)
    assert occupancy.layer_activations == 96


def test_unknown_microbatch_count_assumes_a_full_pipeline():
    occupancy = stage_occupancy(105, 35, 3, microbatches_per_iteration=None)
    assert occupancy.layer_activations == 139
    assert "assumed full" in occupancy.explanation


def test_only_p_equal_1_holds_the_output_layer():
    assert stage_occupancy(48, 1, 1, 1).holds_output_layer
    assert not stage_occupancy(48, 2, 1, 4).holds_output_layer


def test_fewer_microbatches_show_in_the_estimate(actmem):
    """GPT-3 run with global batch 4 on 64 GPUs (d = 1): n = 4 < p = 8 is invalid for the
    interleaved schedule, but with 1F1B it holds 4 x 12 layers = 48 layer activations."""
    out = actmem.json("estimate", "--model", "gpt3", "--interleave", "1", "--global-batch", "4")
    assert out["stage"]["layer_activations"] == 48
    assert out["stage"]["embedding_microbatches"] == 4
    sel = {r["technique"]: r for r in out["techniques"]}["tp-sp-sel"]
    assert sel["layers_bytes"] == 48 * 34 * 2048 * 12288 // 8
    assert sel["extra_bytes"] == 4 * 2048 * 12288 // 8
