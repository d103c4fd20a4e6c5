"""Converters between the tensor-parallel and sequence-parallel regions (Figures 4 and 5).

Megatron's names; each is an autograd function that saves no tensor. With t = 1 they
are the identity.
"""

import torch

from actmem_validate.parallel import TensorParallel, all_gather, all_reduce, reduce_scatter, split_first_dim


def _identity(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return x


def _mapping(forward, backward, doc: str):
    """An autograd function running one collective forward and its conjugate backward."""

    class Mapping(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, tp):
            ctx.tp = tp
            return forward(x, tp)

        @staticmethod
        def backward(ctx, grad):
            return backward(grad, ctx.tp), None

    def apply(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        return x if tp.size == 1 else Mapping.apply(x, tp)

    apply.__doc__ = doc
    return apply


copy_to_tensor_parallel_region = _mapping(
    _identity, all_reduce, "f: forward identity, backward all-reduce.")
reduce_from_tensor_parallel_region = _mapping(
    all_reduce, _identity, "f̄: forward all-reduce, backward identity.")
reduce_scatter_to_sequence_parallel_region = _mapping(
    reduce_scatter, all_gather, "ḡ: forward reduce-scatter, backward all-gather, first dim.")
scatter_to_sequence_parallel_region = _mapping(
    split_first_dim, all_gather, "forward: keep this rank's chunk of the first dim; backward: all-gather.")
