"""Run measurements: rank 0 of t alone (fake tensors in this process, or real ones beside a
fake process group in a process a configuration), or t real ranks (spawned, or torchrun).

Real runs use gloo on CPU and NCCL on GPUs. A rank that raises ends the whole job: the
spawner terminates the other ranks, and every collective has a timeout, so CI never hangs.
"""

import json
import os
import tempfile
from datetime import timedelta
from itertools import groupby

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from actmem_validate import forkserver
from actmem_validate.gloo import on_a_free_port
from actmem_validate.measure import Config, measure

FAIL_RANK_VARIABLE = "ACTMEM_VALIDATE_FAIL_RANK"   # fault injection, for the tests of the above


class HarnessError(RuntimeError):
    """A rank failed; the message says which and why."""


def _by_world_size(configs):
    ordered = sorted(configs, key=lambda c: c.world_size)
    return [(t, list(group)) for t, group in groupby(ordered, key=lambda c: c.world_size)]


def run_fake(configs: list[Config], on_done=lambda config: None, processes: int | None = None) -> list[dict]:
    """Rank 0 of t: FakeTensorMode for shapes without data, the fake process group for
    collectives that return at once. Paper-scale shapes cost no memory. A fake run is one
    core's work from start to end, so several configurations run in as many processes as the
    machine has cores (``processes``), each its own configurations one at a time; the rows
    come back in the configurations' order."""
    processes = min(len(configs), processes or os.cpu_count() or 1)
    if processes <= 1:
        return _rank0(configs, on_done, "cpu", fake=True)
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(processes, mp_context=forkserver.context(), initializer=forkserver.environment,
                             initargs=(dict(os.environ),)) as pool:
        futures = [pool.submit(_fake_process, config) for config in configs]
        rows = []
        for config, future in zip(configs, futures):
            try:
                rows += future.result()
            except HarnessError:
                raise
            except Exception as error:            # a failure in the worker: one line, as a rank's
                raise HarnessError(f"the fake run of {config.label} failed: {error}") from None
            on_done(config)
    return rows


def _fake_process(config: Config) -> list[dict]:
    torch.set_num_threads(1)                      # one core a process: fake tensors compute nothing
    if os.environ.get(FAIL_RANK_VARIABLE) == "fake":
        raise RuntimeError(f"failure injected in the fake run ({FAIL_RANK_VARIABLE})")
    return _rank0([config], lambda config: None, "cpu", fake=True)


def run_rank0(configs: list[Config], on_done=lambda config: None) -> list[dict]:
    """Rank 0 of t, real tensors on this machine's GPU (else its CPU), a fresh process for
    each configuration: the fake process group stands in for the other ranks, so a
    collective allocates its output, as rank 0 of a real run does, and fills nothing. What
    is allocated and saved is a real run's rank 0's (NCCL's own buffers are outside torch's
    allocator either way; gloo's temporaries are not made); the values are not, so no result
    is checked. One process a configuration, because on a GPU a configuration measured after
    others in one process peaked up to 105 MB higher (175B after 22B) than alone."""
    rows = []
    for config in configs:
        rows += _spawned(_rank0_process, (config,), 1, f"the rank0 process of {config.label}")
        on_done(config)
    return rows


def _rank0_process(rank: int, folder: str, config: Config) -> None:
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    if device != "cpu":
        torch.cuda.set_device(device)
    _write_rows(folder, rank, _rank0([config], lambda config: None, device, fake=False))


def _rank0(configs, on_done, device: str, fake: bool) -> list[dict]:
    from actmem_validate.torch_compat import fake_store

    rows = []
    for t, group in _by_world_size(configs):
        dist.init_process_group("fake", store=fake_store(), rank=0, world_size=t)
        try:
            for config in group:
                rows += _measured(config, device, fake)
                on_done(config)
        finally:
            dist.destroy_process_group()
    return rows


def _measured(config: Config, device: str, fake: bool) -> list[dict]:
    try:
        return measure(config, rank=0, device=device, fake=fake)
    except torch.cuda.OutOfMemoryError:
        free, total = torch.cuda.mem_get_info()
        raise HarnessError(f"{config.label} ran out of this GPU's memory ({total / 2**30:,.1f} GiB); "
                           f"measure it with --mode fake") from None


def run_real(configs: list[Config], timeout_s: int = 300, on_done=lambda config: None) -> list[dict]:
    """t processes for each world size, each measuring its own rank."""
    forkserver.preload(*_imports(configs))
    rows = []
    for t, group in _by_world_size(configs):
        for batch in _processes_for(group):
            rows += on_a_free_port(lambda port: _spawned(_spawned_rank, (t, batch, port, timeout_s), t,
                                                         f"a rank of the t={t} run"))
            for config in batch:
                on_done(config)
    return rows


def _imports(configs) -> tuple:
    """What the ranks import beyond the harness, for the fork server to import once: transformers' models for the
    hf backend, DeepSpeed and the Trainer for ZeRO."""
    hf = any(config.spec.architecture.implementation == "hf" for config in configs)
    zero = any(config.spec.run.zero for config in configs)
    return (forkserver.TRANSFORMERS if hf or zero else ()) + (forkserver.DEEPSPEED if zero else ())


def _processes_for(group: list) -> list:
    """The configurations each set of processes runs: all in one, but each DeepSpeed run in its own (its engine
    keeps process-wide state, and the model-state census counts every live storage of the process)."""
    alone = [[config] for config in group if config.spec.run.zero]
    rest = [config for config in group if not config.spec.run.zero]
    return ([rest] if rest else []) + alone


def _spawned(worker, args: tuple, processes: int, who: str) -> list[dict]:
    """Run worker(rank, folder, *args) in `processes` processes and gather the rows each
    wrote (_write_rows); a process that raises or dies ends them all, in one line."""
    with tempfile.TemporaryDirectory() as folder:
        try:
            forkserver.start(worker, (folder, *args), processes)
        except mp.ProcessRaisedException as error:
            last = str(error).strip().splitlines()[-1]
            raise HarnessError(f"{who} failed: {last}") from None
        except mp.ProcessExitedException as error:
            raise HarnessError(f"{who} exited: {error}") from None
        rows = []
        for rank in range(processes):
            with open(os.path.join(folder, f"rank{rank}.json")) as file:
                rows += json.load(file)
        return rows


def _write_rows(folder: str, rank: int, rows: list[dict]) -> None:
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as file:
        json.dump(rows, file)




def _spawned_rank(rank: int, folder: str, world: int, configs, port: int, timeout_s: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _write_rows(folder, rank, run_rank(rank, world, configs, timeout_s))


def run_rank(rank: int, world: int, configs, timeout_s: int, gather: bool = False) -> list[dict]:
    """This rank's measurements (MASTER_ADDR/PORT set, as torchrun sets them); with gather,
    rank 0 returns every rank's rows and the others return none."""
    cuda = torch.cuda.is_available()
    device = f"cuda:{rank % torch.cuda.device_count()}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        if os.environ.get(FAIL_RANK_VARIABLE) == str(rank):
            raise RuntimeError(f"failure injected on rank {rank} ({FAIL_RANK_VARIABLE})")
        rows = [row for config in configs for row in measure(config, rank, device)]
        if not gather:
            return rows
        everyone = [None] * world if rank == 0 else None
        dist.gather_object(rows, everyone, dst=0)
        return [row for part in everyone for row in part] if rank == 0 else []
    finally:
        dist.destroy_process_group()
