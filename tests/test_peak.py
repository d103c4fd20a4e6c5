"""The allocator's peak from below (actmem.memory.peak), derived by hand from the term table.

Notation: sbh/t is one 16-bit-free element count of a sequence-parallel boundary tensor;
the 530B run is a=128, h=20480, s=2048, b=1, t=8 (sbh/t = 5,242,880), the 22B one a=64,
h=6144, s=2048, b=4, t=8 (sbh/t = 6,291,456).
"""

from actmem.memory.estimate import estimate
from actmem.sources.presets import load_preset
from actmem.model.spec import build_spec


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
    assert est.peak.moment == "the last layer's fc1 backward"
    assert est.peak.total_bytes == est.total_bytes + FC1_MADE_530B - FC1_FREED_530B == est.total_bytes + 141_557_760
    assert [row.name for row in est.peak.rows] == ["weights", "main_gradients", "optimizer_state",
                                                  "dummy_weight_gradients", "activations_in_flight",
                                                  "fc1_backward"]
    assert est.peak.bytes_of("fc1_backward") == 230_686_720


def test_the_dummy_weight_gradients_are_one_a_weight_shape():
    """TE's get_dummy_wgrad keeps one 16-bit tensor a distinct weight shape. 530B at t = 8:
    QKV [3h/t, h], projection [h, h/t], fc1 [4h/t, h], fc2 [h, 4h/t]: 12h²/t = 629,145,600
    elements, 1,258,291,200 B; the last stage adds the output layer's [v/t, h] = 6400 x 20480
    = 131,072,000 elements, 262,144,000 B. Shapes that coincide are one tensor: with v = 3h
    the output layer's [v/t, h] is QKV's [3h/t, h], kept once."""
    from actmem.model.architecture import PAPER
    from actmem.memory.parameters import dummy_wgrad_elements

    preset = load_preset("530b")
    spec = build_spec(preset.model, preset.run, name="530b", architecture=preset.architecture)
    first, last = estimate(spec), estimate(spec, stage=34)
    h = 20480
    assert first.parameters.dummy_wgrads_bytes == 2 * 12 * h * h // 8 == 1_258_291_200
    assert last.parameters.dummy_wgrads_bytes == 1_258_291_200 + 2 * 6400 * h == 1_258_291_200 + 262_144_000
    assert dummy_wgrad_elements(h, 8, 3 * h, PAPER, 128, holds_output=1) == 12 * h * h // 8
    assert dummy_wgrad_elements(h, 8, 3 * h + 8192, PAPER, 128, holds_output=1) == (12 * h * h + (3 * h + 8192) * h) // 8

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
    fc2 input 8, MLP mask 1: 24 sbh/t = 125,829,120 B. That is the rerun moment; the core's own
    backward holds more: at the dropout's backward ·V has freed the rerun's dropout output
    (2as²b/t = 134,217,728) and made the probabilities' gradient and v's (2as²b/t + 2sbh/t), the
    dropout the softmax output's gradient (2as²b/t), and the checkpoint holds the core output's
    gradient and the residual stream its own (2sbh/t each): 2 x 134,217,728 + 3 x 10,485,760 =
    299,892,736 B."""
    est = _estimate("530b")
    rows = {row.name: row.bytes for row in est.peak.rows}
    assert est.peak.moment == "the last layer's attention core backward"
    assert rows["rematerialised"] == 346_030_080 - 134_217_728
    assert rows["activations_in_flight"] == est.activations_bytes - 125_829_120
    assert rows["core_backward"] == 299_892_736
    assert est.peak.total_bytes == est.total_bytes + 346_030_080 - 125_829_120 + 299_892_736 - 134_217_728
    assert est.verdict_bytes == est.peak.total_bytes


def test_full_recompute_reruns_a_layer_less_its_checkpoint():
    """530B tp-sp-full: the layer as tp-sp keeps it (Eq 4), sbh/t·(34 + 5as/h) = 5,242,880 ·
    (34 + 64) = 513,802,240 B, less the checkpoint 2sbh/t = 10,485,760 B, and its output made
    again, 2sbh/t: 513,802,240 B. p = 35: the first stage has no output layer, so nothing is
    freed before the rerun; then the rerun layer's fc1 backward adds 44 sbh/t and frees 17 of
    the rerun's rows (the core's backward, later, holds less: 543,162,368 above the total)."""
    est = _estimate("530b", recompute="full")
    rows = {row.name: row.bytes for row in est.peak.rows}
    assert rows["rematerialised"] == 513_802_240 - FC1_FREED_530B
    assert rows["activations_in_flight"] == est.activations_bytes
    assert rows["fc1_backward"] == FC1_MADE_530B
    assert est.peak.total_bytes == est.total_bytes + 513_802_240 + 141_557_760
    # the core's: the rerun less its rows after the core (24 sbh/t) and its dropout output
    # (2as²b/t = 134,217,728), with the two s² gradients, v's and the residual stream's
    core = est.run_row.backward_moment("core")
    assert core.beyond_held == 513_802_240 - 125_829_120 - 134_217_728 + 2 * 134_217_728 + 2 * 10_485_760
    assert core.beyond_held == 543_162_368


def test_full_recompute_with_the_output_layer_frees_the_logits_first():
    """22B (p = 1) tp-sp-full, sbh/t = 6,291,456: the loss's backward frees the final norm's
    input 2sbh/t, the output layer's input 2sbh/t and the fp32 logits 4sbv/t = 4·2048·4·51200/8
    = 209,715,200 B before the last layer is rerun: 234,881,024 B in all. The rerun: sbh/t·34
    + 5as²b/t = 213,909,504 + 671,088,640, less the checkpoint 12,582,912, and its output again
    12,582,912: 884,998,144 B. At its fc1 backward 44 sbh/t = 276,824,064 made and 17 sbh/t =
    106,954,752 freed: above the rerun moment and the loss's (2sbv/t = 104,857,600)."""
    est = _estimate("22b", recompute="full")
    rows = {row.name: row.bytes for row in est.peak.rows}
    assert rows["rematerialised"] == 884_998_144 - 106_954_752
    assert est.peak.total_bytes == est.total_bytes - 234_881_024 - 106_954_752 + 884_998_144 + 276_824_064


