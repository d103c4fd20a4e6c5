"""Megatron-FSDP measured: megatron-core 0.16.1's FullyShardedDataParallel (distributed/fsdp/mcore_fsdp_adapter.py)
around a small GPTModel of its local spec on real gloo CPU ranks, one forward, backward and DistributedOptimizer
(AdamW) step, each rank's model state against actmem's (actmem.memory.megatron_fsdp), 0 B off:
- the 16-bit weights (the model-weight buffer, or under no_shard the module's own weights), the main gradients (the
  gradient buffer), the optimizer state (the fp32 main-weight buffer and AdamW's two moments), each the live
  storages of the buffers' own tensors after the step (kind 'state');
- under optim_grads_params the weights outside the units gathered in the forward: the rest's bucket, allocated by
  its buffer's temporary bucket allocator, measured between the forward and the backward (kind 'state');
- at the forward's end (actmem's 'start' and 'loss' moments; kind 'state'), under optim_grads_params the first units
  the final norm's forward prefetch gathered again (megatron_fsdp.regathered_units);
- at the last layer's fc1 backward, actmem's 'fc1' moment (kind 'state'): under optim_grads_params its unit
  gathered again and the units prefetched before it (their weight buckets), under optim_grads and
  optim_grads_params its gradient bucket and the no-unit group's gradient buckets the final norm's backward made
  (megatron_fsdp.backward_rows);
- under --fsdp-double-buffer the fixed pools (megatron_fsdp.pools: GlobalMemoryBuffer's fsdp_params_* and
  fsdp_grads_* tensors) after the step (kind 'state'), the units' rows above then 0 (they are fetched into the pools);
- as information: under 16-bit gradients the optimizer's fp32 copy of the gradient shard (dist_main_grad), and the
  AdamW step counters torch's fallback optimizer keeps a parameter (TE's FusedAdam keeps one a group).
The units are Megatron-LM d98e8a64's (each TransformerLayer under every strategy but no_shard), handed to 0.16.1's
adapter, which made them under optim_grads_params alone. The model's ffn (1.5h) makes the projection's weight end
inside a chunk, so its bucket's gap is filled (megatron_fsdp.bucket_layout).

CPU stand-ins (none allocates; tools/megatron_fsdp_probe.py found them): CUDA streams, events and
current_device, Tensor.cuda, the device='cuda' of torch's factories, DeviceMesh.from_group's device type, a
no-op CUDA RNG tracker; gradient_reduce_div_fusion off (PREMUL_SUM is NCCL's). The reduce paths that 0.16.1 gets
right on gloo (no_shard and optim reduce only in their hooks at the last microbatch; optim's hook path reduces
wrongly, so it runs the synchronous reduce-scatter): the gradients' values do not change a byte counted here.
"""

import contextlib
from dataclasses import dataclass

from actmem.memory.techniques import run_technique
from actmem.model.architecture import Architecture
from actmem.model.recompute import NONE
from actmem.model.spec import Model, Run, Spec

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
#: (overlap_grad_reduce, overlap_param_gather, leave no_sync before the microbatch) a strategy runs right with on
#: gloo in 0.16.1 (the probe's checks against a run without FSDP: the loss after the step and the gradient norm)
SAFE = {"no_shard": (True, True, True), "optim": (False, False, False), "optim_grads": (True, False, True),
        "optim_grads_params": (True, True, True)}


@dataclass(frozen=True)
class MegatronFSDPConfig:
    """One Megatron-FSDP run over ``world_size`` gloo ranks (d = world, t = 1)."""

    spec: Spec

    @property
    def technique(self):
        return run_technique(False, NONE)

    @property
    def strategy(self) -> str:
        return self.spec.megatron_fsdp_strategy

    @property
    def gradient_bytes(self) -> int:
        return self.spec.gradient_bytes

    @property
    def bucket_size(self):
        """The bucket size Megatron-LM's training.py hands Megatron-FSDP: --ddp-bucket-size beside
        --overlap-grad-reduce, else None (the runs here give it explicitly where they give it)."""
        run = self.spec.run
        return run.ddp_bucket_size if run.overlap_grad_reduce else None

    @property
    def label(self) -> str:
        run = self.spec.run
        buckets = f" buckets {self.bucket_size}" if self.bucket_size else ""
        layers = f" L={self.spec.model.layers}" if self.spec.model.layers != 2 else ""
        unit = layers + (f" unit {run.fsdp_communication_unit}" if run.fsdp_communication_unit else "")
        return (f"mfsdp {self.strategy} d={self.world_size} grads {'fp32' if self.gradient_bytes == 4 else 'bf16'}"
                + buckets + unit + (" double buffer" if run.fsdp_double_buffer else ""))

    @property
    def world_size(self) -> int:
        return self.spec.run.gpus


