"""One estimate: a spec in, a table of named byte counts out. No terminal here."""

from dataclasses import dataclass, replace
from functools import cached_property

from actmem import engine, rules
from actmem.architecture import (PAPER, Architecture, counts_norm_statistics, te_layer_spec, torch_softmax,
                                 unfused_weight_gradients)
from actmem import symbols
from actmem.parameters import ParameterBytes, dummy_wgrad_elements, parameter_bytes, stage_parameters
from actmem.peak import PeakFloor, peak_floor
from actmem.stage_model import StageCounts, chunk_layers, stage_activations
from actmem.pipeline import StageOccupancy, stage_occupancy
from actmem.stages import StageLoad, stage_layers
from actmem.errors import SpecError
from actmem.spec import Spec, padded_vocab
from actmem.techniques import BASELINE, BY_NAME, TECHNIQUES, Technique, matching, run_technique, unnamed_run
from actmem.terms import TERMS, Recompute, Scope, Term
from actmem.units import plural
from actmem.widths import (ACTIVATION_BYTES, GRADIENT_BYTES, LOGITS_BYTES, MASK_BYTES,
                           WEIGHT_BYTES)


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
        """What the peak moment holds above the saved activations (actmem.peak)."""
        return self.peak_moment.bytes - self.first_stage_bytes

    @property
    def peak_bytes(self) -> int:
        """The stage's allocator peak from below (actmem.peak)."""
        return self.total_bytes + self.transient_bytes

    def backward_moment(self, name: str):
        """The evaluated backward.Moment of one moment of the last layer's backward ('fc1',
        'core', 'softmax')."""
        return next(moment.detail for moment in self.moments if moment.name == name)


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

    @cached_property
    def peak(self) -> PeakFloor:
        """This stage's allocator peak from below (actmem.peak.PeakFloor): the model state, the
        activations in flight and what the first backward reruns, live at one moment."""
        return peak_floor(self.run)

    @cached_property
    def stages(self) -> tuple:
        """Every stage of the pipeline (actmem.stages.StageLoad), this one included."""
        return tuple(StageLoad(i, layers, self.occupancy, self.run) if i == self.stage else
                     _stage_load(self.spec, self.run.technique, i, layers)
                     for i, layers in enumerate(stage_layers(self.spec)))

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
        """Tensor parallelism, Figure 7's 100%; 'none' for code that runs on one device."""
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


def _positions_note(arch, s: int) -> str:
    rows = arch.position_rows
    if rows is None or rows == s:
        return ", learned position embedding of s rows"
    return (f", learned position embedding of {rows:,} rows (--max-position-embeddings; "
            f"{rows - s:,} more than the s positions a sequence reads, parameters all the same)")


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
    rows = modelled_techniques(spec) + ((unnamed_run(run),) if matching(run) is None else ())
    techniques = tuple(_technique_row(spec, tech, occupancy, layers) for tech in rows)
    parameters = _parameters(spec, spec.run.tensor_parallel, stage, layers)
    return Estimate(
        spec=spec,
        occupancy=occupancy,
        techniques=techniques,
        run=_technique_row(spec, run, occupancy, layers),
        run_terms=tuple(row for row in terms if row.total_bytes),
        parameters=parameters,
        assumptions=_assumptions(spec, occupancy, techniques, parameters),
        stage=stage,
    )


def architecture_at(spec: Spec, t: int) -> Architecture:
    """The spec's architecture as a run of it at tensor-parallel size t executes: Megatron's local
    core on torch's fallback softmax where its fused kernel does not run at this s, b, a and t
    (rules.fused_softmax_runs; 'none' runs at t = 1)."""
    return spec.architecture.with_fused_softmax(rules.fused_softmax_runs(replace(spec.rule_values(), t=t)))


def _occupancy(spec: Spec, stage: int, layers: int) -> StageOccupancy:
    return stage_occupancy(spec.model.layers, spec.run.pipeline_parallel, spec.run.interleave,
                           spec.microbatches, layers, stage)


