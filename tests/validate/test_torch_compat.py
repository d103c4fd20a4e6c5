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
