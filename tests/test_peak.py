"""The allocator's peak from below (actmem.peak), derived by hand from the term table.

Notation: sbh/t is one 16-bit-free element count of a sequence-parallel boundary tensor;
the 530B run is a=128, h=20480, s=2048, b=1, t=8 (sbh/t = 5,242,880), the 22B one a=64,
h=6144, s=2048, b=4, t=8 (sbh/t = 6,291,456).
"""

from actmem.estimate import estimate
from actmem.presets import load_preset
from actmem.spec import build_spec


def _estimate(name, **run):
    preset = load_preset(name)
    return estimate(build_spec(preset.model, preset.run | run, name=name, architecture=preset.architecture))


#: 530B tp-sp at its last layer's fc1 weight gradient, in sbh/t = 5,242,880 B: GeLU's input
#: gradient 2sbf/t = 8, fc1's input all-gathered again 2sbh = 16, its input gradient 2sbh = 16,
#: that gradient's shard 2 and the gradient at the layer's output 2: 44 sbh/t made; GeLU's input
#: 8, fc2's 8 and the MLP's dropout mask 1 freed: 17 sbh/t.
FC1_MADE_530B, FC1_FREED_530B = 44 * 5_242_880, 17 * 5_242_880


def test_no_recompute_floor_is_the_fc1_moment():
    """Nothing is rerun: the largest moment is the last layer's fc1 backward, 27 sbh/t =
    141,557,760 B above the model state and every activation."""
    est = _estimate("530b", recompute="none")
    assert est.peak.moment == "the last layer's MLP backward, at fc1's weight gradient"
    assert est.peak.total_bytes == est.total_bytes + FC1_MADE_530B - FC1_FREED_530B == est.total_bytes + 141_557_760
    assert [row.name for row in est.peak.rows] == ["weights", "main_gradients", "optimizer_state",
                                                  "activations_in_flight", "fc1_backward"]
    assert est.peak.bytes_of("fc1_backward") == 230_686_720


def test_without_sequence_parallelism_nothing_is_gathered():
    """530B tp (t = 8, no SP): fc1's saved input is whole, and its input gradient is all-reduced
    in place: GeLU's input gradient 2sbf/t = sbh, the input gradient 2sbh and the gradient at
    the layer's output 2sbh (whole without SP): 5sbh made; GeLU's and fc2's inputs sbh each and
    the mask sbh freed: 2sbh net, with sbh = 41,943,040."""
    est = _estimate("530b", recompute="none", sequence_parallel=False)
    assert est.peak.bytes_of("fc1_backward") == 5 * 41_943_040
    assert est.peak.total_bytes == est.total_bytes + 2 * 41_943_040


def test_selective_reruns_the_core_after_the_mlp_is_freed():
    """530B tp-sp-sel. Rerun: softmax output 2as²b/t + mask as²b/t + dropout output 2as²b/t =
    5·128·2048²/8 = 335,544,320 B, and the core's output again (the projection freed its input
    first), 2sbh/t = 10,485,760: 346,030,080 B. Freed first, the last layer's rows after its core:
    projection input 2, attention dropout mask 1, MLP norm input 2, fc1 input 2, GeLU input 8,
    fc2 input 8, MLP mask 1: 24 sbh/t = 125,829,120 B."""
    est = _estimate("530b")
    rows = {row.name: row.bytes for row in est.peak.rows}
    assert rows["rematerialised"] == 346_030_080
    assert rows["activations_in_flight"] == est.activations_bytes - 125_829_120
    assert est.peak.total_bytes == est.total_bytes + 346_030_080 - 125_829_120
    assert est.verdict_bytes == est.peak.total_bytes


def test_full_recompute_reruns_a_layer_less_its_checkpoint():
    """530B tp-sp-full: the layer as tp-sp keeps it (Eq 4), sbh/t·(34 + 5as/h) = 5,242,880 ·
    (34 + 64) = 513,802,240 B, less the checkpoint 2sbh/t = 10,485,760 B, and its output made
    again, 2sbh/t: 513,802,240 B. p = 35: the first stage has no output layer, so nothing is
    freed before the rerun; then the rerun layer's fc1 backward adds 44 sbh/t and frees 17."""
    est = _estimate("530b", recompute="full")
    rows = {row.name: row.bytes for row in est.peak.rows}
    assert rows["rematerialised"] == 513_802_240
    assert rows["activations_in_flight"] == est.activations_bytes - FC1_FREED_530B
    assert rows["fc1_backward"] == FC1_MADE_530B
    assert est.peak.total_bytes == est.total_bytes + 513_802_240 + 141_557_760