def _stage_load(spec: Spec, run: Technique, stage: int, layers: int) -> StageLoad:
    occupancy = _occupancy(spec, stage, layers)
    return StageLoad(stage, layers, occupancy, _technique_row(spec, run, occupancy, layers))


def modelled_techniques(spec: Spec) -> tuple:
    """The techniques actmem models for this architecture (flash attention: no selective rows)
    and implementation (one that runs on one device: 'none' alone)."""
    unmodelled = spec.architecture.unmodelled_recompute(spec.model.heads)
    parallel = "tensor" in spec.architecture.code.runs
    return tuple(tech for tech in TECHNIQUES if tech.recompute.value not in unmodelled
                 and (parallel or not tech.tensor_parallel))


def _counts(occupancy: StageOccupancy) -> tuple:
    return occupancy.layer_activations, occupancy.microbatches, int(occupancy.holds_output_layer)


def _term_row(term, technique, occupancy, bindings, arch) -> TermRow:
    count = engine.stage_count(term, *_counts(occupancy))
    return TermRow(term, engine.exact(engine.term_bytes(term, technique, arch), bindings), count)


def _run_terms(spec: Spec, run: Technique, occupancy) -> tuple:
    """The run's terms. With partial full recompute, a chunk's checkpoints count the layer
    input and its whole layers count everything the same run without recompute keeps."""
    arch, bindings = architecture_at(spec, spec.run.tensor_parallel), spec.bindings()
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


def _technique_t(spec: Spec, technique: Technique) -> int:
    """The t a technique runs at: the run's, or 1 for 'none' (no parallelism)."""
    return spec.run.tensor_parallel if technique.tensor_parallel else 1


