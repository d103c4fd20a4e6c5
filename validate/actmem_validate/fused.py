"""Autograd Functions that keep exactly what the fused GPU kernels of Megatron-Core with
Transformer Engine keep, so a CPU run measures what a GPU run holds.

- Norms: TE's fused LayerNorm and RMSNorm (transformer_engine/pytorch/module/
  layernorm_linear.py, _LayerNormLinear.forward: saves inputmat, ln_out, mu, rsigma; and
  module/rmsnorm.py, ops/basic/rmsnorm.py: saves x and rstdevs). mu and rsigma are fp32, one
  a token (normalization.cpp: at::empty({N}, at::kFloat)); RMSNorm has no mu. The norm's
  output (ln_out) is saved here by the linear that follows: the same bytes, one storage.
- SwiGLU: Megatron's fused_bias_swiglu.py, SwiGLUFunction.forward:
  ctx.save_for_backward(input_for_backward), the 2f-wide input only.
- Rotary embedding: TE's fused RoPE (transformer_engine/pytorch/attention/rope.py,
  FusedRoPEFunc.forward: ctx.save_for_backward(freqs)), which Megatron-Core applies by
  default (apply_rope_fusion): it keeps the fp32 frequency table only, a tensor the model
  caches (RotaryEmbedding.forward is lru_cached), so no activation at all.

- Scaled, masked softmax: Megatron's FusedScaleMaskSoftmax with the upper-triangular
  kernel (fused_softmax.py; apex's scaled_upper_triang_masked_softmax_cuda.cu): forward
  allocates the probabilities only and saves them; backward runs in place on the incoming
  gradient ("backward pass is completely in-place").

The backward passes are the textbook ones; what matters for the measurement is what forward
saves, and it saves nothing else.
"""

import torch
from torch import nn

from actmem_validate.torch_compat import fake_shortcut

EPSILON = 1e-5


NORM_BLOCK_ELEMENTS = 2**24
"""Elements of the fp32 working rows a norm computes at once. TE's fused kernels work row by
row in registers and allocate only their outputs; the harness works through blocks of
tokens, so its fp32 temporaries are a few of these blocks (64 MiB each), not of size sbh."""