def fsdp_spec(strategy: str, world: int = 2, fp32_gradients: bool = False, bucket_size=None, layers: int = 2,
              communication_unit=None, double_buffer: bool = False) -> Spec:
    """GPT-2's kind of layer (LayerNorm, biases, GeLU, learned positions, tied output) at h = 64, a = 4, f = 96,
    L = 2, v = 128, s = 16, b = 2 under ``strategy`` over ``world`` data-parallel ranks, without gradient
    accumulation fusion (its kernel is CUDA's); ``bucket_size``: a pasted --overlap-grad-reduce --ddp-bucket-size;
    ``communication_unit``: --suggested-communication-unit-size; ``double_buffer``: --fsdp-double-buffer."""
    arch = Architecture(ffn_hidden=96, attention_dropout=0.0, hidden_dropout=0.0, gradient_accumulation_fusion=False)
    run = Run(micro_batch=2, gpus=world, megatron_fsdp=True, fsdp_sharding=strategy, distributed_optimizer=True,
              overlap_grad_reduce=bucket_size is not None, ddp_bucket_size=bucket_size,
              fsdp_communication_unit=communication_unit, fsdp_double_buffer=double_buffer)
    return Spec(Model(heads=4, hidden=64, layers=layers, vocab=128, seq_len=16), run, name="mfsdp",
                architecture=arch, gradient_bytes=4 if fp32_gradients else 2)


def mfsdp_grid() -> list:
    """Every strategy at d = 2 with the default (bf16) gradients; fp32 gradients under optim_grads; the default
    strategy at d = 4 (the last rank's shards short of the padding), and there its buckets outside the units split
    at 9000 elements; five layers with a communication unit of two layers' buckets (59,136 elements at d = 2), whose
    window stops the prefetch at one unit; four layers with a window of two units, where the backward's window
    (layers 2 and 3) overlaps the two the forward's end gathered again (1 and 2): one unit prefetched, not two. Under
    --fsdp-double-buffer: optim_grads_params (both pools), the five layers whose window the pools' two units stop,
    optim_grads (the gradients' pool alone), optim (units, no pool fetched into), one layer (one buffer a pool), fp32
    gradients (4-byte gradient buckets in the pool), and one rank (nothing distributed: no pool, nothing gathered)."""
    specs = [fsdp_spec(strategy) for strategy in STRATEGIES]
    specs += [fsdp_spec("optim_grads", fp32_gradients=True), fsdp_spec("optim_grads_params", world=4),
              fsdp_spec("optim_grads_params", world=4, bucket_size=9000),
              fsdp_spec("optim_grads_params", layers=5, communication_unit=59_136),
              fsdp_spec("optim_grads_params", layers=4, communication_unit=118_272)]
    specs += [fsdp_spec("optim_grads_params", double_buffer=True),
              fsdp_spec("optim_grads_params", layers=5, communication_unit=59_136, double_buffer=True),
              fsdp_spec("optim_grads", double_buffer=True), fsdp_spec("optim", double_buffer=True),
              fsdp_spec("optim_grads_params", layers=1, double_buffer=True),
              fsdp_spec("optim_grads", fp32_gradients=True, double_buffer=True),
              fsdp_spec("optim_grads_params", world=1, double_buffer=True)]
    return [MegatronFSDPConfig(spec) for spec in specs]


def formula(config: MegatronFSDPConfig, rank: int) -> dict:
    """{row: bytes} of this rank's model state, from actmem's buckets for this rank's shards."""
    from actmem.memory.megatron_fsdp import (backward_rows, bucket_size, forward_end_rows, gathered_outside_units,
                                             pools, state_bytes)
    from actmem.memory.parameters import megatron_fsdp_buckets

    spec, strategy = config.spec, config.strategy
    model, arch = spec.model, spec.architecture
    laid = megatron_fsdp_buckets(model.hidden, 1, model.vocab, model.seq_len, arch, model.heads, model.layers,
                                 config.world_size, strategy, bucket_size(spec), rank)
    weights, gradients, optimizer = state_bytes(laid, strategy, config.gradient_bytes,
                                                spec.optimizer.bytes_per_parameter)
    unit, double = spec.run.fsdp_communication_unit, spec.run.fsdp_double_buffer
    rows = (*backward_rows(laid, strategy, config.gradient_bytes, model.layers, communication_unit=unit,
                           double_buffer=double),
            *forward_end_rows(laid, strategy, model.layers, unit, double))
    backward = {row.name: row.bytes for row in rows}
    pooled = pools(laid, strategy, config.gradient_bytes, model.layers) if double else (0, 0)
    return {"weights": weights, "main_gradients": gradients, "optimizer_state": optimizer,
            "gathered_weights": gathered_outside_units(laid, strategy), **backward,
            "double_buffer_weights": pooled[0], "double_buffer_gradients": pooled[1]}


