"""Adam's state a parameter keeps: a master weight and two moments, each in its dtype.

Megatron's mixed-precision Adam keeps an fp32 master copy of each 16-bit weight and two fp32
moments: 12 bytes a parameter (widths.OPTIMIZER_BYTES). With --use-precision-aware-optimizer
(the distributed optimizer only: megatron/core/optimizer/__init__.py raises otherwise),
Megatron makes no fp32 master copy (distrib_optimizer.py: shard_main_param = None) and
Transformer Engine's FusedAdam keeps the state in the dtypes asked for
(transformer_engine/pytorch/optimizers/fused_adam.py, _initialize_state):

- the master weight in --main-params-dtype: fp16 is 2 bytes; fp32 beside bf16 weights is the
  16 bits the bf16 weight lacks (store_param_remainders, Megatron's OptimizerConfig default,
  TE >= 2.1: an int16 tensor, 2 bytes), beside fp16 weights a whole fp32 copy (4 bytes);
- exp_avg and exp_avg_sq in --exp-avg-dtype / --exp-avg-sq-dtype: fp32 4, fp16 and bf16 2,
  fp8 1 byte (a Float8Tensor of uint8 data).

A non-fp32 state also keeps an fp32 scale a parameter tensor (4 bytes, and the fp8 moments'
amax and scale_inv): a few bytes a tensor, named and not counted. Megatron asserts the dtypes
stay fp32 without the precision-aware optimizer (optimizer_config.py, __post_init__).
"""

from dataclasses import dataclass

from actmem.errors import SpecError

#: bytes an element of each dtype an optimizer state may take
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
MAIN_PARAMS_DTYPES = ("fp32", "fp16")
MOMENT_DTYPES = ("fp32", "fp16", "bf16", "fp8")
PARAMS_DTYPES = ("bf16", "fp16")


@dataclass(frozen=True)
class OptimizerState:
    precision_aware: bool = False
    """--use-precision-aware-optimizer: TE's FusedAdam keeps the master weight and moments."""
    main_params: str = "fp32"
    exp_avg: str = "fp32"
    exp_avg_sq: str = "fp32"
    params: str = "bf16"
    """The 16-bit weights' dtype (Megatron's --bf16 or --fp16): remainders only beside bf16."""
    fp8_recipe: str | None = None
    """The run's FP8 recipe (Architecture.fp8), or None: under a recipe but delayed, with fp32 main params, Megatron
    keeps its own fp32 master shard and hands TE's FusedAdam no master (optimizer_config.py, __post_init__:
    use_precision_aware_optimizer_no_fp8_or_ds_fp8 False; distrib_optimizer.py: shard_main_param)."""

    def __post_init__(self):
        for name, allowed in (("main_params", MAIN_PARAMS_DTYPES), ("exp_avg", MOMENT_DTYPES),
                              ("exp_avg_sq", MOMENT_DTYPES), ("params", PARAMS_DTYPES)):
            if getattr(self, name) not in allowed:
                raise SpecError(f"{name} dtype must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        lowered = [f"--{name.replace('_', '-')}-dtype {getattr(self, name)}"
                   for name in ("main_params", "exp_avg", "exp_avg_sq") if getattr(self, name) != "fp32"]
        if lowered and not self.precision_aware:
            raise SpecError(f"{', '.join(lowered)} needs --use-precision-aware-optimizer (Megatron asserts the "
                            "optimizer state stays fp32 without it: optimizer_config.py)")

    @property
    def megatron_master(self) -> bool:
        """The precision-aware optimizer beside an FP8 recipe but delayed, with fp32 main params: Megatron's own
        fp32 master shard, 4 bytes (fp8_recipe)."""
        return self.precision_aware and self.main_params == "fp32" and self.fp8_recipe not in (None, "delayed")

    @property
    def remainders(self) -> bool:
        """TE keeps only the trailing 16 bits of the fp32 master weight (store_param_remainders)."""
        return self.precision_aware and self.main_params == "fp32" and self.params == "bf16" and not self.megatron_master

    @property
    def master_bytes(self) -> int:
        return 2 if self.remainders else DTYPE_BYTES[self.main_params]

    @property
    def bytes_per_parameter(self) -> int:
        """Bytes of Adam's state a parameter: 12 for Megatron's default."""
        return self.master_bytes + DTYPE_BYTES[self.exp_avg] + DTYPE_BYTES[self.exp_avg_sq]

    @property
    def unscaled_states(self) -> tuple:
        """The states FusedAdam's step copies to fp32 before its kernel, all of a parameter group
        at once (fused_adam.py, step: get_unscaled_state's .float()): those neither fp32, nor bf16
        beside a bf16 partner (fuse_unscale), nor the master's remainders."""
        fused = self.exp_avg == self.exp_avg_sq == "bf16"
        states = [name for name in ("exp_avg", "exp_avg_sq")
                  if getattr(self, name) != "fp32" and not fused]
        if self.main_params != "fp32":              # fp16: the remainders are fp32's alone
            states.insert(0, "master_param")
        return tuple(states)

    def describe(self) -> str:
        """'12 B fp32 master weight and Adam moments', or the precision-aware optimizer's parts."""
        if not self.precision_aware:
            return f"{self.bytes_per_parameter} B fp32 master weight and Adam moments"
        master = ("2 B master-weight remainder (the 16 bits a bf16 weight lacks: TE's store_param_remainders)"
                  if self.remainders else
                  f"4 B fp32 master weight, Megatron's own under FP8's {self.fp8_recipe} recipe (optimizer_config.py: "
                  f"use_precision_aware_optimizer_no_fp8_or_ds_fp8)" if self.megatron_master else
                  f"{self.master_bytes} B {self.main_params} master weight")
        return (f"{self.bytes_per_parameter} B of TE's precision-aware Adam: {master}, "
                f"{DTYPE_BYTES[self.exp_avg]} B {self.exp_avg} exp_avg, "
                f"{DTYPE_BYTES[self.exp_avg_sq]} B {self.exp_avg_sq} exp_avg_sq")

    def notes(self, shard_parameters: int) -> list[str]:
        """What the estimate names and does not count, for a stage whose optimizer shard holds
        ``shard_parameters``."""
        if not self.precision_aware:
            return []
        notes = ["the precision-aware optimizer (TE's FusedAdam, TE >= 2.1 for the remainders): a non-fp32 "
                 "state's fp32 scale, and an fp8 moment's amax and scale_inv, a few bytes a parameter tensor, "
                 "not counted"]
        if self.unscaled_states:
            notes.append(f"the optimizer step copies {', '.join(self.unscaled_states)} to fp32 for its kernel "
                         f"(fused_adam.py, step), 4 B a parameter each, "
                         f"{4 * len(self.unscaled_states) * shard_parameters:,} B for this shard, after the "
                         "backward has freed the activations: that moment is not counted in the peak floor")
        return notes
