"""One estimate: a spec in, a table of named byte counts out. No terminal here."""

from dataclasses import dataclass, replace
from functools import cached_property

from actmem.memory import assumptions, engine, fsdp, megatron_fsdp, zero
from actmem.model import symbols
from actmem.model.architecture import Architecture
from actmem.memory.parameters import ParameterBytes, mtp_parameters, stage_state
from actmem.model.experts import dense_twin
from actmem.memory.peak import PeakFloor, peak_floor
from actmem.memory.stage_model import StageCounts, chunk_layers, stage_activations
from actmem.memory.pipeline import StageOccupancy, stage_occupancy
from actmem.memory.stages import StageLoad, mtp_layer_kind, mtp_layers_held, stage_fp8_layers, stage_layers, \
    stage_moe_layers
from actmem.errors import SpecError
from actmem.model.spec import Spec, padded_vocab
from actmem.memory.techniques import BASELINE, BY_NAME, TECHNIQUES, Technique, matching, run_technique, unnamed_run
from actmem.memory.terms import TERMS, Scope, Term
from actmem.model.recompute import Recompute


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
    """One technique on one stage of this run (the first, unless another is asked for)."""

    technique: Technique
    per_layer_bytes: int | float
    """One layer, one microbatch; with partial full recompute, the chunk's average."""
    layers_bytes: int
    """per layer x layer activations held (Eq 5, with the interleave factor)."""
    extra_bytes: int
    """Section 4.5: embedding dropout mask; output-layer terms when p = 1."""
    parameters: ParameterBytes
    """Weights, gradients and optimizer state at this technique's t ('none' sets t = 1)."""
    moments: tuple = ()
    """The moments of the stage's first backward that happen (stage_model.StageMoment, in
    whole bytes): its start, the loss's, the rerun's, the last layer's backward's."""

    @property
    def first_stage_bytes(self) -> int:
        """The stage's saved activations (named for the paper's first stage, the default)."""
        return self.layers_bytes + self.extra_bytes

    @property
    def total_bytes(self) -> int:
        return self.first_stage_bytes + self.parameters.total_bytes

    @property
    def peak_moment(self):
        """The moment that holds the most (the first of equals: the start, where none is more)."""
        return max(self.moments, key=lambda moment: moment.bytes)

    @property
    def transient_bytes(self) -> int:
        """What the peak moment holds above the saved activations (actmem.memory.peak)."""
        return self.peak_moment.bytes - self.first_stage_bytes

    @property
    def peak_bytes(self) -> int:
        """The stage's allocator peak from below (actmem.memory.peak): the model state held throughout
        and the largest moment (which holds FSDP2's gradients where they are live)."""
        return self.parameters.held_bytes + self.peak_moment.bytes

    def backward_moment(self, name: str):
        """The evaluated backward.Moment of one moment of the last layer's backward ('fc1',
        'core', 'softmax')."""
        return next(moment.detail for moment in self.moments if moment.name == name)


@dataclass(frozen=True)
class AgainstBf16:
    """An FP8 run against the same run in bf16, on the stage that decides the FP8 run's verdict: what FP8 saves in
    activations and adds in model state (FP8 saves less than its users expect: issue 29)."""

    stage: int
    activations_delta_bytes: int
    """FP8's activations on the stage less bf16's (negative: saved)."""
    model_state_delta_bytes: int
    """FP8's model state on the stage less bf16's: TE's FP8 weight copies and scaling state, less what the weights
    shrink under --fp8-param-gather."""
    verdict_delta_bytes: int
    """The FP8 run's verdict less the bf16 run's (each its busiest stage's peak floor)."""
    bf16_verdict_bytes: int


