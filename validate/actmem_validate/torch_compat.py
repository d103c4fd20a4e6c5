"""Every private PyTorch API the harness leans on, in one place.

Each can move between releases. ``PROBES`` exercises each one, so when a new torch breaks
one, `tests/validate/test_torch_compat.py` names which, instead of a harness run failing
somewhere deep. The harness imports these names from here and never from torch's privates.
"""

import contextlib
import functools
import weakref

import torch


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that holds a DTensor's memory on this rank (the tensor itself otherwise).
    Private: DTensor._local_tensor (to_local() would record an autograd node)."""
    return getattr(tensor, "_local_tensor", tensor)


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of the memory behind a tensor, fake tensors and DTensors included (the ledger
    counts each storage once). Private: UntypedStorage._cdata."""
    return local_tensor(tensor).untyped_storage()._cdata


def fake_tensor_mode():
    """Tensors with shapes and no data, so paper-scale layers cost no memory: torch's FakeTensorMode, which
    counts storages for a LiveStorages entered inside it (_counting_fake_tensor_mode). Private:
    torch._subclasses.fake_tensor.FakeTensorMode (its dispatch method)."""
    return _counting_fake_tensor_mode()()


@functools.cache
def _counting_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = torch.ops.prim.device.default          # the autograd engine's many device queries: no storage

    class CountingFakeTensorMode(FakeTensorMode):
        """FakeTensorMode whose dispatch hands each op's outputs to ``count`` (a LiveStorages' bookkeeping, None
        when none is entered). LiveStorages as a dispatch mode of its own above fake mode costs each op a second
        crossing into Python (about 6 s of a 530b technique's 30). Only the outermost dispatch counts: the ops a
        decomposition runs inside it are the ones a mode above would not see either."""

        count, depth = None, 0

        def dispatch(self, func, types, args=(), kwargs=None):
            if self.count is None or self.depth or func is device:
                return super().dispatch(func, types, args, kwargs)
            self.depth += 1
            try:
                out = super().dispatch(func, types, args, kwargs)
            finally:
                self.depth -= 1
            self.count.after(args, kwargs, out)
            return out

    return CountingFakeTensorMode


FAKE_SHORTCUTS = True
"""Whether fake runs take the shortcuts that make the same storages with fewer of fake mode's dispatches: skip what
allocates nothing (a collective over the fake process group, which writes nothing; in-place accumulations into
main_grad; dropout's and the fused softmax's in-place ops), make a GEMM's product alone and a norm's most at once as
one transient (fused._most_at_once), and count LiveStorages inside fake mode's dispatch.
tests/validate/test_torch_compat.py turns it off and compares the rows; test_fused_memory.py the norm's peaks."""


def fake_shortcut(tensor: torch.Tensor) -> bool:
    """Whether to take, for this tensor, a fake run's shortcut (FAKE_SHORTCUTS). Private:
    torch._subclasses.fake_tensor.FakeTensor."""
    from torch._subclasses.fake_tensor import FakeTensor

    return FAKE_SHORTCUTS and isinstance(tensor, FakeTensor)


def _probe_fake_shortcut():
    with fake_tensor_mode():
        made = torch.empty(2)
    assert fake_shortcut(made) and not fake_shortcut(torch.empty(2))


