"""Megatron-FSDP's model state measured (issue 30): `actmem validate --grid mfsdp` runs megatron-core 0.16.1's
FullyShardedDataParallel around a small GPTModel (local spec) on real gloo ranks, a forward, backward and
DistributedOptimizer step, and checks each rank's buffers against actmem's, to the byte.

The model by hand (h = 64, f = 96, L = 2, v = 128, s = 16, LayerNorm, biases, tied output): a layer's parameters in
named order: ln1 [64] ×2, proj [64, 64] + [64], QKV [192, 64] + [192], ln2 [64] ×2, fc1 [96, 64] + [96],
fc2 [64, 96] + [64]: 29,344. Its bucket: rows widest first, fc2 (96), proj, QKV, fc1 (64), the 1-D ones (1); the chunk
factor lcm(96, 64) = 192 (QKV 12,288, fc1 6144 and QKV's bias 192 are whole chunks). fc2 at 0; proj (4096 = 21
chunks + 64) ends at 10,240, 128 short of its last chunk's end: two 64-element fragments (ln1's weight and bias)
fill it; QKV at 10,368, fc1 at 22,656, QKV's bias at 28,800; the other fragments (352) at 28,992: 29,344, no hole.
The rest (embedding [128, 64], positions [16, 64], final norm [64] ×2): factor 64, 9344.
- d = 2: a layer padded to 2·192: 77·384 = 29,568 (shard 14,784; rank 1's holds 29,344 - 14,784 = 14,560
  parameters), the rest to 128: 9344 (shard 4672). P = 2·29,568 + 9344 = 68,480, S = 34,240.
  optim_grads_params, bf16 gradients: weights 2S = 68,480, gradients 2S = 68,480, optimizer 4S + 8·(its
  parameters): rank 0 136,960 + 8·34,240 = 410,880, rank 1 136,960 + 8·(2·14,560 + 4672) = 407,296; gathered
  weights: the rest's bucket, 2·9344 = 18,688. optim: weights and gradients 2P = 136,960 (whole, padded).
- no_shard, one bucket of every parameter (N = 68,032): factor 192; both fc2s; the embedding (42 chunks + 128)
  shares its last chunk with the positions (5 chunks + 64); layer 1's projection (+64) with layer 2's, a fragment
  between; then QKVs, fc1s, biases, fragments: 68,032, no hole, unpadded: weights and gradients 2N = 136,064,
  optimizer 12N = 816,384.
- d = 4, optim_grads_params: a layer padded to 768: 39·768 = 29,952 (shard 7488), the rest to 256: 9472 (shard
  2368): S = 17,344, weights 34,688, gathered 18,944; rank 3's shards hold 29,344 - 3·7488 = 6880 and 9344 - 3·2368
  = 2240 parameters: optimizer 4·17,344 + 8·(2·6880 + 2240) = 197,376; ranks 0-2 12S = 208,128.
- the same with its buckets outside the units split at 9000 elements (--overlap-grad-reduce --ddp-bucket-size 9000):
  [embedding, positions] (9216 ≥ 9000: factor 64, 9216 a multiple of 256, shard 2304) and [final norm's weight and
  bias] (factor 1, 128, a multiple of 4, shard 32): S = 2·7488 + 2304 + 32 = 17,312, weights 34,624, gathered
  2·(9216 + 128) = 18,688 (one bucket: 18,944); rank 3's shards hold 2·6880 + 2304 + 32 = 16,096 parameters:
  optimizer 4·17,312 + 8·16,096 = 198,016, rank 0's 12·17,312 = 207,744.
At the last layer's fc1 backward (bf16 gradients; actmem's 'fc1' moment): under optim_grads_params its unit gathered
again, 2·29,568 = 59,136 (d = 2; 2·29,952 = 59,904 at d = 4), the one unit before it prefetched (the window, 5·10⁸
elements, holds every unit here), the same again; under optim_grads too its gradient bucket, 59,136, and the no-unit
group's gradient bucket the final norm's backward made, 2·9344 = 18,688; split at 9000, only the final norm's bucket
[64, 64]: 2·128 = 256 (the embedding's bucket is made at the end: the tied output layer's gradient reaches the
embedding's weight with the embedding's own, autograd summing a leaf's gradients first, gradient accumulation
fusion off). Five layers with --suggested-communication-unit-size 59,136: the window, 29,568, is one unit's padded
bucket: the prefetch adds one unit (0 < 29,568), then stops (29,568 is not below it): 59,136 B, not the four
units before the last that the default window would gather (236,544). Four layers with a unit of 118,272 (window
59,136, two units): the final norm's forward prefetch gathers units 1 and 2 again (118,272, held at the forward's
end); the last layer's pre-backward window is units 3 and 2, its gather recycles 1 and 2, and gathers only 3: one
unit prefetched, 59,136, where the window alone says two. The forward's end holds, re-gathered, every unit at L = 2
(2·59,136 = 118,272 at d = 2; 2·59,904 = 119,808 at d = 4) and one at L = 5 with its one-unit window.
Under --fsdp-double-buffer (d = 2) the units' buckets are fetched into fixed pools of two buffers, each a unit's padded
bucket: the weights' 2·29,568·2 B = 118,272 where they are sharded (optim_grads_params), the gradients' (bf16) the
same where they are (optim_grads, optim_grads_params), at L = 5 too (two buffers, whatever the window); under optim
neither (whole buffers, fetched as views). The units gathered, prefetched and re-gathered and the unit's gradient
bucket are then in the pools, 0 apart; the no-unit group's gradient bucket (18,688) and the gathered rest (18,688)
are allocated as without it. One layer: one buffer a pool (59,136 each); fp32 gradients under optim_grads: 2·29,568·4
= 236,544; over one rank nothing is distributed: no pool, nothing gathered, no bucket allocated, the buffers whole
(a layer padded to 192: 153·192 = 29,376; weights and bf16 gradients 2·(2·29,376 + 9344) = 136,192)."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from actmem_validate.compare import judge  # noqa: E402
from actmem_validate.megatron_fsdp import formula, measure, mfsdp_grid, state_rows  # noqa: E402
from tests.validate.cli_grid import validate_grid  # noqa: E402

STATE = ("weights", "main_gradients", "optimizer_state", "gathered_weights")
BACKWARD = ("gathered_unit_weights", "prefetched_unit_weights", "unit_gradient_bucket", "outside_gradient_buckets")
REGATHERED = ("regathered_unit_weights",)
POOLS = ("double_buffer_weights", "double_buffer_gradients")


@pytest.fixture(scope="module")
def grid_rows():
    return validate_grid("mfsdp")        # CI's run of `actmem validate --grid mfsdp` (tests/validate/cli_grid.py)


def _state(rows, config, rank, names=STATE):
    return tuple(next(row["measured_bytes"] for row in rows if row["config"] == config and row["rank"] == rank
                      and row["term"] == name) for name in names)


def test_every_ranks_model_state_is_counted_to_the_byte(grid_rows):
    """Nine runs (every strategy at d = 2, fp32 gradients under optim_grads, optim_grads_params at d = 4, there with
    a bucket size, five and four layers with a communication unit): every
    state row of every rank equals actmem's, both ways; the fp32 gradient copy and AdamW's counters are
    information."""
    assert judge(grid_rows, 0.0) == []
    assert len({row["config"] for row in grid_rows}) == 16
    # the FP8 weights' transposes: 0 both ways here (bf16; TE's Float8Tensor does not run on a CPU)
    assert {row["term"] for row in grid_rows if row["kind"] == "state"} == set(
        STATE + BACKWARD + REGATHERED + POOLS + ("unit_fp8_transposes",))


def test_the_measured_buffers_are_the_hand_derived_ones(grid_rows):
    """The module docstring's numbers: the padding, each rank's Adam moments, the gathered bucket."""
    assert _state(grid_rows, "mfsdp optim_grads_params d=2 grads bf16", 0) == (68_480, 68_480, 410_880, 18_688)
    assert _state(grid_rows, "mfsdp optim_grads_params d=2 grads bf16", 1) == (68_480, 68_480, 407_296, 18_688)
    assert _state(grid_rows, "mfsdp optim d=2 grads bf16", 0) == (136_960, 136_960, 410_880, 0)
    assert _state(grid_rows, "mfsdp no_shard d=2 grads bf16", 1) == (136_064, 136_064, 816_384, 0)
    assert _state(grid_rows, "mfsdp optim_grads d=2 grads fp32", 0) == (136_960, 4 * 34_240, 410_880, 0)
    assert _state(grid_rows, "mfsdp optim_grads_params d=4 grads bf16", 3) == (34_688, 34_688, 197_376, 18_944)
    assert _state(grid_rows, "mfsdp optim_grads_params d=4 grads bf16", 0)[2] == 208_128
    split = "mfsdp optim_grads_params d=4 grads bf16 buckets 9000"
    assert _state(grid_rows, split, 3) == (34_624, 34_624, 198_016, 18_688)
    assert _state(grid_rows, split, 0)[2] == 207_744


def test_what_the_last_layers_backward_holds_is_the_hand_derived(grid_rows):
    """The module docstring's buckets at the last layer's fc1 backward, every rank the same."""
    for rank in (0, 1):
        assert _state(grid_rows, "mfsdp optim_grads_params d=2 grads bf16", rank, BACKWARD) == (
            59_136, 59_136, 59_136, 18_688)
        assert _state(grid_rows, "mfsdp optim_grads d=2 grads bf16", rank, BACKWARD) == (0, 0, 59_136, 18_688)
        assert _state(grid_rows, "mfsdp optim d=2 grads bf16", rank, BACKWARD) == (0, 0, 0, 0)
    split = "mfsdp optim_grads_params d=4 grads bf16 buckets 9000"
    assert _state(grid_rows, split, 3, BACKWARD) == (59_904, 59_904, 59_904, 256)
    window = "mfsdp optim_grads_params d=2 grads bf16 L=5 unit 59136"
    assert _state(grid_rows, window, 1, BACKWARD) == (59_136, 59_136, 59_136, 18_688)
    overlap = "mfsdp optim_grads_params d=2 grads bf16 L=4 unit 118272"
    assert _state(grid_rows, overlap, 0, BACKWARD + REGATHERED) == (59_136, 59_136, 59_136, 18_688, 118_272)
    regathered = {config: _state(grid_rows, config, 0, REGATHERED)[0] for config in (
        "mfsdp optim_grads_params d=2 grads bf16", "mfsdp optim_grads_params d=4 grads bf16", window,
        "mfsdp optim d=2 grads bf16")}
    assert list(regathered.values()) == [118_272, 119_808, 59_136, 0]


def test_the_double_buffers_pools_are_the_hand_derived(grid_rows):
    """The module docstring's pools under --fsdp-double-buffer, the units' transients in them, every rank the same;
    without it no pool."""
    double = "mfsdp {} d=2 grads bf16{} double buffer"
    for rank in (0, 1):
        for strategy, window, pools in (("optim_grads_params", "", (118_272, 118_272)),
                                        ("optim_grads_params", " L=5 unit 59136", (118_272, 118_272)),
                                        ("optim_grads", "", (0, 118_272)), ("optim", "", (0, 0))):
            config = double.format(strategy, window)
            assert _state(grid_rows, config, rank, POOLS) == pools, config
            outside = 18_688 * (strategy != "optim")
            assert _state(grid_rows, config, rank, BACKWARD + REGATHERED) == (0, 0, 0, outside, 0), config
        assert _state(grid_rows, "mfsdp optim_grads_params d=2 grads bf16", rank, POOLS) == (0, 0)
        one_layer = "mfsdp optim_grads_params d=2 grads bf16 L=1 double buffer"
        assert _state(grid_rows, one_layer, rank, POOLS) == (59_136, 59_136)
        assert _state(grid_rows, "mfsdp optim_grads d=2 grads fp32 double buffer", rank, POOLS) == (0, 236_544)
    assert _state(grid_rows, double.format("optim_grads_params", ""), 1) == (68_480, 68_480, 407_296, 18_688)
    one_rank = "mfsdp optim_grads_params d=1 grads bf16 double buffer"
    assert _state(grid_rows, one_rank, 0, STATE[:2] + ("gathered_weights",) + POOLS + BACKWARD + REGATHERED) == (
        136_192, 136_192, 0, 0, 0, 0, 0, 0, 0, 0)


def test_the_gate_fails_padding_left_out_a_buffer_missing_or_one_the_formula_does_not_have():
    """Inject: the weights unpadded (2·(2·29,344 + 9344)/2 = 68,032 for 68,480), no gathered bucket in the formula
    (as if the rest were released after the forward), a buffer measured that no row names, and no prefetch."""
    config = mfsdp_grid()[3]                       # optim_grads_params at d = 2
    rank, measured = measure(config)[0]
    expected = formula(config, rank)
    assert judge(state_rows(config, rank, expected, measured), 0.0) == []
    for wrong, extra in (({"weights": 68_032}, {}), ({"gathered_weights": 0}, {}), ({}, {"a bucket": 1024}),
                         ({"prefetched_unit_weights": 0}, {})):
        failures = judge(state_rows(config, rank, {**expected, **wrong}, {**measured, **extra}), 0.0)
        assert len(failures) == 1, (wrong, extra, failures)


def test_the_gate_fails_a_pool_left_out_or_a_transient_priced_beside_it():
    """Inject under --fsdp-double-buffer: the gradients' pool left out of the formula, one buffer where two are
    (59,136), and the unit's gradient bucket priced as without the pools (59,136 where it is in them)."""
    config = next(config for config in mfsdp_grid() if config.spec.run.fsdp_double_buffer)
    rank, measured = measure(config)[0]
    expected = formula(config, rank)
    assert judge(state_rows(config, rank, expected, measured), 0.0) == []
    for wrong in ({"double_buffer_gradients": 0}, {"double_buffer_weights": 59_136}, {"unit_gradient_bucket": 59_136}):
        failures = judge(state_rows(config, rank, {**expected, **wrong}, measured), 0.0)
        assert len(failures) == 1, (wrong, failures)