@dataclass(frozen=True)
class Estimate:
    spec: Spec
    occupancy: StageOccupancy
    techniques: tuple
    """The six rows of Table 2 and full recompute under SP, each on this run's pipeline."""
    run: TechniqueRow
    run_terms: tuple
    parameters: ParameterBytes
    assumptions: tuple
    stage: int = 0
    """The pipeline stage the techniques and terms are counted on (0: the first, the paper's)."""
    host_bytes: int = 0
    """Host memory a GPU's process needs for CPU offloading (--cpu-offloading-num-layers; actmem.memory.offload):
    the offloaded layers' saved activations of one microbatch, before the pinned allocator rounds them."""

    @cached_property
    def peak(self) -> PeakFloor:
        """This stage's allocator peak from below (actmem.memory.peak.PeakFloor): the model state, the
        activations in flight and what the first backward reruns, live at one moment."""
        return peak_floor(self.run)

    @cached_property
    def stages(self) -> tuple:
        """Every stage of the pipeline (actmem.memory.stages.StageLoad), this one included."""
        return tuple(StageLoad(i, layers, self.occupancy, self.run) if i == self.stage else
                     _stage_load(self.spec, self.run.technique, i, layers)
                     for i, layers in enumerate(stage_layers(self.spec)))

    @cached_property
    def against_bf16(self) -> AgainstBf16 | None:
        """Under FP8, the same run in bf16 beside it (Architecture.bf16_twin: no FP8 anywhere); else None."""
        if not self.spec.architecture.fp8:
            return None
        spec = replace(self.spec, architecture=self.spec.architecture.bf16_twin())
        loads = [_stage_load(spec, self.run.technique, i, layers) for i, layers in enumerate(stage_layers(spec))]
        mine, theirs = self.busiest_stage, loads[self.busiest_stage.stage]
        verdict = max(load.peak.total_bytes for load in loads)
        return AgainstBf16(mine.stage, mine.activations_bytes - theirs.activations_bytes,
                           mine.parameters.total_bytes - theirs.parameters.total_bytes,
                           self.verdict_bytes - verdict, verdict)

    @property
    def busiest_stage(self) -> StageLoad:
        """The stage with the largest peak floor (the first of equals): the verdict's."""
        return max(self.stages, key=lambda load: load.peak.total_bytes)

    @property
    def verdict_bytes(self) -> int:
        """What the busiest GPU holds at least: the largest stage's peak floor."""
        return self.busiest_stage.peak.total_bytes

    @property
    def baseline(self) -> TechniqueRow:
        """Tensor parallelism, Figure 7's 100%; 'none' for code that runs on one device, and at t = 1, where
        'tp' is 'none' (one_rank_rows)."""
        return next((row for row in self.techniques if row.technique == BASELINE), self.techniques[0])

    @property
    def run_row(self) -> TechniqueRow:
        """The named technique this run is (the row the output marks); 'none' for code that
        runs on one device (its run is t = 1 with no parallelism)."""
        named = matching(self.run.technique) or unnamed_run(self.run.technique)
        rows = {row.technique: row for row in self.techniques}
        return rows.get(named) or rows[BY_NAME["none"]]

    @property
    def activations_bytes(self) -> int:
        return self.run.first_stage_bytes

    @property
    def total_bytes(self) -> int:
        return self.activations_bytes + self.parameters.total_bytes

    @property
    def fits(self) -> bool:
        """The peak floor and the reserve fit the GPU, as `plan` reads its budget."""
        return self.verdict == FITS

    @property
    def verdict(self) -> str:
        return verdict_of(self.verdict_bytes, self.spec)

    @property
    def spare_bytes(self) -> int:
        """What the GPU has beyond the peak floor and the reserve (negative where it is short)."""
        return self.spec.gpu_memory_bytes - self.spec.reserve_bytes - self.verdict_bytes

    @cached_property
    def busiest_peaks(self) -> dict:
        """Each technique row's largest peak floor over every stage (the run's is the verdict),
        by technique: computed once, for every view that shows the rows."""
        return {row.technique: max(row.peak_bytes if load.stage == self.stage else
                                   _technique_row(self.spec, row.technique, load.occupancy, load.layers).peak_bytes
                                   for load in self.stages) for row in self.techniques}

    def busiest_peak_bytes(self, row: TechniqueRow) -> int:
        """A technique row's largest peak floor over every stage (busiest_peaks)."""
        return self.busiest_peaks[row.technique]

    def technique_fits(self, row: TechniqueRow) -> bool:
        """A technique row fits where its peak floor and the reserve fit on every stage."""
        return self.technique_verdict(row) == FITS

    def technique_verdict(self, row: TechniqueRow) -> str:
        return verdict_of(self.busiest_peak_bytes(row), self.spec)