def _blocks(rows: int, hidden: int):
    step = max(1, NORM_BLOCK_ELEMENTS // hidden)
    return (slice(start, min(start + step, rows)) for start in range(0, rows, step))


class _Norm(torch.autograd.Function):
    """y = (x - mu)·rsigma·w + b (LayerNorm) or x·rsigma·w (RMSNorm), statistics in fp32.
    Forward allocates y, rsigma and mu; backward dx, dw and db: what TE's kernels allocate,
    the fp32 work done a block of tokens at a time (NORM_BLOCK_ELEMENTS)."""

    @staticmethod
    def forward(ctx, x, weight, bias, rms: bool):
        rows, hidden = x.numel() // x.shape[-1], x.shape[-1]
        work = torch.promote_types(x.dtype, torch.float32)
        stats = dict(dtype=torch.float32, device=x.device)
        y, rsigma = torch.empty_like(x), torch.empty(*x.shape[:-1], 1, **stats)   # (..., 1) fp32
        mu = None if rms else torch.empty(*x.shape[:-1], 1, **stats)
        if fake_shortcut(x):                            # the loop's most at once, made and freed
            torch.empty(_most_at_once(rows, hidden, backward=False), dtype=work, device=x.device)
        else:
            x2, y2, r2, m2 = x.view(rows, hidden), y.view(rows, hidden), rsigma.view(rows, 1), \
                (None if rms else mu.view(rows, 1))
            for block in _blocks(rows, hidden):         # two fp32 blocks live at most
                centred = x2[block].to(work, copy=True)
                if not rms:
                    m2[block] = centred.mean(-1, keepdim=True)
                    centred.sub_(m2[block])
                r2[block] = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + EPSILON)
                out = centred.mul_(r2[block]).mul_(weight.to(work))
                y2[block] = out if bias is None else out.add_(bias.to(work))
                del centred, out                        # before the next block's copy
        ctx.rms, ctx.has_bias = rms, bias is not None
        ctx.save_for_backward(x, weight, rsigma, *(() if rms else (mu,)))
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, rsigma, *mu = ctx.saved_tensors
        rows, hidden = x.numel() // x.shape[-1], x.shape[-1]
        work = torch.promote_types(x.dtype, torch.float32)
        grad_x = torch.empty_like(x)
        grad_weight = torch.zeros(hidden, dtype=work, device=x.device)
        grad_bias = torch.zeros(hidden, dtype=work, device=x.device) if ctx.has_bias else None
        g2 = grad.reshape(rows, hidden)                 # a copy where grad is not contiguous, held to the end
        if fake_shortcut(x):                            # the loop's most at once, made and freed
            torch.empty(_most_at_once(rows, hidden, backward=True), dtype=work, device=x.device)
        else:
            x2, dx2, r2 = x.view(rows, hidden), grad_x.view(rows, hidden), rsigma.view(rows, 1)
            for block in _blocks(rows, hidden):         # three fp32 blocks live at most
                x_hat = x2[block].to(work, copy=True)
                if not ctx.rms:
                    x_hat.sub_(mu[0].view(rows, 1)[block])
                x_hat.mul_(r2[block])
                g = g2[block].to(work, copy=True)
                grad_weight += (g * x_hat).sum(0)
                if grad_bias is not None:
                    grad_bias += g.sum(0)
                g.mul_(weight.to(work))
                projection = (g * x_hat).mean(-1, keepdim=True)
                if not ctx.rms:
                    g.sub_(g.mean(-1, keepdim=True))
                dx2[block] = g.sub_(x_hat.mul_(projection)).mul_(r2[block])
                del x_hat, g                            # before the next block's copies
        grad_bias = None if grad_bias is None else grad_bias.to(weight.dtype)
        return grad_x, grad_weight.to(weight.dtype), grad_bias, None


def _most_at_once(rows: int, hidden: int, backward: bool) -> int:
    """Elements of fp32 work the loops above hold at most at once, by hand (tests/validate/test_fused_memory.py runs
    both and compares). Forward: a block's copy, its square and their mean, 2n·h + n, the first block the largest.
    Backward, block i: its two copies, a product and the larger of the product's column sum (h) or row mean (n_i),
    beside the previous block's projection (n_(i-1)): 3n_i·h + max(h, n_i) + n_(i-1); the last projection outlives
    the loop beside two h-wide casts, never more. A fake run makes this one
    transient in the loops' place: their slices, views and in-place ops allocate nothing, and were the most of a
    fake 530b run's dispatches (about 45% of a full-recompute technique's time)."""
    sizes = [block.stop - block.start for block in _blocks(rows, hidden)]
    if not backward:
        return 2 * sizes[0] * hidden + sizes[0] if sizes else 0
    return max((3 * n * hidden + max(hidden, n) + previous for n, previous in zip(sizes, [0] + sizes)), default=0)


