"""What a run recomputes, as one value with one parser and one label.

Megatron spells it with four arguments: --recompute-granularity (none, selective, full),
--recompute-modules (what selective recompute reruns: core_attn, the default and the
paper's, layernorm, mlp), and --recompute-method with --recompute-num-layers (how full
recompute groups its checkpoints: every layer alone, the paper's; uniform groups of N; or
the first N layers of each model chunk, block). A ``RecomputePolicy`` is the four at once;
its ``label`` is what every output writes and ``parse`` reads back:

    none · selective · selective:core_attn+mlp · full · full:block=2 · full:uniform=3 · selective:op

and ``word`` is the planner's short form ('sel', 'sel+mlp', 'mlp', 'block=2').

``selective:op`` is torchtitan's per-op selective activation checkpointing (activation_checkpoint.mode
"selective", selective_ac_option "op"), which torch-native runs: every block is checkpointed and rerun whole,
as under full recompute, and its checkpoint keeps the outputs of the ops torchtitan's save list names beside
the block's input (``ops``). It has full recompute's granularity, so everything that reruns a layer whole
treats it so; the term table's rows say which tensors those ops make (Term.op_saved). ``selective:every=N`` is
torchtitan's other selective option, a positive int N: every N-th block checkpointed whole, the others kept
whole (_apply_layer_sac), full recompute's third method beside Megatron's uniform and block.
"""

from dataclasses import dataclass
from enum import Enum

from actmem.errors import SpecError

class Recompute(Enum):
    """Activation recomputation (section 5)."""

    NONE = "none"
    SELECTIVE = "selective"
    """Recompute the modules Megatron's --recompute-modules names (the attention core, QKᵀ,
    softmax, dropout, ·V, by default: the paper's selective recompute); keep the rest."""
    FULL = "full"
    """Recompute the whole layer; keep only its input (checkpoint)."""


#: Megatron's --recompute-modules actmem models (TransformerConfig.recompute_modules), in its order;
#: core_attn is its default and the paper's selective recompute; mla_up_proj is multi-latent attention's;
#: moe (the whole MoE layer), moe_act (the experts' activation) and shared_experts a mixture of experts'
#: (moe_layer.py, experts.py)
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
#: the modules whose code runs inside another's: the moe module's checkpoint wraps the whole MoE layer, its
#: shared experts and its experts' activation too (moe_layer.py, forward)
INSIDE = {"moe_act": "moe", "shared_experts": "moe"}
#: the modules whose rerun comes in parts, each at a moment of its own: --recompute-modules layernorm checkpoints
#: the input norm and the pre-MLP norm apart (transformer_layer.py: input_layernorm_checkpoint,
#: pre_mlp_norm_checkpoint, each a CheckpointWithoutOutput), the input norm's rerun hooked on the attention's
#: output gradient, the pre-MLP norm's on the MLP's (discard_output_and_register_recompute)
PARTS = {"layernorm": ("input_layernorm", "pre_mlp_layernorm")}
_PART_OF = {part: module for module, parts in PARTS.items() for part in parts}


def reruns(given: str, module: str | None) -> bool:
    """Whether recomputing ``given`` drops a row that ``module`` drops: the module itself, one inside it, or one
    of its parts."""
    return module is not None and (module == given or INSIDE.get(module) == given or _PART_OF.get(module) == given)


def rerun_units(modules) -> tuple:
    """What a selective recompute of ``modules`` reruns one at a time, in the order given: each module, or each
    part of one rerun in parts (layernorm's two norms)."""
    return tuple(part for module in modules for part in PARTS.get(module, (module,)))


def remakes(given: str, module: str | None, modules) -> bool:
    """Whether ``given``'s rerun makes again, and holds at its end, a row ``module`` drops: its own, or one of a
    module inside it that is not recomputed itself (a recomputed one's checkpoint runs inside the rerun and keeps
    only its input, or frees its output once used: moe_layer.py, experts.py)."""
    return module is not None and (module == given or (INSIDE.get(module) == given and module not in modules))
DEFAULT_MODULES = frozenset({"core_attn"})

METHODS = ("uniform", "block", "every")
#: the methods Megatron's --recompute-method names; 'every' is torchtitan's layer option (selective:every=N)
MEGATRON_METHODS = ("uniform", "block")
_FORMS = "give none, selective[:modules], selective:op, selective:every=N or full[:block=N|:uniform=N]"
#: torchtitan's activation_checkpoint.selective_ac_option that actmem models: "op", the per-op policy
#: (distributed/activation_checkpoint.py @018740b7, _apply_op_sac)
OP = "op"


