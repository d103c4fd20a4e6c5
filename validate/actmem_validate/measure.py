"""Measure one configuration on this rank: saved bytes by term, and the allocator's peak."""

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from actmem.estimate import estimate
from actmem.spec import Spec, build_spec
from actmem_validate.compare import compare
from actmem_validate.gpt import LayerSpec
from actmem_validate.parallel import TensorParallel
from actmem_validate.schedule import FirstStage, run_first_stage

#: technique -> (tensor parallel, sequence parallel, recompute); Table 2's rows plus full
#: recompute under SP (which keeps the layer input split, 2sbh/t)
TECHNIQUES = {
    "none": (False, False, "none"), "tp": (True, False, "none"), "tp-sp": (True, True, "none"),
    "tp-sel": (True, False, "selective"), "tp-sp-sel": (True, True, "selective"),
    "full": (True, False, "full"), "tp-sp-full": (True, True, "full"),
}


@dataclass(frozen=True)
class Config:
    """One measured run of the first pipeline stage."""

    name: str
    technique: str
    heads: int
    hidden: int
    layers: int
    vocab: int
    seq_len: int
    t: int
    p: int
    m: int
    micro_batch: int
    microbatches: int
    dropout: float = 0.1

    @property
    def world_size(self) -> int:
        return self.t if TECHNIQUES[self.technique][0] else 1

    @property
    def label(self) -> str:
        return (f"{self.name} t={self.world_size} p={self.p} m={self.m} b={self.micro_batch} "
                f"n={self.microbatches} {self.technique}")

    def spec(self) -> Spec:
        """actmem's spec for the same run: d = 1, so global batch = n·b."""
        _, sp, recompute = TECHNIQUES[self.technique]
        model = dict(heads=self.heads, hidden=self.hidden, layers=self.layers, vocab=self.vocab,
                     seq_len=self.seq_len)
        run = dict(tensor_parallel=self.world_size, pipeline_parallel=self.p, interleave=self.m,
                   micro_batch=self.micro_batch, sequence_parallel=sp, recompute=recompute,
                   gpus=self.world_size * self.p, global_batch=self.microbatches * self.micro_batch)
        return build_spec(model, run, name=self.name)


def measure(config: Config, rank: int, device: str = "cpu", fake: bool = False) -> list[dict]:
    """Build the first stage on this rank, run its schedule, compare with the estimate."""
    spec = config.spec()
    _, sp, recompute = TECHNIQUES[config.technique]
    tp = TensorParallel.from_world(sp) if config.world_size > 1 else TensorParallel(sequence_parallel=sp)
    layer_spec = LayerSpec(config.hidden, config.heads, config.seq_len, config.layers, config.dropout,
                           recompute, torch.bfloat16, device)
    torch.manual_seed(1234 + rank)
    mode = _fake_mode() if fake else nullcontext()
    with mode:
        stage = FirstStage(layer_spec, spec.padded_vocab, tp, config.p, config.m)
        with _PeakMemory(stage, device) as peak:
            run = run_first_stage(stage, layer_spec, config.p, config.m, config.microbatches,
                                  config.micro_batch, spec.padded_vocab, tp, peak.current)
    mask_bytes = native_dropout_mask_bytes(device)       # a real probe, outside any fake mode
    return compare(config, estimate(spec), run, rank, peak.bytes, mask_bytes)


def native_dropout_mask_bytes(device: str) -> int:
    """Bytes an element of the mask PyTorch's own dropout saves on this device (4 on CPU,
    where it keeps a float mask; 1 with CUDA's fused kernel). The harness keeps 1 byte."""
    x = torch.ones(8, device=device, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        torch.nn.functional.dropout(x, 0.5, training=True)
    return max(t.element_size() for t in saved)


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


class _PeakMemory:
    """Peak bytes above the parameters during the schedule: torch.cuda's allocator stats on a
    GPU, torch.distributed._tools.mem_tracker.MemTracker elsewhere (it follows fake tensors too)."""

    def __init__(self, module, device: str):
        self.module, self.device, self.bytes = module, device, 0

    def __enter__(self):
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.tracker = _device_wide_tracker()
            self.tracker.track_external(self.module)
            self.tracker.__enter__()
        return self

    def current(self) -> int:
        """Bytes allocated now above the parameters."""
        if self.device.startswith("cuda"):
            return torch.cuda.memory_allocated() - self.base
        return _above_parameters(next(iter(self.tracker.get_tracker_snapshot("current").values()), {}))

    def __exit__(self, *exc):
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated() - self.base
            return False
        self.tracker.__exit__(*exc)
        self.bytes = _above_parameters(next(iter(self.tracker.get_tracker_snapshot("peak").values()), {}))
        return False


def _above_parameters(snapshot: dict) -> int:
    """A MemTracker snapshot's bytes, parameters left out."""
    return int(sum(n for kind, n in snapshot.items()
                   if kind != "Total" and getattr(kind, "value", "") != "Parameter"))


def _device_wide_tracker():
    """MemTracker's device-wide peak without its per-module statistics: those assume each
    module runs once an iteration, and a pipeline schedule runs each n·m times."""
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

    return DeviceWideMemTracker()