def cpu_shims():
    """The monkeypatches that let Megatron-FSDP 0.16.1 and megatron-core's DistributedOptimizer run on a CPU-only
    torch over gloo. None allocates a tensor. Once a process (the factories' wrappers would wrap themselves)."""
    import torch

    if getattr(torch, "_actmem_cpu_shims", False):
        return
    torch._actmem_cpu_shims = True

    class _HostStream:
        def __init__(self, *a, **k): pass
        def wait_stream(self, *a): pass
        def synchronize(self): pass
        def record_event(self, *a, **k): return self
        def wait_event(self, *a): pass
        def wait(self, *a): pass             # grad_reduce_event.wait() (param_and_grad_buffer.py)
        def query(self): return True

    torch.cuda.Stream = _HostStream               # megatron_fsdp.py: its streams; the pipelines' current_stream
    torch.cuda.current_stream = lambda *a, **k: _HostStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self          # uneven_dtensor.py: torch.tensor(...).cuda()

    def on_the_host(factory):                   # optimizer.py, clip_grads.py: device='cuda' scalars
        def made(*a, **k):
            if isinstance(k.get("device"), int) or str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return factory(*a, **k)
        return made

    for name in ("tensor", "zeros", "ones", "empty", "full"):
        setattr(torch, name, on_the_host(getattr(torch, name)))
    from torch.distributed.device_mesh import DeviceMesh

    from_group = DeviceMesh.from_group          # mcore_fsdp_adapter.py: DeviceMesh.from_group(..., "cuda")
    DeviceMesh.from_group = staticmethod(lambda group, device_type, *a, **k: from_group(group, "cpu", *a, **k))
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random

    class _Tracker:
        def fork(self, *a, **k): return contextlib.nullcontext()
        def get_states(self): return {}
        def set_states(self, states): pass
        def add(self, *a, **k): pass

    tracker = _Tracker()
    tensor_parallel.get_cuda_rng_tracker = random.get_cuda_rng_tracker = lambda *a, **k: tracker
    random._get_cuda_rng_state = random._set_cuda_rng_state = lambda *a, **k: None


