"""FSDP2 in the harness (--fsdp, issue 30): torchtitan's Llama under torch's own fully_shard over 2 gloo ranks
(actmem_validate.fsdp), its model state to the byte and its step's peak above actmem's floor; each check can fail."""

import pytest

torch = pytest.importorskip("torch")

from actmem_validate.compare import judge  # noqa: E402
from actmem_validate.grid import fsdp_configs  # noqa: E402
from actmem_validate.launch import run_real  # noqa: E402

# The small spec (h = 64, a = 8 heads of d_h = 8 in g = 4 groups, f = 97, v = 511, L = 2) on rank 0 of d = 2, which
# keeps ceil(rows/2) of each parameter: a block's wq and wo 32·64 = 2048 each, wk and wv 16·64 = 1024 each, w1 and w3
# 49·64 = 3136 each, w2 32·97 = 3104, two norms of 32: 15,584; the embedding 256·64 = 16,384; the final norm 32 and
# the output layer 16,384. S = 16,384 + 2·15,584 + 16,416 = 63,968 elements; 21 parameter tensors.
S = 63_968
# With t = 2 and SP inside d = 2 (v = 510, f = 98), rank 0's tensor-parallel shards: wq [32, 64], wk and wv [16, 64],
# wo [64, 32], w1 and w3 [49, 64], w2 [64, 49], norms 64 (replicated), the embedding and output layer [255, 64];
# FSDP2 keeps ceil(rows/2) of each: 16·64 = 1024, 8·64 = 512 twice, 32·32 = 1024, 25·64 = 1600 twice, 32·49 = 1568,
# 32 twice: a block 7904; the embedding 128·64 = 8192; the final norm 32 and the output layer 8192.
S_TP = 8192 + 2 * 7904 + 8224
# v = 4095 at t = 1: the embedding and output layer keep 2048·64 each; the blocks as S's.
S_VOCAB = 131_072 + 2 * 15_584 + 32 + 131_072
# v = 64 at t = 1: the embedding and output layer keep 32·64 each.
S_SHORT = 2048 + 2 * 15_584 + 32 + 2048
# L = 3 (the layer option's run whose last block is kept whole): a third block, 30 parameter tensors.
S_THREE = 16_384 + 3 * 15_584 + 16_416
GAP = 8             # percent: what these runs reach (5.7% in this tree, full recompute under 'always', 7.9% before
                    # its SwiGLU backward was a moment; CI's small grid allows 30)


@pytest.fixture(scope="module")
def fsdp_rows():
    return run_real(fsdp_configs())


def _rows(rows, term, rank=0):
    return [row for row in rows if row["term"] == term and row["rank"] == rank]


def test_each_run_peaks_where_the_floor_says():
    """The moment each run's floor takes: the loss's backward; the embedding's post-backward where a large vocabulary
    sits beside a short sequence; the last block's SwiGLU backward under full recompute where the loss holds no
    weights ('always'), or a short vocabulary beside a long sequence."""
    from actmem.memory.estimate import estimate

    moments = {config.label: estimate(config.spec).run.peak_moment.name for config in fsdp_configs()}
    assert sorted(set(moments.values())) == ["embedding_reduce", "loss", "swiglu"]
    assert all(name == "embedding_reduce" for label, name in moments.items() if "-vocab " in label)
    assert all(name == "swiglu" for label, name in moments.items() if "-checkpointing " in label)


def test_the_floor_is_the_peak_without_recompute(fsdp_rows):
    """Where nothing unmodelled is live (no recompute, t = 1) the measured peak is the floor and 12 B (small scalars);
    now and then more of gloo's own (runs on this machine: 264 B once in 52; once, in a CI run of session 35, more
    than 1 KiB, by an amount not recorded), so within 1 KiB, a run off it measured once more: a wrong floor is off
    every time."""
    exact = [row for row in _rows(fsdp_rows, "peak") if row["config"].endswith(" none") and " t=1 " in row["config"]]
    assert len(exact) == 6
    off = [row["config"] for row in exact if not 0 <= row["measured_bytes"] - row["formula_bytes"] <= 1024]
    if off:         # gloo's own allocations vary from run to run, a wrong floor does not: measured once more
        again = _rows(run_real([config for config in fsdp_configs() if config.label in off]), "peak")
        gaps = {row["config"]: row["measured_bytes"] - row["formula_bytes"] for row in again}
        assert len(gaps) == len(off) and all(0 <= gap <= 1024 for gap in gaps.values()), gaps


def test_per_op_checkpointing_peaks_at_its_floor(fsdp_rows):
    """torchtitan's per-op checkpointing at t = 1, one microbatch and two: the loss's backward decides, with every
    block's input and cached op outputs held (wq's, wv's, w1's, w2's, SDPA's), and the measured peak is the floor and
    the loss's scalars (12 B in this tree), as without recompute: a cached output the floor left out, or one it
    counted that the checkpoint does not keep, would move it by kilobytes."""
    rows = [row for row in _rows(fsdp_rows, "peak") if row["config"].endswith(" op") and " t=1 " in row["config"]
            and "-checkpointing " not in row["config"]]
    assert len(rows) == 2
    assert all(0 <= row["measured_bytes"] - row["formula_bytes"] <= 1024 for row in rows), rows