FITS, TIGHT, NO_FIT = "fits", "tight", "does not fit"


def verdict_of(peak_bytes: int, spec) -> str:
    """fits: the peak floor and the reserve fit the GPU; tight: the floor fits but eats into
    the reserve kept for what actmem does not count; does not fit: the floor alone is over."""
    if peak_bytes + spec.reserve_bytes <= spec.gpu_memory_bytes:
        return FITS
    return TIGHT if peak_bytes <= spec.gpu_memory_bytes else NO_FIT


def estimate(spec: Spec, stage: int = 0) -> Estimate:
    """Activation, parameter and optimizer bytes on one GPU of a pipeline stage (the first by
    default), and the peak floor of every stage."""
    p = spec.run.pipeline_parallel
    if not 0 <= stage < p:
        raise SpecError(f"stage {stage} is not one of the pipeline's stages 0 to {p - 1} (p = {p})")
    layers = stage_layers(spec)[stage]
    occupancy = _occupancy(spec, stage, layers)
    run = run_technique(spec.run.sequence_parallel, spec.run.policy)
    terms = _run_terms(spec, run, occupancy)
    rows = one_rank_rows(spec, modelled_techniques(spec)) + ((unnamed_run(run),) if matching(run) is None else ())
    techniques = tuple(_technique_row(spec, tech, occupancy, layers) for tech in rows)
    parameters = _parameters(spec, spec.run.tensor_parallel, stage, layers)
    return Estimate(
        spec=spec,
        occupancy=occupancy,
        techniques=techniques,
        run=_technique_row(spec, run, occupancy, layers),
        run_terms=tuple(row for row in terms if row.total_bytes),
        parameters=parameters,
        assumptions=assumptions.notes(spec, occupancy, techniques, parameters),
        stage=stage,
        host_bytes=_host_bytes(spec, run),
    )


def _host_bytes(spec: Spec, run: Technique) -> int:
    """What the offloaded layers copy to the host (actmem.memory.offload)."""
    if not spec.run.offload_layers:
        return 0
    from actmem.memory import offload

    t = spec.technique_t(run)
    expr = offload.host_bytes_per_layer(run, spec.architecture_at(t))
    return spec.run.offload_layers * engine.exact(expr, spec.bindings_at(t))


def offloaded_layers(spec: Spec, technique: Technique) -> int:
    """Layers whose saved activations are on the host at the stage's peak: the run's
    --cpu-offloading-num-layers on a row without recompute (Megatron offloads no recomputed run)."""
    return spec.run.offload_layers if technique.recompute is Recompute.NONE else 0


def _occupancy(spec: Spec, stage: int, layers: int) -> StageOccupancy:
    return stage_occupancy(spec.model.layers, spec.run.pipeline_parallel, spec.run.interleave,
                           spec.microbatches, layers, stage)


def _stage_load(spec: Spec, run: Technique, stage: int, layers: int) -> StageLoad:
    occupancy = _occupancy(spec, stage, layers)
    return StageLoad(stage, layers, occupancy, _technique_row(spec, run, occupancy, layers))


def modelled_techniques(spec: Spec) -> tuple:
    """The techniques actmem models for this architecture (flash attention: no selective rows)
    and implementation (one that runs on one device: 'none', and 'full' where it checkpoints whole
    layers: Table 2's full row at t = 1)."""
    unmodelled = spec.architecture.unmodelled_recompute(spec.model.heads)
    parallel = "tensor" in spec.architecture.code.runs
    # Megatron's MoE layer refuses t > 1 without sequence parallelism (moe_layer.py, MoELayer.forward)
    moe_needs_sp = (spec.architecture.moe or spec.architecture.mtp_layers) and spec.run.tensor_parallel > 1
    return tuple(tech for tech in TECHNIQUES if tech.recompute.value not in unmodelled
                 and (parallel or not tech.tensor_parallel or tech.name == "full")
                 and not (moe_needs_sp and tech.tensor_parallel and not tech.sequence_parallel))


