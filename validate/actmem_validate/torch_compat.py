"""Every private PyTorch API the harness leans on, in one place.

Each can move between releases. ``PROBES`` exercises each one, so when a new torch breaks
one, `tests/validate/test_torch_compat.py` names which, instead of a harness run failing
somewhere deep. The harness imports these names from here and never from torch's privates.
"""

import torch


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of the memory behind a tensor, fake tensors included (the ledger counts each
    storage once). Private: UntypedStorage._cdata."""
    return tensor.untyped_storage()._cdata


def fake_tensor_mode():
    """Tensors with shapes and no data, so paper-scale layers cost no memory.
    Private: torch._subclasses.fake_tensor.FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def fake_store():
    """The store of the 'fake' process-group backend: one process plays rank 0 of t and
    every collective returns at once. Private: torch.testing._internal.distributed.fake_pg."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def device_wide_mem_tracker():
    """MemTracker's device-wide peak without its per-module statistics: those assume each
    module runs once an iteration, and a pipeline schedule runs each n·m times. Private:
    torch.distributed._tools.mem_tracker and its _pre/_post forward/backward hooks."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class DeviceWideMemTracker(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            pass

        def _post_fw_hook(self, module, inputs, outputs):
            pass

        def _pre_bw_hook(self, module, args):
            pass

        def _post_bw_hook(self, module, args):
            pass

    for hook in ("_pre_fw_hook", "_post_fw_hook", "_pre_bw_hook", "_post_bw_hook"):
        if not callable(getattr(MemTracker, hook, None)):
            raise AttributeError(f"MemTracker.{hook} is gone: the device-wide tracker overrides it")
    return DeviceWideMemTracker()


def tracker_bytes_above_parameters(tracker, which: str) -> int:
    """A MemTracker snapshot ('current' or 'peak') in bytes, parameters left out.
    Private: the snapshot's per-device dict keyed by _MemRefType."""
    snapshot = next(iter(tracker.get_tracker_snapshot(which).values()), {})
    return int(sum(n for kind, n in snapshot.items()
                   if kind != "Total" and getattr(kind, "value", "") != "Parameter"))


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


def _probe_tracker():
    tracker = device_wide_mem_tracker()
    module = torch.nn.Linear(4, 4)
    tracker.track_external(module)
    with tracker:
        module(torch.ones(2, 4)).sum().backward()
    assert tracker_bytes_above_parameters(tracker, "peak") > 0


def _probe_fake_pg():
    import torch.distributed as dist

    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=2)
    try:
        x = torch.ones(2)
        dist.all_reduce(x)
    finally:
        dist.destroy_process_group()


#: name of the private API -> a call that fails if this torch no longer has it as used
PROBES = {
    "UntypedStorage._cdata": lambda: storage_key(torch.ones(2)),
    "torch._subclasses.fake_tensor.FakeTensorMode": lambda: fake_tensor_mode().__enter__().__exit__(None, None, None),
    "torch.testing._internal.distributed.fake_pg.FakeStore": _probe_fake_pg,
    "torch.distributed._tools.mem_tracker.MemTracker hooks and snapshot": _probe_tracker,
    "Variable._execution_engine.run_backward (Megatron's custom_backward)": _probe_pipeline_backward,
}
