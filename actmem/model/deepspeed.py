"""DeepSpeed's ZeRO as the Hugging Face Trainer runs it: the settings that shape what a data-parallel
rank keeps, read off a DeepSpeed config file (``--deepspeed ds_config.json``, the Trainer's own flag) or
given as a stage alone (``--zero-stage N``, DeepSpeed's defaults for the rest).

Read at DeepSpeed 0.19.8 (runtime/zero/config.py, DeepSpeedZeroConfig) and transformers 5.23
(integrations/deepspeed.py, HfTrainerDeepSpeedConfig.trainer_config_finalize). Every key of the file is
either read (it changes memory and actmem models it), named as changing no memory actmem counts, or
refused with its name: a setting actmem has not read cannot pass silently (``KEYS``).
"""

import json
from dataclasses import dataclass

from actmem.errors import SpecError

DEEPSPEED_VERSION = "0.19.8"
REDUCE_BUCKET_SIZE = 500_000_000
"""reduce_bucket_size's default (config.py): elements of the gradient bucket (2 B each in bf16)."""
PERSISTENCE_THRESHOLD = 100_000
"""stage3_param_persistence_threshold's default: ZeRO-3 keeps a parameter of at most this many elements
whole on every rank (parameter_offload.py, mark_persistent_parameters: ds_numel <= threshold)."""
MAX_REUSE_DISTANCE = 1_000_000_000
"""stage3_max_reuse_distance's default: ZeRO-3 keeps a gathered weight whose next use comes within this many
elements of the weights fetched in between (partitioned_param_coordinator.py, __params_to_release)."""
SUB_GROUP_SIZE = 1_000_000_000
"""sub_group_size's default: ZeRO-3 steps its optimizer over sub-groups of at least this many elements of a
rank's partition (stage3.py, _create_fp16_sub_groups)."""

TRAINER = "trainer"
"""No "optimizer" section: the Trainer's own torch AdamW (fused, transformers' default optim for torch >= 2.8),
in two groups, decayed and not (trainer.py, create_optimizer), each keeping a 0-dim fp32 step on the GPU."""
DEEPSPEED_ADAM = "deepspeed"
"""An "optimizer" section of type Adam or AdamW: DeepSpeed's FusedAdam over one group of every parameter
(transformers' DummyOptim; engine.py, _configure_basic_optimizer), whose step is a Python int (fused_adam.py)."""