def one_rank_rows(spec: Spec, techniques: tuple) -> tuple:
    """The rows that differ at the run's t: at t = 1 tensor parallelism splits nothing, so 'tp' is 'none' and each
    sequence-parallel row its twin without (TE turns SP off at t = 1, and the rules refuse a t = 1 run with it);
    they are left out rather than shown three times alike. The run's own row is then 'none', 'full' or 'tp-sel'."""
    if spec.run.tensor_parallel > 1:
        return techniques
    return tuple(tech for tech in techniques if tech.name != "tp" and not tech.sequence_parallel)


def layer_kinds(spec: Spec, stage: int, arch: Architecture, mtp: int = 0) -> tuple:
    """(the stage's last layer's architecture, its kind's layers or None where every layer is of it,
    ((another kind's architecture, its layers), ...) or ()): a layer's kind is whether it has experts and
    whether it runs in FP8 (stage_layer_kinds); a MoE model's dense layers (--moe-layer-freq) are its dense
    twin's (actmem.model.experts.dense_twin), an FP8 run's bf16 layers (--first-last-layers-bf16) its bf16
    twin's (Architecture.bf16_twin). ``mtp``: the multi-token-prediction layers the stage counts
    (stages.mtp_layers_held), after the stage's own, of the model's last layer's kind (mtp_layer_kind) and in
    FP8 where the run is (multi_token_prediction.py: the global FP8 context, no layer number)."""
    kinds = stage_layer_kinds(spec, stage, mtp)
    counts = {kind: kinds.count(kind) for kind in kinds}       # in order of first appearance
    if not kinds:                                              # a stage of no layers
        return arch, None, ()
    last = kinds[-1]
    if len(counts) == 1 and not mtp:          # the prediction layers are counted beyond the stage's own
        return _kind_architecture(arch, last, spec.gpu_fp8), None, ()
    return (_kind_architecture(arch, last, spec.gpu_fp8), counts[last],
            tuple((_kind_architecture(arch, kind, spec.gpu_fp8), n) for kind, n in counts.items() if kind != last))


def stage_layer_kinds(spec: Spec, stage: int, mtp: int = 0) -> tuple:
    """(has experts, runs in FP8) for each of a stage's layers, in order (stages.stage_moe_layers,
    stages.stage_fp8_layers), then for its ``mtp`` multi-token-prediction layers: of the model's last layer's kind,
    in FP8 where the run is."""
    arch, layers = spec.architecture, stage_layers(spec)[stage]
    experts = stage_moe_layers(spec, stage) if arch.moe else (0,) * layers
    fp8 = stage_fp8_layers(spec, stage) or (int(bool(arch.fp8)),) * layers
    return (tuple((bool(e), bool(f)) for e, f in zip(experts, fp8))
            + ((bool(mtp_layer_kind(spec)), bool(arch.fp8)),) * mtp)


def _kind_architecture(arch: Architecture, kind: tuple, generation) -> Architecture:
    """The architecture a layer of ``kind`` (has experts, runs in FP8) runs, of a run of ``arch`` on a GPU of FP8
    ``generation``."""
    experts, fp8 = kind
    if arch.fp8 and not fp8:
        arch = arch.bf16_twin(generation)
    return arch if experts or not arch.moe else dense_twin(arch)


def _counts(occupancy: StageOccupancy) -> tuple:
    return occupancy.layer_activations, occupancy.microbatches, int(occupancy.holds_output_layer)


def _term_row(term, technique, occupancy, bindings, arch) -> TermRow:
    count = engine.stage_count(term, *_counts(occupancy))
    return TermRow(term, engine.exact(engine.term_bytes(term, technique, arch), bindings), count)