class _ScaledCausalSoftmax(torch.autograd.Function):
    """softmax(scale·scores, causal) over the last dim; scores: (b·a/t, s, s), the product
    the core has just made and nobody keeps, so it is scaled and masked in place. Not
    mark_dirty: scores is not returned. Were it ever saved by another op, its bumped version
    counter would make that op's backward raise, so the in-place write cannot go unseen (in a real
    run: a fake run skips the in-place ops, which allocate nothing)."""

    @staticmethod
    def forward(ctx, scores, scale: float):
        s = scores.shape[-1]
        above = torch.ones(s, s, dtype=torch.bool, device=scores.device)   # s² bytes, transient
        if not fake_shortcut(scores):          # in place: a fake run skips them, which allocate nothing
            scores.mul_(scale).masked_fill_(above.triu_(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        ctx.scale = scale
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, grad):
        (probs,) = ctx.saved_tensors
        rows = torch.bmm(probs.view(-1, 1, probs.shape[-1]), grad.reshape(-1, probs.shape[-1], 1))
        if fake_shortcut(grad):                # the rest is in place: a fake run skips it
            return grad, None
        # p·(g - Σ p·g)·scale, written over the incoming gradient
        return grad.sub_(rows.view(*probs.shape[:-1], 1)).mul_(probs).mul_(ctx.scale), None


def scaled_causal_softmax(scores: torch.Tensor, scale: float) -> torch.Tensor:
    return _ScaledCausalSoftmax.apply(scores, scale)


class Norm(nn.Module):
    """LayerNorm (weight and bias) or RMSNorm (weight), as TE's fused kernels run them."""

    def __init__(self, hidden: int, normalization: str, dtype=None, device=None, summed_over_heads=False):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.rms = normalization == "rmsnorm"
        self.weight = nn.Parameter(torch.ones(hidden, **kw))
        self.bias = None if self.rms else nn.Parameter(torch.zeros(hidden, **kw))
        for param in self.parameters():
            param.sequence_parallel = True     # replicated; grads all-reduced under SP
            param.summed_over_heads = summed_over_heads   # a q or k norm: all-reduced under TP too

    def forward(self, x):
        return _Norm.apply(x, self.weight, self.bias, self.rms)


class _SwiGLU(torch.autograd.Function):
    """silu(gate)·up of the 2f-wide input [gate | up]; keeps the input only."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        gate, up = x.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        """Allocates the 2f-wide input gradient only, as the fused kernel does (Megatron's
        jit-fused swiglu_back writes torch.cat of two fused expressions): each half is
        computed in place in its part of that one tensor."""
        (x,) = ctx.saved_tensors
        gate, up = x.chunk(2, dim=-1)
        out = torch.empty_like(x)                                  # (..., 2f)
        grad_gate, grad_up = out.chunk(2, dim=-1)
        torch.sigmoid(gate, out=grad_up)                           # σ
        grad_gate.copy_(grad_up).neg_().add_(1).mul_(gate).add_(1).mul_(grad_up)   # σ(1 + gate(1 - σ))
        grad_gate.mul_(up).mul_(grad)
        grad_up.mul_(gate).mul_(grad)                              # g·silu(gate)
        return out


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """(..., 2f) -> (..., f), keeping what Megatron's fused SwiGLU keeps."""
    return _SwiGLU.apply(x)


ROPE_BASE = 10000.0


def rotary_frequencies(seq_len: int, dim: int, device=None) -> torch.Tensor:
    """Megatron-Core's RotaryEmbedding table: angles of each position for each of d/2
    frequencies, repeated to d ([freqs | freqs]), fp32, shaped (s, 1, 1, d)."""
    inverse = 1.0 / ROPE_BASE ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inverse)
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]


def _rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class _Rope(torch.autograd.Function):
    """x·cos + rotate_half(x)·sin, a new tensor; keeps the frequency table only. The
    rotation is orthogonal, so backward rotates the gradient back: g·cos - rotate_half(g·sin)."""

    @staticmethod
    def forward(ctx, x, freqs):
        ctx.save_for_backward(freqs)
        rot = freqs.shape[-1]                          # --rotary-percent: the rest of d passes
        cos, sin = freqs.cos(), freqs.sin()
        wide = x[..., :rot].to(torch.promote_types(x.dtype, torch.float32))   # 16-bit in, fp32 math
        return torch.cat(((wide * cos + _rotate_half(wide) * sin).to(x.dtype), x[..., rot:]), dim=-1)

    @staticmethod
    def backward(ctx, grad):
        (freqs,) = ctx.saved_tensors
        rot = freqs.shape[-1]
        g = grad[..., :rot].to(torch.promote_types(grad.dtype, torch.float32))
        back = (g * freqs.cos() - _rotate_half(g * freqs.sin())).to(grad.dtype)
        return torch.cat((back, grad[..., rot:]), dim=-1), None


def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """(s, b, n, d) rotated by position, keeping what TE's fused RoPE keeps."""
    return _Rope.apply(x, freqs)
