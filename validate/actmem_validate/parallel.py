"""The tensor-parallel group a module runs in, and the collectives it uses (first dim)."""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from actmem_validate.torch_compat import fake_shortcut

# torch >= 2.13 names them *_single; older releases *_into_tensor / *_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class TensorParallel:
    """t ranks splitting the blocks; with sequence parallelism they also split the sequence."""

    size: int = 1
    rank: int = 0
    group: object = None
    sequence_parallel: bool = False
    context: object = None
    """The context-parallel group beside this one (actmem_validate.context); None: c = 1."""

    @property
    def context_size(self) -> int:
        return 1 if self.context is None else self.context.size

    @classmethod
    def from_world(cls, sequence_parallel: bool) -> "TensorParallel":
        if not dist.is_initialized():
            return cls(sequence_parallel=sequence_parallel)
        return cls(dist.get_world_size(), dist.get_rank(), None, sequence_parallel)


# In a fake run the fake process group writes nothing, and its collective is a dispatch past fake mode's cache
# (about 0.8 ms): the outputs and contiguous copies are made as ever, the collective itself skipped (fake_shortcut)


def all_gather(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    out = x.new_empty((x.shape[0] * tp.size, *x.shape[1:]))
    source = x.contiguous()
    if not fake_shortcut(x):
        _all_gather_single(out, source, group=tp.group)
    return out


def reduce_scatter(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    out = x.new_empty((x.shape[0] // tp.size, *x.shape[1:]))
    source = x.contiguous()
    if not fake_shortcut(x):
        _reduce_scatter_single(out, source, group=tp.group)
    return out


def all_reduce(x: torch.Tensor, tp: TensorParallel, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if tp.size == 1:
        return x
    x = x.contiguous().clone()
    if not fake_shortcut(x):
        dist.all_reduce(x, op=op, group=tp.group)
    return x


def split_first_dim(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's contiguous chunk of the first dim."""
    chunk = x.shape[0] // tp.size
    return x[tp.rank * chunk:(tp.rank + 1) * chunk].contiguous()
