"""What a real (not fake) harness run needs from this machine, known before it starts.

A real run spawns t processes, each holding its rank's parameters, their gradients and the
activations of the schedule. actmem's own estimate gives those sizes, so a run that cannot
fit is refused with the numbers instead of swapping or being killed halfway.
"""

import os

from actmem.errors import SpecError
from actmem.memory.estimate import estimate
from actmem.units import gib

HARNESS_PARAMETER_BYTES = 2 + 4
"""bf16 weights and Megatron's fp32 main gradients (layers.attach_main_grads); no optimizer."""
TRANSIENT_FACTOR = 2
"""Allocator peak over the saved activations: the harness measures up to +49% at paper scale
(the 175B run); twice the saved bytes covers it with room for the fp32 loss temporaries."""
PROCESS_BYTES = 512 * 2**20
"""One torch process with gloo, before any tensor (about 400 MiB resident here)."""


def rank_bytes(config) -> int:
    """One rank of one configuration: weights, main gradients and TE's dummy weight
    gradients, twice the saved activations (saved + transients), and the process itself;
    under FSDP2 (a training step, AdamW's state made), twice actmem's peak floor."""
    est = estimate(config.spec)
    if config.spec.run.fsdp:
        return TRANSIENT_FACTOR * est.peak.total_bytes + PROCESS_BYTES
    return (HARNESS_PARAMETER_BYTES * est.parameters.count + est.parameters.dummy_wgrads_bytes
            + TRANSIENT_FACTOR * est.activations_bytes + PROCESS_BYTES)


def available_bytes() -> int:
    """Memory the kernel says a new process can have (MemAvailable), else free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits_machine(configs, available: int | None = None) -> None:
    """Refuse a real run whose largest configuration needs more than this machine has
    (configurations of one world size run one after another in the same t processes)."""
    available = available_bytes() if available is None else available
    worst = max(configs, key=lambda config: config.world_size * rank_bytes(config))
    need = worst.world_size * rank_bytes(worst)
    if need > available:
        raise SpecError(f"a real run of {worst.label} needs about {gib(need):,.1f} GiB "
                        f"({worst.world_size} ranks × {gib(rank_bytes(worst)):,.2f} GiB: {RANK_PARTS}), and "
                        f"this machine has {gib(available):,.1f} GiB available; measure it with --mode fake, "
                        f"or fewer --layers")


RANK_PARTS = "bf16 weights, fp32 main gradients, dummy weight gradients, twice the saved activations, the process"


GPU_MARGIN = 0.02, 2 * 2**30
"""Room a GPU run leaves above actmem's floor: 2% for what the floor does not model (the
harness's peak sits at most 0.9% above it at paper scale) and 2 GiB for the allocator's
rounding, cuBLAS's workspaces and the CUDA context's own growth."""


def gpu_bytes(config) -> int:
    """Rank 0 on a GPU (--mode rank0): actmem's peak floor (weights, main gradients, the
    activations in flight, the modelled transients) less the optimizer state the harness
    never makes (under FSDP2 it runs AdamW, so all of it), with GPU_MARGIN."""
    floor = estimate(config.spec).peak
    need = floor.total_bytes - (0 if config.spec.run.fsdp else floor.bytes_of("optimizer_state"))
    return int(need * (1 + GPU_MARGIN[0])) + GPU_MARGIN[1]


def rank0_runs(configs, gpu_free: int | None, host_free: int | None = None) -> tuple[list, list[str]]:
    """The configurations --mode rank0 measures, and one line a configuration it leaves out:
    the megatron backend, and torch-native under FSDP2 (a training step whose values are not
    checked); not torch-native alone (it checks its values against one device, which the
    fake ranks do not compute) nor hf (it runs on one device: --mode real measures both); on a GPU
    (gpu_free: its free bytes) no context parallelism (the harness's attention all-gathers k
    and v: not TE's ring, and larger than actmem's floor) and a floor, with GPU_MARGIN,
    within its free memory; on a CPU (host_free: the memory available) one rank's
    rank_bytes within it."""
    kept, left_out = [], []
    for config in configs:
        run, implementation = config.spec.run, config.spec.architecture.implementation
        if implementation != "megatron" and not run.fsdp:
            left_out.append(f"{config.label}: --mode rank0 measures the megatron backend and FSDP2; "
                            f"{implementation} runs with --mode real")
        elif gpu_free is not None and run.context_parallel > 1:
            left_out.append(f"{config.label}: context parallelism on a GPU (the harness's attention "
                            f"is not TE's ring, and needs more than actmem's floor)")
        elif gpu_free is not None and gpu_bytes(config) > gpu_free:
            left_out.append(f"{config.label}: needs about {gib(gpu_bytes(config)):,.1f} GiB, "
                            f"{gib(gpu_free):,.1f} GiB free on this GPU")
        elif host_free is not None and rank_bytes(config) > host_free:
            left_out.append(f"{config.label}: one process needs about {gib(rank_bytes(config)):,.1f} GiB "
                            f"({RANK_PARTS}), {gib(host_free):,.1f} GiB available on this machine; "
                            f"measure it with --mode fake")
        else:
            kept.append(config)
    return kept, left_out
