"""A DeepSpeed config file (``--deepspeed ds_config.json``) read as the Hugging Face Trainer hands it to DeepSpeed
0.19.8: the ZeroConfig it prices (actmem.model.deepspeed).

Every key is classified by the tables below:
- zero_optimization's keys are DeepSpeedZeroConfig's fields (runtime/zero/config.py), which DeepSpeed refuses
  beyond (extra="forbid"), by their names or their stage3_ aliases: read, changing no memory actmem counts, or
  changing memory in ways it does not model (refused, all at once, by name);
- the top level's keys: read, changing no memory (logging, the schedule, checkpointing), or changing memory
  unmodelled (refused); a key in none of these is accepted and named in the estimate's assumptions (DeepSpeed
  ignores keys it does not read: runtime/config.py, _initialize_params).
"Auto" is resolved as the Trainer resolves it (integrations/deepspeed.py, trainer_config_finalize), and a config
without a bf16 section is priced as the Trainer's --bf16 makes it (accelerate's DeepSpeedPlugin.set_mixed_precision
adds bf16.enabled true where the config has no bf16 section).
"""

import json
from dataclasses import replace

from actmem.errors import SpecError
from actmem.model.deepspeed import (DEEPSPEED_ADAM, DEEPSPEED_VERSION, MAX_REUSE_DISTANCE, PERSISTENCE_THRESHOLD,
                                    REDUCE_BUCKET_SIZE, SUB_GROUP_SIZE, TRAINER, ZeroConfig)

LARGEST_BUCKET = 10 ** 11
"""A reduce bucket larger than this (200 GB of bf16) fits no GPU: refused as a mistake."""

#: zero_optimization's stage3_ aliases (DeepSpeedZeroConfig: Field(alias=...), populate_by_name)
ALIASES = {f"stage3_{name}": name for name in (
    "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold", "max_live_parameters",
    "max_reuse_distance", "gather_16bit_weights_on_model_save", "module_granularity_threshold",
    "use_all_reduce_for_fetch_params", "allgather_sequential")}

#: zero_optimization: what actmem reads
ZERO_READ = ("stage", "reduce_bucket_size", "param_persistence_threshold", "sub_group_size", "max_reuse_distance",
             "round_robin_gradients", "overlap_comm")
#: ... what changes no memory it counts, and why
ZERO_NO_MEMORY = {
    "allgather_partitions": "the weights are gathered into their flat buffer",
    "allgather_bucket_size": "all_gather_into_tensor gathers into the flat buffer (runtime/utils.py)",
    "prefetch_bucket_size": "ZeRO-3's prefetch, which the floor does not count",
    "max_live_parameters": "ZeRO-3's prefetch cap, which the floor does not count",
    "gather_16bit_weights_on_model_save": "saving", "stage3_gather_fp16_weights_on_model_save": "saving",
    "ignore_unused_parameters": "a check", "elastic_checkpoint": "checkpointing",
    "load_from_fp32_weights": "checkpoint loading", "pipeline_loading_checkpoint": "checkpoint loading",
    "memory_efficient_linear": "ZeRO-3's linear keeps what torch's keeps", "log_trace_cache_warnings": "logging",
    "enable_sanity_checks": "checks", "override_module_apply": "how ZeRO-3 wraps module.apply",
    "use_all_reduce_for_fetch_params": "how ZeRO-3 fetches, not what it keeps",
    "allgather_sequential": "how ZeRO-3 fetches, not what it keeps",
    "save_muon_momentum_buffer_in_memory": "Muon only",
}
#: ... the values it models of the settings that change memory otherwise (DeepSpeed's defaults)
ZERO_MODELLED_ONLY = {
    "contiguous_gradients": True, "reduce_scatter": True, "compute_grad_norm": True, "offload_param": None,
    "offload_optimizer": None, "cpu_offload": None, "cpu_offload_param": None, "cpu_offload_use_pin_memory": None,
    "zenflow": None, "model_persistence_threshold": None, "legacy_stage1": False, "parameter_alignment": False,
    "zero_hpz_partition_size": 1, "zero_quantized_weights": False, "zero_quantized_nontrainable_weights": False,
    "zero_quantized_gradients": False, "leaf_module": None,
    # false: each destination's slices reduced apart, none flattened (the floor counts the all-reduce's copy)
    "use_multi_rank_bucket_allreduce": True,
    # above 0: modules become ZeRO-3 leaves, traced whole, and what it keeps gathered is no longer bounded so
    "module_granularity_threshold": 0,
}