def test_uniform_groups_rerun_the_chunks_tail_then_a_full_group():
    """530B without interleave: 3 layers a chunk (105/35). Uniform groups of 2 make groups
    [0, 1] and [2]; the tail group, 1 layer, is rerun first: the same bytes as one layer
    alone, a layer kept whole (34sbh/t + 5as²b/t = 178,257,920 + 335,544,320 = 513,802,240)
    less its checkpoint 2sbh/t = 10,485,760. Then group [0, 1] reruns 2 layers less its
    checkpoint, with the tail's checkpoint freed: 2 x 513,802,240 - 2 x 10,485,760 =
    1,006,632,960 beyond the total, more than the tail's 503,316,480; each rerun also makes its
    output again, 2sbh/t = 10,485,760. Block 1 keeps the chunk's last 2 layers whole, so the
    first backward reruns nothing, and its last layer's backward is a whole layer's: the floor
    is the fc1 moment of a run without recompute, 27 sbh/t = 141,557,760 above the total."""
    grouped = _estimate("530b", recompute="full", interleave=1, recompute_method="uniform", recompute_layers=2)
    assert grouped.peak.bytes_of("rematerialised") == 2 * 513_802_240 - 10_485_760 + 10_485_760
    assert grouped.peak.total_bytes == grouped.total_bytes + 1_006_632_960 + 10_485_760
    block = _estimate("530b", recompute="full", interleave=1, recompute_method="block", recompute_layers=1)
    assert "rematerialised" not in {row.name for row in block.peak.rows}
    assert block.peak.total_bytes == block.total_bytes + FC1_MADE_530B - FC1_FREED_530B == block.total_bytes + 141_557_760
    assert block.peak.moment == "the last layer's fc1 backward"


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


def _moments(est, technique="") -> dict:
    row = est.run_row if not technique else next(r for r in est.techniques if r.technique.name == technique)
    return {moment.name: moment.detail.beyond_held for moment in row.moments if moment.detail is not None}


def test_the_none_row_peaks_in_its_core_backward():
    """530B's 'none' row (t = 1, no SP), in sbh = 41,943,040 B; 2as²b = 2·128·2048/20480 sbh =
    25.6 sbh. fc1: GeLU's input gradient 8, the input gradient 2, the residual stream's 2 made,
    GeLU's and fc2's inputs 8 each and the mask 1 freed: -5 sbh, below the start. The core: the
    probabilities' and the softmax output's gradients 25.6 each, v's 2 and the residual
    stream's 2 made; the 24 sbh after the core and the dropout output 25.6 freed: +5.6 sbh."""
    est = _estimate("530b")
    moments = _moments(est, "none")
    assert moments["fc1"] == -5 * 41_943_040
    assert moments["core"] * 5 == 28 * 41_943_040
    none = next(r for r in est.techniques if r.technique.name == "none")
    assert none.peak_bytes == none.total_bytes + 234_881_024


def test_at_t_1_the_table_shows_each_row_once():
    """At t = 1 TE turns SP off (sequence_parallel = tp_size > 1 and ...) and the rules refuse SP there, and tp splits
    nothing: 'tp' is 'none', each SP row its twin. The table shows 'none', 'tp-sel' and 'full' once each, the run
    marked on its own; the twins it leaves out peak where the rows it keeps do."""
    from actmem.memory.estimate import _technique_row
    from actmem.memory.techniques import BY_NAME

    for recompute, named in (("none", "none"), ("full", "full")):
        est = _estimate("llama-3.1-8b", tensor_parallel=1, sequence_parallel=False, recompute=recompute)
        assert [row.technique.name for row in est.techniques] == ["none", "tp-sel", "full"]
        assert est.run_row.technique.name == named
    occupancy, layers = est.occupancy, est.spec.model.layers
    peak = lambda name: _technique_row(est.spec, BY_NAME[name], occupancy, layers).peak_bytes
    assert peak("tp") == peak("none") == peak("tp-sp") and peak("tp-sp-full") == peak("full")
    assert peak("tp-sp-sel") == peak("tp-sel")


