"""Measure one configuration on this rank: saved bytes by term, and the allocator's peak."""

from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

from actmem.memory.estimate import estimate
from actmem.model.implementation import MEGATRON
from actmem.model.spec import Spec
from actmem.memory.stages import split_of
from actmem.memory.techniques import Technique, matching, unnamed_run
from actmem.model.recompute import Recompute
from actmem_validate.compare import compare
from actmem_validate.gpt import LayerSpec, fp8_weights, fused_wgrad_weights
from actmem_validate.layers import attach_main_grads, free_main_grads, make_dummy_wgrads, make_fp8_state
from actmem_validate.context import tensor_and_context_groups
from actmem_validate.offload import CpuOffload
from actmem_validate.parallel import TensorParallel
from actmem_validate.schedule import FirstStage, run_first_stage
from actmem_validate.torch_compat import LiveStorages, fake_tensor_mode


@dataclass(frozen=True)
class Config:
    """One measured run of the first pipeline stage: the spec as measured (its run set to
    the technique, d = 1 and global batch n·b) and the technique it stands for."""

    spec: Spec
    technique: Technique
    microbatches: int

    @property
    def world_size(self) -> int:
        """t·c ranks, and under FSDP2 its d data-parallel ranks too (they shard the model state)."""
        return self.spec.run.tensor_parallel * self.spec.run.context_parallel * self.sharded_over

    @property
    def sharded_over(self) -> int:
        """d where its ranks shard the model state (FSDP2, ZeRO): they are measured; 1 otherwise."""
        return self.spec.data_parallel if self.spec.run.fsdp or self.spec.run.zero else 1

    @property
    def label(self) -> str:
        run = self.spec.run
        named = "·" in self.technique.name                  # an unnamed run's name says its shape ('full·every 2')
        shape = f" {run.policy.method} {run.policy.layers}" if run.policy.partial and not named else ""
        cp = f" c={run.context_parallel}" if run.context_parallel > 1 else ""
        if run.fsdp:                       # FSDP2 over d ranks, or HSDP's replicas x shards
            cp += (f" fsdp d={self.sharded_over}" if run.fsdp_replicate == 1 else
                   f" hsdp {run.fsdp_replicate}x{self.spec.fsdp_shards}")
        if run.zero:
            cp += f" zero{run.zero.stage} d={self.sharded_over}"
        arch = self.spec.architecture
        core = arch.code.attention_label(arch.attention_core)      # transformers' attn_implementation
        code = "" if arch.implementation == MEGATRON else f" · {arch.implementation}" + (f" {core}" if core else "")
        split = f" ({split_of(self.spec)})" if split_of(self.spec) else ""     # uneven: 'p=2 (2+3)'
        return (f"{self.spec.name}{code} t={run.tensor_parallel}{cp} p={run.pipeline_parallel}{split} "
                f"m={run.interleave} b={run.micro_batch} n={self.microbatches} {self.technique.name}{shape}")


def config_for(spec: Spec, technique: Technique, microbatches: int) -> Config:
    """The spec a technique is measured at: t = 1 for 'none' (no parallelism), the technique's
    SP and recompute (selective: of the spec's --recompute-modules, 'tp-sp-sel·mlp'), one
    data-parallel rank, n microbatches."""
    t = spec.run.tensor_parallel if technique.tensor_parallel else 1
    d = spec.data_parallel if spec.run.fsdp or spec.run.zero else 1     # FSDP2's, ZeRO's ranks are measured
    modules = spec.run.recompute_modules if technique.recompute is Recompute.SELECTIVE else None
    if modules is not None:
        technique = replace(technique, policy=replace(technique.policy, modules=frozenset(modules)))
        technique = matching(technique) or unnamed_run(technique)
    option = technique.policy.run_values.get("selective_ac_option")    # torchtitan's: its selective, refined
    run = replace(spec.run, tensor_parallel=t, sequence_parallel=technique.sequence_parallel,
                  recompute=Recompute.SELECTIVE if option else technique.recompute, recompute_modules=modules,
                  selective_ac_option=option,
                  gpus=t * spec.run.context_parallel * spec.run.pipeline_parallel * d,
                  global_batch=microbatches * spec.run.micro_batch * d, distributed_optimizer=False)
    return Config(replace(spec, run=run), technique, microbatches)


