"""Megatron's tensor-parallel building blocks, saving what Megatron's save.

Shapes: activations are [s, b, h] (or [s/t, b, h] in the sequence-parallel region).
"""

import math

import torch
from torch import nn

from actmem_validate.ledger import label
from actmem_validate.mappings import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region, \
    reduce_scatter_to_sequence_parallel_region
from actmem_validate.parallel import TensorParallel, all_gather, all_reduce, reduce_scatter


class _LinearWithSequenceParallel(torch.autograd.Function):
    """y = all-gather(x)·Wᵀ + b, saving only the local sequence shard x (2sbh/t) and
    all-gathering it again in backward, as Megatron's column-parallel linear does under SP.
    Saving the gathered input instead would hold t times more."""

    @staticmethod
    def forward(ctx, x, weight, bias, tp):
        ctx.tp, ctx.has_bias = tp, bias is not None
        ctx.save_for_backward(x, weight)
        total = all_gather(x, tp)                          # (s, b, h)
        out = total @ weight.t()
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        total = all_gather(x, ctx.tp)                      # re-gathered, not stored
        grad_input = reduce_scatter(grad @ weight, ctx.tp)  # (s/t, b, h)
        grad_weight = grad.flatten(0, -2).t() @ total.flatten(0, -2)
        grad_bias = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None


class ColumnParallelLinear(nn.Module):
    """Weight split along its output dim; the input is replicated (TP) or sequence-split (SP)."""

    def __init__(self, in_features, out_features, tp: TensorParallel, bias=True, dtype=None, device=None):
        super().__init__()
        self.tp = tp
        kw = dict(dtype=dtype, device=device)
        self.weight = nn.Parameter(torch.empty(out_features // tp.size, in_features, **kw))
        self.bias = nn.Parameter(torch.zeros(out_features // tp.size, **kw)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        if self.tp.sequence_parallel and self.tp.size > 1:
            return _LinearWithSequenceParallel.apply(x, self.weight, self.bias, self.tp)
        x = copy_to_tensor_parallel_region(x, self.tp)
        return nn.functional.linear(x, self.weight, self.bias)    # saves x: 2sbh


class RowParallelLinear(nn.Module):
    """Weight split along its input dim; the partial outputs are summed: all-reduce under TP,
    reduce-scatter into the sequence-parallel region under SP. The bias is replicated and
    added after the reduction."""

    def __init__(self, in_features, out_features, tp: TensorParallel, bias=True, dtype=None, device=None):
        super().__init__()
        self.tp = tp
        kw = dict(dtype=dtype, device=device)
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp.size, **kw))
        self.bias = nn.Parameter(torch.zeros(out_features, **kw)) if bias else None
        if bias:
            self.bias.sequence_parallel = True        # replicated; grads all-reduced under SP
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        partial = nn.functional.linear(x, self.weight)             # saves x: 2sbh/t
        if self.tp.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(partial, self.tp)
        else:
            out = reduce_from_tensor_parallel_region(partial, self.tp)
        return out if self.bias is None else out + self.bias


class _Dropout(torch.autograd.Function):
    """Dropout that keeps a 1-byte mask, as Megatron's fused kernels do (PyTorch's own
    dropout keeps a float mask on CPU)."""

    @staticmethod
    def forward(ctx, x, p, term):
        mask = torch.rand_like(x) >= p                    # bool: 1 byte an element
        label(mask, term)
        ctx.scale = 1.0 / (1.0 - p)
        ctx.save_for_backward(mask)
        return x * mask * ctx.scale

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad * mask * ctx.scale, None, None


class Dropout(nn.Module):
    def __init__(self, p: float, mask_term: str):
        super().__init__()
        self.p, self.mask_term = p, mask_term

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        return _Dropout.apply(x, self.p, self.mask_term)


def init_scaled(module: nn.Module, layers: int) -> None:
    """Megatron scales the output layers' init by 1/sqrt(2L); harmless, keeps values sane."""
    nn.init.normal_(module.weight, std=0.02 / math.sqrt(2 * layers))


def allreduce_sequence_parallel_grads(module: nn.Module, tp: TensorParallel) -> None:
    """Under SP each rank's layer-norm and row-bias grads cover its own sequence shard;
    Megatron all-reduces them after backward."""
    if not (tp.sequence_parallel and tp.size > 1):
        return
    for name, param in module.named_parameters():
        if param.grad is not None and getattr(param, "sequence_parallel", False):
            param.grad = all_reduce(param.grad, tp)
