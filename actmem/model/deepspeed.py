"""DeepSpeed's ZeRO as the Hugging Face Trainer runs it: the settings that shape what a data-parallel
rank keeps, read off a DeepSpeed config file (``--deepspeed ds_config.json``, the Trainer's own flag) or
given as a stage alone (``--zero-stage N``, DeepSpeed's defaults for the rest).

Read at DeepSpeed 0.19.8 (runtime/zero/config.py, DeepSpeedZeroConfig) and transformers 5.23
(integrations/deepspeed.py, HfTrainerDeepSpeedConfig.trainer_config_finalize). Every key of the file is
either read (it changes memory and actmem models it), named as changing no memory actmem counts, or
refused with its name: a setting actmem has not read cannot pass silently (actmem.sources.deepspeed_config).
"""

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
    round_robin: bool = False
    """round_robin_gradients: each group's parameters laid out every N-th first (stages 1 and 2), which changes
    the parameters in rank 0's partition, not its size."""
    overlap_comm: bool = False
    """At stages 1 and 2, a second reduce bucket (stage_1_and_2.py, setup_buckets: double buffers) and, at stage 1,
    the reduce inside the backward; stage 3 overlaps whatever it says (its default: True), on a GPU's side streams."""
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
    notes: tuple = ()
    """What the file left to the Trainer that actmem assumed (bf16), and the keys it accepted unread."""
    gpus: int | None = None
    """The processes an accelerate config launches (num_processes), where it was one."""

    def __post_init__(self):
        if self.stage not in (1, 2, 3):
            raise SpecError(f"ZeRO stage must be 1, 2 or 3, got {self.stage!r}")
        if isinstance(self.reduce_bucket_size, bool) or not isinstance(self.reduce_bucket_size, int) \
                or self.reduce_bucket_size < 1:
            raise SpecError(f"zero_optimization.reduce_bucket_size must be a positive number of elements, got "
                            f"{self.reduce_bucket_size!r}")
        for name, key in (("persistence_threshold", "stage3_param_persistence_threshold"),
                          ("reuse_distance", "stage3_max_reuse_distance"), ("sub_group_size", "sub_group_size")):
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


def zero_from_run(run: dict) -> None:
    """A run's two spellings of its ZeRO config (zero_stage; deepspeed: a config file as
    actmem.sources.deepspeed_config read it) made one ``zero`` in place, and the batch the file gives
    (train_micro_batch_size_per_gpu, gradient_accumulation_steps, train_batch_size) set where the run does not; a
    value both give must agree."""
    stage, config = run.pop("zero_stage", None), run.pop("deepspeed", None)
    if config is None:
        if stage is not None:
            run["zero"] = stage_only(stage)
        return
    if not isinstance(config, ZeroConfig):
        raise SpecError(f"deepspeed must be a DeepSpeed config read by --deepspeed, got {config!r}")
    path = config.source
    if stage is not None and stage != config.stage:
        raise SpecError(f"--zero-stage {stage} and --deepspeed {path} (zero_optimization.stage {config.stage}) "
                        "disagree; give the stage once")
    _agree(run, "gpus", config.gpus, "--gpus", "num_processes", path)
    _agree(run, "micro_batch", config.micro_batch, "--micro-batch-size", "train_micro_batch_size_per_gpu", path)
    micro, gpus = run.get("micro_batch", 1), run.get("gpus")
    implied = (micro * config.accumulation * gpus if config.accumulation is not None and gpus is not None
               else None)
    if None not in (implied, config.train_batch) and implied != config.train_batch:
        raise SpecError(f"--deepspeed {path}: train_batch_size {config.train_batch} is not train_micro_batch_size_per_gpu "
                        f"· gradient_accumulation_steps · GPUs = {micro} · {config.accumulation} · {gpus} = {implied} "
                        "(DeepSpeed refuses it too)")
    _agree(run, "global_batch", config.train_batch if config.train_batch is not None else implied,
           "--global-batch-size", "train_batch_size" if config.train_batch is not None else
           "train_micro_batch_size_per_gpu · gradient_accumulation_steps · GPUs", path)
    run["zero"] = config


def _agree(run: dict, key: str, value, flag: str, name: str, path: str) -> None:
    if value is None:
        return
    if run.get(key) is not None and run[key] != value:
        raise SpecError(f"{flag} {run[key]} and --deepspeed {path} ({name}: {value}) disagree; give it once")
    run[key] = value