def _technique_row(spec: Spec, technique: Technique, occupancy, stage_layers: int,
                   arch: Architecture | None = None) -> TechniqueRow:
    """A technique's row; ``arch``: in place of the spec's architecture as the run executes it."""
    layer_activations, microbatches, holds_output = _counts(occupancy)
    t = _technique_t(spec, technique)
    bindings = spec.bindings() | {symbols.t: t, engine.holds_output: holds_output,
                                  engine.microbatches_held: microbatches,
                                  symbols.v: padded_vocab(spec.model.vocab, t, spec.vocab_divisible_by)}
    arch = arch or architecture_at(spec, t)
    per_chunk = occupancy.chunk_layers
    counts = StageCounts(per_chunk, layer_activations // per_chunk if per_chunk else 0)
    stage = stage_activations(technique, arch, lambda expr: engine.exact(expr, bindings), counts)
    per_layer = (stage.layers_bytes / layer_activations if technique.partial else
                 engine.exact(engine.per_layer_bytes(technique, arch), bindings))
    return TechniqueRow(technique, per_layer, stage.layers_bytes, stage.extra_bytes,
                        _parameters(spec, t, occupancy.stage, stage_layers),
                        tuple(moment for moment in stage.moments if moment.present))


def _parameters(spec: Spec, t: int, stage: int, layers: int) -> ParameterBytes:
    model, run = spec.model, spec.run
    vocab = padded_vocab(model.vocab, t, spec.vocab_divisible_by)
    count = stage_parameters(model.hidden, model.layers, run.pipeline_parallel, t, vocab, model.seq_len,
                             spec.architecture, model.heads, layers, stage)
    dummies = dummy_wgrad_elements(model.hidden, t, vocab, spec.architecture, model.heads,
                                   holds_output=int(stage == run.pipeline_parallel - 1))
    return parameter_bytes(count, spec.optimizer_shards, run.distributed_optimizer, dummies, spec.gradient_bytes,
                           spec.optimizer.bytes_per_parameter)


def _layer_formula(arch) -> str:
    """The paper's 12h² + 13h, or the weights of this architecture's layer."""
    no_weights = ("attention_dropout", "hidden_dropout", "attention_core", "position_embedding", "rope_fusion",
                  "rotary_percent", "position_rows", "implementation", "masked_softmax_fusion", "softmax_in_fp32")
    if not arch.qk_norm and replace(arch, **{name: getattr(PAPER, name) for name in no_weights}) == PAPER:
        return "12h² + 13h"
    attention = "4h²" if arch.query_groups is None and arch.head_dim is None else "h·(ad + 2gd) + ad·h"
    f = "4h" if arch.ffn_hidden is None else "f"
    return (f"{attention} + {arch.fc1_width + 1}h·{f} weights, {arch.activation}, {arch.normalization}"
            + ("" if arch.biases == "biases" else f", {arch.biases}")
            + (f", q and k {arch.normalization}s of d" if arch.qk_norm else ""))


def _attention_notes(spec: Spec, rows: tuple) -> list:
    """What the attention core keeps, and the rows it leaves out."""
    arch = spec.architecture
    if arch.code.notes:                            # another code's notes say what its attention keeps
        return [f"technique rows left out: {why}"
                for why in dict.fromkeys(arch.unmodelled_recompute(spec.model.heads).values())]
    if arch.attention_core == "eager":
        return _eager_core_notes(spec, rows)
    notes = ["attention core: flash (Transformer Engine's cuDNN fused attention, Megatron-Core's default "
             "on Hopper and newer): keeps q, k, v, its output and an fp32 log-sum-exp, no s² term; its "
             "16-byte RNG state per layer is not counted" if arch.attention_core == "flash" else
             "attention core: flash-attn through Transformer Engine: keeps q, k, v, its output and an fp32 "
             "log-sum-exp, no s² term, and at b > 1 the projection's input is a copy of that output; its "
             "16-byte RNG state per layer is not counted"]
    if arch.attention_dropout:
        notes.append("flash attention regenerates its dropout mask from the RNG state and keeps none "
                     "(flash_attn_interface.py); the CPU harness cannot measure this (SDPA's CPU flash "
                     "kernel has no dropout), so it rests on the kernels' source")
    if arch.position_embedding == "rope" and arch.rope_fusion:
        notes.append("rotary embedding as Megatron-Core's fused kernel applies it: q and k are rotated "
                     "into tensors of their own; its fp32 frequency table (4sd bytes, cached once) is "
                     "held like a buffer, not counted as activations")
    elif arch.position_embedding == "rope":
        notes.append("rotary embedding unfused (--no-rope-fusion; Megatron-Core's rope_utils.py): q and k are "
                     "rotated into tensors of their own, and the 16-bit cos and sin made for each are kept "
                     "(rope_cos_sin, whole on every rank); the fp32 frequency table is held like a buffer")
    if arch.qk_norm:
        notes.append("q and k normalised per head (--qk-layernorm; TENorm, Transformer Engine's op-based "
                     f"{arch.normalization}, as in TE 2): each keeps its input made contiguous, a copy out of the "
                     "QKV output, and fp32 statistics a head a token (qk_norm_input, qk_norm_statistics)")
    if "selective" not in arch.unmodelled_recompute(spec.model.heads, spec.run.recompute_modules) \
            and "core_attn" in (spec.run.recompute_modules or ("core_attn",)):
        notes.append("selective recompute of the attention core (core_attn) under flash: Megatron's checkpoint "
                     "keeps its inputs, the rotated q and k and v, a view of the QKV output, so that whole output "
                     "(qkv_output); it drops only TE's copy of v, the log-sum-exp and flash-attn's output copy. "
                     "Against no recompute it keeps 2sb·(a + g)d/t more and 4b·as/t less: more at every size "
                     "under TE's cuDNN core; under flash-attn at b > 1 also 2sb·ad/t less, so more unless "
                     "g·d < 2a. --recompute-modules mlp saves memory instead")
    c = spec.run.context_parallel
    if c > 1:
        notes.append(f"context parallelism c = {c}: each rank keeps s/c = {spec.model.seq_len // c:,} tokens of "
                     "every sequence, so every term is counted at s/c; its ring attention (TE's "
                     "AttnFuncWithCPAndKVP2P, Megatron's default p2p) keeps q, its own k and v, its output "
                     "and the log-sum-exp, not the keys and values it receives (a few small index and RNG "
                     "tensors a layer are not counted)")
    left_out = arch.unmodelled_recompute(spec.model.heads)
    notes += [f"technique rows left out: {why}" for why in left_out.values()]
    return notes


def _eager_core_notes(spec: Spec, rows: tuple) -> list:
    """The local core's softmax: the fused kernel where it runs; where it does not (or is switched
    off), torch's fallback, what it keeps, and the paper's rows with the kernel's bytes beside."""
    arch, values = spec.architecture, spec.rule_values()
    if not torch_softmax(architecture_at(spec, spec.run.tensor_parallel)):
        return ["attention core: eager (Megatron-Core's local DotProductAttention, the paper's): keeps the s² "
                "softmax output of its fused causal softmax, which runs here (16 < s <= 4096, 4 | s, b·a/t a "
                "multiple of the kernel's rows a block; elsewhere Megatron's torch fallback is counted)"]
    why = ("switched off (--no-masked-softmax-fusion)" if not arch.masked_softmax_fusion else
           f"does not run here: {rules.fused_softmax_reason(values)}")
    return [f"attention core: eager (Megatron-Core's local DotProductAttention): its fused causal softmax {why}, "
            f"so Megatron runs torch's softmax (fused_softmax.py, FusedScaleMaskSoftmax.forward_torch_softmax), "
            f"which keeps {_torch_softmax_keeps(arch)}", _paper_rows_note(spec, rows)]


def _torch_softmax_keeps(arch: Architecture) -> str:
    """What forward_torch_softmax and the ops after it keep, in words."""
    if arch.softmax_in_fp32:
        kept = ("in fp32 (--attention-softmax-in-fp32): its fp32 output (softmax_output_fp32, 4as²b/t), "
                + ("and the dropout keeps only its mask of the 16-bit copy" if arch.attention_dropout else
                   "and its 16-bit copy, which ·V keeps (softmax_output, 2as²b/t)"))
    else:
        kept = "in 16 bits: its output (softmax_output, 2as²b/t), the fused kernel's bytes"
    mask = ("the dataloader's mask it fills, under every recompute mode (attention_mask: masked_fill_ keeps it)"
            if arch.attention_mask else
            "the causal mask it makes at each call and fills the scores with (softmax_causal_mask: "
            "get_default_causal_mask, s² bytes of bool a layer, whole on every rank, not cached)")
    return f"{kept}; and {mask}; its backward is not in place (a 'softmax' moment of the peak floor)"


def _paper_rows_note(spec: Spec, rows: tuple) -> str:
    """Each technique row on torch's softmax, beside the paper's value: the same row with the fused
    kernel's bytes (Table 2's closed form for the paper's layer)."""
    fused = replace(spec.architecture, masked_softmax_fusion=True)
    shown = []
    for row in rows:
        t = _technique_t(spec, row.technique)
        if row.technique.partial or not torch_softmax(architecture_at(spec, t)):
            continue
        bindings = spec.bindings() | {symbols.t: t}
        paper = engine.exact(engine.per_layer_bytes(row.technique, fused), bindings)
        shown.append(f"{row.technique.name} {row.per_layer_bytes:,} B (paper {paper:,} B)")
    return ("per layer here on torch's softmax, and the paper's value beside (the same row with the fused "
            "kernel's bytes): " + "; ".join(shown))


def _recompute_notes(spec: Spec) -> list:
    """What --recompute-modules other than Megatron's default does to the rows."""
    modules = spec.run.recompute_modules
    if modules is None:
        return []
    notes = [f"selective recompute of {' and '.join(modules)} (Megatron's --recompute-modules)"
             + ("" if "core_attn" in modules else ": the attention core is not recomputed, its rows are kept")]
    if "mlp" in modules:
        kept = ("Transformer Engine fuses its norm into linear_fc1, so the MLP keeps only the norm's input "
                "(mlp_layernorm_input, one storage with the checkpoint's)" if te_layer_spec(spec.architecture) else
                "the eager core runs in Megatron's local spec, whose norm is a module of its own before the MLP, "
                "so the MLP keeps the norm's output (fc1_input, the checkpoint's input) and the norm its input")
        notes.append("recompute module mlp: Megatron checkpoints the MLP (transformer_layer.py, _forward_mlp: "
                     f"tensor_parallel.checkpoint(self.mlp, ...)); {kept}; the mask of the bias-dropout-add "
                     "after it is kept")
    if "layernorm" in modules:
        notes.append("recompute module layernorm changes no byte here: Megatron recomputes only a norm of its "
                     "own, and Transformer Engine fuses both norms into the next linear (input_layernorm and "
                     "pre_mlp_layernorm are IdentityOps in its layer spec)")
    return notes


def _mask_notes(spec: Spec) -> list:
    """Whether the dataloader's attention mask is counted, under Megatron's code."""
    if "dataloader_mask" not in spec.architecture.code.has:
        return []
    if spec.architecture.attention_mask:
        return ["the dataloader's causal attention mask (Megatron's default, create_attention_mask_in_dataloader): "
                "b·s² bytes of bool a microbatch (under context parallelism a rank's s/c rows of it), whole on "
                "every tensor-parallel rank of the first and last stages; the recompute checkpoints (core_attn's, full recompute's) save it, so it is held while "
                "its microbatch is in flight (attention_mask); without recompute it lives only during the forward"]
    return ["no dataloader attention mask counted: Megatron makes one, b·s² bytes of bool a microbatch kept "
            "by the recompute checkpoints, unless --no-create-attention-mask-in-dataloader; --attention-mask "
            "counts it (a pasted argument list without that switch has it)"]


def _assumptions(spec: Spec, occupancy: StageOccupancy, rows: tuple, parameters: ParameterBytes) -> tuple:
    arch = spec.architecture
    grad = spec.gradient_bytes
    grad_text = f"{grad} B {'fp32' if grad == GRADIENT_BYTES else '16-bit'} gradient"
    adam = spec.optimizer
    per_parameter = WEIGHT_BYTES + grad + adam.bytes_per_parameter
    notes = [
        f"activations 16-bit ({ACTIVATION_BYTES} B), dropout masks {MASK_BYTES} B, logits fp32 "
        f"({LOGITS_BYTES} B) (section 4); "
        + ("the norms' fp32 statistics counted"
           + (" (TE's fused norms keep them)" if "te_flash_core" in arch.code.has else "")
           if counts_norm_statistics(arch) else "layer-norm mean/variance left out, as in the paper")
        + "; small buffers left out",
        f"dropout: attention {arch.attention_dropout:g}, hidden {arch.hidden_dropout:g}"
        + ("" if arch.attention_dropout and arch.hidden_dropout else
           " (a dropout of 0 keeps no mask, and no attention dropout keeps no separate output)"),
        *_attention_notes(spec, rows),
        *_recompute_notes(spec),
        *_mask_notes(spec),
        ("first pipeline stage" if occupancy.stage == 0 else f"pipeline stage {occupancy.stage}")
        + f": {occupancy.explanation}"
        + ("" if occupancy.holds_output_layer else
           "; the output-layer terms of section 4.5 sit on the last stage (p > 1)")
        + ("" if occupancy.stage == 0 else "; the embedding sits on the first stage"),
        "the technique rows share this run's pipeline and microbatch and vary only t, SP and "
        "recompute; 'none' sets t = 1, so its parameters are not split either",
        *([f"embedding dropout masks of {plural(occupancy.microbatches, 'microbatch')}: p as "
           "section 4.5 counts under 1F1B, 2p at the peak of the interleaved schedule (the paper "
           "says p)"] if occupancy.stage == 0 else []),
        "the verdict is the allocator's peak from below on the busiest pipeline stage: model state, "
        "activations in flight and, under recompute, what the first backward reruns, all live at "
        "one moment (actmem.peak), or on the stage with the output layer the loss's backward "
        "and its 16-bit logits gradient, or inside the last layer's backward its fc1's and its eager "
        "core's gradients (actmem.backward); not counted yet: the other ops' backward transients "
        "(the flash core's, the QKV and projection linears', fc2's, a recomputed MLP's), allocator "
        "fragmentation, workspace and communication buffers",
        f"parameters: layers of {_layer_formula(arch)} each, word embedding split "
        "over the vocabulary on the first stage" + (
            ", tied with the output layer (the last stage keeps a copy when p > 1)" if arch.tied_output
            else "; the output layer's own weights on the last stage")
        + (_positions_note(arch, spec.model.seq_len) if arch.position_embedding == "learned" else
           "; rotary positions have no parameters"),
    ]
    if spec.run.distributed_optimizer:
        notes.append(f"{WEIGHT_BYTES} B weight + {grad_text} + {adam.describe()} / "
                     + (f"d = {spec.data_parallel}" if spec.run.context_parallel == 1 else
                        f"d·c = {spec.optimizer_shards}")
                     + " (the distributed optimizer) a parameter"
                     + ("; over one data-parallel rank it shards nothing (Megatron allows it): the plain "
                        "optimizer's bytes" if spec.optimizer_shards == 1 else ""))
        notes.append("not counted: the distributed optimizer's buffer padding (optimizer/param_layout.py: each "
                     "parameter's start aligned to 64 elements, each bucket's end to lcm(d·c, 128)): at most 63 "
                     f"elements a parameter tensor and lcm(d·c, 128) a bucket, {WEIGHT_BYTES + grad} B each")
    else:
        notes.append(f"{per_parameter} B a parameter: {WEIGHT_BYTES} B weight + {grad_text} + "
                     f"{adam.describe()} (mixed-precision Adam)")
    shard = -(-parameters.count // (spec.optimizer_shards if spec.run.distributed_optimizer else 1))
    notes += adam.notes(shard)
    if grad != GRADIENT_BYTES and not adam.precision_aware:
        notes.append("16-bit main gradients (DDP's buffer in the parameters' dtype): the optimizer step then "
                     "copies its gradients to fp32 (`.float()`, 4 B a parameter of its shard) after the last "
                     "backward has freed the activations; that moment is not counted in the peak floor")
    if unfused_weight_gradients(arch):
        notes.append("no gradient accumulation fusion (--no-gradient-accumulation-fusion): no dummy weight gradients; "
                     "each linear makes a 16-bit weight gradient at its backward (TE linear.py: the wgrad GEMM with no "
                     "out), which DDP's hook adds to main_grad and frees: fc1's is in its backward moment; the "
                     "others' (QKV, projection, fc2, the output layer's) at their own moments are not counted")
    elif "wgrad_fusion" in arch.code.has:
        notes.append("dummy weight gradients: under Megatron's DDP each linear that accumulates into main_grad "
                     "hands autograd an uncomputed 16-bit tensor of its weight's shape, and Transformer Engine "
                     "(get_dummy_wgrad, since its PR #1651, 2025) keeps one a shape for the process; older releases make one at "
                     "each weight gradient instead, a transient not modelled")
    if spec.run.gpus is None:
        notes.append("GPU count unknown: data parallel size taken as 1")
    if spec.padded_vocab != spec.model.vocab and arch.code.pads_vocab:
        notes.append(f"vocabulary {spec.model.vocab} padded to {spec.padded_vocab} "
                     f"(a multiple of {spec.vocab_divisible_by}·t, as Megatron does)")
    elif spec.padded_vocab != spec.model.vocab:
        notes.append(f"vocabulary {spec.model.vocab} sharded unevenly over t (DTensor pads none): "
                     f"rank 0 holds {spec.padded_vocab // spec.run.tensor_parallel:,} rows, counted as if "
                     f"v were {spec.padded_vocab:,}")
    return tuple(notes) + arch.code.notes_for(arch) + spec.notes