#: top level: what actmem reads
TOP_READ = ("zero_optimization", "bf16", "fp16", "optimizer", "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps", "train_batch_size", "communication_data_type", "data_types", "amp",
            "torch_autocast")
#: ... what changes no memory it counts
TOP_NO_MEMORY = {
    "scheduler", "gradient_clipping", "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
    "prescale_gradients", "gradient_predivide_factor", "tensorboard", "wandb", "csv_monitor", "comet",
    "comms_logger", "flops_profiler", "memory_breakdown", "dump_state", "checkpoint", "seed", "autotuning",
    "timers", "log_level", "dataloader_drop_last", "gradient_allreduce_op", "disable_allgather",
    # DeepSpeed's own checkpointing, which only a model calling deepspeed.checkpointing runs (transformers' models
    # use torch's: gradient_checkpointing); asynchronous I/O and the CPU optimizer, for offloading alone
    "activation_checkpointing", "aio", "zero_force_ds_cpu_optimizer",
}
#: ... what changes memory in ways actmem does not model
TOP_UNMODELLED = {
    "tensor_parallel": "AutoTP's tensor parallelism", "sequence_parallel_size": "Ulysses' sequence parallelism",
    "compile": "DeepSpeed's torch.compile", "data_efficiency": "data sampling and routing",
    "curriculum_learning": "a curriculum's sequence lengths", "compression_training": "compression",
    "sparse_attention": "sparse attention", "weight_quantization": "quantized weights",
    "hybrid_engine": "the hybrid engine", "progressive_layer_drop": "layer dropping",
    "elasticity": "an elastic batch", "quantize_training": "quantized training", "sparse_gradients": "sparse gradients",
    "managed_gradient_accumulation": "DeepSpeed-managed gradient accumulation", "expert_parallel": "expert parallelism",
}



def read(path: str, hidden: int) -> ZeroConfig:
    """The ZeroConfig a DeepSpeed config file describes, for a model of hidden size ``hidden``: DeepSpeed's JSON, or
    an accelerate config (YAML) of distributed_type DEEPSPEED."""
    if str(path).endswith((".yaml", ".yml")):
        return _accelerate(path, hidden)
    return from_dict(_json(path), hidden, source=path)


