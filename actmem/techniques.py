"""The six techniques of Table 2, as switches, and full recompute under sequence parallelism."""

from dataclasses import dataclass

from actmem.terms import Recompute


@dataclass(frozen=True)
class Technique:
    name: str
    tensor_parallel: bool
    """Split the attention and MLP blocks t ways (Figure 4)."""
    sequence_parallel: bool
    """Split the block boundaries along the sequence t ways (Figure 5)."""
    recompute: Recompute
    label: str

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


def run_technique(sequence_parallel: bool, recompute: Recompute) -> Technique:
    """The technique of a user's own run: tensor parallel (t may be 1) with its own flags."""
    return Technique("run", True, sequence_parallel, recompute, "this run")


def matching(technique: Technique) -> Technique:
    """The named technique with the same switches as a run's (t > 1 or not aside)."""
    return next(named for named in TECHNIQUES if named.tensor_parallel and
                (named.sequence_parallel, named.recompute) == (technique.sequence_parallel,
                                                              technique.recompute))
