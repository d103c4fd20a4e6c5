"""Context parallelism: c ranks split each sequence, and attention sees every key.

Megatron-Core runs it through Transformer Engine (``--context-parallel-size``, default
``--cp-comm-type p2p``): the keys and values go round a ring of the c ranks, and
``AttnFuncWithCPAndKVP2P.forward`` ends with ``ctx.save_for_backward(q, kv, out,
softmax_lse, ...)``: q, this rank's own k and v, the output and the fp32 log-sum-exp, all
of this rank's s/c tokens; what it received is not kept, and backward sends it round again
(plus a few index and RNG tensors of a few bytes, not counted).

The Function below keeps exactly those tensors. It computes with an all-gather of k and v
instead of a ring (the same result; which one runs does not change what is kept), and
re-gathers them in backward. Each rank holds a contiguous s/c slice here; Megatron gives
each rank two of 2c chunks to balance the causal mask, which moves no byte.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from actmem_validate.ledger import label
from actmem_validate.parallel import TensorParallel, all_gather, reduce_scatter


@dataclass(frozen=True)
class ContextParallel:
    """c ranks splitting each sequence; this one holds tokens [rank·s/c, (rank + 1)·s/c)."""

    size: int = 1
    rank: int = 0
    group: object = None

    def offset(self, local_tokens: int) -> int:
        return self.rank * local_tokens


class _ContextParallelAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over every rank's keys; keeps q, k, v (local),
    out and the fp32 log-sum-exp. q (s/c, b, a/t, d); k, v (s/c, b, g/t, d)."""

    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel):
        s_local, b, heads, d = q.shape
        with torch.no_grad():
            keys, values = (_expand(all_gather(x, cp), heads) for x in (k, v))      # (s, b, a/t, d)
            scores = _scores(q, keys, cp.offset(s_local))                            # (b, a/t, s/c, s)
            lse = torch.logsumexp(scores, dim=-1)                                    # fp32 (b, a/t, s/c)
            out = torch.einsum("bhij,jbhd->ibhd", (scores - lse[..., None]).exp(), values.float())
            out = out.to(q.dtype).contiguous()                                       # (s/c, b, a/t, d)
        label(out, "projection_input"), label(lse, "softmax_lse")
        ctx.cp = cp
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        cp, (s_local, b, heads, d), groups = ctx.cp, q.shape, k.shape[2]
        keys, values = (_expand(all_gather(x, cp), heads) for x in (k, v))           # re-gathered
        probs = (_scores(q, keys, cp.offset(s_local)) - lse[..., None]).exp()        # (b, a/t, s/c, s)
        grad = grad.float()
        grad_values = torch.einsum("bhij,ibhd->jbhd", probs, grad)
        grad_probs = torch.einsum("ibhd,jbhd->bhij", grad, values.float())
        rows = (grad * out.float()).sum(-1).permute(1, 2, 0)[..., None]              # (b, a/t, s/c, 1)
        grad_scores = probs * (grad_probs - rows) * d ** -0.5
        grad_q = torch.einsum("bhij,jbhd->ibhd", grad_scores, keys.float())
        grad_keys = torch.einsum("bhij,ibhd->jbhd", grad_scores, q.float())
        grad_k, grad_v = (reduce_scatter(_fold(x, groups).to(k.dtype), cp) for x in (grad_keys, grad_values))
        return grad_q.to(q.dtype), grad_k, grad_v, None


def _expand(x, heads):
    """(s, b, g, d) -> (s, b, a, d): each group's key or value for its a/g heads."""
    return x.repeat_interleave(heads // x.shape[2], dim=2)


def _fold(x, groups):
    """(s, b, a, d) -> (s, b, g, d): the heads' gradients summed into their group."""
    s, b, heads, d = x.shape
    return x.view(s, b, groups, heads // groups, d).sum(3)


def _scores(q, keys, offset: int):
    """QKᵀ/√d in fp32 with the causal mask of queries at positions offset + i."""
    s_local, s = q.shape[0], keys.shape[0]
    scores = torch.einsum("ibhd,jbhd->bhij", q.float(), keys.float()) * q.shape[-1] ** -0.5
    future = torch.arange(s, device=q.device)[None, :] > (offset + torch.arange(s_local, device=q.device))[:, None]
    return scores.masked_fill(future, float("-inf"))


def context_parallel_attention(q, k, v, cp: ContextParallel):
    """(s/c, b, a/t, d), (s/c, b, g/t, d) x 2 -> (s/c, b, a/t·d), keeping what TE's ring keeps."""
    s_local, b, heads, d = q.shape
    return _ContextParallelAttention.apply(q, k, v, cp).view(s_local, b, heads * d)


def tensor_and_context_groups(t: int, c: int, sequence_parallel: bool) -> TensorParallel:
    """This rank's groups when t·c ranks run tensor and context parallelism, in Megatron's
    order (tensor-parallel ranks adjacent: rank = cp_rank·t + tp_rank). Every rank creates
    every group, in the same order, as torch.distributed requires."""
    rank = dist.get_rank()
    tensor_groups = [dist.new_group([j * t + i for i in range(t)]) for j in range(c)]
    context_groups = [dist.new_group([j * t + i for j in range(c)]) for i in range(t)]
    context = ContextParallel(c, rank // t, context_groups[rank % t])
    return TensorParallel(t, rank % t, tensor_groups[rank // t], sequence_parallel, context)
