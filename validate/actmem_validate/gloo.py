"""Megatron-Core's own layers run over real gloo ranks on a CPU: one process a rank, spawned, each
putting its (rank, ...) result on a queue (the MoE, MLA and MTP harnesses' common launch)."""

import contextlib
import os
import socket
from dataclasses import dataclass


def spawn(rank_fn, config) -> list[tuple]:
    """The sorted results of ``rank_fn(rank, world, port, config, results)`` on each of the
    config's ``world_size`` ranks, over a free local port."""
    from actmem_validate import forkserver

    forkserver.preload(*forkserver.MEGATRON)
    results = forkserver.context().SimpleQueue()

    def start(port):
        forkserver.start(rank_fn, (config.world_size, port, config, results), config.world_size)

    on_a_free_port(start)
    return sorted(results.get() for _ in range(config.world_size))


def spawn_each(rank_fn, configs) -> dict:
    """{config: spawn(rank_fn, config)'s results} with one set of processes a world size: its configurations run one
    after the other in one gloo group (a spawn and megatron-core's import a world size, not a configuration; each
    configuration's model-parallel state its own: rank_group)."""
    measured = {}
    for world in dict.fromkeys(config.world_size for config in configs):
        batch = _Batch(rank_fn, tuple(config for config in configs if config.world_size == world))
        per_rank = spawn(_each, batch)
        for i, config in enumerate(batch.configs):
            measured[config] = sorted(runs[i] for _, runs in per_rank)
    return measured


@dataclass(frozen=True)
class _Batch:
    rank_fn: object
    configs: tuple

    @property
    def world_size(self) -> int:
        return self.configs[0].world_size


class _One:
    """A queue of one put: what a rank function puts for its configuration."""

    def put(self, item):
        self.item = item


def _each(rank: int, world: int, port: int, batch: _Batch, results) -> None:
    """This rank of every configuration of the batch, in one gloo group (rank_group leaves it up between them)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        runs = []
        for config in batch.configs:
            one = _One()
            batch.rank_fn(rank, world, port, config, one)
            runs.append(one.item)
        results.put((rank, runs))
    finally:
        dist.destroy_process_group()


TAKEN = "EADDRINUSE"
"""What torch's TCPStore says when the rendezvous port was taken."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def on_a_free_port(start, tries: int = 3):
    """``start(port)`` on a free local port for a rendezvous. A port free when probed can be bound by another
    process before rank 0's store binds it (EADDRINUSE, seen beside other gloo runs on the machine): then again
    on another, up to ``tries`` times; any other failure at once."""
    for attempt in range(tries):
        try:
            return start(free_port())
        except Exception as error:                  # the spawner's own exception, or the harness's one line
            if TAKEN not in str(error) or attempt == tries - 1:
                raise


def term_table(configs, measure, formula) -> list[dict]:
    """The error table's rows (compare.term_rows) of every rank of every configuration: ``measure(config)``
    gives (rank, {term: bytes}) a rank, ``formula(spec, technique)`` the rows it is checked against."""
    from actmem_validate.compare import term_rows

    table = []
    for config in configs:
        expected = formula(config.spec, config.technique)
        for rank, named in measure(config):
            table += term_rows(config, rank, expected, named)
    return table


@contextlib.contextmanager
def rank_group(rank: int, world: int, port: int, shims, tensor_parallel: int, **parallel):
    """This process as one of ``world`` gloo ranks with megatron-core's parallel state initialised (t =
    ``tensor_parallel``; ``parallel``: initialize_model_parallel's expert sizes), the CPU ``shims`` applied
    first; torn down after, whatever happens. In a group already up (spawn_each's) only the parallel state is this
    configuration's."""
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        shims()
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_parallel, 1, **parallel)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
    finally:
        if owned:
            dist.destroy_process_group()


def recompute_settings(technique) -> dict:
    """TransformerConfig's recompute fields of a technique: selective with its modules, full as every layer
    alone (uniform 1), none: {}."""
    from actmem.model.recompute import Recompute

    if technique is None or technique.recompute is Recompute.NONE:
        return {}
    if technique.recompute is Recompute.SELECTIVE:
        return dict(recompute_granularity="selective", recompute_modules=list(technique.modules))
    return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def held_storages(saved: dict, *modules) -> list:
    """(key, dtype, shape, bytes) of the saved storages alive when the forward ends, at their size then (a
    recompute checkpoint that discards its output resizes that storage to 0: it holds nothing), less the
    modules' parameters and buffers (model state)."""
    state = {tensor.untyped_storage().data_ptr() for module in modules
             for tensor in (*module.parameters(), *module.buffers())}
    held = []
    for key, (alive, dtype, shape) in saved.items():
        storage = alive()
        if storage is not None and storage.nbytes() and key not in state:
            held.append((key, dtype, shape, storage.nbytes()))
    return held


