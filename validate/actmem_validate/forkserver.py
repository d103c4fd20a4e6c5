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

HARNESS = ("torch", "torch.distributed", "torch._dynamo", "actmem_validate.measure")
"""What every rank imports: the server imports it before its first fork. torch._dynamo: what a fake run's first
FakeTensorMode imports (about 1.5 s)."""
MEGATRON = ("megatron.core.models.gpt", "megatron.core.transformer.moe.moe_layer",
            "megatron.core.transformer.moe.token_dispatcher", "megatron.core.transformer.multi_latent_attention",
            "megatron.core.transformer.multi_token_prediction")
"""What the moe, mla, mtp and mfsdp grids' ranks import: megatron-core's layers (about 5 s)."""
TRANSFORMERS = tuple(f"transformers.models.{name}.modeling_{name}"
                     for name in ("llama", "gpt2", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"))
"""What the hf backend's ranks import: transformers' models (about 5 s)."""
DEEPSPEED = ("deepspeed", "transformers.trainer")
"""What the ZeRO harness's ranks import beside transformers' models: DeepSpeed and the Trainer (its optimizer's
parameter groups). Imported on a machine without a GPU only (the harness refuses ZeRO on one), where DeepSpeed
finds the CPU accelerator as the ranks' DS_ACCELERATOR=cpu makes it."""
_preloaded: list[str] = []
METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
"""Python's forkserver where the platform has one (Linux, macOS); else spawn (Windows), each rank importing it all."""


def preload(*modules: str) -> None:
    """Add modules (those installed) for the server to import before its first fork; once it runs, it keeps what it
    imported, and the rest is imported by each rank as it needs it. Where a GPU is visible, the harness only:
    DeepSpeed's accelerator and megatron-core ask CUDA at import, which a forked rank could not use after."""
    import torch

    for module in HARNESS + (() if torch.cuda.is_available() else modules):
        if module not in _preloaded and importlib.util.find_spec(module.split(".")[0]) is not None:
            _preloaded.append(module)
    multiprocessing.set_forkserver_preload(list(_preloaded))


def context():
    """The context ranks start in (METHOD), for the queues they put their results on."""
    import torch.multiprocessing as mp

    preload()
    return mp.get_context(METHOD)


def start(fn, args: tuple, nprocs: int) -> None:
    """fn(rank, *args) in nprocs ranks forked from the server, joined; a rank that raises or dies raises
    torch.multiprocessing's ProcessRaisedException or ProcessExitedException here, as mp.spawn does."""
    import torch.multiprocessing as mp

    preload()
    mp.start_processes(_in_the_callers_environment, args=(fn, dict(os.environ), args), nprocs=nprocs, join=True,
                       start_method=METHOD)


def environment(environ: dict) -> None:
    """This forked process's environment: the caller's (a process pool's initializer)."""
    os.environ.clear()
    os.environ.update(environ)


def _in_the_callers_environment(rank: int, fn, environ: dict, args: tuple) -> None:
    environment(environ)
    fn(rank, *args)