def test_the_layer_option_reruns_only_a_checkpointed_last_block(fsdp_rows):
    """torchtitan's layer option, every second block checkpointed (selective_ac_option 2): of 3 blocks the middle
    one, so the last is kept whole and the loss's backward decides, measured at the floor (12 B above in this tree);
    of 2 the last, which the last block's backward reruns, a moment of the floor, above it by what the rerun holds
    besides, as under full recompute (kilobytes)."""
    rows = {row["config"]: row for row in _rows(fsdp_rows, "peak") if "every 2" in row["config"]}
    assert len(rows) == 2
    (three,) = [row for label, row in rows.items() if "-3 " in label]
    assert 0 <= three["measured_bytes"] - three["formula_bytes"] <= 1024


def test_every_fsdp_run_is_measured_to_the_byte(fsdp_rows):
    """Saved activations as without FSDP, 0 B off on both ranks; rank 0's fp32 shards 4S, their gradients 4S,
    AdamW's two moments 8S and a 4-B step a tensor, as the storages hold them; the step's peak above the floor."""
    assert judge(fsdp_rows, 0.0, GAP) == []
    sizes = {4 * S, 4 * S_TP, 4 * S_VOCAB, 4 * S_SHORT, 4 * S_THREE}
    assert {row["measured_bytes"] for row in _rows(fsdp_rows, "fsdp_weights")} == sizes == {
        255_872, 128_896, 1_173_376, 141_184, 318_208}
    assert {row["measured_bytes"] for row in _rows(fsdp_rows, "fsdp_gradients")} == sizes
    assert {row["measured_bytes"] for row in _rows(fsdp_rows, "fsdp_optimizer_state")} == {
        8 * S + 4 * 21, 8 * S_TP + 4 * 21, 8 * S_VOCAB + 4 * 21, 8 * S_SHORT + 4 * 21, 8 * S_THREE + 4 * 30}
    assert len(_rows(fsdp_rows, "peak")) == 20 and not _rows(fsdp_rows, "peak", rank=1)


def test_the_swiglu_backward_measures_within_its_weight_gradient(fsdp_rows):
    """v = 64 beside s = 512, full recompute and torchtitan's per-op checkpointing: the last block's SwiGLU backward
    decides (every checkpoint, the rerun block less the product, the product's and mul's gradients, the residual
    stream's; the block gathered, the one before it prefetched). Measured above it by w2's unsharded bf16 gradient,
    made just before (FSDP2 holds it to the block's post-backward; not counted: 97·64·2 = 12,416 B) and the loss's
    scalars."""
    rows = [row for row in _rows(fsdp_rows, "peak") if "-checkpointing " in row["config"]]
    assert sorted(row["config"].rsplit(" ", 1)[1] for row in rows) == ["full", "op"]
    assert all(0 <= row["measured_bytes"] - row["formula_bytes"] <= 12_416 + 16 for row in rows)
    hsdp = [row for row in _rows(fsdp_rows, "fsdp_weights") if " hsdp 2x2 " in row["config"]]
    assert [row["measured_bytes"] for row in hsdp] == [4 * S]        # two replicas of d = 2's shards
    assert _rows(fsdp_rows, "total", rank=3)          # the t = 2 runs' four ranks


@pytest.mark.parametrize("term, factor", [("fsdp_gradients", 0), ("fsdp_optimizer_state", 2), ("peak", 1.5)])
def test_the_gate_fails_a_state_or_floor_counted_wrong(fsdp_rows, term, factor):
    """Inject: the gradients left out of actmem's state (measured, not in the formula), the optimizer doubled, the
    floor raised above what the step held: red."""
    rows = [dict(row) for row in fsdp_rows]
    for row in rows:
        if row["term"] == term:
            row["formula_bytes"] = int(row["formula_bytes"] * factor)
    assert judge(rows, 0.0, GAP)


def test_the_gate_fails_a_peak_far_above_the_floor(fsdp_rows):
    """A gap the run does not allow (1%): red, from above."""
    assert any("more than --max-peak-gap" in line for line in judge([dict(row) for row in fsdp_rows], 0.0, 1))


def test_a_ledger_that_keeps_the_gathered_weights_is_red(monkeypatch):
    """Inject: the ledger without its pre-hooks counts the unsharded bf16 weights autograd saves as activations;
    they are no term of the table, so the run is red. One process over the fake process group (the collectives'
    data is not the point: their sizes are)."""
    import torch.distributed as dist

    from actmem_validate import fsdp
    from actmem_validate.ledger import Ledger
    from actmem_validate.torch_compat import fake_store

    monkeypatch.setattr(fsdp, "_ledger", lambda model: Ledger([*model.parameters(), *model.buffers()]))
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=2)
    try:
        rows = fsdp.measure(fsdp_configs()[0], 0)
    finally:
        dist.destroy_process_group()
    assert any("no term or named residual accounts for" in line for line in judge(rows, 0.0, GAP))