def _json(path: str) -> dict:
    """A DeepSpeed config file's JSON object."""
    try:
        with open(path) as file:
            config = json.load(file)
    except OSError as error:
        raise SpecError(f"--deepspeed {path}: {error.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        where = f" (line {error.lineno})" if isinstance(error, json.JSONDecodeError) else ""
        raise SpecError(f"--deepspeed {path} is not JSON{where}: give DeepSpeed's JSON config (an accelerate YAML "
                        "names it in deepspeed_config.deepspeed_config_file)") from None
    if not isinstance(config, dict):
        raise SpecError(f"--deepspeed {path} must hold a JSON object, the DeepSpeed config")
    return config


#: an accelerate config's deepspeed_config keys (accelerate 16cb6eb8, utils/launch.py, prepare_deepspeed_cmd_env: each
#: an ACCELERATE_ variable that utils/dataclasses.py's DeepSpeedPlugin reads): what actmem reads, and what changes
#: no memory it counts; any other is refused by name
ACCELERATE_READ = ("zero_stage", "offload_optimizer_device", "offload_param_device", "gradient_accumulation_steps",
                   "deepspeed_config_file", "zero3_save_16bit_model")
ACCELERATE_NO_MEMORY = ("gradient_clipping", "zero3_init_flag", "deepspeed_multinode_launcher", "deepspeed_hostfile",
                        "deepspeed_exclusion_filter", "deepspeed_inclusion_filter", "offload_optimizer_nvme_path",
                        "offload_param_nvme_path")
#: ... and those accelerate refuses beside a deepspeed_config_file (DeepSpeedPlugin._deepspeed_config_checks; the
#: YAML's mixed_precision too: commands/launch.py, launch_command)
ACCELERATE_NOT_WITH_A_FILE = ("gradient_accumulation_steps", "gradient_clipping", "zero_stage",
                              "offload_optimizer_device", "offload_param_device", "offload_param_nvme_path",
                              "offload_optimizer_nvme_path", "zero3_save_16bit_model")


def _accelerate(path: str, hidden: int) -> ZeroConfig:
    """An accelerate config (``accelerate launch --config_file``) of distributed_type DEEPSPEED: its
    deepspeed_config_file read as DeepSpeed's JSON, or else the config DeepSpeedPlugin.__post_init__ writes from its
    deepspeed_config (zero_stage, 2 when absent; the offload devices; gradient_accumulation_steps, "auto" when
    absent; the batch left "auto" for the Trainer) with bf16 where mixed_precision is bf16; num_processes, the
    GPUs it launches."""
    import yaml

    try:
        with open(path) as file:
            config = yaml.safe_load(file)
    except OSError as error:
        raise SpecError(f"--deepspeed {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise SpecError(f"--deepspeed {path} is not YAML ({str(error).splitlines()[0]}): give DeepSpeed's JSON config "
                        "or accelerate's YAML") from None
    if not isinstance(config, dict) or config.get("distributed_type") != "DEEPSPEED":
        kind = config.get("distributed_type") if isinstance(config, dict) else None
        raise SpecError(f"--deepspeed {path}: an accelerate config of distributed_type {kind!r}; actmem reads "
                        "DEEPSPEED's (accelerate's FSDP is not modelled)")
    plugin = config.get("deepspeed_config") or {}
    unknown = sorted(set(plugin) - set(ACCELERATE_READ) - set(ACCELERATE_NO_MEMORY))
    if unknown:
        raise SpecError(f"--deepspeed {path}: deepspeed_config's {', '.join(unknown)}: not read by actmem (it reads "
                        f"{', '.join(ACCELERATE_READ)})")
    gpus = config.get("num_processes")
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1):
        raise SpecError(f"--deepspeed {path}: num_processes must be a positive integer, got {gpus!r}")
    precision = str(config.get("mixed_precision", "no")).lower()
    if precision not in ("bf16", "no"):
        raise SpecError(f"--deepspeed {path}: mixed_precision {precision}: actmem prices bf16 training only")
    if plugin.get("deepspeed_config_file") not in (None, "none"):
        return _accelerate_file(path, plugin, config, gpus, hidden)
    offloaded = [key for key in ("offload_optimizer_device", "offload_param_device")
                 if str(plugin.get(key, "none")).lower() != "none"]
    if offloaded:
        raise SpecError(f"--deepspeed {path}: {', '.join(f'{key} {plugin[key]}' for key in offloaded)}: ZeRO-Offload "
                        "is not modelled yet (none prices the GPU-only run)")
    written = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
               "gradient_accumulation_steps": plugin.get("gradient_accumulation_steps", "auto"),
               "zero_optimization": {"stage": plugin.get("zero_stage", 2),
                                     "stage3_gather_16bit_weights_on_model_save":
                                         bool(plugin.get("zero3_save_16bit_model", False))}}
    if precision == "bf16":
        written["bf16"] = {"enabled": True}
    zero = from_dict(written, hidden, source=path)
    return replace(zero, gpus=gpus, notes=zero.notes + (
        f"{path}: accelerate's DeepSpeedPlugin writes the DeepSpeed config from its deepspeed_config "
        f"(zero_stage {written['zero_optimization']['stage']}, DeepSpeed's defaults for the rest)",))


def _accelerate_file(path: str, plugin: dict, config: dict, gpus, hidden: int) -> ZeroConfig:
    """An accelerate config that names its deepspeed_config_file: that file, with gradient_accumulation_steps 1
    where it gives none (DeepSpeedPlugin.__post_init__); the settings accelerate refuses beside a file refused."""
    beside = [key for key in ACCELERATE_NOT_WITH_A_FILE if key in plugin] + (
        ["mixed_precision"] if config.get("mixed_precision") is not None else [])
    if beside:
        raise SpecError(f"--deepspeed {path}: {', '.join(beside)} beside deepspeed_config_file: accelerate refuses "
                        "them (they belong in the DeepSpeed config file)")
    file = plugin["deepspeed_config_file"]
    written = {"gradient_accumulation_steps": 1} | _json(file)
    zero = from_dict(written, hidden, source=file)
    return replace(zero, gpus=gpus, source=path, notes=zero.notes + (
        f"{path}: accelerate's deepspeed_config_file, {file}, read as DeepSpeed's config"
        + ("" if "gradient_accumulation_steps" in _json(file) else
           ", gradient_accumulation_steps 1 where it gives none (as accelerate sets it)"),))


