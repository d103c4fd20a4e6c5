"""Transformer Engine's whole-layer CPU offloading (Megatron's --cpu-offloading-num-layers), as a stand-in
that runs on a CPU and under fake tensors.

TE's code (v2.11, transformer_engine/pytorch/cpu_offload.py: DefaultOffloadSynchronizer,
OffloadableLayerState) needs CUDA streams and events; this class keeps its schedule and its
choice of tensors, line for line, and moves the data the way a copy would, outside torch's
allocator, so what the device holds is what TE's GPU would hold:

- around each layer, a saved_tensors_hooks pair (push_tensor, pop_tensor) files every tensor
  the layer saves that TE would offload (_check_if_offload: not a Parameter, not marked
  _TE_do_not_offload, contiguous unless marked offload_base_tensor) in the layer's state and
  hands autograd an index; the others stay with autograd. TE skips FakeTensors and tensors off
  CUDA: here the harness's device stands for CUDA and fake tensors for real ones;
- TE's attention (FusedAttnFunc, FlashAttention: start_offload(q, k, v, offload_base_tensor=True)) hands
  its kernel q, k and v marked to offload their bases, and the kernel writes its output and statistics
  contiguous (sbhd); the harness's SDPA keeps permuted views of the same tensors, so inside
  ``te_attention()`` a saved tensor that is dense in memory counts as TE's contiguous one;
- a saved view whose base has as many elements is replaced by its base before the copy, and a
  layer's copies are deduplicated by id (TensorGroupProcessor);
- entering layer j starts layer j - 1's copy when j - 1 < N, and releases layer j - (L - N)'s
  device tensors (finish_offload_map); entering layer 0 of a new forward releases every state;
- a layer's backward, at its output's grad_fn prehook (group_prefetch_offload_commit_async),
  releases the layer backwarded before it and reloads layer l - (L - 1 - N) into new device
  tensors (start_reload: torch.empty_like on the device); the backward's end releases the last.

On a GPU the host copy is a CPU tensor, as TE's; on the CPU harness it is a numpy array of the
tensor's bytes in storage order (no data under fake tensors), which torch's dispatcher never sees, so
LiveStorages (the CPU's allocator stand-in) counts only what the device holds. ``host_bytes`` is what
the copies hold at their most.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from actmem_validate import ledger


@dataclass
class _Copy:
    """A tensor on the host: its bytes (None under fake tensors) and how to remake it."""

    data: object
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    nbytes: int


@dataclass(eq=False)
class _LayerState:
    """OffloadableLayerState: the layer's tensors on the device, on the host, and reloaded."""

    device: list = field(default_factory=list)
    host: list = field(default_factory=list)
    views: list = field(default_factory=list)
    """For each filed tensor, (index of its copy, its view's shape, stride and offset, or None)."""
    reloaded: list = field(default_factory=list)
    state: str = "not_offloaded"


