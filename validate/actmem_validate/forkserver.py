"""How the harness starts its rank processes: forked from a server that imported torch and the harness once.

torch.multiprocessing's spawn starts every rank as a new interpreter that imports torch again (and megatron-core,
DeepSpeed or transformers where the rank runs them): seconds a process set on a 2-core machine, paid by each of
the hundreds of process sets the tests start. Python's forkserver imports them once, in a server process that
runs nothing else (no CUDA, no thread pool started: forking it is safe), and forks each rank from it; the rank's
function and arguments are still pickled, as spawn's are. A forked rank has the server's environment, not the
caller's of the moment, so each start hands its environment over (a test's injected failure, a port).
"""

import importlib.util
import multiprocessing
import os

HARNESS = ("torch", "torch.distributed", "actmem_validate.measure")
"""What every rank imports: the server imports it before its first fork."""
_preloaded: list[str] = []


def preload(*modules: str) -> None:
    """Add modules (those installed) for the server to import before its first fork; once it runs, it keeps what it
    imported, and the rest is imported by each rank as it needs it."""
    for module in HARNESS + modules:
        if module not in _preloaded and importlib.util.find_spec(module.split(".")[0]) is not None:
            _preloaded.append(module)
    multiprocessing.set_forkserver_preload(list(_preloaded))


def context():
    """The forkserver context, for the queues ranks put their results on."""
    import torch.multiprocessing as mp

    preload()
    return mp.get_context("forkserver")


def start(fn, args: tuple, nprocs: int) -> None:
    """fn(rank, *args) in nprocs ranks forked from the server, joined; a rank that raises or dies raises
    torch.multiprocessing's ProcessRaisedException or ProcessExitedException here, as mp.spawn does."""
    import torch.multiprocessing as mp

    preload()
    mp.start_processes(_in_the_callers_environment, args=(fn, dict(os.environ), args), nprocs=nprocs, join=True,
                       start_method="forkserver")


def environment(environ: dict) -> None:
    """This forked process's environment: the caller's (a process pool's initializer)."""
    os.environ.clear()
    os.environ.update(environ)


def _in_the_callers_environment(rank: int, fn, environ: dict, args: tuple) -> None:
    environment(environ)
    fn(rank, *args)
