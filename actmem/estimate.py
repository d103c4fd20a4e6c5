"""One estimate: a spec in, a table of named byte counts out. No terminal here."""

from dataclasses import dataclass

from actmem import engine
from actmem.parameters import ParameterBytes, first_stage_parameters, parameter_bytes
from actmem.pipeline import StageOccupancy, first_stage_occupancy
from actmem.spec import Spec
from actmem.techniques import BASELINE, TABLE_2, Technique, run_technique
from actmem.terms import TERMS, Term


@dataclass(frozen=True)
class TermRow:
    """One term of the chosen run on the first stage."""

    term: Term
    bytes_each: int
    """One instance: per layer per microbatch, or per microbatch."""
    count: int
    """Instances the first stage holds."""

    @property
    def total_bytes(self) -> int:
        return self.bytes_each * self.count


@dataclass(frozen=True)
class TechniqueRow:
    """One technique on the first stage of this run."""

    technique: Technique
    per_layer_bytes: int
    layers_bytes: int
    """per layer x layer activations held (Eq 5, with the interleave factor)."""
    extra_bytes: int
    """Section 4.5: embedding dropout mask; output-layer terms when p = 1."""

    @property
    def first_stage_bytes(self) -> int:
        return self.layers_bytes + self.extra_bytes


@dataclass(frozen=True)
class Estimate:
    spec: Spec
    occupancy: StageOccupancy
    techniques: tuple
    """The six rows of Table 2, each on this run's pipeline."""
    run: TechniqueRow
    run_terms: tuple
    parameters: ParameterBytes
    assumptions: tuple

    @property
    def baseline(self) -> TechniqueRow:
        return next(row for row in self.techniques if row.technique == BASELINE)

    @property
    def activations_bytes(self) -> int:
        return self.run.first_stage_bytes

    @property
    def total_bytes(self) -> int:
        return self.activations_bytes + self.parameters.total_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.spec.gpu_memory_bytes


def estimate(spec: Spec) -> Estimate:
    """Activation, parameter and optimizer bytes on one GPU of the first pipeline stage."""
    occupancy = first_stage_occupancy(spec.model.layers, spec.run.pipeline_parallel,
                                      spec.run.interleave, spec.microbatches)
    bindings = spec.bindings()
    run = run_technique(spec.run.sequence_parallel, spec.run.recompute)
    terms = tuple(_term_row(term, run, occupancy, bindings) for term in TERMS)
    return Estimate(
        spec=spec,
        occupancy=occupancy,
        techniques=tuple(_technique_row(t, occupancy, bindings) for t in TABLE_2),
        run=_technique_row(run, occupancy, bindings),
        run_terms=tuple(row for row in terms if row.total_bytes),
        parameters=_parameters(spec),
        assumptions=_assumptions(spec, occupancy),
    )


def _counts(occupancy: StageOccupancy) -> tuple:
    return occupancy.layer_activations, occupancy.microbatches, int(occupancy.holds_output_layer)


def _term_row(term, technique, occupancy, bindings) -> TermRow:
    count = engine.stage_count(term, *_counts(occupancy))
    return TermRow(term, engine.exact(engine.term_bytes(term, technique), bindings), count)


def _technique_row(technique, occupancy, bindings) -> TechniqueRow:
    layer_activations, microbatches, holds_output = _counts(occupancy)
    per_layer = engine.exact(engine.per_layer_bytes(technique), bindings)
    extra = engine.exact(engine.extra_bytes(technique, microbatches, holds_output), bindings)
    return TechniqueRow(technique, per_layer, per_layer * layer_activations, extra)


def _parameters(spec: Spec) -> ParameterBytes:
    model, run = spec.model, spec.run
    count = first_stage_parameters(model.hidden, model.layers, run.pipeline_parallel,
                                   run.tensor_parallel, spec.padded_vocab, model.seq_len)
    return parameter_bytes(count, spec.data_parallel, run.distributed_optimizer)


def _assumptions(spec: Spec, occupancy: StageOccupancy) -> tuple:
    notes = [
        "activations 16-bit (2 B), dropout masks 1 B, logits fp32 (section 4); layer-norm "
        "mean/variance and small buffers left out, as in the paper",
        f"first pipeline stage: {occupancy.explanation}"
        + ("" if occupancy.holds_output_layer else
           "; the output-layer terms of section 4.5 sit on the last stage (p > 1)"),
        "Table 2 rows share this run's pipeline and microbatch and vary only t, SP and "
        "recompute ('none' sets t = 1)",
        f"embedding dropout masks of {occupancy.microbatches} microbatches: p as section 4.5 "
        "counts under 1F1B, 2p at the peak of the interleaved schedule (the paper says p)",
        "not counted: the one layer rematerialised during a recompute backward, "
        "allocator fragmentation, workspace and communication buffers",
        "parameters: Megatron GPT layers (12h² + 13h each), word embedding split over the "
        "vocabulary and tied with the output layer, learned position embedding",
    ]
    if spec.run.distributed_optimizer:
        notes.append(f"18 B per parameter less the optimizer sharding: 2 B weight + 4 B fp32 "
                     f"gradient + 12 B fp32 master weight and Adam moments / d = {spec.data_parallel}")
    else:
        notes.append("18 B per parameter: 2 B weight + 4 B fp32 gradient + 12 B fp32 master "
                     "weight and Adam moments (mixed-precision Adam)")
    if spec.run.gpus is None:
        notes.append("GPU count unknown: data parallel size taken as 1")
    if spec.padded_vocab != spec.model.vocab:
        notes.append(f"vocabulary {spec.model.vocab} padded to {spec.padded_vocab} "
                     f"(a multiple of {spec.vocab_divisible_by}·t, as Megatron does)")
    return tuple(notes)