def _run_terms(spec: Spec, run: Technique, occupancy) -> tuple:
    """The run's terms. With partial full recompute, a chunk's checkpoints count the layer
    input and its whole layers count everything the same run without recompute keeps."""
    arch, bindings = spec.architecture_at(spec.run.tensor_parallel), spec.bindings()
    mtp = mtp_layers_held(spec, occupancy.stage, run.recompute is Recompute.FULL)
    last, n_last, others = layer_kinds(spec, occupancy.stage, arch, mtp)
    if others or mtp:
        return _mixed_terms(run, occupancy, bindings, ((last, n_last),) + others)
    arch = last
    if offloaded_layers(spec, run):          # layers on the host hold nothing on the GPU (offload.py)
        return tuple(_offloaded(_term_row(term, run, occupancy, bindings, arch), offloaded_layers(spec, run))
                     for term in TERMS)
    if not run.partial:
        return tuple(_term_row(term, run, occupancy, bindings, arch) for term in TERMS)
    chunks = occupancy.layer_activations // occupancy.chunk_layers
    checkpoints, whole = (chunks * count for count in chunk_layers(run, occupancy.chunk_layers))
    kept = run.whole()
    rows = []
    for term in TERMS:
        row = _term_row(term, run, occupancy, bindings, arch)
        if term.scope is Scope.LAYER:
            source, count = (run, checkpoints) if Recompute.FULL in term.kept_under else (kept, whole)
            row = TermRow(term, engine.exact(engine.term_bytes(term, source, arch), bindings), count)
        rows.append(row)
    return tuple(rows)


def _offloaded(row: TermRow, layers: int) -> TermRow:
    return TermRow(row.term, row.bytes_each, row.count - layers) if row.term.scope is Scope.LAYER else row


def _mixed_terms(run: Technique, occupancy, bindings, kinds: tuple) -> tuple:
    """The terms of a stage of two kinds of layer (a MoE model's dense and MoE layers; an FP8 run's FP8 and bf16
    ones): a layer's rows counted for the layers of each kind that have them, one row where the kinds keep the
    same bytes (the attention's and the norms' beside experts), one a kind where they differ (an FP8 layer's
    quantized inputs beside a bf16 layer's 16-bit ones)."""
    chunks = occupancy.layer_activations // occupancy.chunk_layers
    rows = {}                                 # (term, bytes each) -> row; estimate keeps the rows that hold bytes
    for arch, layers in kinds:
        for term in TERMS:
            row = _term_row(term, run, occupancy, bindings, arch)
            if term.scope is not Scope.LAYER:
                rows.setdefault((term.name, None), row)
            elif row.bytes_each and layers:
                held = rows.get((term.name, row.bytes_each))
                rows[term.name, row.bytes_each] = TermRow(term, row.bytes_each,
                                                          chunks * layers + (held.count if held else 0))
    order = {term.name: i for i, term in enumerate(TERMS)}
    return tuple(sorted(rows.values(), key=lambda row: order[row.term.name]))


def _technique_row(spec: Spec, technique: Technique, occupancy, stage_layers: int,
                   arch: Architecture | None = None) -> TechniqueRow:
    """A technique's row; ``arch``: in place of the spec's architecture as the run executes it."""
    layer_activations, microbatches, holds_output = _counts(occupancy)
    t = spec.technique_t(technique)
    bindings = spec.bindings_at(t) | {engine.holds_output: holds_output,
                                  engine.microbatches_held: microbatches,
                                  symbols.v: padded_vocab(spec.model.vocab, t, spec.vocab_divisible_by)}
    arch = arch or spec.architecture_at(t)
    mtp = mtp_layers_held(spec, occupancy.stage, technique.recompute is Recompute.FULL)
    arch, n_last, others = layer_kinds(spec, occupancy.stage, arch, mtp)
    per_chunk = occupancy.chunk_layers
    counts = StageCounts(per_chunk if n_last is None else n_last, layer_activations // per_chunk if per_chunk else 0,
                         offloaded=offloaded_layers(spec, technique))
    stage = stage_activations(technique, arch, lambda expr: engine.exact(expr, bindings), counts, others)
    moments = stage.moments
    if spec.run.fsdp:
        moments = fsdp.stage_moments(stage, technique, arch, lambda expr: engine.exact(expr, bindings),
                                     _sharded_model(spec, t, bindings[symbols.v], arch))
    if spec.run.zero:
        moments = zero.stage_moments(moments, _zero_model(spec))
    parameters = _parameters(spec, t, occupancy.stage, stage_layers)
    if spec.run.megatron_fsdp:
        moments = megatron_fsdp.stage_moments(moments, parameters.buckets, spec.megatron_fsdp_strategy,
                                              spec.gradient_bytes, stage_layers, technique.recompute is Recompute.FULL,
                                              spec.run.fsdp_communication_unit, spec.run.fsdp_double_buffer)
    per_layer = (stage.layers_bytes / layer_activations if technique.partial or others else
                 engine.exact(engine.per_layer_bytes(technique, arch), bindings))
    return TechniqueRow(technique, per_layer, stage.layers_bytes, stage.extra_bytes,
                        parameters,
                        tuple(moment for moment in moments if moment.present))