def build_model(spec: Spec):
    """(config, the GPTModel of the spec in megatron-core's local spec, cast to bf16 by Float16Module as
    megatron/training's get_model does for --bf16)."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    model = spec.model
    config = TransformerConfig(
        num_layers=model.layers, hidden_size=model.hidden, num_attention_heads=model.heads,
        ffn_hidden_size=spec.architecture.ffn(model.hidden), use_cpu_initialization=True,
        params_dtype=torch.float32, bf16=True, pipeline_dtype=torch.bfloat16, hidden_dropout=0.0,
        attention_dropout=0.0, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False)
    gpt = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=model.vocab, max_sequence_length=model.seq_len,
                   share_embeddings_and_output_weights=True)
    return config, Float16Module(config, gpt)


def _rank(rank: int, world: int, port: int, config: MegatronFSDPConfig, results) -> None:
    """One rank of one configuration (gloo.spawn_each runs those of a world size in one gloo group)."""
    from actmem_validate.gloo import rank_group

    with rank_group(rank, world, port, cpu_shims, 1):
        results.put((rank, _run(rank, config)))


def _run(rank: int, config: MegatronFSDPConfig) -> dict:
    """Wrap, forward (the gathered weights measured), backward (the last layer's fc1 moment measured), step; the
    buffers measured after."""
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    spec, strategy = config.spec, config.strategy
    overlap_grads, overlap_gather, last_microbatch = SAFE[strategy]
    torch.manual_seed(1234)
    model_config, model = build_model(spec)
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy,
        grad_reduce_in_fp32=config.gradient_bytes == 4, use_distributed_optimizer=True,
        overlap_grad_reduce=overlap_grads, overlap_param_gather=overlap_gather,
        gradient_reduce_div_fusion=False, check_for_nan_in_grad=False, bucket_size=config.bucket_size,
        suggested_communication_unit_size=spec.run.fsdp_communication_unit,
        fsdp_double_buffer=spec.run.fsdp_double_buffer)
    _fresh_pools()
    units = [TransformerLayer] if strategy != "no_shard" else []          # Megatron-LM d98e8a64's
    fsdp = FullyShardedDataParallel(model_config, ddp_config, model, fsdp_unit_modules=units,
                                    device=torch.device("cpu"))
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True,
                                                       params_dtype=torch.bfloat16, use_distributed_optimizer=True,
                                                       clip_grad=0.0), [fsdp])   # its clip asserts CUDA
    fsdp.zero_grad_buffer()
    optimizer.zero_grad()
    generator = torch.Generator().manual_seed(rank)
    b, s, v = spec.run.micro_batch, spec.model.seq_len, spec.model.vocab
    tokens, labels = (torch.randint(0, v, (b, s), generator=generator) for _ in range(2))
    if last_microbatch:
        with fsdp.no_sync():       # megatron-core's schedules leave no_sync before the last microbatch
            pass
    backward = {}
    gpt = model.module                       # Float16Module's GPTModel
    gpt.decoder.layers[-1].mlp.linear_fc1.register_full_backward_hook(
        lambda *_: backward.update(_in_the_last_layer(fsdp, gpt)))
    loss = fsdp(tokens, torch.arange(s).expand(b, s), None, labels=labels).float().mean()
    gathered = _gathered(fsdp)
    regathered = sum(_temporary(group.model_weight_buffer) for group in fsdp.param_and_grad_buffer.parameter_groups
                     if group.fsdp_unit_id is not None)
    loss.backward()
    fsdp.finish_grad_sync()
    optimizer.step()
    return {**_state(fsdp, optimizer), "gathered_weights": gathered, "regathered_unit_weights": regathered, **backward,
            **_pools()}


def _fresh_pools() -> None:
    """Megatron-FSDP's GlobalMemoryBuffer emptied: its fixed pools are a process's (utils.py,
    get_global_memory_buffer), and each configuration of a batch is measured on its own."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import utils

    utils._GLOBAL_MEMORY_BUFFER = None


def _pools() -> dict:
    """Bytes of the fixed pools' buffers (GlobalMemoryBuffer's tensors named fsdp_params_* and fsdp_grads_*: the
    weights' and the gradients'), each storage once; any other buffer there is named too, so it fails the table."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import get_global_memory_buffer

    rows, seen = {"double_buffer_weights": 0, "double_buffer_gradients": 0}, set()
    for (name, _), tensor in get_global_memory_buffer().buffer.items():
        row = ("double_buffer_weights" if name.startswith("fsdp_params_") else
               "double_buffer_gradients" if name.startswith("fsdp_grads_") else f"global buffer {name}")
        storage = _storage(tensor)
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            rows[row] = rows.get(row, 0) + storage.nbytes()
    return rows


@dataclass(frozen=True)
class _LayoutProbe:
    """megatron-core's own grouping and layout of the small model's buckets over ``shards`` ranks, computed on one."""

    spec: Spec
    shards: tuple
    world_size: int = 1


def fp8_groups(spec: Spec, shards=(2, 4)) -> list:
    """[(d, dtype, unit, parameters, padded)] of each bucket megatron-core 0.16.1 makes of the spec's model under
    --fp8-param-gather (pgb, _get_parameter_groups, given the FP8 parameters as the --init-model-with-meta-device path
    marks TE's (meta_device_init_fp8_params: each TE linear's weight; here the layers' 2-D parameters), then
    build_data_parallel_buffer_index for each at d ranks): the grouping by dtype and the padding, without TE's
    Float8Tensor, which a CPU does not run."""
    from actmem_validate.gloo import spawn

    return spawn(_probe_layout, _LayoutProbe(spec, tuple(shards)))[0][1]


def _probe_layout(rank: int, world: int, port: int, probe: _LayoutProbe, results) -> None:
    from actmem_validate.gloo import rank_group

    with rank_group(rank, world, port, cpu_shims, 1):
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
            BucketingPolicy, _get_parameter_groups, build_data_parallel_buffer_index)
        from megatron.core.transformer.transformer_layer import TransformerLayer

        gpt = build_model(probe.spec)[1].module
        fp8 = {name: (True, False) for name, p in gpt.named_parameters() if ".layers." in name and p.dim() == 2}
        policy = BucketingPolicy(suggested_bucket_size=None, fsdp_unit_modules=[TransformerLayer],
                                 data_parallel_sharding_strategy="optim_grads_params")
        groups = _get_parameter_groups(gpt, policy, fp8)[0]
        config = DistributedDataParallelConfig(use_megatron_fsdp=True,
                                               data_parallel_sharding_strategy="optim_grads_params")
        rows = [(d, str(group.dtype), group.fsdp_unit_id, sum(p.numel() for p in group.params),
                 build_data_parallel_buffer_index([p.shape for p in group.params], 0, d, True, config,
                                                  chunk_size_factor=group.chunk_size_factor)[1].size)
                for d in probe.shards for group in groups]
        results.put((rank, rows))


def _storage(tensor):
    from torch.distributed.tensor import DTensor

    return (tensor._local_tensor if isinstance(tensor, DTensor) else tensor).untyped_storage()


def _gathered(fsdp) -> int:
    """Bytes of the weight buckets outside the units the forward's all-gathers hold now (the temporary bucket of
    each group of no unit)."""
    return sum(_temporary(group.model_weight_buffer) for group in fsdp.param_and_grad_buffer.parameter_groups
               if group.fsdp_unit_id is None)


def _in_the_last_layer(fsdp, gpt) -> dict:
    """At the last layer's fc1 backward: its unit's gathered weight bucket and the other units' (prefetched), its
    gradient bucket, and the no-unit group's gradient buckets, each where one is allocated."""
    buffer = fsdp.param_and_grad_buffer
    groups = buffer.parameter_groups
    last = groups[buffer.param_to_param_group[next(gpt.decoder.layers[-1].parameters())]]
    units = [group for group in groups if group.fsdp_unit_id is not None and group is not last]
    return {"gathered_unit_weights": _temporary(last.model_weight_buffer),
            "prefetched_unit_weights": sum(_temporary(group.model_weight_buffer) for group in units),
            "unit_gradient_bucket": _temporary(last.main_grad_buffer),
            "outside_gradient_buckets": sum(_temporary(group.main_grad_buffer) for group in groups
                                            if group.fsdp_unit_id is None)}


