"""The six techniques of Table 2, as switches, and full recompute under sequence parallelism."""

from dataclasses import dataclass, replace
from typing import NamedTuple

from actmem.terms import DEFAULT_MODULES, RECOMPUTE_MODULES, Recompute, Term


@dataclass(frozen=True)
class Technique:
    name: str
    tensor_parallel: bool
    """Split the attention and MLP blocks t ways (Figure 4)."""
    sequence_parallel: bool
    """Split the block boundaries along the sequence t ways (Figure 5)."""
    recompute: Recompute
    label: str
    recompute_method: str = "uniform"
    """Full recompute as Megatron groups it: 'uniform' checkpoints groups of
    ``recompute_layers`` layers (each keeps its group's input); 'block' checkpoints the
    first ``recompute_layers`` layers of each model chunk and keeps everything of the rest."""
    recompute_layers: int = 1
    """N of --recompute-num-layers; uniform with N = 1 is every layer alone (the paper's)."""
    recompute_modules: frozenset = DEFAULT_MODULES
    """Selective recompute as Megatron chooses it (--recompute-modules): the modules whose
    checkpoints drop their rows (Term.module). core_attn, the default, is the paper's."""

    def drops(self, term: Term, arch) -> bool:
        """Whether selective recompute recomputes this row of this architecture rather than keep
        it, or leaves out a row that only a module's checkpoint keeps (Term.kept_by) because
        that module is not recomputed."""
        if self.recompute is not Recompute.SELECTIVE:
            return False
        kept_by = term.kept_by_for(arch)
        if kept_by is not None and kept_by not in self.recompute_modules:
            return True
        return term.module_of(arch) in self.recompute_modules

    @property
    def modules(self) -> tuple:
        """The recompute modules in Megatron's order ('core_attn', 'layernorm', 'mlp')."""
        return tuple(module for module in RECOMPUTE_MODULES if module in self.recompute_modules)

    @property
    def partial(self) -> bool:
        """Full recompute other than every layer checkpointed alone."""
        return self.recompute is Recompute.FULL and (self.recompute_method, self.recompute_layers) != ("uniform", 1)

    def whole(self) -> "Technique":
        """The same switches with nothing recomputed: what a layer kept whole keeps."""
        return replace(self, recompute=Recompute.NONE, recompute_method="uniform", recompute_layers=1,
                       recompute_modules=DEFAULT_MODULES)

    def __post_init__(self):
        if self.sequence_parallel and not self.tensor_parallel:
            raise ValueError(f"{self.name}: sequence parallelism runs inside a tensor-parallel group")


TABLE_2 = (
    Technique("none", False, False, Recompute.NONE, "no parallelism (Eq 1)"),
    Technique("tp", True, False, Recompute.NONE, "tensor parallel, the baseline (Eq 2)"),
    Technique("tp-sp", True, True, Recompute.NONE, "tensor + sequence parallel (Eq 4)"),
    Technique("tp-sel", True, False, Recompute.SELECTIVE, "tensor parallel + selective recompute"),
    Technique("tp-sp-sel", True, True, Recompute.SELECTIVE,
              "tensor + sequence parallel + selective recompute (Eq 6)"),
    Technique("full", True, False, Recompute.FULL, "full recompute"),
)

#: Table 2's rows, then full recompute under sequence parallelism: the checkpointed layer
#: input is already split along the sequence, so 2sbh/t (section 5 with Figure 5).
TECHNIQUES = TABLE_2 + (
    Technique("tp-sp-full", True, True, Recompute.FULL, "tensor + sequence parallel + full recompute"),
)

BY_NAME = {technique.name: technique for technique in TECHNIQUES}
BASELINE = BY_NAME["tp"]


