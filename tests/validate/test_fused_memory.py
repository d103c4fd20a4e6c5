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