def fake_store():
    """The store of the 'fake' process-group backend: one process plays rank 0 of t and
    every collective returns at once. Private: torch.testing._internal.distributed.fake_pg."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def _tensors(tree):
    """The tensors of an op's arguments or outputs (tuples, lists and dicts of them): what
    torch.utils._pytree.tree_flatten finds here, at a fraction of its cost per op."""
    import torch

    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


class _StorageCount:
    """LiveStorages' bookkeeping, given each op's arguments and outputs (by its own dispatch mode, or by fake mode's
    dispatch)."""

    def __init__(self):
        self.live, self.current, self.peak = {}, 0, 0

    def _freed(self, key):
        self.current -= self.live.pop(key, (0, None))[0]

    def after(self, args, kwargs, out):
        made = [tensor for tensor in _tensors(out) if not tensor._is_view()]
        if not made:                  # a view, a device query (the autograd engine's many): no storage
            return
        inputs = {arg.untyped_storage()._cdata for arg in _tensors((args, kwargs))}
        for tensor in made:
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key not in self.live and key not in inputs:     # not in place, not an alias
                ref = weakref.ref(storage, lambda _, key=key: self._freed(key))
                self.live[key] = (storage.nbytes(), ref)
                self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)


class LiveStorages:
    """Bytes of every storage an op made while it was entered and that is still alive, and
    their peak: what a caching allocator must hold, before its rounding. A TorchDispatchMode
    sees each op's outputs, fake tensors included; a storage counts once, from the op that
    made it to the moment it dies (a weakref on the storage object, which torch preserves as
    long as the storage lives). Views and in-place results make no storage; storages made
    before entering (the parameters) are not counted. It replaces torch's MemTracker on CPU,
    which (torch 2.13) never releases a leaf tensor that has received a .grad, such as a
    pipeline stage's received input: it counted each such input and its gradient forever,
    11.7 GB too much on 530B's interleaved first stage (tests/validate/test_torch_compat.py).
    Entered inside fake_tensor_mode() (and FAKE_SHORTCUTS on), fake mode's own dispatch does the counting: the
    ops the harness's Megatron runs make, one crossing into Python fewer each (tests/validate/test_torch_compat.py
    compares the two). It then counts no op outside that fake mode (real tensors, another fake mode), does count
    what a dispatch mode entered beneath it runs in its own handler, and does not nest. Neither way follows
    DTensor (LiveBytes does). Private: torch.utils._python_dispatch.TorchDispatchMode,
    UntypedStorage._cdata, torch._C._get_dispatch_mode."""

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode

        fake = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
        if FAKE_SHORTCUTS and isinstance(fake, _counting_fake_tensor_mode()):
            return _CountedByFakeMode(fake)

        class _Mode(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.count = _StorageCount()

            current = property(lambda self: self.count.current)
            peak = property(lambda self: self.count.peak)

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                self.count.after(args, kwargs, out)
                return out

        return _Mode()


class _CountedByFakeMode:
    """LiveStorages inside a counting fake mode: its bookkeeping attached to the mode while entered."""

    def __init__(self, mode):
        self.mode, self.count = mode, _StorageCount()

    current = property(lambda self: self.count.current)
    peak = property(lambda self: self.count.peak)

    def __enter__(self):
        if self.mode.count is not None:
            raise RuntimeError("a LiveStorages is already counting in this fake mode")
        self.mode.count = self.count
        return self

    def __exit__(self, *exc):
        self.mode.count = None
        return False


def live_tensors() -> list:
    """The strided tensors with storage that the garbage collector reaches (isinstance on
    torch.distributed.reduce_op warns, so its FutureWarning is silenced)."""
    import gc
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    return [tensor for tensor in tensors if not tensor.is_meta and tensor.layout == torch.strided]


class LiveBytes:
    """Bytes of every live storage at its current size, sampled after every op, and their peak: what
    FSDP2's step holds. LiveStorages cannot follow FSDP2, which allocates and frees its unsharded
    parameters with untyped_storage().resize_() (torch 2.13, _fsdp_param.py: alloc_storage,
    free_storage), a call no dispatch mode sees, and which keeps the model state in DTensors.
    LiveBytes knows every storage alive on entering (the garbage collector's tensors: the sharded
    parameters, their gradients, the optimizer's state, FSDP2's emptied unsharded weights) and every
    one an op makes, each by a weak reference; a DTensor counts its local shard. The storages empty on
    entering are the ones FSDP2 resizes: their sizes are summed again at each op, so a resize shows at
    the next op; the others keep the size they had (``fixed``). ``base``: the bytes alive on entering. A
    storage first met after entering that no op made (an op's input, or a view's base) was made below
    the dispatcher: gloo's reduce-scatter copies its input (NCCL makes no such copy), so those are left
    out, their most at once kept apart (``below_peak``: the harness reports it, and a fake run, with no
    gloo, must have none). An op on DTensors is left to DTensor (the mode returns NotImplemented), so the mode sees the ops
    on local tensors its handlers run, their temporaries too (loss_parallel's backward). DTensor's sharding
    propagation runs each op once more on fake tensors of the global shape, which hold no memory of the
    run: the mode pauses inside it, and counts only tensors of ``fake_mode`` (None: real ones). Private:
    TorchDispatchMode, UntypedStorage._cdata, DTensor._local_tensor, FakeTensor.fake_mode,
    ShardingPropagator._propagate_tensor_meta_non_cached."""

    def __new__(cls, fake_mode=None):
        import gc
        import weakref

        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
        from torch.utils._python_dispatch import TorchDispatchMode

        class _Mode(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.known, self.resizable, self.fixed, self.base, self.peak = {}, {}, 0, 0, 0
                self.paused, self.below, self.below_peak = 0, 0, 0

            def _forget(self, key, counted, below):
                self.known.pop(key, None)
                self.resizable.pop(key, None)
                self.fixed -= counted
                self.below -= below

            def _add(self, tensor, made_here: bool, entering: bool = False):
                tensor = local_tensor(tensor)
                if getattr(tensor, "fake_mode", None) is not fake_mode or tensor.is_meta:
                    return                          # DTensor's sharding propagation, or no memory
                storage = tensor.untyped_storage()
                key = storage._cdata
                if key in self.known and self.known[key]() is not None:
                    return
                size, below = storage.nbytes(), 0
                if entering and not size:
                    self.resizable[key] = weakref.ref(storage)
                elif not (entering or made_here):        # made below the dispatcher: apart (``below_peak``)
                    size, below = 0, size
                self.known[key] = weakref.ref(storage, lambda _, key=key, size=size, below=below:
                                              self._forget(key, size, below))
                self.fixed += size
                self.below += below
                self.below_peak = max(self.below_peak, self.below)
                self.base += size if entering else 0

            def current(self) -> int:
                """Bytes alive now, less what was made below the dispatcher."""
                return self.fixed + sum(storage.nbytes() for ref in list(self.resizable.values())
                                        if (storage := ref()) is not None)

            def __enter__(self):
                # the base is what is alive: garbage in cycles (an earlier run's modules and their tensors) is
                # collected first, and no collection runs inside, where its frees would read as the run's
                gc.collect()
                self.collecting = gc.isenabled()
                gc.disable()
                for tensor in live_tensors():
                    self._add(tensor, False, entering=True)
                self.peak = self.current()
                self.propagate = ShardingPropagator._propagate_tensor_meta_non_cached
                mode, propagate = self, self.propagate

                def paused(propagator, op_schema):
                    mode.paused += 1
                    try:
                        return propagate(propagator, op_schema)
                    finally:
                        mode.paused -= 1

                ShardingPropagator._propagate_tensor_meta_non_cached = paused
                return super().__enter__()

            def __exit__(self, *exc):
                ShardingPropagator._propagate_tensor_meta_non_cached = self.propagate
                if self.collecting:
                    gc.enable()
                return super().__exit__(*exc)

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if any(issubclass(kind, DTensor) for kind in types):
                    return NotImplemented          # DTensor's handler runs, its local ops seen here
                out = func(*args, **(kwargs or {}))
                if self.paused:
                    return out
                inputs = set()
                for tensor in _tensors((args, kwargs)):
                    self._add(tensor, False)
                    inputs.add(storage_key(tensor))
                for tensor in _tensors(out):
                    self._add(tensor, not tensor._is_view() and storage_key(tensor) not in inputs)
                self.peak = max(self.peak, self.current())
                return out

        return _Mode()


def selective_checkpoint_cache(caching_mode) -> list:
    """The tensors a selective checkpoint's caching mode holds for the rerun (torch.utils.checkpoint's
    create_selective_checkpoint_contexts: the outputs of the ops its policy saves). Private: the mode's ``storage``,
    in torch 2.13 {op: {call: its outputs, each in a _VersionWrapper (.val)}}, a marker where the op is recomputed;
    older releases {op: [outputs]}."""
    from torch.utils._pytree import tree_leaves

    calls = caching_mode.storage.values()
    entries = [entry for call in calls for entry in (call.values() if isinstance(call, dict) else call)]
    values = [getattr(leaf, "val", leaf) for leaf in tree_leaves(entries)]
    return [value for value in values if isinstance(value, torch.Tensor)]


def _probe_selective_checkpoint_cache():
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    modes = []

    def contexts():
        caching, cached = create_selective_checkpoint_contexts([torch.ops.aten.mm.default])
        modes.append(caching)
        return caching, cached

    x = torch.randn(2, 2, requires_grad=True)
    checkpoint(lambda a: (a @ a).sin(), x, use_reentrant=False, context_fn=contexts)
    cached = selective_checkpoint_cache(modes[0])
    assert len(cached) == 1 and cached[0].shape == (2, 2)


def flash_rng_state(out: torch.Tensor) -> list:
    """The philox state SDPA's flash kernel saved for the backward of ``out``: on a GPU,
    flash_api.cpp's rng_state and its unused scalar (saved as rng_state and unused by torch
    2.11, as philox_seed and philox_offset by older releases); none from the CPU's kernel. Private:
    the backward node's _saved_* attributes."""
    node = out.grad_fn
    names = ("_saved_rng_state", "_saved_unused", "_saved_philox_seed", "_saved_philox_offset")
    return [tensor for tensor in (getattr(node, name, None) for name in names) if isinstance(tensor, torch.Tensor)]