@dataclass(frozen=True)
class ZeroConfig:
    """What of a DeepSpeed config changes a rank's memory, as actmem models it."""

    stage: int
    reduce_bucket_size: int = REDUCE_BUCKET_SIZE
    persistence_threshold: int = PERSISTENCE_THRESHOLD
    sub_group_size: int = SUB_GROUP_SIZE
    reuse_distance: int = MAX_REUSE_DISTANCE
    optimizer: str = TRAINER
    source: str = ""
    """Where it was read: the file, or '--zero-stage N'."""
    auto: tuple = ()
    """The keys whose "auto" was resolved as the Trainer resolves it (a name, and the value)."""
    micro_batch: int | None = None
    """train_micro_batch_size_per_gpu where the file gives a number."""
    accumulation: int | None = None
    """gradient_accumulation_steps where the file gives a number."""
    train_batch: int | None = None
    """train_batch_size where the file gives a number."""

    def __post_init__(self):
        if self.stage not in (1, 2, 3):
            raise SpecError(f"ZeRO stage must be 1, 2 or 3 (0 is no ZeRO: leave --zero-stage out), got {self.stage!r}")
        for name in ("reduce_bucket_size", "sub_group_size"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise SpecError(f"zero_optimization.{name} must be a positive number of elements, got {getattr(self, name)!r}")
        for name, key in (("persistence_threshold", "stage3_param_persistence_threshold"),
                          ("reuse_distance", "stage3_max_reuse_distance")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SpecError(f"zero_optimization.{key} must be 0 or more elements, got {value!r}")
        if self.optimizer not in (TRAINER, DEEPSPEED_ADAM):
            raise SpecError(f"optimizer must be {TRAINER} or {DEEPSPEED_ADAM}, got {self.optimizer!r}")

    @property
    def label(self) -> str:
        return f"ZeRO-{self.stage}"


def stage_only(stage: int) -> ZeroConfig:
    """--zero-stage N alone: a config of the stage and bf16, every other key DeepSpeed's default, the
    Trainer's AdamW."""
    return ZeroConfig(stage, source=f"--zero-stage {stage}")


def zero_from_run(run: dict, hidden) -> None:
    """A run's two spellings of its ZeRO config (zero_stage, deepspeed: a file) made one ``zero`` in place, and
    the batch the file gives (train_micro_batch_size_per_gpu, gradient_accumulation_steps, train_batch_size) set
    where the run does not; a value both give must agree."""
    stage, path = run.pop("zero_stage", None), run.pop("deepspeed", None)
    if path is None:
        if stage is not None and stage != 0:
            run["zero"] = stage_only(stage)
        return
    if not isinstance(hidden, int):
        raise SpecError("--deepspeed resolves \"auto\" from the model's hidden size: give --hidden or a preset")
    config = read(path, hidden)
    if stage is not None and stage != config.stage:
        raise SpecError(f"--zero-stage {stage} and --deepspeed {path} (zero_optimization.stage {config.stage}) "
                        "disagree; give the stage once")
    _agree(run, "micro_batch", config.micro_batch, "--micro-batch-size", "train_micro_batch_size_per_gpu", path)
    micro, gpus = run.get("micro_batch", 1), run.get("gpus")
    implied = []
    if config.train_batch is not None:
        implied.append((config.train_batch, "train_batch_size"))
    if config.accumulation is not None and gpus is not None:
        implied.append((micro * config.accumulation * gpus, "train_micro_batch_size_per_gpu · "
                                                            "gradient_accumulation_steps · GPUs"))
    for batch, where in implied:
        _agree(run, "global_batch", batch, "--global-batch-size", where, path)
    run["zero"] = config


def _agree(run: dict, key: str, value, flag: str, name: str, path: str) -> None:
    if value is None:
        return
    if run.get(key) is not None and run[key] != value:
        raise SpecError(f"{flag} {run[key]} and --deepspeed {path} ({name}: {value}) disagree; give it once")
    run[key] = value


# --- reading a config file ------------------------------------------------------------------------------------

#: top-level keys that change no memory actmem counts, and why
_TOP_NO_MEMORY = {
    "scheduler": "the learning-rate schedule", "gradient_clipping": "clipping scales the gradients in place",
    "steps_per_print": "logging", "wall_clock_breakdown": "timing", "zero_allow_untested_optimizer": "a check",
    "prescale_gradients": "scales in place", "gradient_predivide_factor": "scales in place",
    "tensorboard": "logging", "wandb": "logging", "csv_monitor": "logging", "comet": "logging",
    "comms_logger": "logging", "flops_profiler": "profiling", "memory_breakdown": "logging", "dump_state": "logging",
    "checkpoint": "checkpoint saving", "seed": "randomness",
    "activation_checkpointing": "DeepSpeed's own checkpointing, which only a model calling "
                                "deepspeed.checkpointing uses (transformers' models use torch's: "
                                "gradient_checkpointing)",
}
#: zero_optimization keys that change no memory actmem counts, and why
_ZERO_NO_MEMORY = {
    "allgather_partitions": "the weights are gathered into their flat buffer (all_gather_into_tensor)",
    "allgather_bucket_size": "costs nothing where all_gather_into_tensor runs (runtime/utils.py)",
    "round_robin_gradients": "it reorders, the partition sizes stay (stage_1_and_2.py)",
    "use_multi_rank_bucket_allreduce": "a collective's choice",
    "stage3_prefetch_bucket_size": "ZeRO-3's prefetch: weights it gathers ahead, which the floor does not count",
    "stage3_max_live_parameters": "ZeRO-3's prefetch cap, which the floor does not count",
    "stage3_gather_16bit_weights_on_model_save": "saving", "stage3_gather_fp16_weights_on_model_save": "saving",
    "gather_16bit_weights_on_model_save": "saving", "ignore_unused_parameters": "a check",
    "elastic_checkpoint": "checkpointing", "load_from_fp32_weights": "checkpoint loading",
    "memory_efficient_linear": "ZeRO-3's linear wrapper (on by default) keeps what torch's linear keeps",
    "log_trace_cache_warnings": "logging", "module_granularity_threshold": "how ZeRO-3 fetches, not what it keeps",
    "stage3_module_granularity_threshold": "how ZeRO-3 fetches, not what it keeps",
}
#: zero_optimization keys actmem reads, with the value it models where it models only that one (None: any)
_ZERO_READ = {"stage", "reduce_bucket_size", "stage3_param_persistence_threshold", "sub_group_size",
              "stage3_max_reuse_distance",
              "overlap_comm", "contiguous_gradients", "reduce_scatter", "offload_optimizer", "offload_param",
              "stage3_model_persistence_threshold", "zero_hpz_partition_size", "zero_quantized_weights",
              "zero_quantized_gradients", "zero_quantized_nontrainable_weights", "mics_shard_size",
              "parameter_alignment", "cpu_offload", "cpu_offload_params"}
_TOP_READ = {"zero_optimization", "bf16", "fp16", "optimizer", "train_micro_batch_size_per_gpu",
             "gradient_accumulation_steps", "train_batch_size", "communication_data_type", "data_types",
             "amp", "torch_autocast"}

KEYS = {"read": _TOP_READ | {f"zero_optimization.{key}" for key in _ZERO_READ},
        "no memory": set(_TOP_NO_MEMORY) | {f"zero_optimization.{key}" for key in _ZERO_NO_MEMORY}}
"""Every key of a config file actmem knows: read, or changing no memory it counts (the rest are refused)."""


def read(path: str, hidden: int) -> ZeroConfig:
    """The ZeroConfig a DeepSpeed config file describes, "auto" resolved as the Trainer resolves it for a model
    of hidden size ``hidden``; SpecError naming the first key actmem cannot price."""
    try:
        with open(path) as file:
            config = json.load(file)
    except OSError as error:
        raise SpecError(f"--deepspeed {path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise SpecError(f"--deepspeed {path} is not JSON: {error.msg} (line {error.lineno})") from None
    if not isinstance(config, dict):
        raise SpecError(f"--deepspeed {path} must hold a JSON object, the DeepSpeed config")
    return from_dict(config, hidden, source=path)


def from_dict(config: dict, hidden: int, source: str = "the DeepSpeed config") -> ZeroConfig:
    _known(config, _TOP_READ | set(_TOP_NO_MEMORY), "", source)
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict) or "stage" not in zero:
        raise SpecError(f"{source} sets no zero_optimization.stage: actmem prices ZeRO stages 1, 2 and 3 "
                        "(no ZeRO is plain data parallelism: leave --deepspeed out)")
    _known(zero, _ZERO_READ | set(_ZERO_NO_MEMORY), "zero_optimization.", source)
    stage = _integer(zero["stage"], "zero_optimization.stage", source)
    if stage == 0:
        raise SpecError(f"{source} sets zero_optimization.stage 0, no ZeRO: that is plain data parallelism, which "
                        "--implementation hf prices without --deepspeed")
    _precision(config, source)
    _refused(zero, stage, source)
    auto, values = [], {}
    for key, default, resolved in (("reduce_bucket_size", REDUCE_BUCKET_SIZE, hidden * hidden),
                                   ("stage3_param_persistence_threshold", PERSISTENCE_THRESHOLD, 10 * hidden)):
        value = zero.get(key, default)
        if value == "auto":          # trainer_config_finalize: hidden_size², and ZeRO-3's 10·hidden_size
            value = resolved
            auto.append((key, resolved))
        values[key] = _integer(value, f"zero_optimization.{key}", source)
    batch = {key: _batch_value(config, key, source) for key in
             ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")}
    return ZeroConfig(stage, values["reduce_bucket_size"], values["stage3_param_persistence_threshold"],
                      _integer(zero.get("sub_group_size", SUB_GROUP_SIZE), "zero_optimization.sub_group_size", source),
                      _integer(zero.get("stage3_max_reuse_distance", MAX_REUSE_DISTANCE),
                               "zero_optimization.stage3_max_reuse_distance", source),
                      _optimizer(config, source), source, tuple(auto), batch["train_micro_batch_size_per_gpu"],
                      batch["gradient_accumulation_steps"], batch["train_batch_size"])


def _known(section: dict, known: set, prefix: str, source: str) -> None:
    for key in section:
        if key not in known:
            raise SpecError(f"{source}: {prefix}{key} is a setting actmem has not read (DeepSpeed {DEEPSPEED_VERSION}); "
                            "it may change what a rank keeps, so the estimate would not be trusted: remove it to "
                            "price the rest")


def _integer(value, key: str, source: str) -> int:
    """A count: JSON's 5e8 is a float, which DeepSpeed takes as the integer it is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise SpecError(f"{source}: {key} must be a whole number, got {value!r}")
    return int(value)


def _batch_value(config: dict, key: str, source: str) -> int | None:
    value = config.get(key, "auto")
    return None if value == "auto" else _integer(value, key, source)


def _enabled(config: dict, key: str):
    section = config.get(key, {})
    return section.get("enabled", False) if isinstance(section, dict) else section


def _precision(config: dict, source: str) -> None:
    """bf16, as actmem prices the layers: refuse fp16 (loss-scaled, other buffers) and fp32 training."""
    if _enabled(config, "fp16") not in (False, "auto"):
        raise SpecError(f"{source} enables fp16: actmem prices bf16 training under ZeRO (fp16's loss scaling keeps "
                        "other buffers, not read yet): set bf16.enabled")
    if _enabled(config, "bf16") is False:
        raise SpecError(f"{source} does not enable bf16: actmem prices bf16 training under ZeRO (fp32 weights "
                        "and gradients are not modelled): set bf16.enabled true (or \"auto\" with --bf16)")
    if _enabled(config, "amp") or _enabled(config, "torch_autocast"):
        raise SpecError(f"{source} enables autocast (amp or torch_autocast): fp32 weights under autocast are not "
                        "modelled; actmem prices bf16.enabled")
    if config.get("communication_data_type") not in (None, "bf16", "bfloat16"):
        raise SpecError(f"{source}: communication_data_type {config['communication_data_type']!r} makes the gradient "
                        "buckets another dtype, not modelled: leave it out (bf16)")
    types = config.get("data_types", {})
    extra = set(types) - {"grad_accum_dtype"} if isinstance(types, dict) else {"data_types"}
    if extra:
        raise SpecError(f"{source}: data_types.{sorted(extra)[0]} is a setting actmem has not read")
    if types.get("grad_accum_dtype") not in (None, "bf16", "bfloat16"):
        raise SpecError(f"{source}: data_types.grad_accum_dtype {types['grad_accum_dtype']!r} accumulates gradients "
                        "in fp32 (ZeRO-1 then runs BF16_Optimizer), not modelled: leave it out (bf16)")


def _refused(zero: dict, stage: int, source: str) -> None:
    """The zero_optimization settings that change memory in ways actmem has not modelled yet."""
    for key in ("offload_optimizer", "offload_param"):
        device = zero.get(key, {}).get("device", "none") if isinstance(zero.get(key), dict) else zero.get(key)
        if device not in (None, "none"):
            raise SpecError(f"{source}: zero_optimization.{key} moves model state to {device}, which actmem does not "
                            "model yet (ZeRO-Offload): remove it to price the GPU-only run")
    for key, default in (("cpu_offload", False), ("cpu_offload_params", False), ("zero_quantized_weights", False),
                         ("zero_quantized_gradients", False), ("zero_quantized_nontrainable_weights", False),
                         ("zero_hpz_partition_size", 1), ("mics_shard_size", -1), ("parameter_alignment", False),
                         ("contiguous_gradients", True), ("reduce_scatter", True)):
        if key in zero and zero[key] != default:
            raise SpecError(f"{source}: zero_optimization.{key} {json.dumps(zero[key])} changes the buffers a rank "
                            f"keeps in ways actmem does not model yet: leave it at {json.dumps(default)}")
    if stage < 3 and zero.get("overlap_comm", False) not in (False, "auto"):
        raise SpecError(f"{source}: overlap_comm true at ZeRO-{stage} keeps a second gradient bucket "
                        "(stage_1_and_2.py), not measured yet: leave it out (false at stages 1 and 2)")
    if zero.get("stage3_model_persistence_threshold", None) not in (None, "auto"):
        raise SpecError(f"{source}: zero_optimization.stage3_model_persistence_threshold caps the parameters ZeRO-3 "
                        "keeps whole, not modelled yet: leave it out (no cap)")


def _optimizer(config: dict, source: str) -> str:
    section = config.get("optimizer")
    if section is None:
        return TRAINER
    kind = section.get("type", "") if isinstance(section, dict) else ""
    if not isinstance(kind, str) or kind.lower() not in ("adam", "adamw"):
        raise SpecError(f"{source}: optimizer {kind!r} is not modelled; actmem prices Adam and AdamW (DeepSpeed's "
                        "FusedAdam) or, with no optimizer section, the Trainer's AdamW")
    params = section.get("params", {})
    if isinstance(params, dict) and params.get("torch_adam"):
        raise SpecError(f"{source}: optimizer.params.torch_adam runs torch's AdamW, whose step counter actmem has "
                        "not read there: leave it out (FusedAdam)")
    return DEEPSPEED_ADAM