def _temporary(buffer) -> int:
    """Bytes of the buffer's temporary (unsharded) bucket allocated now; 0 where none. Under --fsdp-double-buffer its
    allocator is a FixedPoolAllocator: a bucket outside its pools is its backup allocator's (the pools: _pools)."""
    if buffer is None:
        return 0
    allocator = buffer.temporary_bucket_allocator
    allocator = getattr(allocator, "backup_allocator", allocator)
    bucket = getattr(allocator, "buckets", {}).get(buffer.bucket_index.bucket_id)
    return _storage(bucket.data).nbytes() if bucket is not None else 0


def _state(fsdp, optimizer) -> dict:
    """{row: bytes} of the live storages of the buffers' own tensors (each once) and of AdamW's state."""
    import torch

    buffer, seen, rows = fsdp.param_and_grad_buffer, set(), {}

    def add(row, tensor):
        storage = None if tensor is None else _storage(tensor)
        if storage is not None and storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            rows[row] = rows.get(row, 0) + storage.nbytes()

    for group in buffer.parameter_groups:
        if group.model_weight_buffer is not None:
            add("weights", group.model_weight_buffer.data)
        else:                                   # no_shard: the module's own weights
            for parameter in group.params:
                add("weights", parameter.data)
        if group.main_weight_buffer is not None:
            add("optimizer_state", group.main_weight_buffer.data)
        if group.main_grad_buffer is not None:
            add("main_gradients", group.main_grad_buffer.data)
    for copy in buffer.dist_main_grad.values():
        add("fp32 gradient shard for the step (information)", copy)
    for state in optimizer.optimizer.state.values():
        for name, value in state.items():
            if torch.is_tensor(value):
                add("optimizer_state" if name in ("exp_avg", "exp_avg_sq") else
                    "AdamW step counters (information)", value)
    return rows


def measure(config: MegatronFSDPConfig) -> list[tuple]:
    """(rank, {row: bytes}) of every rank of one configuration."""
    return measure_all([config])[config]


def measure_all(configs) -> dict:
    """{config: [(rank, {row: bytes}), ...]}: the configurations of each world size in one set of processes."""
    from actmem_validate.gloo import spawn_each

    return spawn_each(_rank, configs)


def rows(configs) -> list[dict]:
    """The error table's rows of every rank of every configuration (state_rows), in the grid's order."""
    measured = measure_all(configs)
    return [row for config in configs for rank, values in measured[config]
            for row in state_rows(config, rank, formula(config, rank), values)]


def state_rows(config: MegatronFSDPConfig, rank: int, expected: dict, measured: dict) -> list[dict]:
    """A row a name either side has: the model state ('state', checked both ways: a buffer the formula does not
    have fails, as does one it has that is not measured), or information."""
    from actmem_validate.compare import _row

    return [_row(config, rank, name, expected.get(name, 0), measured.get(name, 0),
                 "information" if name.endswith("(information)") else "state")
            for name in sorted(set(expected) | set(measured))]
