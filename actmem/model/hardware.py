"""GPUs actmem knows: the memory the allocator can reach, peak 16-bit throughput and the
bandwidths the planner assumes; each number with its source."""

from dataclasses import dataclass

from actmem.errors import SpecError


# Share of the peak the matmuls reach. With 0.6 of the A100's peak the planner's time model
# puts the paper's GPT-3 run at 13.9 s an iteration and its 530B run at 40.3 s (Table 5
# measured 13.75 s and 37.83 s).
DEFAULT_EFFICIENCY = 0.6

# Headroom the planner keeps free on every GPU above the modelled peak (actmem.memory.peak), for
# what that model does not know: the CUDA context and NCCL/cuBLAS workspaces (about 1-2 GiB),
# allocator fragmentation and rounding, and the backward transients not modelled yet (the
# flash core's, the other linears'; actmem.memory.backward models fc1's and the eager core's). The
# harness measures its peak above the floor by 0-0.9% of the bytes above the parameters at
# the paper's four runs and Llama 3.1 8B, 70B and 405B (README, measured table), under 0.8
# GiB at each; 8 GiB covers those with room for fragmentation, which no model here knows.
DEFAULT_RESERVE = "8GiB"


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int
    """What the allocator can reach: torch's total_memory (cudaMemGetInfo's total, after the
    driver's own reservations), as PyTorch's out-of-memory message reports it ("GPU 0 has a
    total capacity of 79.10 GiB"); the least seen across drivers. The CUDA context, NCCL and
    the workspaces then come out of it, inside the reserve."""
    peak_flops: float
    """Dense bf16/fp16 tensor-core peak, FLOP/s."""
    intra_node_bandwidth: float
    """Bytes/s one GPU achieves in an NVLink all-reduce (NCCL bus bandwidth), for t."""
    inter_node_bandwidth: float
    """Bytes/s one GPU achieves across nodes (its InfiniBand share), for data parallelism."""
    fp8: str | None = None
    """Its FP8 tensor cores' generation as Transformer Engine tells them apart ('hopper', sm90: FP8 GEMMs TN
    only, so TE keeps transposes; 'blackwell', sm100), or None (no FP8, or a GPU TE's FP8 is not read for)."""
    kernel_tables: str | None = None
    """The measured kernel tables its compute time reads (actmem.planner.kernels: actmem/planner/data/
    <name>_*.csv), or None: every FLOP at one efficiency (DEFAULT_EFFICIENCY, or --efficiency)."""


def _gib(gib: float) -> int:
    """A capacity as PyTorch prints it (two decimals of GiB), in bytes."""
    return round(gib * 2**30)


_A100_80 = Gpu("A100 80GB", 85_056_798_720, 312e12, 230e9, 25e9)
GPUS = {
    # The paper's GPU: 312 TFLOP/s bf16; NVLink 3 (600 GB/s both ways) reaches ~230 GB/s bus
    # bandwidth in NCCL all-reduce; one 200 Gb/s HDR InfiniBand link a GPU is 25 GB/s.
    # torch.cuda.get_device_properties().total_memory of an A100-SXM4-80GB: 85,056,798,720 B
    # (79.21 GiB).
    "a100": _A100_80,
    "a100-80": _A100_80,
    # A100 40GB: the 80GB's compute; PyTorch reports 39.39-39.56 GiB total capacity.
    "a100-40": Gpu("A100 40GB", _gib(39.39), 312e12, 230e9, 25e9),
    # H100 SXM: 989 TFLOP/s dense bf16; NVLink 4 (900 GB/s both ways) ~360 GB/s bus
    # bandwidth; one 400 Gb/s NDR InfiniBand link a GPU is 50 GB/s. PyTorch reports 79.10-79.18
    # GiB total capacity (nvidia-smi: 81,559 MiB). Its kernel tables were measured on an H100 80GB HBM3.
    "h100": Gpu("H100 SXM 80GB", _gib(79.10), 989e12, 360e9, 50e9, "hopper", "h100"),
    # H200 SXM: the H100's compute and NVLink with 141 GB of HBM3e; PyTorch reports 139.72-139.81
    # GiB total capacity (139.80 most often). It reads the H100's kernel tables: the same GH100 chip
    # and clocks (1980 MHz, 700 W, 132 multiprocessors on both here); one eager run of
    # benchmarks/gpu_kernel_tables.py on each (2026-11-26) put the median bf16 GEMM of 4096-32768 a
    # side at 676 TFLOP/s on the H200 against 692 on the H100, its faster memory helping the small ones.
    # The memory-bound kernels' table overcharges it: a device-to-device copy moves about 4.3 TB/s on
    # an H200 here against 3.0 on an H100 (the workplace's device notes, KINDS.md, 2026-10/11).
    "h200": Gpu("H200 SXM 141GB", _gib(139.72), 989e12, 360e9, 50e9, "hopper", "h100"),
    # H800 SXM: the H100's chip, compute and 80 GB of HBM3 (its capacity taken as the H100's) with NVLink cut to
    # 400 GB/s both ways: "NVLink offers a bandwidth of 160 GB/s, roughly 3.2 times that of IB (50 GB/s)"
    # (DeepSeek-V3 Technical Report, arXiv 2412.19437, section 3.2.2, of the H800 cluster it trained on).
    "h800": Gpu("H800 SXM 80GB", _gib(79.10), 989e12, 160e9, 50e9, "hopper", "h100"),
    # B200 (HGX B200): 180 GB HBM3e, 2.25 PFLOP/s dense bf16 (4.5 with sparsity); NVLink 5
    # (1.8 TB/s both ways), taken at the H100's share of it, ~720 GB/s bus bandwidth; one
    # 400 Gb/s ConnectX-7 link a GPU. PyTorch reports 178.35-178.36 GiB total capacity.
    "b200": Gpu("B200 180GB", _gib(178.35), 2.25e15, 720e9, 50e9, "blackwell"),
    # AMD MI300X: 192 GB HBM3, 1307.4 TFLOP/s dense bf16; seven Infinity Fabric links of 64 GB/s,
    # ~300 GB/s all-reduce bus bandwidth in RCCL; 400 Gb/s a GPU across nodes. PyTorch (ROCm)
    # reports 191.69-191.98 GiB total capacity.
    "mi300x": Gpu("MI300X 192GB", _gib(191.69), 1307.4e12, 300e9, 50e9),
    # GB200 is not here: no reported capacity to cite yet (give --gpu-memory).
}
#: the paper's GPU, for a model whose preset names none (and said so: DEFAULT_GPU_WORDS)
DEFAULT_GPU = "a100"
DEFAULT_GPU_WORDS = "actmem's default, the paper's GPU; give --gpu for yours"


def gpu_label(name: str, default: bool) -> str:
    """A GPU's name as the output shows it, saying where it is actmem's default (with --gpu-memory alone, the
    default's FP8 and speed beside the memory given)."""
    if not default:
        return name
    default_name = GPUS[DEFAULT_GPU].name
    return f"{name if name == default_name else f'{name}, otherwise {default_name}'}, {DEFAULT_GPU_WORDS}"


def gpu_named(name: str) -> Gpu:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise SpecError(f"unknown GPU {name!r}; known: {', '.join(GPUS)} (or give --gpu-memory SIZE)")