class CpuOffload:
    """TE's DefaultOffloadSynchronizer over ``layers`` layers, the first ``offloaded`` of them offloaded."""

    def __init__(self, layers: int, offloaded: int):
        self.layers, self.offloaded = layers, offloaded
        self.states = [_LayerState() for _ in range(layers)]
        self.forwards = None           # TE's num_of_fwds
        self.current = None
        self.previous_backward = None
        self.host_bytes = 0            # the most the host held at once

    @contextmanager
    def layer(self):
        """One layer's forward (Megatron: ``with self.offload_context``)."""
        self._forward_step()
        with torch.autograd.graph.saved_tensors_hooks(self._push, self._pop):
            yield

    def commit(self, x: torch.Tensor) -> torch.Tensor:
        """group_prefetch_offload_commit_async: the layer's backward begins at its output's grad_fn."""
        layer = self.current

        def prehook(_):
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._backward_step(layer)

        x.grad_fn.register_prehook(prehook)
        return x

    def _forward_step(self):
        if self.forwards in (None, self.layers - 1):
            for state in self.states:
                self._release_all(state)
            self.forwards = 0
        else:
            self.forwards += 1
        j = self.current = self.forwards
        if 0 < j <= self.offloaded:
            self._start_offload(self.states[j - 1])
        finished = j - (self.layers - self.offloaded)
        if 0 <= finished < self.offloaded:
            self.states[finished].device, self.states[finished].state = [], "offload_finished"

    def _backward_step(self, layer: int):
        if self.previous_backward is not None:
            self._release_all(self.states[self.previous_backward])
        self.previous_backward = self.current = layer
        reload = layer - (self.layers - 1 - self.offloaded)
        if 0 <= reload < self.offloaded:
            self._start_reload(self.states[reload])

    def _finish_backward(self):
        if self.previous_backward is not None:
            self._release_all(self.states[self.previous_backward])
        self.previous_backward = None

    def _push(self, tensor):
        ledger.record(tensor)              # the ledger names it, as it names what autograd keeps
        if not _offloadable(tensor):
            return tensor
        state = self.states[self.forwards]
        state.device.append(tensor)
        return len(state.device) - 1

    def _pop(self, packed):
        """pop_tensor: by index into the state of the layer whose backward runs (current_layer_id)."""
        if isinstance(packed, torch.Tensor):
            return packed
        state = self.states[self.current]
        if state.state == "not_offloaded":
            return state.device[packed]
        if state.state != "reload_started":
            raise RuntimeError(f"layer {self.current}'s tensors are asked for in state {state.state}")
        copy, view = state.views[packed]
        tensor = state.reloaded[copy]
        return tensor if view is None else tensor.as_strided(*view)

    def _start_offload(self, state: _LayerState):
        """TensorGroupProcessor (base switching, deduplication by id), then one host copy a tensor."""
        bases, views = [], []
        for tensor in state.device:
            base, view = tensor, None
            if tensor._base is not None and (getattr(tensor, "offload_base_tensor", False)
                                             or tensor._base.numel() == tensor.numel()):   # TE's base switching
                base, view = tensor._base, (tensor.shape, tensor.stride(), tensor.storage_offset())
            index = next((i for i, held in enumerate(bases) if held is base), None)
            if index is None:
                bases.append(base)
                index = len(bases) - 1
            views.append((index, view))
        state.host = [_to_host(base) for base in bases]
        state.views, state.state = views, "offload_started"
        self._count_host()

    def _start_reload(self, state: _LayerState):
        state.reloaded = [_to_device(copy) for copy in state.host]
        state.state = "reload_started"

    def _release_all(self, state: _LayerState):
        state.device, state.host, state.views, state.reloaded = [], [], [], []
        state.state = "not_offloaded"

    def _count_host(self):
        held = sum(copy.nbytes for state in self.states for copy in state.host)
        self.host_bytes = max(self.host_bytes, held)


_IN_TE_ATTENTION: list = []


@contextmanager
def te_attention():
    """The harness's flash core, standing for TE's attention: what it saves in permuted layouts, TE's
    kernel saves contiguous, or marked to offload its base (start_offload(q, k, v, offload_base_tensor=True))."""
    _IN_TE_ATTENTION.append(True)
    try:
        yield
    finally:
        _IN_TE_ATTENTION.pop()


def _offloadable(tensor: torch.Tensor) -> bool:
    """OffloadableLayerState._check_if_offload, the harness's device standing for CUDA."""
    if isinstance(tensor, torch.nn.Parameter) or getattr(tensor, "_TE_do_not_offload", False):
        return False
    if _IN_TE_ATTENTION and _dense(tensor):
        return True
    return tensor.is_contiguous() or getattr(tensor, "offload_base_tensor", False)


def _dense(tensor: torch.Tensor) -> bool:
    """Its elements fill its storage without gaps or overlap, in some order of its dims (a permuted
    contiguous tensor)."""
    expected = 1
    for stride, size in sorted((stride, size) for stride, size in zip(tensor.stride(), tensor.shape) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _to_host(tensor: torch.Tensor) -> _Copy:
    """The pinned host copy (torch.empty_like(..., device='cpu', pin_memory=True).copy_), kept where the
    device's allocator does not see it: a CPU tensor beside a GPU; on the CPU harness, the bytes in
    numpy, in the order of the storage (a permuted tensor keeps its layout)."""
    data = None
    if tensor.device.type == "cuda":
        data = tensor.detach().to("cpu")
    elif not isinstance(tensor, torch._subclasses.FakeTensor):
        data = _in_storage_order(tensor.detach()).view(torch.uint8).numpy().copy()
    return _Copy(data, tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device,
                 tensor.numel() * tensor.element_size())


def _to_device(copy: _Copy) -> torch.Tensor:
    """start_reload: a new device tensor of the same layout (torch.empty_like on the GPU) and the copy back."""
    tensor = torch.empty_strided(copy.shape, copy.stride, dtype=copy.dtype, device=copy.device)
    if isinstance(copy.data, torch.Tensor):
        tensor.copy_(copy.data)
    elif copy.data is not None:
        _in_storage_order(tensor).view(torch.uint8).copy_(torch.from_numpy(copy.data))
    return tensor


def _in_storage_order(tensor: torch.Tensor) -> torch.Tensor:
    """A dense tensor as a flat view of its elements in the order they are stored (no copy)."""
    order = sorted(range(tensor.dim()), key=lambda dim: -tensor.stride(dim))
    flat = tensor.permute(order)
    if not flat.is_contiguous():
        raise ValueError(f"a tensor of strides {tensor.stride()} is not dense: TE would not offload it")
    return flat.reshape(-1)
