"""Every pipeline stage: what each holds, and which one holds the most.

With even stages the first usually holds the most (section 4.4: it has the most
microbatches in flight, and the embedding). The last holds the output layer's logits and
its own copy of the output weights; an uneven pipeline moves layers off the first and last
stages (Llama 3: 7, then 8 on each stage between, then 7), so a stage in between can hold
more. Each stage is the same estimate at its own occupancy and parameters; the largest
peak floor is what must fit.
"""

from dataclasses import dataclass
from functools import cached_property

from actmem.errors import SpecError
from actmem.memory.peak import PeakFloor, peak_floor
from actmem.memory.pipeline import StageOccupancy, split_text


@dataclass(frozen=True)
class StageLoad:
    stage: int
    layers: int
    occupancy: StageOccupancy
    row: object
    """The run's estimate.TechniqueRow on this stage."""

    @property
    def activations_bytes(self) -> int:
        return self.row.first_stage_bytes

    @property
    def parameters(self):
        return self.row.parameters

    @property
    def total_bytes(self) -> int:
        return self.row.total_bytes

    @cached_property
    def peak(self) -> PeakFloor:
        return peak_floor(self.row)


def stage_moe_layers(spec, stage: int) -> tuple:
    """1 for each MoE layer of a stage, 0 for each dense one, in order (a stage's layers follow the
    stages before it's: no interleaving where the kinds are mixed, a rule)."""
    from actmem.model.experts import moe_layers

    indices = stage_indices(spec, stage)
    return moe_layers(spec.architecture, spec.model.layers)[indices.start:indices.stop]


def stage_fp8_layers(spec, stage: int) -> tuple:
    """1 for each layer of a stage that runs in FP8, 0 for each that runs in bf16 though the run is FP8
    (--first-last-layers-bf16: by global index), in order; () where the run is not FP8."""
    arch = spec.architecture
    if not arch.fp8:
        return ()
    return tuple(int(not arch.bf16_layer(index, spec.model.layers)) for index in stage_indices(spec, stage))


def stage_indices(spec, stage: int) -> range:
    """The model's layers a stage holds, by global index (no interleaving: a rule where it matters)."""
    counts = stage_layers(spec)
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


def stage_layers(spec) -> list[int]:
    """Layers of each stage: the first and last as given, the rest shared evenly."""
    run, p = spec.run, spec.run.pipeline_parallel
    first, last = run.first_stage_layers, run.last_stage_layers
    middle_stages = p - (first is not None) - (last is not None)
    share = (spec.model.layers - (first or 0) - (last or 0)) // middle_stages if middle_stages else 0
    layers = [share] * p
    if first is not None:
        layers[0] = first
    if last is not None:
        layers[-1] = last
    return layers


def split_of(spec) -> str | None:
    """An uneven pipeline's layers as the Llama 3 paper counts them, '7+8x14+7'
    (pipeline.split_text); None when every stage has L/p."""
    layers = stage_layers(spec)
    if len(set(layers)) == 1:
        return None
    return split_text(layers[0], layers[1] if len(layers) > 2 else None, layers[-1], len(layers))


def parse_stage(text: str, p: int, fmt: str = "rich") -> int | None:
    """--stage: 'first' (0), 'last' (p - 1), a stage number from 0, or 'all' (None: every
    stage's peak beside the first stage's detail; the other formats list every stage always)."""
    if text == "all" and fmt != "rich":
        raise SpecError(f"--stage all adds a table to the terminal output; --format {fmt} lists "
                        "every stage always (its stages section)")
    named = {"first": 0, "last": p - 1, "all": None}
    if text in named:
        return named[text]
    if text.isdigit() and int(text) < p:
        return int(text)
    raise SpecError(f"--stage {text}: give first, last, all or a stage number from 0 to {p - 1} (p = {p})")


def stage_name(stage: int, p: int, article: bool = False) -> str:
    """'first stage', 'last stage' or 'stage 3' (counting from 0, as Megatron's ranks do);
    with the article: 'the first stage', 'stage 3'."""
    if 0 < stage < p - 1:
        return f"stage {stage}"
    return ("the " if article else "") + ("first stage" if stage == 0 else "last stage")


def mtp_layers_held(spec, stage: int, full_recompute: bool) -> int:
    """The multi-token-prediction layers a stage counts as layers of its own: the D of the last stage
    (multi_token_prediction.py, mtp_on_this_rank: the last pipeline stage without a custom layout), none
    under full recompute, where Megatron checkpoints each whole and keeps its arguments (terms.MTP_TERMS)."""
    last = stage == spec.run.pipeline_parallel - 1
    return spec.architecture.mtp_layers if last and not full_recompute else 0


def mtp_layer_kind(spec) -> int:
    """1 where the model's last layer, whose spec the multi-token-prediction layers take, is a MoE
    layer (gpt_layer_specs.py, get_gpt_mtp_block_spec: the decoder's last layer spec), else 0."""
    from actmem.model.experts import last_layer_moe

    return last_layer_moe(spec.architecture, spec.model.layers)
