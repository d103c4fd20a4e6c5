"""The six techniques of Table 2, as switches, and full recompute under sequence parallelism."""

from dataclasses import dataclass, replace

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
    recompute_method: str = "uniform"
    """Full recompute as Megatron groups it: 'uniform' checkpoints groups of
    ``recompute_layers`` layers (each keeps its group's input); 'block' checkpoints the
    first ``recompute_layers`` layers of each model chunk and keeps everything of the rest."""
    recompute_layers: int = 1
    """N of --recompute-num-layers; uniform with N = 1 is every layer alone (the paper's)."""

    @property
    def partial(self) -> bool:
        """Full recompute other than every layer checkpointed alone."""
        return self.recompute is Recompute.FULL and (self.recompute_method, self.recompute_layers) != ("uniform", 1)

    def whole(self) -> "Technique":
        """The same switches with nothing recomputed: what a layer kept whole keeps."""
        return replace(self, recompute=Recompute.NONE, recompute_method="uniform", recompute_layers=1)

    def chunk_layers(self, per_chunk: int) -> tuple[int, int]:
        """(checkpoints, layers kept whole) in a model chunk of per_chunk layers."""
        if self.recompute is not Recompute.FULL:
            return 0, per_chunk
        if self.recompute_method == "block":
            recomputed = min(self.recompute_layers, per_chunk)
            return recomputed, per_chunk - recomputed
        return -(-per_chunk // self.recompute_layers), 0

    def reruns(self, per_chunk: int) -> tuple:
        """The reruns of a chunk's backward the peak floor weighs, as (layers rerun at once,
        checkpoints freed before it): the first, 1 layer (every layer alone) or under
        'uniform' the chunk's tail group (its last, perhaps shorter than N); then, where the
        tail is shorter, the next group of N, with only the tail's checkpoint freed before
        it. Under 'block' 1 layer when every layer of the chunk is checkpointed, else none:
        its last layers are kept whole, so the first rerun comes after their activations are
        freed, a moment the floor does not take."""
        if not self.partial:
            return ((1, 0),)
        n = self.recompute_layers
        if self.recompute_method == "block":
            return ((1, 0),) if n >= per_chunk else ()
        tail = per_chunk % n or n
        return ((tail, 0),) + (((n, 1),) if tail < n else ())

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


def run_technique(sequence_parallel: bool, recompute: Recompute, method: str = "uniform",
                  layers: int = 1) -> Technique:
    """The technique of a user's own run: tensor parallel (t may be 1) with its own flags."""
    return Technique("run", True, sequence_parallel, recompute, "this run", method, layers)


def matching(technique: Technique) -> Technique | None:
    """The named technique with the same switches as a run's (t > 1 or not aside); None for
    a partial full recompute, which no named row is."""
    return next((named for named in TECHNIQUES if named.tensor_parallel and
                 (named.sequence_parallel, named.recompute, named.recompute_method, named.recompute_layers)
                 == (technique.sequence_parallel, technique.recompute, technique.recompute_method,
                     technique.recompute_layers)), None)


def partial_run(technique: Technique) -> Technique:
    """A row for a run with partial full recompute: 'tp-sp-full·block 2'."""
    base = matching(replace(technique, recompute_method="uniform", recompute_layers=1))
    shape = f"{technique.recompute_method} {technique.recompute_layers}"
    return replace(technique, name=f"{base.name}·{shape}",
                   label=f"{base.label}, {shape} (Megatron's --recompute-method "
                         f"{technique.recompute_method} --recompute-num-layers {technique.recompute_layers})")