def _probe_flash_rng_state():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.ones(1, 1, 4, 8, requires_grad=True)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert "Flash" in out.grad_fn.name() and flash_rng_state(out) == []     # the CPU kernel keeps none
    if torch.cuda.is_available():
        q = q.detach().to("cuda", torch.bfloat16).requires_grad_()
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        assert sum(t.untyped_storage().nbytes() for t in flash_rng_state(out)) == 24


def pipeline_backward(output: torch.Tensor, grad: torch.Tensor) -> None:
    """Backward from a pipeline stage's output whose storage was already freed (its .data
    swapped for one element after the send), with the gradient received for it: Megatron's
    custom_backward (pipeline_parallel/schedules.py) calls the engine directly, skipping the
    shape check. Private: Variable._execution_engine.run_backward."""
    from torch.autograd import Variable

    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad,), keep_graph=False, create_graph=False, inputs=tuple(),
        allow_unreachable=True, accumulate_grad=True)


def _probe_pipeline_backward():
    x = torch.ones(3, requires_grad=True)
    out = x * 2
    out.data = torch.empty((1,))
    pipeline_backward(out, torch.ones(3))
    assert x.grad.tolist() == [2.0, 2.0, 2.0]


def _probe_live_storages():
    for mode in (contextlib.nullcontext(), fake_tensor_mode()):        # its own mode; counted by fake mode
        with mode, LiveStorages() as live:
            x = torch.ones(256)
            y = x * 2
            del x, y
        assert live.peak == 2 * 256 * 4 and live.current == 0


