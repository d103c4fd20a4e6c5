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

EPSILON = 1e-5


class _Norm(torch.autograd.Function):
    """y = (x - mu)·rsigma·w + b (LayerNorm) or x·rsigma·w (RMSNorm), statistics in fp32."""

    @staticmethod
    def forward(ctx, x, weight, bias, rms: bool):
        x32 = x.float()
        mu = None if rms else x32.mean(-1, keepdim=True)                     # (..., 1) fp32
        centred = x32 if rms else x32 - mu
        rsigma = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + EPSILON)  # (..., 1) fp32
        y = centred * rsigma * weight.float()
        if bias is not None:
            y = y + bias.float()
        ctx.rms, ctx.has_bias = rms, bias is not None
        ctx.save_for_backward(x, weight, rsigma, *(() if rms else (mu,)))
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rsigma, *mu = ctx.saved_tensors
        x_hat = (x.float() - (0 if ctx.rms else mu[0])) * rsigma
        g = grad.float() * weight.float()
        grad_x = g - x_hat * (g * x_hat).mean(-1, keepdim=True)
        if not ctx.rms:
            grad_x = grad_x - g.mean(-1, keepdim=True)
        tokens = tuple(range(grad.dim() - 1))
        grad_weight = (grad.float() * x_hat).sum(tokens).to(weight.dtype)
        grad_bias = grad.float().sum(tokens).to(weight.dtype) if ctx.has_bias else None
        return (grad_x * rsigma).to(x.dtype), grad_weight, grad_bias, None


class _ScaledCausalSoftmax(torch.autograd.Function):
    """softmax(scale·scores, causal) over the last dim; scores: (b·a/t, s, s), the product
    the core has just made and nobody keeps, so it is scaled and masked in place."""

    @staticmethod
    def forward(ctx, scores, scale: float):
        s = scores.shape[-1]
        above = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu_(1)   # s² bytes, transient
        probs = torch.softmax(scores.mul_(scale).masked_fill_(above, float("-inf")), dim=-1)
        ctx.scale = scale
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, grad):
        (probs,) = ctx.saved_tensors
        rows = torch.bmm(probs.view(-1, 1, probs.shape[-1]), grad.reshape(-1, probs.shape[-1], 1))
        # p·(g - Σ p·g)·scale, written over the incoming gradient
        return grad.sub_(rows.view(*probs.shape[:-1], 1)).mul_(probs).mul_(ctx.scale), None


def scaled_causal_softmax(scores: torch.Tensor, scale: float) -> torch.Tensor:
    return _ScaledCausalSoftmax.apply(scores, scale)


class Norm(nn.Module):
    """LayerNorm (weight and bias) or RMSNorm (weight), as TE's fused kernels run them."""

    def __init__(self, hidden: int, normalization: str, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.rms = normalization == "rmsnorm"
        self.weight = nn.Parameter(torch.ones(hidden, **kw))
        self.bias = None if self.rms else nn.Parameter(torch.zeros(hidden, **kw))
        for param in self.parameters():
            param.sequence_parallel = True     # replicated; grads all-reduced under SP

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
        (x,) = ctx.saved_tensors
        gate, up = x.chunk(2, dim=-1)
        sigmoid = torch.sigmoid(gate)
        grad_gate = grad * up * sigmoid * (1 + gate * (1 - sigmoid))
        return torch.cat([grad_gate, grad * gate * sigmoid], dim=-1)


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
        cos, sin = freqs.cos(), freqs.sin()
        wide = x.to(torch.promote_types(x.dtype, torch.float32))        # 16-bit in, fp32 math
        return (wide * cos + _rotate_half(wide) * sin).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        (freqs,) = ctx.saved_tensors
        g = grad.to(torch.promote_types(grad.dtype, torch.float32))
        return (g * freqs.cos() - _rotate_half(g * freqs.sin())).to(grad.dtype), None


def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """(s, b, n, d) rotated by position, keeping what TE's fused RoPE keeps."""
    return _Rope.apply(x, freqs)
