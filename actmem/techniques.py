"""The six techniques of Table 2, as switches over the term table."""

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

BY_NAME = {technique.name: technique for technique in TABLE_2}
BASELINE = BY_NAME["tp"]


def run_technique(sequence_parallel: bool, recompute: Recompute) -> Technique:
    """The technique of a user's own run: tensor parallel (t may be 1) with its own flags."""
    return Technique("run", True, sequence_parallel, recompute, "this run")
