"""The harness's fused Functions allocate what the GPU kernels allocate, so its measured peak
is the kernels' and not the harness's own temporaries (fake tensors: paper-scale shapes)."""

import pytest

torch = pytest.importorskip("torch")

from actmem_validate import fused  # noqa: E402
from actmem_validate.torch_compat import LiveStorages, fake_tensor_mode  # noqa: E402


def test_swiglu_backward_allocates_only_its_2f_wide_gradient():
    """Llama 405B's MLP on one of t = 8: s = 8192, f/t = 6656, so the input is 8192 x 13312
    16-bit = 218,103,808 B, and the backward allocates exactly one tensor that size."""
    with fake_tensor_mode():
        x = torch.empty(8192, 1, 2 * 6656, dtype=torch.bfloat16, requires_grad=True)
        y = fused.swiglu(x)
        grad = torch.empty_like(y)
        with LiveStorages() as live:
            torch.autograd.grad(y, x, grad)
    assert live.peak == 8192 * 2 * 6656 * 2 == 218_103_808


def test_a_norm_holds_its_output_and_statistics_and_blocks_of_fp32_work():
    """530B's LayerNorm without SP: 2048 tokens x 20480, 16-bit output 83,886,080 B, fp32 mu
    and rsigma 8,192 B each. TE's kernel allocates those; the harness's fp32 work is a block
    of NORM_BLOCK_ELEMENTS (64 MiB in fp32) at a time, a few live at once, never the whole
    sbh in fp32 (335,544,320 B a copy, which the textbook version makes four of)."""
    block_bytes = 4 * fused.NORM_BLOCK_ELEMENTS
    with fake_tensor_mode():
        x = torch.empty(2048, 1, 20480, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.empty(20480, dtype=torch.bfloat16, requires_grad=True)
        bias = torch.empty(20480, dtype=torch.bfloat16, requires_grad=True)
        with LiveStorages() as forward:
            y = fused._Norm.apply(x, weight, bias, False)
        grad = torch.empty_like(y)
        with LiveStorages() as backward:
            torch.autograd.grad(y, (x, weight, bias), grad)
    output, statistics, vectors = 83_886_080, 2 * 8_192, 2**20     # vectors: h-sized weights, sums
    assert output + statistics < forward.peak <= output + statistics + 2 * block_bytes + vectors
    assert output < backward.peak <= output + 3 * block_bytes + vectors


class _Allocations:
    """Sizes of the storages each op makes, in order (a dispatch mode of its own, above fake mode)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        from actmem_validate.torch_compat import _tensors

        sizes = self.sizes = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = {t.untyped_storage()._cdata for t in _tensors((args, kwargs))}
                sizes.extend(t.untyped_storage().nbytes() for t in _tensors(out)
                             if not t._is_view() and t.untyped_storage()._cdata not in inputs)
                return out

        self.mode = Mode()


def _norm_run(rows, hidden, dtype, weight_dtype, rms, transposed_grad):
    """A norm's forward and backward in fake mode: (its allocations in order, the peak and what is left after
    forward, the same after backward, the gradients' shapes and dtypes)."""
    allocations = _Allocations()
    with fake_tensor_mode():
        x = torch.empty(rows, 1, hidden, dtype=dtype, requires_grad=True)
        weight = torch.empty(hidden, dtype=weight_dtype, requires_grad=True)
        bias = None if rms else torch.empty(hidden, dtype=weight_dtype, requires_grad=True)
        inputs = (x, weight) if rms else (x, weight, bias)
        with allocations.mode, LiveStorages() as forward:
            y = fused._Norm.apply(x, weight, bias, rms)
        grad = torch.empty(hidden, 1, rows, dtype=dtype).permute(2, 1, 0) if transposed_grad else torch.empty_like(y)
        with allocations.mode, LiveStorages() as backward:
            grads = torch.autograd.grad(y, inputs, grad)
    return (allocations.sizes, forward.peak, forward.current, backward.peak, backward.current,
            [(tuple(g.shape), g.dtype) for g in grads])


@pytest.mark.parametrize("rows, hidden, block", [(10, 8, 24), (10, 2, 8), (7, 16, 16), (3, 64, 64), (40, 4, 4096)])
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dtype, weight_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                                 (torch.bfloat16, torch.float32)])
def test_a_fake_norm_holds_what_its_loops_hold(monkeypatch, rows, hidden, block, rms, dtype, weight_dtype):
    """A fake run's norm makes the loops' most at once as one transient (fused._most_at_once) and keeps what they
    keep: the same peaks forward and backward, the same left alive, the same gradients, as the loops run in fake
    mode (FAKE_SHORTCUTS off), which make many more allocations. Blocks of 3, 1, 1 and 40 tokens (NORM_BLOCK_ELEMENTS small: a remainder block; a block
    wider than half the hidden size, where the last block's projection outlives the rest), LayerNorm and RMSNorm,
    16-bit and fp32 work, an fp32 weight beside 16-bit input, and a gradient that is not contiguous (reshape copies)."""
    from actmem_validate import torch_compat

    monkeypatch.setattr(fused, "NORM_BLOCK_ELEMENTS", block)
    for transposed_grad in (False, True):
        fast = _norm_run(rows, hidden, dtype, weight_dtype, rms, transposed_grad)
        monkeypatch.setattr(torch_compat, "FAKE_SHORTCUTS", False)
        loops = _norm_run(rows, hidden, dtype, weight_dtype, rms, transposed_grad)
        monkeypatch.setattr(torch_compat, "FAKE_SHORTCUTS", True)
        assert fast[1:] == loops[1:]
        assert len(loops[0]) > len(fast[0]) + 4 and fast[1] > fast[2] and fast[3] > 0