def from_dict(config: dict, hidden: int, source: str = "the DeepSpeed config") -> ZeroConfig:
    """The ZeroConfig of a DeepSpeed config (a dict): SpecError naming what cannot be priced."""
    refused = [f"{key} ({why})" for key, why in TOP_UNMODELLED.items() if key in config]
    if refused:
        raise SpecError(f"{source}: {', '.join(refused)} change{'s' if len(refused) == 1 else ''} what a rank keeps "
                        "in ways actmem does not model yet: remove to price the rest")
    zero = _zero_section(config, source)
    stage = _integer(zero.get("stage"), "zero_optimization.stage", source)
    if stage not in (1, 2, 3):
        raise SpecError(f"{source}: zero_optimization.stage {stage}: actmem prices ZeRO stages 1, 2 and 3 "
                        "(stage 0 is DeepSpeed without ZeRO, not modelled; plain data parallelism is "
                        "--implementation hf without --deepspeed)")
    notes = _precision(config, source)
    _modelled_only(zero, stage, source)
    if stage < 3:         # trainer_config_finalize fills these only at stage 3; DeepSpeed's int fields refuse "auto"
        left = [key for key in ALIASES.values() if zero.get(key) == "auto"]
        if left:
            raise SpecError(f"{source}: zero_optimization's {', '.join(left)} \"auto\" at ZeRO-{stage}: the Trainer "
                            "fills them only at stage 3, and DeepSpeed refuses the string: remove them")
    auto, values = [], {}
    for key, default, resolved in (("reduce_bucket_size", REDUCE_BUCKET_SIZE, hidden * hidden),
                                   ("param_persistence_threshold", PERSISTENCE_THRESHOLD, 10 * hidden)):
        value = zero.get(key, default)
        if value == "auto":          # trainer_config_finalize: hidden_size², and ZeRO-3's 10·hidden_size
            value = resolved
            auto.append((key, resolved))
        values[key] = _integer(value, f"zero_optimization.{key}", source)
    if values["reduce_bucket_size"] > LARGEST_BUCKET:
        raise SpecError(f"{source}: zero_optimization.reduce_bucket_size {values['reduce_bucket_size']:.3g} elements "
                        f"is more than any GPU holds (at most {LARGEST_BUCKET:.0e})")
    unknown = sorted(set(config) - set(TOP_READ) - TOP_NO_MEMORY)
    if unknown:
        notes += (f"{source}'s {', '.join(unknown)}: keys neither DeepSpeed {DEEPSPEED_VERSION} nor actmem reads "
                  "(DeepSpeed ignores them)",)
    batch = {key: _batch_value(config, key, source) for key in
             ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")}
    return ZeroConfig(stage, values["reduce_bucket_size"], values["param_persistence_threshold"],
                      _integer(zero.get("sub_group_size", SUB_GROUP_SIZE), "zero_optimization.sub_group_size", source),
                      _integer(zero.get("max_reuse_distance", MAX_REUSE_DISTANCE),
                               "zero_optimization.stage3_max_reuse_distance", source),
                      _flag(zero.get("round_robin_gradients", False), "zero_optimization.round_robin_gradients",
                            source),
                      _flag(zero.get("overlap_comm", stage == 3), "zero_optimization.overlap_comm", source),
                      _optimizer(config, source), source, tuple(auto), batch["train_micro_batch_size_per_gpu"],
                      batch["gradient_accumulation_steps"], batch["train_batch_size"], notes)


def _zero_section(config: dict, source: str) -> dict:
    """zero_optimization with its stage3_ aliases under DeepSpeed's field names; every key DeepSpeedZeroConfig
    does not have refused at once (DeepSpeed refuses them too)."""
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict) or "stage" not in zero:
        raise SpecError(f"{source} sets no zero_optimization.stage: actmem prices ZeRO stages 1, 2 and 3 "
                        "(plain data parallelism is --implementation hf without --deepspeed)")
    named = {}
    for key, value in zero.items():
        name = ALIASES.get(key, key)
        if name in named and named[name] != value:
            raise SpecError(f"{source}: zero_optimization sets {name} twice ({key} too) and the values disagree")
        named[name] = value
    known = set(ZERO_READ) | set(ZERO_NO_MEMORY) | set(ZERO_MODELLED_ONLY)
    unknown = sorted(set(named) - known)
    if unknown:
        raise SpecError(f"{source}: zero_optimization.{', zero_optimization.'.join(unknown)}: not settings of "
                        f"DeepSpeed {DEEPSPEED_VERSION}'s ZeRO (it refuses them too)")
    return named