def recorder():
    """(saved, pack): the pack hook of saved_tensors_hooks, recording each saved storage once, its weak
    reference, dtype and shape, in the order first saved (a dead or emptied one's address reused: the later
    one)."""
    import weakref

    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        held = saved.get(key)
        if storage.nbytes() and (held is None or _dead(held[0]())):
            saved.pop(key, None)
            saved[key] = (weakref.ref(storage), str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
        return tensor

    return saved, pack


def _dead(storage) -> bool:
    """A recorded storage that holds nothing now: freed, or resized to 0 by a recompute checkpoint that
    discards its output (its address free for a later one)."""
    return storage is None or not storage.nbytes()


#: megatron-core's CheckpointWithoutOutput instances, by the attribute that holds each, and the unit actmem prices
#: its rerun as (actmem.memory.engine.rematerialised_bytes; the two norms are --recompute-modules layernorm's parts)
_RERUN_UNITS = {"input_layernorm_checkpoint": "input_layernorm", "pre_mlp_norm_checkpoint": "pre_mlp_layernorm",
                "activation_checkpoint": "moe_act"}


def _rerun_unit(layer, checkpoint) -> str:
    """The unit of a CheckpointWithoutOutput: the attribute of a module of the layer that holds it
    (transformer_layer.py, experts.py), or multi-latent attention's, which lets go of its own once registered
    (multi_latent_attention.py: qkv_up_checkpoint = None) and reruns its up projections."""
    for module in layer.modules():
        for attribute, unit in _RERUN_UNITS.items():
            if getattr(module, attribute, None) is checkpoint:
                return unit
    if getattr(checkpoint.run_function, "__name__", "") == "qkv_up_proj_and_rope_apply":
        return "mla_up_proj"
    raise ValueError(f"a CheckpointWithoutOutput rerun of {checkpoint.run_function!r}: whose is it?")


def _checkpoint_unit(run_function) -> str | None:
    """The unit of a rerun through megatron-core's own checkpoint (tensor_parallel.checkpoint, CheckpointFunction)
    that the harness measures: the attention core's (attention.py, _checkpointed_attention_forward), the MoE
    layer's (moe_layer.py: custom_forward) and the shared experts' (the SharedExpertMLP itself). None for the dense
    MLP's, not measured: its rerun output is left out of actmem's floor."""
    function = getattr(run_function, "func", run_function)
    name = getattr(function, "__qualname__", "")
    if "_checkpointed_attention_forward" in name:
        return "core_attn"
    if "MoELayer.forward" in name:
        return "moe"
    return "shared_experts" if type(function).__name__ == "SharedExpertMLP" else None


@contextlib.contextmanager
def rerun_moments(layer, saved: dict, moments: dict):
    """Each rerun in the backward, measured at its moment, into ``moments[unit]``: megatron-core's
    CheckpointWithoutOutput (--recompute-modules layernorm's two norms, mla_up_proj, moe_act) as it ends, and its
    own checkpoint's (CheckpointFunction.backward) once its forward has rerun, before the backward through it: the
    attention core's (core_attn), the MoE layer's (moe) and the shared experts' (the dense MLP's, not measured, still
    counts for the reruns inside it). Each is the bytes the forward's saved storages (``saved``, recorder's) still hold
    then, at their size then (the backward has freed what it ran, and a rerun resized its output's storage back),
    and what this rerun and those before it made or restored that is alive (the outputs, ctx.outputs beside them,
    what their own autograd saved: a norm's rerun holds its outputs through its block's reruns); less the layer's
    model state (its parameters and buffers then: the rope's cos and sin are cached in the forward). The moment
    actmem's stage model prices as its ``rerun``. Entered before the forward: the checkpoints register their rerun
    there, as a bound hook."""
    import gc
    import weakref

    import torch
    from megatron.core.tensor_parallel import random

    earlier = []            # what the reruns before made or restored: a norm's stays through its block's reruns

    def measure(unit, made, outputs):
        earlier.extend([ref for ref, _, _ in made.values()]
                       + [weakref.ref(output.untyped_storage()) for output in outputs])
        if unit is None:
            return
        gc.collect()     # what only a reference cycle keeps is garbage the code no longer holds, freed when gc runs
        state = {tensor.untyped_storage().data_ptr() for tensor in (*layer.parameters(), *layer.buffers())}
        storages = [ref() for ref, _, _ in saved.values()] + [ref() for ref in earlier]
        alive = {storage.data_ptr(): storage.nbytes() for storage in storages
                 if storage is not None and storage.nbytes() and storage.data_ptr() not in state}
        moments[unit] = sum(alive.values())

    without_output = random.CheckpointWithoutOutput._recompute

    def measured(self, grad):
        if self.ctx is None:
            return without_output(self, grad)
        unit, ctx, restored = _rerun_unit(layer, self), self.ctx, tuple(self.outputs)
        made, pack = recorder()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            result = without_output(self, grad)
        # (the outputs it restored by name: the forward's record may have let a discarded, empty one go for
        # another saved at its address)
        measure(unit, made, (*restored, *ctx.outputs))
        return result

    checkpoint_backward = random.CheckpointFunction.backward
    backward = torch.autograd.backward

    def measured_checkpoint(ctx, *grads):
        unit = _checkpoint_unit(ctx.run_function)
        made, pack = recorder()

        def at_the_rerun(outputs, *args, **kwargs):      # CheckpointFunction.backward's own backward through it
            torch.autograd.backward = backward
            measure(unit, made, [output for output in outputs if torch.is_tensor(output)])
            return backward(outputs, *args, **kwargs)

        torch.autograd.backward = at_the_rerun
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                return checkpoint_backward(ctx, *grads)
        finally:
            torch.autograd.backward = backward

    random.CheckpointWithoutOutput._recompute = measured
    random.CheckpointFunction.backward = staticmethod(measured_checkpoint)
    try:
        yield moments
    finally:
        random.CheckpointWithoutOutput._recompute = without_output
        random.CheckpointFunction.backward = staticmethod(checkpoint_backward)