def _probe_fake_pg():
    import torch.distributed as dist

    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=2)
    try:
        x = torch.ones(2)
        dist.all_reduce(x)
    finally:
        dist.destroy_process_group()


def _probe_local_tensor():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=2)
    try:
        local = torch.ones(2)
        dtensor = DTensor.from_local(local, init_device_mesh("cpu", (2,)), [Replicate()])
        assert local_tensor(dtensor).untyped_storage()._cdata == local.untyped_storage()._cdata
    finally:
        dist.destroy_process_group()


#: name of the private API -> a call that fails if this torch no longer has it as used
PROBES = {
    "UntypedStorage._cdata": lambda: storage_key(torch.ones(2)),
    "DTensor._local_tensor": _probe_local_tensor,
    "torch._subclasses.fake_tensor.FakeTensorMode": lambda: fake_tensor_mode().__enter__().__exit__(None, None, None),
    "torch.testing._internal.distributed.fake_pg.FakeStore": _probe_fake_pg,
    "TorchDispatchMode and storage weakrefs (LiveStorages)": _probe_live_storages,
    "Variable._execution_engine.run_backward (Megatron's custom_backward)": _probe_pipeline_backward,
    "SDPA flash backward node's _saved_rng_state / _saved_philox_* (flash_rng_state)": _probe_flash_rng_state,
    "a selective checkpoint's caching mode's storage (selective_checkpoint_cache)": _probe_selective_checkpoint_cache,
    "torch._subclasses.fake_tensor.FakeTensor (fake_shortcut)": _probe_fake_shortcut,
}
