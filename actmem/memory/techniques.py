"""The six techniques of Table 2, as switches, and full recompute under sequence parallelism;
the recompute choices the planner sweeps."""

from dataclasses import dataclass, replace

from actmem.model.recompute import FULL, NONE, OP_CHECKPOINTING, SELECTIVE, Recompute, RecomputePolicy, reruns
from actmem.memory.terms import Term


@dataclass(frozen=True)
class Technique:
    name: str
    tensor_parallel: bool
    """Split the attention and MLP blocks t ways (Figure 4)."""
    sequence_parallel: bool
    """Split the block boundaries along the sequence t ways (Figure 5)."""
    policy: RecomputePolicy
    """What it recomputes (actmem.model.recompute): Megatron's granularity with its modules, or
    full recompute's method and N."""
    label: str

    @property
    def recompute(self) -> Recompute:
        """none, selective or full: what the term table's rows are kept under."""
        return self.policy.granularity

    @property
    def modules(self) -> tuple:
        """Selective recompute's modules in Megatron's order ('core_attn', 'layernorm', 'mlp')."""
        return self.policy.ordered_modules

    @property
    def partial(self) -> bool:
        """Full recompute other than every layer checkpointed alone."""
        return self.policy.partial

    def drops(self, term: Term, arch) -> bool:
        """Whether selective recompute recomputes this row of this architecture rather than keep
        it, or leaves out a row that only a module's checkpoint keeps (Term.kept_by) because
        that module is not recomputed."""
        if self.recompute is not Recompute.SELECTIVE:
            return False
        kept_by = term.kept_by_for(arch)
        if kept_by is not None and kept_by not in self.policy.modules:
            return True
        module = term.module_of(arch)
        return any(reruns(given, module) for given in self.policy.modules)

    def whole(self) -> "Technique":
        """The same switches with nothing recomputed: what a layer kept whole keeps."""
        return replace(self, policy=NONE)

    def __post_init__(self):
        if self.sequence_parallel and not self.tensor_parallel:
            raise ValueError(f"{self.name}: sequence parallelism runs inside a tensor-parallel group")


TABLE_2 = (
    Technique("none", False, False, NONE, "no parallelism (Eq 1)"),
    Technique("tp", True, False, NONE, "tensor parallel, the baseline (Eq 2)"),
    Technique("tp-sp", True, True, NONE, "tensor + sequence parallel (Eq 4)"),
    Technique("tp-sel", True, False, SELECTIVE, "tensor parallel + selective recompute"),
    Technique("tp-sp-sel", True, True, SELECTIVE, "tensor + sequence parallel + selective recompute (Eq 6)"),
    Technique("full", True, False, FULL, "full recompute"),
)

#: Table 2's rows, then full recompute under sequence parallelism: the checkpointed layer
#: input is already split along the sequence, so 2sbh/t (section 5 with Figure 5).
TECHNIQUES = TABLE_2 + (
    Technique("tp-sp-full", True, True, FULL, "tensor + sequence parallel + full recompute"),
)

BY_NAME = {technique.name: technique for technique in TECHNIQUES}
BASELINE = BY_NAME["tp"]


#: The recompute choices the planner sweeps, by their labels: Megatron's three granularities
#: (selective of the attention core, the paper's), and selective recompute of the MLP beside
#: the core or alone (--recompute-modules core_attn mlp, or mlp); and torch-native's selective,
#: torchtitan's per-op checkpointing (selective:op), where the implementation has it (each
#: implementation's unmodelled_recompute leaves out the others).
PLAN_RECOMPUTE = {policy.label: policy for policy in (
    NONE, SELECTIVE, RecomputePolicy(Recompute.SELECTIVE, frozenset({"core_attn", "mlp"})),
    RecomputePolicy(Recompute.SELECTIVE, frozenset({"mlp"})), FULL, OP_CHECKPOINTING)}

#: The planner's family of full recompute of the first N layers of each chunk (Megatron's
#: --recompute-method block; N is the row's recompute_layers): not swept as the others are,
#: but derived from full recompute's rows (plan.block_recompute)
PLAN_BLOCK = "full:block"
PLAN_CHOICES = PLAN_RECOMPUTE | {PLAN_BLOCK: RecomputePolicy(Recompute.FULL, method="block")}
"""Every recompute a plan row may carry, by name (a block row's N is its recompute_layers)."""


def sweep_name(policy: RecomputePolicy) -> str | None:
    """The planner's name for a policy's granularity and modules, its full recompute's method
    aside ('selective:mlp'); None for modules the planner does not sweep (layernorm)."""
    name = RecomputePolicy(policy.granularity, policy.modules, ops=policy.ops).label
    return name if name in PLAN_RECOMPUTE else None


def row_policy(recompute: str, recompute_layers: int = 0) -> RecomputePolicy:
    """The policy of a plan row: its recompute name, and N for a block row."""
    if recompute == PLAN_BLOCK:
        return replace(PLAN_CHOICES[PLAN_BLOCK], layers=int(recompute_layers))
    return PLAN_CHOICES[recompute]


def run_technique(sequence_parallel: bool, policy: RecomputePolicy = NONE) -> Technique:
    """The technique of a user's own run: tensor parallel (t may be 1) with its own recompute."""
    return Technique("run", True, sequence_parallel, policy, "this run")


def matching(technique: Technique) -> Technique | None:
    """The named technique with the same switches as a run's (t > 1 or not aside); None for
    a partial full recompute or recompute modules other than core_attn, which no named row is."""
    return next((named for named in TECHNIQUES if named.tensor_parallel and
                 (named.sequence_parallel, named.policy) == (technique.sequence_parallel, technique.policy)), None)


def op_checkpointing(sequence_parallel: bool) -> Technique:
    """torch-native's selective recompute, torchtitan's per-op checkpointing, with or without SP: 'tp-sp-op', 'op'."""
    return unnamed_run(run_technique(sequence_parallel, OP_CHECKPOINTING))


def layer_checkpointing(sequence_parallel: bool, n: int) -> Technique:
    """torchtitan's layer option: every n-th block checkpointed whole, the others kept whole ('full·every 2')."""
    return unnamed_run(run_technique(sequence_parallel, RecomputePolicy(Recompute.FULL, method="every", layers=n)))


def unnamed_run(technique: Technique) -> Technique:
    """A row for a run no named technique is: partial full recompute, 'tp-sp-full·block 2', or
    selective recompute of other modules, 'tp-sp-sel·core_attn+mlp'."""
    policy = technique.policy
    base = matching(replace(technique, policy=RecomputePolicy(policy.granularity)))
    label = base.label.split(" (Eq")[0]        # the paper's equation is core_attn's alone
    if policy.ops:
        return replace(technique, name=f"{base.name.removesuffix('full')}op",
                       label=f"{label.removesuffix(' + full recompute').removesuffix('full recompute')} + torchtitan's "
                             f"per-op checkpointing (selective_ac_option op)".lstrip(" +"))
    shape = "+".join(policy.ordered_modules) if technique.recompute is Recompute.SELECTIVE else \
        f"{policy.method} {policy.layers}"
    spelled = f"torchtitan's selective_ac_option {policy.layers}" if policy.method == "every" else \
        f"Megatron's {policy.megatron_flags}"
    return replace(technique, name=f"{base.name}·{shape}", label=f"{label}, {shape} ({spelled})")