@dataclass(frozen=True)
class RecomputePolicy:
    granularity: Recompute = Recompute.NONE
    modules: frozenset = DEFAULT_MODULES
    """Selective recompute's modules (Megatron's default, core_attn, otherwise)."""
    method: str = "uniform"
    """Full recompute's grouping: 'uniform' (groups of ``layers``) or 'block'."""
    layers: int = 1
    """Full recompute's N: uniform with N = 1 is every layer alone, the paper's."""
    ops: bool = False
    """torchtitan's per-op selective checkpointing (selective:op): every layer checkpointed alone, the
    checkpoint keeping the outputs of the ops in torchtitan's _op_sac_save_list besides the input."""

    def __post_init__(self):
        if not isinstance(self.granularity, Recompute):
            raise SpecError(f"recompute must be one of none, selective, full; got {self.granularity!r}")
        object.__setattr__(self, "modules", frozenset(self.modules))
        unknown = sorted(self.modules - set(RECOMPUTE_MODULES))
        if unknown or not self.modules:
            raise SpecError(f"recompute modules must be some of {', '.join(RECOMPUTE_MODULES)}; got "
                            f"{', '.join(unknown) or 'none'}")
        if self.method not in METHODS or isinstance(self.layers, bool) or not isinstance(self.layers, int) \
                or self.layers < 1:
            raise SpecError(f"recompute method must be uniform, block or every with N >= 1; got {self.method} "
                            f"{self.layers!r}")
        if self.modules != DEFAULT_MODULES and self.granularity is not Recompute.SELECTIVE:
            raise SpecError("recompute modules choose what selective recompute reruns; this is "
                            f"{self.granularity.value}")
        if (self.method, self.layers) != ("uniform", 1) and self.granularity is not Recompute.FULL:
            raise SpecError(f"a recompute method groups full recompute; this is {self.granularity.value}")
        if self.ops and (self.granularity is not Recompute.FULL or self.partial):
            raise SpecError("torchtitan's per-op checkpointing checkpoints every layer alone")

    @property
    def ordered_modules(self) -> tuple:
        """The modules in Megatron's order (core_attn, layernorm, mlp)."""
        return tuple(module for module in RECOMPUTE_MODULES if module in self.modules)

    @property
    def partial(self) -> bool:
        """Full recompute other than every layer checkpointed alone."""
        return self.granularity is Recompute.FULL and (self.method, self.layers) != ("uniform", 1)

    @property
    def label(self) -> str:
        """The one text form: 'selective:core_attn+mlp', 'full:block=2', 'selective:op', 'selective:every=2'."""
        if self.ops:
            return f"selective:{OP}"
        if self.method == "every":
            return f"selective:every={self.layers}"
        if self.modules != DEFAULT_MODULES:
            return f"selective:{'+'.join(self.ordered_modules)}"
        if self.partial:
            return f"full:{self.method}={self.layers}"
        return self.granularity.value

    @property
    def word(self) -> str:
        """The planner's short form in a configuration's label ('t=8 p=8 b=1 sp sel+mlp')."""
        if self.partial:
            return f"{self.method}={self.layers}"
        if self.ops:
            return OP
        if self.granularity is not Recompute.SELECTIVE:
            return self.granularity.value
        return {DEFAULT_MODULES: "sel", frozenset({"core_attn", "mlp"}): "sel+mlp",
                frozenset({"mlp"}): "mlp"}.get(self.modules, f"sel:{'+'.join(self.ordered_modules)}")

    @classmethod
    def parse(cls, text: str) -> "RecomputePolicy":
        """The label back: 'none', 'selective', 'selective:mlp', 'full', 'full:block=2'."""
        granularity, _, shape = str(text).partition(":")
        try:
            kind = Recompute(granularity)
        except ValueError:
            raise SpecError(f"recompute {text!r}: {_FORMS}") from None
        if not shape:
            return cls(kind)
        if kind is Recompute.SELECTIVE and shape == OP:
            return cls(Recompute.FULL, ops=True)
        method, _, layers = shape.partition("=")
        if kind is Recompute.SELECTIVE and method == "every" and layers.isdecimal():
            return cls(Recompute.FULL, method=method, layers=int(layers))
        if kind is Recompute.SELECTIVE:
            return cls(kind, frozenset(shape.split("+")))
        if kind is not Recompute.FULL or not layers.isdecimal() or method not in MEGATRON_METHODS:
            raise SpecError(f"recompute {text!r}: {_FORMS}")
        return cls(kind, method=method, layers=int(layers))

    @classmethod
    def of_run(cls, recompute, method=None, layers=None, modules=None, option=None) -> "RecomputePolicy":
        """From Megatron's four settings as a Run holds them (None: Megatron's default), and torchtitan's
        selective_ac_option (``option``: 'op' with selective recompute is its per-op checkpointing)."""
        if option is not None and getattr(recompute, "value", recompute) == Recompute.SELECTIVE.value \
                and not modules and not method:
            if option == OP:
                return cls(Recompute.FULL, ops=True)
            if str(option).isdecimal() and int(option) > 0:
                return cls(Recompute.FULL, method="every", layers=int(option))
        return cls(Recompute(getattr(recompute, "value", recompute)), DEFAULT_MODULES if modules is None else
                   frozenset(modules), method or "uniform", layers or 1)

    @property
    def run_values(self) -> dict:
        """The Run's four settings (actmem.model.spec.Run), and torchtitan's option where the policy is its
        selective checkpointing (its selective mode with selective_ac_option op or N)."""
        option = OP if self.ops else str(self.layers) if self.method == "every" else None
        megatron = self.partial and not option
        values = {"recompute": Recompute.SELECTIVE.value if option else self.granularity.value,
                  "recompute_modules": None if self.modules == DEFAULT_MODULES else self.ordered_modules,
                  "recompute_method": self.method if megatron else None,
                  "recompute_layers": self.layers if megatron else None}
        return values | {"selective_ac_option": option} if option else values

    @property
    def megatron_flags(self) -> str:
        """How Megatron spells the shape: '--recompute-modules core_attn mlp',
        '--recompute-method block --recompute-num-layers 2' ('' for none, plain selective and full)."""
        if self.modules != DEFAULT_MODULES:
            return f"--recompute-modules {' '.join(self.ordered_modules)}"
        if self.partial and self.method in MEGATRON_METHODS:
            return f"--recompute-method {self.method} --recompute-num-layers {self.layers}"
        return ""

    def whole(self) -> "RecomputePolicy":
        """Nothing recomputed: what a layer kept whole keeps."""
        return RecomputePolicy()


NONE = RecomputePolicy()
SELECTIVE = RecomputePolicy(Recompute.SELECTIVE)
FULL = RecomputePolicy(Recompute.FULL)
OP_CHECKPOINTING = RecomputePolicy(Recompute.FULL, ops=True)
"""torchtitan's per-op selective checkpointing (selective:op)."""
