"""Transformer Engine's fused MoE permutation (--moe-permute-fusion) as a CPU stand-in.

TE's kernels are Triton and need a GPU; these autograd Functions keep exactly what TE's keep, so that
megatron-core's own dispatchers run their fused path on a CPU and the harness sees what that path
holds. Read at TE v2.11 (the releases megatron-core 0.16.1 pairs with, >=2.9,<2.12), permutation.py:

- permute with a mask map (moe_permute / moe_permute_with_probs, map_type "mask", Megatron's): saves
  row_id_map alone, int32 [N, 2E+1] (triton/permutation.py, make_row_id_map; the layout since TE 2.6,
  commit dc97cc9ef) and returns it, Megatron's "sorted_indices" from then on;
- unpermute without merging probabilities (Megatron passes none): saves that same row_id_map;
- sort chunks by index (moe_sort_chunks_by_index[_with_probs]): saves its own int32 [T] map.

What the map holds here is this stand-in's own (each token's destination row by expert); its dtype
and shape are TE's, which is what memory sees. The arithmetic is the unfused path's: tokens in
expert-major order (moe_utils.py, permute).
"""

import torch


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, routing_map, probs):
        n, e = routing_map.shape
        flat = routing_map.bool().T.reshape(-1).nonzero().squeeze(1)       # e·N + token, expert-major
        rows = torch.full((e * n,), -1, dtype=torch.int32)
        rows[flat] = torch.arange(flat.numel(), dtype=torch.int32)
        row_id_map = torch.empty((n, 2 * e + 1), dtype=torch.int32)
        row_id_map[:, :e] = rows.view(e, n).T
        row_id_map[:, e:2 * e] = torch.arange(e, dtype=torch.int32)
        row_id_map[:, 2 * e] = routing_map.sum(dim=1)
        output = tokens.index_select(0, flat % n)
        permuted_probs = None if probs is None else probs.T.reshape(-1).index_select(0, flat)
        ctx.save_for_backward(row_id_map)
        ctx.mark_non_differentiable(row_id_map)
        ctx.with_probs = probs is not None
        return output, row_id_map, permuted_probs

    @staticmethod
    def backward(ctx, grad_output, _, grad_probs):
        (row_id_map,) = ctx.saved_tensors
        e = (row_id_map.shape[1] - 1) // 2
        rows = row_id_map[:, :e].long()
        routed = rows >= 0
        gathered = grad_output.index_select(0, rows.clamp(min=0).reshape(-1)).view(*rows.shape, -1)
        grad_tokens = (gathered * routed.unsqueeze(-1)).sum(dim=1).to(grad_output.dtype)
        grad_map_probs = None
        if ctx.with_probs and grad_probs is not None:
            grad_map_probs = torch.zeros(rows.shape, dtype=grad_probs.dtype)
            grad_map_probs[routed] = grad_probs.index_select(0, rows[routed])
        return grad_tokens, None, grad_map_probs


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, permuted, row_id_map, restore_shape):
        e = (row_id_map.shape[1] - 1) // 2
        rows = row_id_map[:, :e].long()
        routed = rows >= 0
        gathered = permuted.index_select(0, rows.clamp(min=0).reshape(-1)).view(*rows.shape, -1)
        ctx.save_for_backward(row_id_map)
        ctx.rows = permuted.shape[0]
        return (gathered * routed.unsqueeze(-1)).sum(dim=1).to(permuted.dtype).view(restore_shape)

    @staticmethod
    def backward(ctx, grad_output):
        (row_id_map,) = ctx.saved_tensors
        e = (row_id_map.shape[1] - 1) // 2
        rows = row_id_map[:, :e].long()
        routed = rows >= 0
        grad = torch.zeros(ctx.rows, grad_output.shape[-1], dtype=grad_output.dtype)
        tokens = routed.nonzero()[:, 0]
        grad[rows[routed]] = grad_output.reshape(-1, grad_output.shape[-1]).index_select(0, tokens)
        return grad, None, None


class _SortChunks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, split_sizes, sorted_idxs, probs):
        sizes = [int(size) for size in split_sizes.tolist()]
        starts = torch.tensor([0, *sizes]).cumsum(0)
        source = torch.cat([torch.arange(int(starts[i]), int(starts[i]) + sizes[i]) for i in sorted_idxs.tolist()])
        row_id_map = torch.empty(source.numel(), dtype=torch.int32)        # each input row's destination
        row_id_map[source] = torch.arange(source.numel(), dtype=torch.int32)
        ctx.save_for_backward(row_id_map)
        ctx.with_probs = probs is not None
        return inp.index_select(0, source), None if probs is None else probs.index_select(0, source)

    @staticmethod
    def backward(ctx, grad_output, grad_probs):
        (row_id_map,) = ctx.saved_tensors
        destinations = row_id_map.long()
        grad_inp = grad_output.index_select(0, destinations)
        grad_in_probs = grad_probs.index_select(0, destinations) if ctx.with_probs and grad_probs is not None \
            else None
        return grad_inp, None, None, grad_in_probs


def fused_permute(tokens, routing_map, num_out_tokens=None):
    output, row_id_map, _ = _Permute.apply(tokens, routing_map, None)
    return output, row_id_map


def fused_permute_with_probs(tokens, probs, routing_map, num_out_tokens=None):
    output, row_id_map, permuted_probs = _Permute.apply(tokens, routing_map, probs)
    return output, permuted_probs, row_id_map


def fused_unpermute(permuted, row_id_map, merging_probs=None, restore_shape=None):
    if merging_probs is not None:
        raise NotImplementedError("the stand-in unpermutes without merging probabilities, as Megatron calls it")
    return _Unpermute.apply(permuted, row_id_map, restore_shape)


def fused_sort_chunks_by_index(inp, split_sizes, sorted_idxs):
    return _SortChunks.apply(inp, split_sizes, sorted_idxs, None)[0]


def fused_sort_chunks_by_index_with_probs(inp, probs, split_sizes, sorted_idxs):
    return _SortChunks.apply(inp, split_sizes, sorted_idxs, probs)


_FUSED = ("fused_permute", "fused_permute_with_probs", "fused_unpermute", "fused_sort_chunks_by_index",
          "fused_sort_chunks_by_index_with_probs")
_ORIGINAL: dict = {}
_ABSENT = object()


def uninstall() -> None:
    """moe_utils as it was before install (a configuration without permute fusion after one with it, in a process)."""
    from megatron.core.transformer.moe import moe_utils

    for name, value in _ORIGINAL.items():
        if value is _ABSENT:
            delattr(moe_utils, name)
        else:
            setattr(moe_utils, name, value)
    _ORIGINAL.clear()


def install() -> None:
    """megatron-core's moe_utils calls these where TE would be (it imports them only where TE imports)."""
    from megatron.core.transformer.moe import moe_utils

    for name in ("HAVE_TE", *_FUSED):
        _ORIGINAL.setdefault(name, getattr(moe_utils, name, _ABSENT))
    moe_utils.HAVE_TE = True
    for function in (fused_permute, fused_permute_with_probs, fused_unpermute, fused_sort_chunks_by_index,
                     fused_sort_chunks_by_index_with_probs):
        setattr(moe_utils, function.__name__, function)
