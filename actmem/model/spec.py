"""The typed spec: a model's dims and the run that trains it, validated.

Every constraint a user can break raises ``SpecError`` with the arithmetic in
the message, e.g. ``t (3) must divide heads (128)``.
"""

from dataclasses import dataclass, field, fields, replace

from actmem.model import defaults, rules, symbols
from actmem.model.architecture import Architecture
from actmem.model.fp8 import expert_block_rows, expert_padding_rows
from actmem.errors import SpecError
from actmem.model.hardware import DEFAULT_GPU, DEFAULT_RESERVE, GPUS, gpu_label
from actmem.model.optimizer_state import OptimizerState
from actmem.model.recompute import RecomputePolicy
from actmem.model.recompute import RECOMPUTE_MODULES, Recompute
from actmem.units import parse_bytes
from actmem.model.widths import GRADIENT_BYTES



def require_positive_int(name: str, value) -> None:
    """The check every count and size takes (a bool is not an integer here)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SpecError(f"{name} must be a positive integer, got {value!r}")


def _require_positive_ints(obj) -> None:
    for f in fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get("positive") and not (value is None and f.metadata.get("optional")):
            require_positive_int(f.name, value)


def _positive(optional=False, **kw):
    return field(metadata={"positive": True, "optional": optional}, **kw)


@dataclass(frozen=True)
class Model:
    """Transformer dims (Table 1)."""

    heads: int = _positive()       # a
    hidden: int = _positive()      # h
    layers: int = _positive()      # L
    vocab: int = _positive()       # v, before padding
    seq_len: int = _positive()     # s

    def __post_init__(self):
        _require_positive_ints(self)
        _divides("heads", self.heads, "hidden", self.hidden)


@dataclass(frozen=True)
class Run:
    """How the model is trained: parallelism, microbatch, recompute."""

    tensor_parallel: int = _positive(default=1)     # t
    pipeline_parallel: int = _positive(default=1)   # p
    context_parallel: int = _positive(default=1)    # c: ranks splitting each sequence (ring attention)
    interleave: int = _positive(default=1)          # m, model chunks per pipeline rank
    micro_batch: int = _positive(default=1)         # b
    sequence_parallel: bool = False
    recompute: Recompute = Recompute.NONE
    global_batch: int | None = _positive(optional=True, default=None)
    gpus: int | None = _positive(optional=True, default=None)
    distributed_optimizer: bool = False
    first_stage_layers: int | None = _positive(optional=True, default=None)
    """Megatron's --decoder-first-pipeline-num-layers: an uneven pipeline's first stage."""
    last_stage_layers: int | None = _positive(optional=True, default=None)
    """Megatron's --decoder-last-pipeline-num-layers; the stages between share the rest."""

    recompute_method: str | None = None
    """Megatron's --recompute-method, with full recompute: 'uniform' or 'block'."""
    recompute_layers: int | None = _positive(optional=True, default=None)
    """Megatron's --recompute-num-layers N: layers a checkpoint (uniform) or checkpointed
    layers a model chunk (block). Neither given: every layer checkpointed alone."""
    recompute_modules: tuple | None = None
    """Megatron's --recompute-modules, with selective recompute: what it recomputes, from
    core_attn, layernorm and mlp. None: core_attn, Megatron's default and the paper's."""
    selective_ac_option: str | None = None
    """torchtitan's activation_checkpoint.selective_ac_option, with selective recompute under torch-native: 'op',
    its per-op checkpointing (actmem.model.recompute: selective:op). None: not given."""
    expert_parallel: int = _positive(default=1)
    """EP: ranks the experts are spread over (--expert-model-parallel-size), carved from the
    data-parallel ranks (and the tensor- and context-parallel ones): E/EP experts a rank."""
    expert_tensor_parallel: int | None = _positive(optional=True, default=None)
    """ETP: ranks each expert's linears are split over (--expert-tensor-parallel-size); None: t,
    as Megatron sets it."""
    routing_imbalance: object = 1
    """r >= 1: the rows the busiest rank's experts receive over the balanced count (a Fraction,
    or an int; 1: perfectly balanced routing, Megatron's aux loss at its goal)."""
    expert_loads: tuple | None = None
    """A per-expert load histogram, one row of E token counts a layer (--moe-load-histogram), in place
    of r: the busiest EP rank's share of it is r (actmem.model.experts.busiest_rank)."""
    offload_layers: int = 0
    """N of Megatron's --cpu-offloading-num-layers: Transformer Engine copies the saved activations of
    the first N layers to host memory (actmem.memory.offload); 0, Megatron's default: none."""
    fsdp: bool = False
    """--fsdp: PyTorch's FSDP2 (fully_shard) over the d data-parallel ranks as torchtitan applies it
    (actmem.memory.fsdp): the model state sharded, each group's weights gathered while it computes."""
    fsdp_replicate: int = _positive(default=1)
    """--fsdp-replicate R: HSDP, FSDP2 over a 2-D mesh that replicates the model state R times and shards it
    over d/R ranks (torchtitan's data_parallel_replicate_degree); 1: every data-parallel rank shards."""
    fsdp_reshard: str = "default"
    """--fsdp-reshard-after-forward: which groups FSDP2's forward reshards, torchtitan's policy
    (actmem.model.implementation.RESHARD_POLICIES)."""
    megatron_fsdp: bool = False
    """--use-megatron-fsdp: megatron-core's own FSDP over the d·c data-parallel ranks (actmem.memory.megatron_fsdp),
    the model state sharded as fsdp_sharding says."""
    fsdp_sharding: str | None = None
    """--data-parallel-sharding-strategy: what Megatron-FSDP shards (implementation.MEGATRON_FSDP_STRATEGIES);
    None: Megatron-LM's default, optim_grads_params."""
    overlap_grad_reduce: bool = False
    """Megatron's --overlap-grad-reduce (a pasted script's): under Megatron-FSDP it makes Megatron-LM split the
    buckets outside the units (actmem.memory.megatron_fsdp.bucket_size)."""
    ddp_bucket_size: int | None = None
    """Megatron's --ddp-bucket-size (a pasted script's), read under Megatron-FSDP beside --overlap-grad-reduce; 0
    splits nothing."""
    fsdp_communication_unit: int | None = _positive(optional=True, default=None)
    """Megatron's --suggested-communication-unit-size (a pasted script's): Megatron-FSDP's prefetch window is half
    of it; None: max(10⁹, two units) elements (actmem.memory.megatron_fsdp.prefetched_units)."""
    fsdp_double_buffer: bool = False
    """Megatron's --fsdp-double-buffer (--use-nccl-ub turns it on): Megatron-FSDP's units' gathered weights and
    gradient buckets in a fixed pool of two buffers each, held for the run (actmem.memory.megatron_fsdp.pools)."""
    zero: object = None
    """DeepSpeed's ZeRO as the Hugging Face Trainer runs it (actmem.model.deepspeed.ZeroConfig: --zero-stage or
    --deepspeed ds_config.json), None where the run has none."""

    def __post_init__(self):
        _require_positive_ints(self)
        if isinstance(self.offload_layers, bool) or not isinstance(self.offload_layers, int) or self.offload_layers < 0:
            raise SpecError(f"offload_layers (--cpu-offloading-num-layers) must be a whole number of layers, 0 or "
                            f"more, got {self.offload_layers!r}")
        check_imbalance(self.routing_imbalance)
        from actmem.model.deepspeed import ZeroConfig
        from actmem.model.implementation import MEGATRON_FSDP_STRATEGIES, RESHARD_POLICIES

        if self.zero is not None and not isinstance(self.zero, ZeroConfig):
            raise SpecError(f"zero must be a ZeroConfig (give zero_stage or deepspeed), got {self.zero!r}")

        if self.fsdp_reshard not in RESHARD_POLICIES:
            raise SpecError(f"fsdp_reshard (--fsdp-reshard-after-forward) must be one of {', '.join(RESHARD_POLICIES)}, "
                            f"got {self.fsdp_reshard!r}")
        if self.ddp_bucket_size is not None and (isinstance(self.ddp_bucket_size, bool) or not isinstance(
                self.ddp_bucket_size, int) or self.ddp_bucket_size < 0):
            raise SpecError(f"--ddp-bucket-size must be a whole number of elements, 0 or more, got "
                            f"{self.ddp_bucket_size!r}")
        if self.fsdp_sharding is not None and self.fsdp_sharding not in MEGATRON_FSDP_STRATEGIES:
            raise SpecError(f"fsdp_sharding (--data-parallel-sharding-strategy) must be one of "
                            f"{', '.join(MEGATRON_FSDP_STRATEGIES)}, got {self.fsdp_sharding!r}")
        _check_recompute_shape(self)
        if self.recompute_modules is not None:
            object.__setattr__(self, "recompute_modules", _checked_modules(self))
        for name in ("sequence_parallel", "distributed_optimizer", "fsdp", "megatron_fsdp", "fsdp_double_buffer"):
            if not isinstance(getattr(self, name), bool):
                raise SpecError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.recompute, Recompute):
            raise SpecError(f"recompute must be one of none, selective, full; got {self.recompute!r}")

    @property
    def etp(self) -> int:
        """ETP: --expert-tensor-parallel-size, or t."""
        return self.tensor_parallel if self.expert_tensor_parallel is None else self.expert_tensor_parallel

    @property
    def policy(self) -> RecomputePolicy:
        """The four recompute settings as one value (actmem.model.recompute)."""
        return RecomputePolicy.of_run(self.recompute, self.recompute_method, self.recompute_layers,
                                      self.recompute_modules, self.selective_ac_option)


