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


def test_no_recompute_floor_is_the_total():
    """Nothing is rerun: the first backward's start holds the model state and every activation."""
    est = _estimate("530b", recompute="none")
    assert est.peak.total_bytes == est.total_bytes
    assert [row.name for row in est.peak.rows] == ["weights", "main_gradients", "optimizer_state",
                                                  "activations_in_flight"]


def test_selective_reruns_the_core_after_the_mlp_is_freed():
    """530B tp-sp-sel. Rerun: softmax output 2as²b/t + mask as²b/t + dropout output 2as²b/t =
    5·128·2048²/8 = 335,544,320 B. Freed first, the last layer's rows after its core:
    projection input 2, attention dropout mask 1, MLP norm input 2, fc1 input 2, GeLU input 8,
    fc2 input 8, MLP mask 1: 24 sbh/t = 125,829,120 B."""
    est = _estimate("530b")
    rows = {row.name: row.bytes for row in est.peak.rows}
    assert rows["rematerialised"] == 335_544_320
    assert rows["activations_in_flight"] == est.activations_bytes - 125_829_120
    assert est.peak.total_bytes == est.total_bytes + 335_544_320 - 125_829_120
    assert est.verdict_bytes == est.peak.total_bytes


def test_full_recompute_reruns_a_layer_less_its_checkpoint():
    """530B tp-sp-full: the layer as tp-sp keeps it (Eq 4), sbh/t·(34 + 5as/h) = 5,242,880 ·
    (34 + 64) = 513,802,240 B, less the checkpoint 2sbh/t = 10,485,760 B. p = 35: the first
    stage has no output layer, so nothing is freed before the rerun."""
    est = _estimate("530b", recompute="full")
    rows = {row.name: row.bytes for row in est.peak.rows}
    assert rows["rematerialised"] == 503_316_480
    assert rows["activations_in_flight"] == est.activations_bytes


def test_full_recompute_with_the_output_layer_frees_the_logits_first():
    """22B (p = 1) tp-sp-full: the loss's backward frees the final norm's input 2sbh/t, the
    output layer's input 2sbh/t and the fp32 logits 4sbv/t = 4·2048·4·51200/8 = 209,715,200 B
    before the last layer is rerun: 234,881,024 B in all. The rerun: sbh/t·34 + 5as²b/t =
    213,909,504 + 671,088,640, less the checkpoint 12,582,912 = 872,415,232 B."""
    est = _estimate("22b", recompute="full")
    rows = {row.name: row.bytes for row in est.peak.rows}
    assert rows["rematerialised"] == 872_415_232
    assert est.peak.total_bytes == est.total_bytes - 234_881_024 + 872_415_232


def test_uniform_groups_rerun_the_chunks_tail():
    """530B without interleave: 3 layers a chunk (105/35). Uniform groups of 2 make groups
    [0, 1] and [2]; the tail group, 1 layer, is rerun first: the same bytes as one layer
    alone. Block 1 keeps the chunk's last 2 layers whole, so the first backward reruns
    nothing and the floor is the total."""
    full = _estimate("530b", recompute="full")
    whole = {row.name: row.bytes for row in full.peak.rows}["rematerialised"]
    grouped = _estimate("530b", recompute="full", interleave=1, recompute_method="uniform", recompute_layers=2)
    assert {row.name: row.bytes for row in grouped.peak.rows}["rematerialised"] == whole
    block = _estimate("530b", recompute="full", interleave=1, recompute_method="block", recompute_layers=1)
    assert "rematerialised" not in {row.name for row in block.peak.rows}
    assert block.peak.total_bytes == block.total_bytes