def test_full_recompute_with_the_output_layer_frees_the_logits_first():
    """22B (p = 1) tp-sp-full, sbh/t = 6,291,456: the loss's backward frees the final norm's
    input 2sbh/t, the output layer's input 2sbh/t and the fp32 logits 4sbv/t = 4·2048·4·51200/8
    = 209,715,200 B before the last layer is rerun: 234,881,024 B in all. The rerun: sbh/t·34
    + 5as²b/t = 213,909,504 + 671,088,640, less the checkpoint 12,582,912, and its output again
    12,582,912: 884,998,144 B. At its fc1 backward 44 sbh/t = 276,824,064 made and 17 sbh/t =
    106,954,752 freed: above the rerun moment and the loss's (2sbv/t = 104,857,600)."""
    est = _estimate("22b", recompute="full")
    rows = {row.name: row.bytes for row in est.peak.rows}
    assert rows["rematerialised"] == 884_998_144
    assert est.peak.total_bytes == est.total_bytes - 234_881_024 - 106_954_752 + 884_998_144 + 276_824_064


def test_uniform_groups_rerun_the_chunks_tail_then_a_full_group():
    """530B without interleave: 3 layers a chunk (105/35). Uniform groups of 2 make groups
    [0, 1] and [2]; the tail group, 1 layer, is rerun first: the same bytes as one layer
    alone, a layer kept whole (34sbh/t + 5as²b/t = 178,257,920 + 335,544,320 = 513,802,240)
    less its checkpoint 2sbh/t = 10,485,760. Then group [0, 1] reruns 2 layers less its
    checkpoint, with the tail's checkpoint freed: 2 x 513,802,240 - 2 x 10,485,760 =
    1,006,632,960 beyond the total, more than the tail's 503,316,480; each rerun also makes its
    output again, 2sbh/t = 10,485,760. Block 1 keeps the chunk's last 2 layers whole, so the
    first backward reruns nothing and the floor is the total (the fc1 moment is not modelled
    under partial recompute)."""
    grouped = _estimate("530b", recompute="full", interleave=1, recompute_method="uniform", recompute_layers=2)
    assert grouped.peak.bytes_of("rematerialised") == 2 * 513_802_240 - 10_485_760 + 10_485_760
    assert grouped.peak.total_bytes == grouped.total_bytes + 1_006_632_960 + 10_485_760
    block = _estimate("530b", recompute="full", interleave=1, recompute_method="block", recompute_layers=1)
    assert "rematerialised" not in {row.name for row in block.peak.rows}
    assert block.peak.total_bytes == block.total_bytes


def test_the_loss_backward_adds_the_16bit_logits_gradient_where_the_output_layer_is():
    """22B at p = 1 without recompute: the stage holds the output layer, and the loss's
    backward makes the 16-bit logits gradient 2sbv/t = 2·2048·4·51200/8 = 104,857,600 B while
    every saved activation (the fp32 logits among them, updated in place) is held."""
    est = _estimate("22b", recompute="none")
    assert est.peak.moment == "the loss's backward, every microbatch held"
    assert est.peak.bytes_of("logits_gradient_16bit") == 104_857_600
    assert est.peak.total_bytes == est.total_bytes + 104_857_600
    assert _estimate("530b", recompute="none").peak.bytes_of("logits_gradient_16bit") == 0   # p = 35


def test_uniform_groups_weigh_the_full_group_after_a_short_tail():
    """175B tp-sp-full, --recompute-method uniform, N = 3, 4 layers a chunk (96 / (8·3)): the
    tail group is 1 layer, the next 3. A layer kept whole is sbh(34/t + 5as/ht) = 106,954,752
    + 251,658,240 = 358,612,992 B (sbh = 25,165,824, t = 8); a checkpoint 2sbh/t = 6,291,456.
    The tail's rerun holds 358,612,992 - 6,291,456 = 352,321,536 beyond the total; the next
    group's 3 x 358,612,992 - 6,291,456, less the tail's checkpoint already freed,
    1,063,256,064: the floor takes the larger. Each rerun makes its output again, 2sbh/t =
    6,291,456."""
    est = _estimate("175b", recompute="full", recompute_method="uniform", recompute_layers=3)
    assert est.peak.bytes_of("rematerialised") == 3 * 358_612_992 - 6_291_456 + 6_291_456
    assert est.peak.total_bytes == est.total_bytes + 1_063_256_064 + 6_291_456
