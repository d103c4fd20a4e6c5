"""Converters between the tensor-parallel and sequence-parallel regions (Figures 4 and 5).

Megatron's names; each is an autograd function that saves no tensor. With t = 1 they
are the identity.
"""

import torch

from actmem_validate.parallel import TensorParallel, all_gather, all_reduce, reduce_scatter, split_first_dim


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """f: forward identity, backward all-reduce."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.tp), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """f̄: forward all-reduce, backward identity."""

    @staticmethod
    def forward(ctx, x, tp):
        return all_reduce(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """g: forward all-gather, backward reduce-scatter, first dim."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return all_gather(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.tp), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """ḡ: forward reduce-scatter, backward all-gather, first dim."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return reduce_scatter(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.tp), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """forward: keep this rank's chunk of the first dim; backward: all-gather."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return split_first_dim(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.tp), None


def _bypass(function):
    def apply(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        return x if tp.size == 1 else function.apply(x, tp)
    apply.__doc__ = function.__doc__
    return apply


copy_to_tensor_parallel_region = _bypass(_CopyToTensorParallelRegion)
reduce_from_tensor_parallel_region = _bypass(_ReduceFromTensorParallelRegion)
gather_from_sequence_parallel_region = _bypass(_GatherFromSequenceParallelRegion)
reduce_scatter_to_sequence_parallel_region = _bypass(_ReduceScatterToSequenceParallelRegion)
scatter_to_sequence_parallel_region = _bypass(_ScatterToSequenceParallelRegion)
