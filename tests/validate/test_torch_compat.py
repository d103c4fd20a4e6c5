"""Each private PyTorch API the harness uses still works on this torch; a failure names it."""

import pytest

pytest.importorskip("torch")

from actmem_validate.torch_compat import PROBES  # noqa: E402


@pytest.mark.parametrize("api", PROBES)
def test_private_torch_api_still_works(api):
    PROBES[api]()


def test_live_storages_free_a_leaf_that_received_a_gradient():
    """A pipeline stage's received input is a leaf that gets a .grad. Per microbatch: the
    input x (4096 x 256 fp32, 4 MiB) and its gradient (4 MiB) must be freed with the graph.
    torch's MemTracker kept both forever (it grew by 8 MiB a microbatch); the live count
    returns to zero, and its peak is the same every microbatch."""
    import torch

    from actmem_validate.torch_compat import LiveStorages

    weight = torch.randn(256, 256, requires_grad=True)          # made before: not counted
    mib = 2**20
    with LiveStorages() as live:
        peaks = []
        for _ in range(3):
            x = torch.randn(4096, 256, requires_grad=True)
            (x @ weight).sum().backward()
            del x
            weight.grad = None
            peaks.append(live.peak)
            assert live.current == 0
    # forward: x and x @ w, 4 MiB each (the sum keeps neither); backward: x, dx = g @ wᵀ (4 MiB;
    # g is the sum's gradient expanded, a view), dw = xᵀ @ g (256 KiB) and two 4-byte scalars
    assert peaks == [8 * mib + 256 * 1024 + 8] * 3


def test_live_storages_do_not_count_views_or_in_place_results():
    import torch

    from actmem_validate.torch_compat import LiveStorages

    base = torch.zeros(1024)                                      # 4 KiB, made before entering
    with LiveStorages() as live:
        view = base.view(32, 32).t()
        base.add_(1)
        made = torch.ones(1024)                                   # 4 KiB
        del view
    assert live.peak == 4096 and live.current == 4096 and made.sum() == 1024


def test_live_bytes_sees_a_storage_resized_between_ops():
    """FSDP2 frees and reallocates its unsharded weights with untyped_storage().resize_(), which no dispatch
    mode sees: a storage alive and empty on entering, resized to 4 MiB, counts at the next op; one alive and full
    on entering is in the base."""
    import torch

    from actmem_validate.torch_compat import LiveBytes

    with LiveBytes() as before:                                  # whatever else this process holds
        pass
    full, empty = torch.ones(1024), torch.empty(0)
    with LiveBytes() as live:
        empty.untyped_storage().resize_(4 * 2**20)
        torch.zeros(1)                                            # an op: the mode looks again
        empty.untyped_storage().resize_(0)
        torch.zeros(1)
    assert live.base - before.base == 4096                       # full, alive on entering
    assert live.peak - live.base == 4 * 2**20 + 4               # each zeros(1) freed at once


def test_live_bytes_sees_inside_dtensors_loss_parallel_backward():
    """loss_parallel's backward (torch 2.13, _nll_loss_and_log_softmax_backward) runs on the local shard inside
    DTensor's handler: zeros_like(x), exp(x) and their sum are live at once, then the product: 3 fp32 copies of the
    [N, V/t] log-probabilities above what the forward left (the allocator's own count, torch.profiler's, says
    3.0 copies too). A mode that did not look inside DTensor saw one; the
    global-shape fake tensors of DTensor's sharding propagation are not counted (they would add V/(V/t) = t times
    a copy)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    from actmem_validate.torch_compat import LiveBytes, fake_store

    rows, vocab, t = 512, 256, 2
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=t)
    try:
        logits = distribute_tensor(torch.randn(rows, vocab), init_device_mesh("cpu", (t,)), [Shard(1)])
        logits = logits.detach().requires_grad_()
        labels = torch.randint(0, vocab, (rows,))
        with loss_parallel():
            loss = F.cross_entropy(logits, labels)
            with LiveBytes() as live:
                loss.backward()
    finally:
        dist.destroy_process_group()
    copy = 4 * rows * vocab // t            # beside them the handler's int64 and bool index tensors, 33 B a row
    assert 3 * copy <= live.peak - live.base < 3 * copy + 64 * rows


@pytest.mark.parametrize("code", ["torchtitan", "transformers"])
def test_the_loss_backward_holds_two_fp32_gradients_of_the_logits(code):
    """actmem's cross_entropy_fp32_gradients at t = 1 (8sbv): PyTorch's cross entropy on fp32 logits, as torchtitan's
    loss (components/loss.py) and transformers' ForCausalLMLoss (loss/loss_utils.py) run it. Above what the forward
    left (the bf16 logits, their fp32 copy's log-softmax), its backward holds nll_loss's fp32 gradient of the
    log-probabilities and log_softmax's of the logits at once; the 16-bit copy after them is smaller. (transformers'
    loss frees the shifted int64 labels it made, 8 B a row, and its 4-B total weight before then.)"""
    import torch

    from actmem_validate.torch_compat import LiveBytes

    rows, vocab = 256, 1024
    logits = torch.randn(1, rows, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, rows))
    if code == "torchtitan":
        from actmem_validate.torchtitan import cross_entropy_loss

        loss = cross_entropy_loss(logits, labels)
    else:
        from transformers.loss.loss_utils import ForCausalLMLoss

        loss = ForCausalLMLoss(logits, labels, vocab)
    with LiveBytes() as live:
        loss.backward()
    fp32 = 4 * rows * vocab
    own_labels = 8 * rows + 4 if code == "transformers" else 0
    assert 2 * fp32 - own_labels <= live.peak - live.base < 2 * fp32 + 64 * rows


def test_live_bytes_is_not_lowered_by_an_earlier_runs_garbage():
    """An earlier run's modules hold their tensors in reference cycles until the collector runs; were it to run
    inside the measured step, their frees would read as the step's and lower its peak (the small grid's HSDP run
    once measured a whole gradient set low that way). LiveBytes collects on entering and not inside."""
    import gc

    import torch

    from actmem_validate.torch_compat import LiveBytes

    class Cycle:
        def __init__(self):
            self.me, self.tensor = self, torch.ones(2**20)      # 4 MiB, garbage once made

    live = LiveBytes()               # made first: its imports could run the collector themselves
    Cycle()
    with live:
        gc.collect()                                            # a collection inside: nothing left to free
        kept = torch.ones(1024)
    assert live.peak - live.base == 4096
    assert gc.isenabled()
    del kept


def test_fake_shortcuts_measure_what_the_skipped_ops_would(monkeypatch):
    """A fake run skips the collectives over the fake process group, the in-place accumulations into main_grad,
    dropout's and the softmax's in-place ops and a GEMM's views (torch_compat.fake_shortcut), makes a norm's most at
    once as one transient, and counts storages inside fake mode's dispatch: every row, the peak and each term's
    bytes, is the same with none of that, at t = 2 with SP and two microbatches through the fused weight-gradient
    GEMM."""
    from actmem_validate import torch_compat
    from actmem_validate.grid import configs_for, small_spec
    from actmem_validate.launch import run_fake

    config = configs_for(small_spec(2, 2, name="small"), ["tp-sp-sel"], 2)[0]
    short = run_fake([config])
    monkeypatch.setattr(torch_compat, "FAKE_SHORTCUTS", False)
    assert run_fake([config]) == short
    assert any(row["term"] == "peak" for row in short)