def test_fp8_weights_groups_are_laid_out_as_megatron_core_lays_them():
    """Under --fp8-param-gather (Megatron-LM's FSDP example) each unit's TE linears' weights are a "float8" group of
    their own, laid out and padded apart from its norms and biases. megatron-core's own _get_parameter_groups and
    build_data_parallel_buffer_index, given the FP8 parameters as the meta-device path marks them, against actmem's
    buckets: the small model's layer by hand, FP8: proj 4096, QKV 12,288, fc1 6144, fc2 6144 = 28,672 (factor
    lcm(96, 64) = 192; proj ends 64 into a chunk, no partner, no fragment: a 128 hole; 28,800 = 75·384 at d = 2, and
    29,184 = 38·768 at d = 4); the rest 672 (chunk 1: padded to 2 and 4, unchanged); the embedding's group as in
    bf16."""
    from actmem.memory.megatron_fsdp import buckets
    from actmem.memory.parameters import layer_shapes, outside_shapes
    from actmem_validate.megatron_fsdp import fp8_groups, fsdp_spec

    spec = fsdp_spec("optim_grads_params")
    rows = fp8_groups(spec)
    units = {(d, dtype): padded for d, dtype, unit, _, padded in rows if unit == 0}
    assert units == {(2, "float8"): 28_800, (2, "torch.bfloat16"): 672, (4, "float8"): 29_184,
                     (4, "torch.bfloat16"): 672}
    arch = spec.architecture
    for d in (2, 4):
        laid = buckets(layer_shapes(64, 1, arch, 4), 2, *outside_shapes(64, 1, 128, 16, arch), d, "optim_grads_params",
                       fp8_weights=True)
        fp8 = units[(d, "float8")]
        assert (laid.unit_fp8_padded, laid.unit_padded, laid.unit_fp8_count) == (fp8, fp8 + 672, 28_672)
        assert laid.padded == sum(padded for d_, *_, padded in rows if d_ == d)
        assert laid.fp8_shard == 2 * fp8 // d