def check_imbalance(value) -> None:
    from fractions import Fraction

    if isinstance(value, bool) or not isinstance(value, (int, Fraction)) or value < 1:
        raise SpecError(f"routing imbalance must be at least 1 (the busiest rank's expert rows over the balanced "
                        f"count), got {value}")


def _check_recompute_shape(run) -> None:
    shape = (run.recompute_method, run.recompute_layers)
    if shape == (None, None):
        return
    if run.recompute_method not in ("uniform", "block", None):
        raise SpecError(f"recompute_method must be uniform or block, got {run.recompute_method!r}")


def _checked_modules(run) -> tuple:
    """--recompute-modules as a tuple in Megatron's order, or the first thing wrong with it."""
    given = run.recompute_modules
    if isinstance(given, str) or not isinstance(given, (tuple, list)) or not all(isinstance(m, str) for m in given):
        raise SpecError(f"recompute_modules must be a list of module names, got {given!r}")
    if not given:
        raise SpecError("--recompute-modules names no module: give core_attn, layernorm or mlp "
                        "(or leave it out for core_attn, Megatron's default)")
    for module in given:
        if module not in RECOMPUTE_MODULES:
            raise SpecError(f"--recompute-modules {module} is not one of Megatron's modules: "
                            f"{', '.join(RECOMPUTE_MODULES)}")
    return tuple(module for module in RECOMPUTE_MODULES if module in given)