def _sharded_model(spec: Spec, t: int, vocab: int, arch: Architecture):
    """The model under FSDP2 at tensor-parallel size t (actmem.memory.fsdp): FSDP2 runs at p = 1, every layer on
    the stage; a step of global_batch/(b·d) microbatches, or one where the batch is not given (torchtitan's
    default)."""
    model = spec.model
    return fsdp.sharded_model(model.hidden, t, vocab, arch, model.heads, model.layers, spec.fsdp_shards,
                              spec.microbatches or 1, spec.run.fsdp_reshard)


def _zero_model(spec: Spec):
    """The model under DeepSpeed's ZeRO (actmem.memory.zero): transformers' parameters (hf, one device's whole
    model), over the d data-parallel ranks, a step of global_batch/(b·d) microbatches (or one)."""
    from actmem.model.hf_parameters import hf_parameters

    model, arch = spec.model, spec.architecture
    parameters = hf_parameters(arch.code.model_class(arch).name, model.hidden, model.vocab, model.seq_len,
                               model.layers, arch, model.heads)
    return zero.zero_model(spec.run.zero, parameters, spec.data_parallel, spec.microbatches or 1,
                           model.vocab * model.hidden, checkpointed=spec.run.recompute is Recompute.FULL)


def _parameters(spec: Spec, t: int, stage: int, layers: int) -> ParameterBytes:
    model, run, arch = spec.model, spec.run, spec.architecture
    vocab = padded_vocab(model.vocab, t, spec.vocab_divisible_by)
    if run.fsdp:
        return fsdp.model_state(_sharded_model(spec, t, vocab, arch))
    if run.zero:
        return zero.model_state(_zero_model(spec))
    # the multi-token-prediction layers' weights, whatever the recompute, are layers of the last model kind
    # beside their own norms and projection; a MoE model's dense layers are its dense twin's
    mtp = mtp_layers_held(spec, stage, full_recompute=False)
    moe = sum(stage_moe_layers(spec, stage)) + mtp * mtp_layer_kind(spec) if arch.moe else None
    extra = mtp_parameters(model.hidden, t, vocab, arch, run.pipeline_parallel) if mtp else 0
    fp8 = [experts for experts, fp8 in stage_layer_kinds(spec, stage, mtp) if fp8]   # FP8 layers: which have experts
    return stage_state(model.hidden, model.layers, run.pipeline_parallel, t, vocab, model.seq_len, arch, model.heads,
                       stage_layers=layers + mtp, stage=stage, shards=spec.optimizer_shards,
                       expert_shards=spec.expert_optimizer_shards, distributed_optimizer=run.distributed_optimizer,
                       gradient_bytes=spec.gradient_bytes, optimizer_bytes=spec.optimizer.bytes_per_parameter,
                       ep=run.expert_parallel, etp=run.etp if t == run.tensor_parallel else 1, moe_layers=moe,
                       extra=extra, dense_layers_too=bool(moe and layers + mtp - moe), gpu_fp8=spec.gpu_fp8,
                       fp8_layers=(len(fp8), sum(fp8)) if arch.fp8_first_last_bf16 else None,
                       eh_projections=mtp, megatron_fsdp=spec.megatron_fsdp_strategy,
                       fsdp_bucket_size=megatron_fsdp.bucket_size(spec) if run.megatron_fsdp else None,
                       fsdp_double_buffer=run.fsdp_double_buffer)