def test_without_sp_under_te_fc1_makes_three_gradients():
    """Llama 3.1 8B at t = 8 without SP (s 8192, b 1, h 4096, f 14336): SwiGLU's input gradient
    4sbf/t = 58,720,256, fc1's input gradient 2sbh = 67,108,864 and the residual stream's 2sbh
    (whole without SP): 192,937,984 B; nothing gathered, dgrad all-reduced in place."""
    est = _estimate("llama-3.1-8b", tensor_parallel=8, sequence_parallel=False, recompute="none")
    fc1 = est.run_row.backward_moment("fc1")
    assert fc1.transient == 58_720_256 + 2 * 67_108_864 == 192_937_984


def test_the_moments_are_not_modelled_where_their_op_is_recomputed_or_absent():
    """fc1's with the MLP recomputed (its own rerun is not modelled), the core's under flash
    (its backward is TE's kernel's), neither inside uniform groups of N > 1 layers; under
    block N < 3 (530B: 3 layers a chunk) the chunk ends with whole layers, whose moments are
    those of a run without recompute, and block 3 is plain full recompute's."""
    assert "fc1" not in _moments(_estimate("22b", recompute_modules=("core_attn", "mlp")))
    assert "fc1" not in _moments(_estimate("22b", recompute_modules=("mlp",)))
    assert set(_moments(_estimate("llama-3.1-8b", tensor_parallel=8))) == {"fc1"}
    assert _moments(_estimate("530b", recompute="full", interleave=1, recompute_method="uniform",
                              recompute_layers=2)) == {}
    block = _moments(_estimate("530b", recompute="full", interleave=1, recompute_method="block", recompute_layers=1))
    assert block == _moments(_estimate("530b", recompute="none", interleave=1)) and set(block) == {"fc1", "core"}
    every_layer = _moments(_estimate("530b", recompute="full", interleave=1, recompute_method="block",
                                     recompute_layers=3))            # N = 3: every layer checkpointed
    assert every_layer == _moments(_estimate("530b", recompute="full", interleave=1)) and "fc1" in every_layer


def test_a_full_recompute_stage_names_its_rows_without_a_negative_one():
    """The last of 4 stages (1 layer each, a = 8, h = 1024, s = 2048, t = 2 with SP, v = 256),
    one microbatch, full recompute; sbh/t = 1,048,576, as²b/t = 16,777,216. Held: the
    checkpoint 2sbh/t and the output layer's rows (final norm and output inputs 2sbh/t each,
    fp32 logits 4sbv/t = 1,048,576): 7,340,032 B. The rerun: the layer, sbh/t·(34 + 5as/h) =
    114 sbh/t, less its checkpoint, with its output again: 119,537,664. At the core's backward
    the output layer's rows (5,242,880) were freed from what is held, and from the rerun its
    24 sbh/t after the core and its dropout output 2as²b/t (58,720,256); made: 2 x 2as²b/t,
    v's and the residual stream's gradients 2sbh/t each (71,303,168)."""
    from actmem.model.spec import build_spec

    spec = build_spec(dict(heads=8, hidden=1024, layers=4, vocab=256, seq_len=2048),
                      dict(tensor_parallel=2, sequence_parallel=True, pipeline_parallel=4, recompute="full",
                           gpus=8, global_batch=1))
    rows = {row.name: row.bytes for row in estimate(spec, 3).peak.rows}
    assert rows["activations_in_flight"] == 7_340_032 - 5_242_880
    assert rows["rematerialised"] == 119_537_664 - 58_720_256
    assert rows["core_backward"] == 71_303_168


def test_with_query_groups_the_core_backward_has_freed_v_s_copy():
    """530B tp-sp with 16 query groups of d = 128 (ad = 16,384): Megatron's eager core expands v
    to a heads with repeat_interleave, a copy only ·V keeps, freed once ·V's backward ran.
    Freed at the core's softmax backward, with sbh/t = 5,242,880: the rows after the core
    (projection input 2sb·ad/t = 8,388,608, the two masks sbh/t each, the MLP norm's and fc1's
    inputs 2sbh/t each, GeLU's and fc2's 8sbh/t each: 123,731,968), the dropout output 2as²b/t
    = 134,217,728 and v's copy 2sb·ad/t = 8,388,608: 266,338,304 B. With g = a, v is a view of
    the QKV output, which the q and k views still hold: 8,388,608 B less."""
    from actmem.model.spec import build_spec

    preset = load_preset("530b")

    def core(**architecture):
        spec = build_spec(preset.model, preset.run | dict(recompute="none"), architecture=architecture)
        return estimate(spec).run_row.backward_moment("core")

    assert core(query_groups=16, head_dim=128).freed_held == 123_731_968 + 134_217_728 + 8_388_608
    assert core(head_dim=128).freed_held == 123_731_968 + 134_217_728