@dataclass(frozen=True)
class Spec:
    """A model, a run, and the GPU it must fit; cross-checked, with derived sizes."""

    model: Model
    run: Run
    name: str = "custom"
    gpu_memory_bytes: int = GPUS[DEFAULT_GPU].memory_bytes
    """What the allocator can reach on one GPU (actmem.model.hardware), or --gpu-memory."""
    gpu_name: str = GPUS[DEFAULT_GPU].name
    gpu_fp8: str | None = GPUS[DEFAULT_GPU].fp8
    """The GPU's FP8 generation (actmem.model.hardware.Gpu.fp8): what TE keeps of an FP8 weight."""
    gpu_default: bool = False
    """The GPU is actmem's default (hardware.DEFAULT_GPU), not one the input named: the output says so."""
    gradient_bytes: int = GRADIENT_BYTES
    """Bytes a main gradient: 4 (fp32, bf16 training's default) or 2 (the parameters' dtype: fp16
    training without --accumulate-allreduce-grads-in-fp32, or --grad-reduce-in-bf16)."""
    optimizer: OptimizerState = OptimizerState()
    """Adam's state: fp32 master weight and moments, or the precision-aware optimizer's dtypes."""
    reserve_bytes: int = parse_bytes(DEFAULT_RESERVE)
    """Kept free above the peak floor for what actmem does not count (hardware.DEFAULT_RESERVE):
    'fits' means the peak and the reserve fit, as `plan` reads its budget."""
    vocab_divisible_by: int = defaults.VOCAB_DIVISIBLE_BY
    architecture: Architecture = Architecture()
    notes: tuple = ()
    """What the input said that the estimate should repeat (pasted arguments it ignored)."""
    dims_only: bool = False
    """Only the model's dims are checked (its run is the defaults, unknown yet): rules of the run's
    kernels (whether Megatron's fused softmax runs at this b and t) and of its data-parallel run (gpus, the
    global batch) wait for the run (rules.Values.run_known)."""

    def __post_init__(self):
        for name in ("gpu_memory_bytes", "vocab_divisible_by"):
            require_positive_int(name, getattr(self, name))
        if self.gradient_bytes not in (2, 4):
            raise SpecError(f"gradient_bytes must be 4 (fp32) or 2 (16-bit), got {self.gradient_bytes!r}")
        if isinstance(self.reserve_bytes, bool) or not isinstance(self.reserve_bytes, int):
            raise SpecError(f"reserve must be a whole number of bytes, got {self.reserve_bytes!r}")
        if not isinstance(self.optimizer, OptimizerState):
            raise SpecError(f"optimizer must be an OptimizerState, got {self.optimizer!r}")
        if not isinstance(self.architecture, Architecture):
            raise SpecError(f"architecture must be an Architecture, got {self.architecture!r}")
        object.__setattr__(self, "optimizer", replace(self.optimizer, fp8_recipe=self.architecture.fp8))
        object.__setattr__(self, "vocab_divisible_by", self.architecture.code.stored_padding(
            self.vocab_divisible_by, defaults.VOCAB_DIVISIBLE_BY))
        from actmem.model.experts import check_routing

        check_routing(self.architecture, self.run.routing_imbalance, self.run.expert_loads)
        from actmem.model.fp8 import check_gpu, check_megatron_fsdp

        if not self.dims_only:        # the dims alone name no GPU yet (plan checks its own: PlanRequest)
            check_gpu(self.architecture, self.gpu_fp8, self.gpu_name, self.gpu_default)
            if self.run.megatron_fsdp:
                check_megatron_fsdp(self.architecture, self.gpu_fp8, self.gpu_name)
        rules.check(self.rule_values())

    @property
    def gpu_label(self) -> str:
        """The GPU's name, and where it is actmem's default, that it is ('A100 80GB, actmem's default, ...')."""
        return gpu_label(self.gpu_name, self.gpu_default)

    def rule_values(self) -> rules.Values:
        """This spec in the names ``actmem.model.rules`` reads."""
        model, run = self.model, self.run
        exact = run.gpus is not None and run.gpus % (run.tensor_parallel * run.context_parallel
                                                     * run.pipeline_parallel) == 0
        return rules.Values(
            heads=model.heads, hidden=model.hidden, layers=model.layers, seq_len=model.seq_len,
            t=run.tensor_parallel, p=run.pipeline_parallel, m=run.interleave, b=run.micro_batch,
            sequence_parallel=run.sequence_parallel, distributed_optimizer=run.distributed_optimizer,
            gpus=run.gpus, global_batch=run.global_batch, d=self.data_parallel,
            n=self.microbatches if exact else None, ffn=self.architecture.ffn_hidden,
            groups=self.architecture.query_groups, recompute=run.recompute.value,
            first=run.first_stage_layers, last=run.last_stage_layers, c=run.context_parallel,
            core=self.architecture.attention_core,
            recompute_layers=run.recompute_layers if run.recompute_method else None,
            chunk_layers=self.chunk_layers if run.recompute_method else None,
            unmodelled_recompute=self.architecture.unmodelled_recompute(model.heads, run.recompute_modules,
                                                                        run.selective_ac_option),
            selective_ac_option=run.selective_ac_option,
            code=self.architecture.code, head_dim=self.architecture.head_dim_or(model.hidden, model.heads),
            run_known=None if self.dims_only else True, vocab=model.vocab, vocab_divisible_by=self.vocab_divisible_by,
            gpu_memory_bytes=self.gpu_memory_bytes, architecture=self.architecture,
            precision_aware=self.optimizer.precision_aware, reserve_bytes=self.reserve_bytes,
            recompute_shape=None if (run.recompute_method, run.recompute_layers) == (None, None)
            else (run.recompute_method, run.recompute_layers),
            recompute_modules=run.recompute_modules,
            experts=self.architecture.num_experts, dense=None if self.architecture.moe else True,
            latent=True if self.architecture.multi_latent_attention else None,
            mtp=True if self.architecture.mtp_layers else None,
            ep=run.expert_parallel, etp=run.etp, imbalance=run.routing_imbalance,
            load_histogram=run.expert_loads is not None, expert_ffn=self.architecture.expert_ffn(model.hidden),
            shared_ffn=self.architecture.moe_shared_ffn, moe_freq=self.architecture.moe_layer_freq,
            mixed_layers=self.architecture.moe and 0 in _pattern_or_all(self.architecture, model.layers),
            offload_layers=run.offload_layers, fsdp=run.fsdp, gradient_bytes=self.gradient_bytes,
            fsdp_replicate=run.fsdp_replicate, fsdp_reshard=run.fsdp_reshard, params_dtype=self.optimizer.params,
            zero=run.zero.stage if run.zero else 0, megatron_fsdp=run.megatron_fsdp, fsdp_sharding=run.fsdp_sharding,
            fsdp_double_buffer=run.fsdp_double_buffer)

    def architecture_at(self, t: int) -> Architecture:
        """The architecture as a run of it at tensor-parallel size t executes: Megatron's local
        core on torch's fallback softmax where its fused kernel does not run at this s, b, a and t
        (rules.fused_softmax_runs; 'none' runs at t = 1)."""
        from dataclasses import replace

        return self.architecture.with_fused_softmax(rules.fused_softmax_runs(replace(self.rule_values(), t=t)))

    def technique_t(self, technique) -> int:
        """The t a technique row runs at: the run's, or 1 for 'none' (no parallelism)."""
        return self.run.tensor_parallel if technique.tensor_parallel else 1

    @property
    def chunk_layers(self) -> int:
        """Layers in one model chunk of the first stage: its layers / m."""
        return self.stage_layers // self.run.interleave

    @property
    def stage_layers(self) -> int:
        """Layers on the first pipeline stage: L/p, or the uneven pipeline's own count."""
        run = self.run
        if run.first_stage_layers is not None:
            return run.first_stage_layers
        if run.last_stage_layers is not None:            # the rest share the other stages
            return (self.model.layers - run.last_stage_layers) // (run.pipeline_parallel - 1)
        return self.model.layers // run.pipeline_parallel

    @property
    def data_parallel(self) -> int:
        """d = gpus/(t·c·p); 1 when the GPU count is not given."""
        if self.run.gpus is None:
            return 1
        return self.run.gpus // (self.run.tensor_parallel * self.run.context_parallel * self.run.pipeline_parallel)

    @property
    def fsdp_shards(self) -> int:
        """The ranks FSDP2 shards the model state over: d, or d/R under HSDP (--fsdp-replicate R)."""
        return self.data_parallel // self.run.fsdp_replicate

    @property
    def megatron_fsdp_strategy(self) -> str | None:
        """What Megatron-FSDP shards (--data-parallel-sharding-strategy, Megatron-LM's default where not given);
        None where the run does not use it."""
        from actmem.model.implementation import MEGATRON_FSDP_DEFAULT

        return (self.run.fsdp_sharding or MEGATRON_FSDP_DEFAULT) if self.run.megatron_fsdp else None

    @property
    def optimizer_shards(self) -> int:
        """Ranks the distributed optimizer shards over: d·c (Megatron's data-parallel group
        with context parallelism, which holds the same weights)."""
        return self.data_parallel * self.run.context_parallel

    @property
    def effective_imbalance(self):
        """r as the busiest rank can receive it: at most min(EP, E/k) times its share (experts.capped_imbalance),
        1 at EP = 1, where each rank holds every expert and receives its own k·N·ETP rows; from the load
        histogram where one is given."""
        from actmem.model.experts import busiest_rank, capped_imbalance

        if self.run.expert_loads is not None:
            return busiest_rank(self.run.expert_loads, self.run.expert_parallel).imbalance
        arch = self.architecture
        if not arch.moe:
            return self.run.routing_imbalance
        r = capped_imbalance(self.run.routing_imbalance, self.run.expert_parallel, arch.num_experts, arch.moe_topk)
        return int(r) if r.denominator == 1 else r          # an int or a Fraction, as the run's own

    @property
    def expert_optimizer_shards(self) -> int:
        """Ranks the distributed optimizer shards the experts' state over: the expert data-parallel
        group, gpus/(ETP·EP·p) (parallel_state.py: expert_data_parallel_size); at EP = 1 the dense
        parameters' d·c (the experts join their buffers); 1 when the GPU count is not given."""
        from actmem.model.experts import expert_shards

        run = self.run
        if run.gpus is None:
            return self.optimizer_shards if run.expert_parallel == 1 else 1
        return expert_shards(self.optimizer_shards, run.gpus, run.etp, run.expert_parallel, run.pipeline_parallel)

    @property
    def microbatches(self) -> int | None:
        """Microbatches per iteration, global_batch/(b·d); None when the batch or GPUs are unknown."""
        run = self.run
        if run.global_batch is None or run.gpus is None:
            return None
        return run.global_batch // (run.micro_batch * self.data_parallel)

    @property
    def padded_vocab(self) -> int:
        return padded_vocab(self.model.vocab, self.run.tensor_parallel, self.vocab_divisible_by)

    def bindings(self) -> dict:
        """The paper's symbols bound to this spec's integers."""
        model, run = self.model, self.run
        # context parallelism: every tensor a rank keeps holds s/c of each sequence (the flash
        # core has no s² term, and c > 1 needs it), so s binds to s/c
        values = {"s": model.seq_len // run.context_parallel, "b": run.micro_batch, "h": model.hidden, "a": model.heads,
                  "L": model.layers, "t": run.tensor_parallel, "p": run.pipeline_parallel,
                  "v": self.padded_vocab, "m": run.interleave, "c": run.context_parallel,
                  "e": run.etp, "r": self.effective_imbalance, "ep": run.expert_parallel,
                  "C": self.expert_capacity(run.tensor_parallel),
                  "P": expert_padding_rows(self.architecture, run.expert_parallel),
                  "Q": expert_block_rows(self.architecture, run.expert_parallel)}
        return {symbols.BY_NAME[name]: value for name, value in values.items()}

    def bindings_at(self, t: int) -> dict:
        """The bindings of a technique row run at t (the run's, or 1 for 'none'): its experts split
        over the run's ETP at the run's t, over none at t = 1, each expert's capacity of that t's tokens."""
        expert_split = self.run.etp if t == self.run.tensor_parallel else 1
        return self.bindings() | {symbols.t: t, symbols.e: expert_split, symbols.C: self.expert_capacity(t)}

    def expert_capacity(self, t: int) -> int:
        """C of the N = (s/c)·b/t tokens a rank routes at t (actmem.model.experts.capacity)."""
        from actmem.model.experts import capacity

        run = self.run
        return capacity(self.architecture, self.model.seq_len // run.context_parallel * run.micro_batch // t)


def _pattern_or_all(arch, layers) -> tuple:
    """The MoE pattern where its length fits the model (the rule checks it), else every layer MoE."""
    from actmem.model.experts import moe_layers

    freq = arch.moe_layer_freq
    return moe_layers(arch, layers) if isinstance(freq, int) or len(freq) == layers else (1,)


def padded_vocab(vocab, t, divisible_by):
    """Megatron pads the vocabulary to a multiple of divisible_by·t (ints or numpy arrays)."""
    multiple = divisible_by * t
    return -(-vocab // multiple) * multiple


def _divides(small_name, small, big_name, big):
    if big % small:
        raise SpecError(f"{small_name} ({small}) must divide {big_name} ({big})")


def build_spec(model: dict, run: dict, name: str = "custom", architecture: dict | None = None,
               **options) -> Spec:
    """A Spec from plain values (a preset file merged with flags); names missing or unknown keys."""
    _check_keys("model", model, Model, required=True)
    run = dict(run)
    if "zero_stage" in run or "deepspeed" in run:     # a flag's or a preset's spelling of the ZeRO config
        from actmem.model.deepspeed import zero_from_run

        zero_from_run(run)
    if run.get("gradient_accumulation") is not None:
        _accumulated_batch(run)
    run.pop("gradient_accumulation", None)
    _check_keys("run", run, Run, required=False)
    _check_keys("architecture", architecture or {}, Architecture, required=False)
    if isinstance(run.get("recompute_modules"), str):    # a flag: 'core_attn,mlp' or 'core_attn mlp'
        run["recompute_modules"] = tuple(run["recompute_modules"].replace(",", " ").split())
    if isinstance(run.get("recompute"), str):
        try:
            run["recompute"] = Recompute(run["recompute"])
        except ValueError:
            raise SpecError(f"recompute must be one of none, selective, full; got {run['recompute']!r}")
    return Spec(Model(**model), Run(**run), name=name, architecture=Architecture(**(architecture or {})),
                **options)


def _accumulated_batch(run: dict) -> None:
    """--gradient-accumulation-steps N (the Trainer's and DeepSpeed's spelling of the microbatches a step): the
    global batch b·N·d, d = gpus/(t·c·p), set in place; it must agree with a --global-batch given too."""
    steps = run["gradient_accumulation"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise SpecError(f"--gradient-accumulation-steps must be a positive integer, got {steps!r}")
    zero = run.get("zero")
    if zero is not None and zero.accumulation not in (None, steps):
        raise SpecError(f"--gradient-accumulation-steps {steps} and --deepspeed {zero.source} "
                        f"(gradient_accumulation_steps {zero.accumulation}) disagree; give it once")
    if run.get("gpus") is None:
        raise SpecError("--gradient-accumulation-steps needs --gpus: the global batch is micro batch · steps · "
                        "data-parallel ranks")
    ranks = run.get("tensor_parallel", 1) * run.get("context_parallel", 1) * run.get("pipeline_parallel", 1)
    implied = run.get("micro_batch", 1) * steps * (run["gpus"] // ranks)
    if run.get("global_batch") is not None and run["global_batch"] != implied:
        raise SpecError(f"the global batch {run['global_batch']} and --gradient-accumulation-steps {steps} disagree: "
                        f"micro batch · steps · d = {run.get('micro_batch', 1)} · {steps} · {run['gpus'] // ranks} = "
                        f"{implied}; give one")
    run["global_batch"] = implied


def _check_keys(section: str, values: dict, cls, required: bool) -> None:
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise SpecError(f"[{section}] has unknown keys: {', '.join(unknown)} (known: {', '.join(names)})")
    missing = [name for name in names if name not in values]
    if required and missing:
        raise SpecError(f"[{section}] is missing {', '.join(missing)}")


def interleave_from_layers_per_chunk(layers: int, p: int, layers_per_chunk: int) -> int:
    """Megatron's --num-layers-per-virtual-pipeline-stage N gives m = (L/p)/N."""
    if layers_per_chunk <= 0:
        raise SpecError(f"layers per virtual pipeline stage must be a positive integer, got {layers_per_chunk}")
    if layers % p or (layers // p) % layers_per_chunk:
        raise SpecError(f"layers per virtual pipeline stage ({layers_per_chunk}) must divide the "
                        f"layers per stage L/p = {layers}/{p}")
    return layers // p // layers_per_chunk