def measure(config: Config, rank: int, device: str = "cpu", fake: bool = False) -> list[dict]:
    """Build the first stage on this rank, run its schedule, compare with the estimate."""
    if config.spec.run.fsdp:                           # torch-native under FSDP2: a training step
        from actmem_validate import fsdp

        return fsdp.measure(config, rank, device, fake)
    if config.spec.run.zero:                           # hf under DeepSpeed's ZeRO: a training step
        from actmem_validate import zero

        return zero.measure(config, rank, device, fake)
    if config.spec.architecture.implementation == "torch-native":
        from actmem_validate import torch_native

        return torch_native.measure(config, rank, device, fake)
    if config.spec.architecture.implementation == "hf":
        from actmem_validate import hf

        return hf.measure(config, rank, device, fake)
    spec, run = config.spec, config.spec.run
    if run.context_parallel > 1:
        tp = tensor_and_context_groups(run.tensor_parallel, run.context_parallel, run.sequence_parallel)
    elif run.tensor_parallel > 1:
        tp = TensorParallel.from_world(run.sequence_parallel)
    else:
        tp = TensorParallel(sequence_parallel=run.sequence_parallel)
    layer_spec = LayerSpec.of(spec, device)
    torch.manual_seed(1234 + rank)
    with fake_tensor_mode() if fake else nullcontext():
        stage = FirstStage(layer_spec, spec.padded_vocab, tp, run.pipeline_parallel, run.interleave,
                           spec.stage_layers)
        if run.offload_layers:
            stage.offload = CpuOffload(spec.stage_layers, run.offload_layers)
        fused = fused_wgrad_weights(stage)
        for weight in fused:                              # --no-gradient-accumulation-fusion: 16-bit wgrads
            weight.unfused_wgrad = not layer_spec.wgrad_fusion

        def schedule(allocated=lambda: 0):
            return run_first_stage(stage, layer_spec, run.pipeline_parallel, run.interleave, config.microbatches,
                                   run.micro_batch, spec.padded_vocab, tp, allocated)

        try:
            kept_for_the_process = _warm_up(stage, schedule) if device.startswith("cuda") else 0
            with _PeakMemory(stage, device) as peak:
                attach_main_grads(stage)                  # fp32, allocated before the step (counted)
                make_dummy_wgrads(fused if layer_spec.wgrad_fusion else [])   # TE's cache, made by the first step
                make_fp8_state(fp8_weights(stage), layer_spec.fp8, layer_spec.fp8_generation, layer_spec.fp8_history)
                result = schedule(peak.current)
        finally:
            make_dummy_wgrads([])                 # they go with the stage
            make_fp8_state([], None, None, 1)
    mask_bytes = native_dropout_mask_bytes(device)       # a real probe, outside any fake mode
    return compare(config, estimate(spec), result, rank, peak.bytes, device, mask_bytes, kept_for_the_process)


def _warm_up(stage, schedule) -> int:
    """On a GPU, one unmeasured pass of the schedule before the measured one. cuBLAS and
    cuBLASLt take their workspaces from the caching allocator at their first GEMM on a
    stream and keep them for the life of the process (torch's CUDABlasHandlePool), so a
    measured first pass would count them in the first configuration's peak only. They are
    what --reserve covers, not activations: returns the bytes the pass left allocated for
    good, which the rows report ('kept_for_the_process')."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    attach_main_grads(stage)                  # the pass makes its own dummies, dropped after it
    schedule()
    free_main_grads(stage)
    make_dummy_wgrads([])                     # the measured pass makes its own
    for param in stage.parameters():
        param.grad = None
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before


def native_dropout_mask_bytes(device: str) -> int:
    """Bytes an element of the mask PyTorch's own dropout saves on this device (4 on CPU,
    where it keeps a float mask; 1 with CUDA's fused kernel). The harness keeps 1 byte."""
    x = torch.ones(8, device=device, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        torch.nn.functional.dropout(x, 0.5, training=True)
    return max(t.element_size() for t in saved)


class _PeakMemory:
    """Peak bytes above the parameters during the schedule: torch.cuda's allocator stats on a
    GPU; elsewhere the live storages every op made (torch_compat.LiveStorages, which follows
    fake tensors too)."""

    def __init__(self, module, device: str):
        self.module, self.device, self.bytes = module, device, 0

    def __enter__(self):
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.tracker = LiveStorages().__enter__()
        return self

    def current(self) -> int:
        """Bytes allocated now above the parameters."""
        if self.device.startswith("cuda"):
            return torch.cuda.memory_allocated() - self.base
        return self.tracker.current

    def __exit__(self, *exc):
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated() - self.base
            return False
        self.tracker.__exit__(*exc)
        self.bytes = self.tracker.peak
        return False