def _integer(value, key: str, source: str) -> int:
    """A count, 0 or more: JSON's 5e8 is a float, which DeepSpeed takes as the integer it is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 0:
        raise SpecError(f"{source}: {key} must be a whole number, 0 or more, got {json.dumps(value)}")
    return int(value)


def _flag(value, key: str, source: str) -> bool:
    if not isinstance(value, bool):
        raise SpecError(f"{source}: {key} must be true or false, got {json.dumps(value)}")
    return value


def _batch_value(config: dict, key: str, source: str) -> int | None:
    value = config.get(key, "auto")
    return None if value == "auto" else _integer(value, key, source)


def _precision(config: dict, source: str) -> tuple:
    """bf16, as actmem prices the layers: fp16 (loss-scaled, other buffers), autocast and fp32 training refused;
    the notes of what was taken as bf16."""
    if "amp" in config:
        raise SpecError(f"{source}: amp is not a setting of DeepSpeed {DEEPSPEED_VERSION} (it refuses it): remove it")
    sections = {}
    for key in ("bf16", "fp16", "torch_autocast"):
        section = config.get(key)
        if section is not None and not isinstance(section, dict):
            raise SpecError(f"{source}: {key} must be an object such as {{\"enabled\": true}}, got {json.dumps(section)}")
        sections[key] = section
    if (sections["fp16"] or {}).get("enabled", False) not in (False, "auto"):
        raise SpecError(f"{source} enables fp16: actmem prices bf16 training under ZeRO (fp16's loss scaling keeps "
                        "other buffers, not read yet): set bf16.enabled")
    if (sections["torch_autocast"] or {}).get("enabled", False):
        raise SpecError(f"{source} enables torch_autocast: fp32 weights under autocast are not modelled; actmem "
                        "prices bf16.enabled")
    extra = sorted(set(sections["bf16"] or {}) - {"enabled", "check_grad_overflow", "immediate_grad_update"})
    if extra:
        raise SpecError(f"{source}: bf16.{', bf16.'.join(extra)} keep{'s' if len(extra) == 1 else ''} bf16 master "
                        "weights, gradients or optimizer states, not modelled: remove to price fp32 ones")
    if sections["bf16"] is None:
        return (f"{source} has no bf16 section: priced as bf16, which the Trainer's --bf16 adds (accelerate's "
                "DeepSpeedPlugin.set_mixed_precision)",)
    enabled = sections["bf16"].get("enabled", False)
    if enabled is False:
        raise SpecError(f"{source}: bf16.enabled is false (DeepSpeed's default where the section does not set it): "
                        "fp32 training is not modelled; set it true, or \"auto\" with the Trainer's --bf16")
    if enabled not in (True, "auto"):
        raise SpecError(f"{source}: bf16.enabled must be true, false or \"auto\", got {json.dumps(enabled)}")
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
    return (f"{source}'s bf16.enabled \"auto\": priced as the Trainer's --bf16 sets it",) if enabled == "auto" else ()


def _modelled_only(zero: dict, stage: int, source: str) -> None:
    """The settings actmem models at DeepSpeed's default alone: another value refused (all of them, by name)."""
    off = []
    for key, default in ZERO_MODELLED_ONLY.items():
        value = zero.get(key, default)
        if isinstance(value, dict) and set(value) <= {"device", "pin_memory", "nvme_path", "buffer_count",
                                                      "buffer_size", "max_in_cpu", "pipeline_read", "pipeline_write",
                                                      "fast_init", "ratio"}:
            value = None if value.get("device", "none") in (None, "none") else value      # offload to 'none'
        if value != default:
            off.append(f"{key} {json.dumps(value)}")
    if off:
        raise SpecError(f"{source}: zero_optimization's {', '.join(off)} change{'s' if len(off) == 1 else ''} the "
                        "buffers a rank keeps in ways actmem does not model yet (offloading, quantized or hierarchical "
                        "partitions, ...): remove to price the GPU-only run")


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
