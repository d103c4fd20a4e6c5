"""The schedule's order and the ledger's accounting, on small hand-checkable cases."""

import pytest

torch = pytest.importorskip("torch")

from actmem_validate.ledger import Ledger, label, scope  # noqa: E402
from actmem_validate.schedule import first_stage_order  # noqa: E402


def test_1f1b_order_for_rank_0():
    """p = 3, n = 4: warm-up p - 1 = 2 forwards, then one forward one backward, then drain."""
    assert first_stage_order(3, 1, 4) == [
        ("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("B", 0, 0), ("F", 3, 0), ("B", 1, 0),
        ("B", 2, 0), ("B", 3, 0)]


def test_interleaved_order_for_rank_0():
    """Megatron, p = 2, m = 2, n = 4: warm-up 2(p-1) + (m-1)p = 4 chunk forwards, groups of p
    microbatches a chunk; backwards start from the last chunk."""
    assert first_stage_order(2, 2, 4) == [
        ("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1),
        ("F", 2, 0), ("B", 0, 1), ("F", 3, 0), ("B", 1, 1), ("F", 2, 1), ("B", 0, 0),
        ("F", 3, 1), ("B", 1, 0), ("B", 2, 1), ("B", 3, 1), ("B", 2, 0), ("B", 3, 0)]


def test_all_forwards_first_when_n_equals_p():
    order = first_stage_order(2, 3, 2)
    assert [kind for kind, _, _ in order] == ["F"] * 6 + ["B"] * 6


def test_ledger_counts_a_storage_once_and_leaves_parameters_out():
    weight = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    ledger = Ledger([weight])
    with ledger.recording():
        label(x, "input")
        y = x @ weight                     # saves x and weight
        z = x[1:] * y[1:]                  # saves a view of x (same storage) and a view of y
        with scope("softmax_output"):
            torch.softmax(z, dim=-1)       # saves its own output
    assert ledger.by_term() == {"input": 4 * 8 * 4, "unattributed": 4 * 8 * 4, "softmax_output": 3 * 8 * 4}


def test_a_storage_of_no_bytes_is_not_filed_but_one_byte_is():
    """torch 2.11's non-reentrant checkpoint saves a torch.empty((0,)) beside its inputs (_NoopSaveInputs): it holds
    nothing, so it is no row; an unnamed tensor of one element still is (unattributed, 4 B)."""
    class Saves(torch.autograd.Function):
        @staticmethod
        def forward(ctx, empty, one):
            ctx.save_for_backward(empty, one)
            return one.clone()

        @staticmethod
        def backward(ctx, grad):
            return None, grad

    ledger = Ledger([])
    with ledger.recording():
        Saves.apply(torch.empty((0,), requires_grad=True), torch.ones(1, requires_grad=True))
    assert ledger.by_term() == {"unattributed": 4}


def test_a_dead_label_does_not_stick_to_a_reused_address():
    ledger = Ledger([])
    with ledger.recording():
        label(torch.randn(4), "gone")      # dies at once: its storage may be reused
        x = torch.randn(4, requires_grad=True)
        (x * x).sum()
    assert set(ledger.by_term()) <= {"unattributed"}


def test_what_autograd_frees_before_the_forward_ends_is_not_held():
    """A branch nothing uses (the values of a top-k thrown away, as Megatron's aux loss does): its node
    and what it saved die with it, so the ledger drops them, and a later storage that takes the freed
    one's address is counted, not hidden behind it."""
    import torch

    x = torch.randn(64, 8, requires_grad=True)
    ledger = Ledger([])
    with ledger.recording():
        kept = torch.tanh(x)                             # tanh saves its output: held
        _, indices = torch.topk(x * 2, k=2, dim=1)        # mul saves nothing of x's (a scalar); topk its indices
        saved_then = len(ledger.saved)
        del _, indices                                    # the values discarded: the indices die with their node
        later = torch.sigmoid(x + 1)                      # sigmoid saves its output: held
    assert saved_then == 2                                # tanh's output and topk's indices were saved
    ledger.drop_freed()
    held = sum(n for _, n in ledger.saved.values())
    assert held == kept.untyped_storage().nbytes() + later.untyped_storage().nbytes()


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpointed_region_shows_the_ledger_only_its_inputs(reentrant):
    """The ledger does not depend on use_reentrant: either way the checkpoint's inputs (q, k:
    2 x 4·8·4 B) are saved where the ledger sees them, and nothing inside the region is."""
    from torch.utils.checkpoint import checkpoint

    q = torch.randn(4, 8, requires_grad=True) * 1
    k = torch.randn(4, 8, requires_grad=True) * 1
    ledger = Ledger([])
    with ledger.recording():
        label(q, "query"), label(k, "key")
        out = checkpoint(lambda q, k: torch.softmax(q @ k.t(), -1) @ k, q, k, use_reentrant=reentrant)
    assert ledger.by_term() == {"query": 128, "key": 128}
    out.sum().backward()


def _simulated_peak(p, m, n, rank=0):
    """(chunks, chunk-0 forwards) in flight at the schedule's fullest moment, from the order
    the rank really runs: the most chunks, and among those moments the most with the embedding."""
    in_flight, best = set(), (0, 0)
    for kind, microbatch, chunk in first_stage_order(p, m, n, rank):
        if kind == "F":
            in_flight.add((microbatch, chunk))
            best = max(best, (len(in_flight), sum(c == 0 for _, c in in_flight)))
        else:
            in_flight.remove((microbatch, chunk))
    return best


def test_pipeline_closed_forms_match_the_real_schedule_order():
    """actmem.memory.pipeline's arithmetic (Eq 5, the interleave factor, the 2p embedding masks, few
    microbatches) against the order itself, for p <= 8, m <= 4, n <= 6p (n a multiple of p
    when interleaved, as Megatron requires); one layer a chunk, so layers held = chunks."""
    from actmem.memory.pipeline import held_counts

    checked = 0
    for p in range(1, 9):
        for m in range(1, 5) if p > 1 else (1,):
            for n in range(1, 6 * p + 1):
                if m > 1 and n % p:
                    continue
                assert held_counts(p * m, p, m, n) == _simulated_peak(p, m, n), (p, m, n)
                checked += 1
    assert checked > 200


def test_every_stage_s_chunks_in_flight_match_its_schedule_order():
    """Every rank, not only the first: the layers held at each rank's fullest moment (its
    embedding count is 0: only rank 0 has the embedding). The closed form takes the warm-up
    plus one, capped at n·m; the order runs the warm-up, then 1F1B, then the cool-down, and
    the simulation counts what is really in flight at every step. Includes the interleaved
    n = p case, where rank 0 runs every forward first and later ranks do not."""
    from actmem.memory.pipeline import held_counts

    for p in range(2, 7):
        for m in range(1, 4):
            for n in range(1, 4 * p + 1):
                if m > 1 and n % p:
                    continue
                for rank in range(1, p):
                    chunks, _ = _simulated_peak(p, m, n, rank)
                    assert held_counts(p * m, p, m, n, stage=rank) == (chunks, 0), (p, m, n, rank)
    # p = 4, m = 2, n = 4, rank 3: warm-up 2·0 + 1·4 = 4 of 8, so 5 chunks held, not all 8
    assert _simulated_peak(4, 2, 4, 3)[0] == 5