class PlanRecompute(NamedTuple):
    """One recompute choice of the planner's sweep."""

    recompute: Recompute
    modules: frozenset
    word: str
    """How a configuration's label writes it ('t=8 p=8 m=3 b=1 sp sel+mlp'); --explain reads it."""
    method: str | None = None
    """Megatron's --recompute-method, where the choice is partial full recompute ('block')."""

    @property
    def modules_setting(self) -> tuple | None:
        """The Run's recompute_modules: None for Megatron's default (core_attn) or no selective."""
        if self.recompute is not Recompute.SELECTIVE or self.modules == DEFAULT_MODULES:
            return None
        return tuple(module for module in RECOMPUTE_MODULES if module in self.modules)

    @property
    def run_values(self) -> dict:
        """The Run's settings for this choice (actmem.spec.Run: recompute, recompute_modules, and
        recompute_method for block, whose N a row carries: a Run without it is refused)."""
        method = {} if self.method is None else {"recompute_method": self.method}
        return {"recompute": self.recompute.value, "recompute_modules": self.modules_setting} | method


#: The recompute choices the planner sweeps, by the name its tables print: Megatron's three
#: granularities (selective of the attention core, the paper's), and selective recompute of
#: the MLP beside the core or alone (--recompute-modules core_attn mlp, or mlp).
PLAN_RECOMPUTE = {
    "none": PlanRecompute(Recompute.NONE, DEFAULT_MODULES, "none"),
    "selective": PlanRecompute(Recompute.SELECTIVE, DEFAULT_MODULES, "sel"),
    "selective:core_attn+mlp": PlanRecompute(Recompute.SELECTIVE, frozenset({"core_attn", "mlp"}), "sel+mlp"),
    "selective:mlp": PlanRecompute(Recompute.SELECTIVE, frozenset({"mlp"}), "mlp"),
    "full": PlanRecompute(Recompute.FULL, DEFAULT_MODULES, "full"),
}


#: The planner's name for full recompute of the first N layers of each chunk (Megatron's
#: --recompute-method block; N is the row's recompute_layers): not swept as the others are,
#: but derived from full recompute's rows (plan.block_recompute)
PLAN_BLOCK = "full:block"
PLAN_CHOICES = PLAN_RECOMPUTE | {PLAN_BLOCK: PlanRecompute(Recompute.FULL, DEFAULT_MODULES, "block", "block")}
"""Every recompute a plan row may carry, by name."""


def plan_recompute_name(recompute: Recompute, modules=None) -> str | None:
    """The planner's name for a run's recompute ('selective:mlp'); None for modules the
    planner does not sweep (layernorm)."""
    modules = DEFAULT_MODULES if modules is None or recompute is not Recompute.SELECTIVE else frozenset(modules)
    return next((name for name, choice in PLAN_RECOMPUTE.items()
                 if choice.recompute is recompute and choice.modules == modules), None)


def run_technique(sequence_parallel: bool, recompute: Recompute, method: str = "uniform",
                  layers: int = 1, modules=None) -> Technique:
    """The technique of a user's own run: tensor parallel (t may be 1) with its own flags."""
    return Technique("run", True, sequence_parallel, recompute, "this run", method, layers,
                     DEFAULT_MODULES if modules is None else frozenset(modules))


def _switches(technique: Technique) -> tuple:
    return (technique.sequence_parallel, technique.recompute, technique.recompute_method,
            technique.recompute_layers, technique.recompute_modules)


def matching(technique: Technique) -> Technique | None:
    """The named technique with the same switches as a run's (t > 1 or not aside); None for
    a partial full recompute or recompute modules other than core_attn, which no named row is."""
    return next((named for named in TECHNIQUES if named.tensor_parallel and
                 _switches(named) == _switches(technique)), None)


def unnamed_run(technique: Technique) -> Technique:
    """A row for a run no named technique is: partial full recompute, 'tp-sp-full·block 2', or
    selective recompute of other modules, 'tp-sp-sel·core_attn+mlp'."""
    base = matching(replace(technique, recompute_method="uniform", recompute_layers=1,
                            recompute_modules=DEFAULT_MODULES))
    if technique.recompute is Recompute.SELECTIVE:
        shape, flags = "+".join(technique.modules), f"--recompute-modules {' '.join(technique.modules)}"
    else:
        shape = f"{technique.recompute_method} {technique.recompute_layers}"
        flags = f"--recompute-method {technique.recompute_method} --recompute-num-layers {technique.recompute_layers}"
    label = base.label.split(" (Eq")[0]        # the paper's equation is core_attn's alone
    return replace(technique, name=f"{base.name}·{shape}", label=f"{label}, {shape} (Megatron's {flags})")
