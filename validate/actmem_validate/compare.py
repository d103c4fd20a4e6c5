"""Formula against measurement, term by term: the rows of the error table, and the gate.

Every saved byte lands in exactly one kind of row:
- ``paper``: a term of actmem's table. It must match the formula, in both directions: a
  term measured where the formula has 0 (selective recompute silently broken, say) fails
  as surely as a term in the formula that nothing saved.
- ``residual``: a tensor PyTorch keeps that the paper leaves out, one of ``RESIDUALS``
  below. Each is sized from what the harness's code saves (``expected_residuals``) and
  must match that size exactly, so nothing can hide inside a residual's name.
- ``unnamed``: anything else (a tensor no layer labelled). Always a failure: nothing is
  saved that the table does not name.
Then ``total``: every saved byte at the stage's peak, against the formula's activations
plus the expected residuals. Under CPU offloading, ``host``: what the host copies held at their
most against actmem's host line, both ways. Under FSDP2, ``state``: the sharded parameters', gradients' and
optimizer's storages against actmem's model state, both ways. ``peak`` holds the allocator's peak against actmem's floor
(``actmem.memory.peak``: main gradients, activations in flight, the rerun layer, all live at one
moment; the harness keeps no optimizer and its weights are left out of both): it fails
below the floor, and above it by more than a gap the run allows (``--max-peak-gap``; the
transients actmem does not model yet). Under context parallelism the row is ``floor_cp``,
judged from below only: the harness's context-parallel attention all-gathers k and v and
computes fp32 s/c x s scores, its own peak, not Transformer Engine's ring.
``rerun`` (Megatron-Core's layers): each rerun of a CheckpointWithoutOutput (--recompute-modules layernorm's two
norms, mla_up_proj, moe_act) measured as it ends, and of Megatron's own checkpoint the attention core's
(core_attn) before the backward through it, the saved storages still alive and what the reruns keep, against
actmem's rerun moment for one layer, both ways (a rerun measured that actmem does not price fails, and one it prices
that does not run).
``allocated``, ``pytorch_choice`` and ``reserve`` rows are information.
"""

from actmem.memory.estimate import Estimate

from actmem.memory.stage_model import chunk_layers
from actmem.memory.techniques import run_technique
from actmem.memory.terms import TERMS
from actmem.model.recompute import Recompute

PAPER_TERMS = [term.name for term in TERMS]

#: tensors PyTorch saves that the paper does not count, and why they are not errors
RESIDUALS = {
    "attention_norm_statistics": "fp32 mu and rsigma of the LayerNorm before attention (8 B a token), "
                                 "rsigma of an RMSNorm (4 B a token), as TE's fused norms keep them; "
                                 "the paper leaves them out (on the flash path they are a counted term)",
    "mlp_norm_statistics": "the same for the norm before the MLP",
    "final_norm_statistics": "the same for the final norm, when the stage holds the output layer",
    "token_ids": "the embedding's int64 token indices and its bool out-of-shard mask: 9 B a token, "
                 "for each microbatch whose embedding the stage holds",
    "position_ids": "the position embedding's int64 indices: 8s B a microbatch held",
    "cross_entropy_targets": "the loss's int64 target indices and bool out-of-shard mask: 9 B a "
                             "token, when the stage holds the output layer (p = 1); transformers' "
                             "loss keeps its shifted int64 labels, 8 B a token",
    "cross_entropy_total_weight": "transformers' loss (nll_loss) keeps its fp32 total weight, 4 B",
    "core_attn_mask_type": "Megatron's core_attn checkpoint keeps the attention mask type as a tensor, "
                           "torch.tensor([value], dtype=torch.int) (attention.py, _checkpointed_attention_forward): "
                           "4 B a layer, left out as the paper leaves it",
    "sdpa_rng_state": "on a GPU, SDPA runs cuDNN's attention (transformers' sdpa on an H200, torch 2.11; torchtitan's first choice), which keeps "
                      "its philox seed and offset for the backward: 16 B a layer",
    "flash_rng_state": "on a GPU, SDPA's flash kernel keeps its philox state for the backward, 24 B a "
                       "call: rng_state, 2 uint64, and an unused uint64 scalar (PyTorch's flash_api.cpp, "
                       "mha_fwd); TE's and flash-attn's kernels keep a like 16-byte rng_state",
}
FLASH_RNG_STATE_BYTES = {"cuda": 2 * 8 + 8, "cpu": 0}
CUDNN_RNG_STATE_BYTES = 2 * 8
"""On a GPU, the philox seed and offset cuDNN's attention keeps a call: two int64 [1] (measured on an
H200 with torch 2.11: 32 B over two layers); none from the CPU's flash kernel."""
"""The flash kernel's saved philox state by device type: none on the CPU's kernel
(_scaled_dot_product_flash_attention_for_cpu returns no rng tensors)."""
CHECKED = ("paper", "residual", "unnamed", "total", "floor", "floor_cp", "host", "state", "held", "rerun")
"""The kinds of row the gate judges; the others are information."""
HARNESS_LEAVES_OUT = ("weights", "optimizer_state")
"""Rows of the floor the harness's peak does not hold: its peak is measured above the
parameters, and it runs no optimizer step."""
INDEX_BYTES, FLAG_BYTES, STATISTIC_BYTES = 8, 1, 4     # int64 indices, bool masks, fp32 statistics


def expected_residuals(spec, occupancy, device: str = "cpu") -> dict:
    """Bytes of each residual on the first stage at its peak, from what the harness's own
    code saves (gpt.py, fused.py): per norm held (where the formula does not count them),
    per microbatch whose embedding is held, once for the loss when p = 1, and per flash
    core held on a GPU."""
    s, b, run, arch = spec.model.seq_len // spec.run.context_parallel, spec.run.micro_batch, spec.run, spec.architecture
    tokens_per_norm = s * b // (run.tensor_parallel if run.sequence_parallel else 1)
    layers = _whole_layers(spec, occupancy)            # full recompute: inside the checkpoint
    per_norm = tokens_per_norm * arch.norm_statistics * STATISTIC_BYTES    # rsigma; mu and rsigma
    counted = arch.attention_core != "eager"      # terms of the table on the flash path
    return {                   # (the eager core's MLP norm is outside the MLP's checkpoint: kept)
        "attention_norm_statistics": 0 if counted else layers * per_norm,
        "mlp_norm_statistics": 0 if counted else layers * per_norm,
        "final_norm_statistics": 0 if counted else int(occupancy.holds_output_layer) * per_norm,
        "token_ids": occupancy.microbatches * s * b * (INDEX_BYTES + FLAG_BYTES),
        "position_ids": (arch.position_embedding == "learned") * occupancy.microbatches * s * INDEX_BYTES,
        "cross_entropy_targets": int(occupancy.holds_output_layer) * s * b * (INDEX_BYTES + FLAG_BYTES),
        "flash_rng_state": _flash_cores_held(spec, layers) * FLASH_RNG_STATE_BYTES.get(device.split(":")[0], 0),
    }


def expected_host_residual(spec, device: str = "cpu") -> int:
    """What the offloaded layers copy to the host beyond actmem's host line: on a GPU, each offloaded layer's
    SDPA flash core hands TE's offloading its philox state too (24 B, flash_rng_state; TE v2.11's
    _check_if_offload takes any contiguous CUDA tensor, however small). actmem leaves out TE's own 16 B
    (actmem.memory.offload, "Not counted"); the harness names its kernel's, as the residual rows do."""
    return _flash_cores_held(spec, spec.run.offload_layers) * FLASH_RNG_STATE_BYTES.get(device.split(":")[0], 0)


def _flash_cores_held(spec, layers: int) -> int:
    """SDPA flash cores whose saved tensors are held: one a whole layer; none where selective
    recompute reruns the core (Megatron's core_attn checkpoint keeps only its inputs), nor
    under context parallelism (the harness's own ring-less attention, context.py)."""
    run = spec.run
    rerun = run.recompute is Recompute.SELECTIVE and "core_attn" in (run.recompute_modules or ("core_attn",))
    sdpa = spec.architecture.attention_core != "eager" and run.context_parallel == 1
    return layers if sdpa and not rerun else 0


def _whole_layers(spec, occupancy) -> int:
    """Layers held whole (not inside a full-recompute checkpoint) on the first stage: per
    model chunk as the run's technique splits it, times the chunks in flight."""
    run = spec.run
    technique = run_technique(run.sequence_parallel, run.policy)
    # outside full recompute no layer is inside a checkpoint: all are whole
    whole = chunk_layers(technique, spec.chunk_layers)[1] if run.recompute is Recompute.FULL else spec.chunk_layers
    return occupancy.layer_activations // spec.chunk_layers * whole - run.offload_layers   # those on the host


def run_term_bytes(est: Estimate) -> dict:
    """{term: bytes} of the estimate's run, a term's rows summed (an FP8 run's bf16 layers keep a row of their own)."""
    totals: dict = {}
    for row in est.run_terms:
        totals[row.term.name] = totals.get(row.term.name, 0) + row.total_bytes
    return totals


def _kind(name: str, residuals: dict) -> str:
    """A residual where the harness expects one (the norms' statistics are residuals on the
    eager path and terms of the table on the flash path), else a term, else unnamed."""
    if name in residuals:
        return "residual"
    if name in PAPER_TERMS:
        return "paper"
    return "residual" if name in RESIDUALS else "unnamed"


def compare(config, est: Estimate, run, rank: int, peak_bytes: int, device: str = "cpu",
            native_mask_bytes: int = 1, kept_for_the_process: int = 0) -> list[dict]:
    """One row a term the formula or the measurement has, and one a residual the harness
    expects or measures; then 'total'; 'allocated' (above the parameters right after the
    forward that made the peak) and 'peak' (the allocator's peak during the schedule); and,
    where PyTorch's own dropout keeps a wider mask than 1 byte, what that choice would add
    ('pytorch_choice'); on a GPU, what its warm-up pass left allocated for the process
    ('reserve': cuBLAS's workspaces, measure._warm_up). A residual row's formula_bytes are
    the harness's expected size."""
    residuals = {name: n for name, n in expected_residuals(config.spec, est.occupancy, device).items() if n}
    formula = run_term_bytes(est) | residuals
    measured = run.terms_at_peak
    names = [n for n in PAPER_TERMS if n in formula or n in measured]
    names += sorted((set(measured) | set(residuals)) - set(PAPER_TERMS))
    rows = [_row(config, rank, name, formula.get(name, 0), measured.get(name, 0), _kind(name, residuals))
            for name in names]
    rows.append(_row(config, rank, "total", est.activations_bytes + sum(residuals.values()),
                     run.peak_saved_bytes, "total"))
    if est.host_bytes or run.host_bytes:          # CPU offloading's host copies, checked both ways
        rows.append(_row(config, rank, "host_offload", est.host_bytes + expected_host_residual(config.spec, device),
                         run.host_bytes, "host"))
    rows.append(_row(config, rank, "allocated", est.activations_bytes + est.parameters.gradients_bytes
                     + est.parameters.dummy_wgrads_bytes,
                     run.allocated_at_peak, "allocated"))
    floor = est.peak
    rows.append(_row(config, rank, "peak", floor.total_bytes - floor.bytes_of(*HARNESS_LEAVES_OUT),
                     peak_bytes, "floor_cp" if config.spec.run.context_parallel > 1 else "floor"))
    if kept_for_the_process:
        rows.append(_row(config, rank, "kept_for_the_process", 0,
                         kept_for_the_process, "reserve"))
    masks = sum(n for name, n in measured.items() if name.endswith("dropout_mask"))
    if native_mask_bytes > 1 and masks:
        rows.append(_row(config, rank, f"native_dropout_mask_extra ({native_mask_bytes} B/element)", 0,
                         masks * (native_mask_bytes - 1), "pytorch_choice"))
    return rows


def term_rows(config, rank: int, formula: dict, measured: dict, widths: dict | None = None) -> list[dict]:
    """The rows of a backend that measures saved tensors only (torch-native, hf): one a term
    or residual either side has, then the total. A term of the table is checked both ways, a
    named residual against the size given, anything else is unnamed. A storage that holds
    several terms, measured as 'a+b', is checked against their sum (and they are not checked
    alone). ``widths``: {term: (factor, why)} for a term the device keeps at another width
    than the formula's (a CPU's 16-bit LayerNorm statistics): checked at formula x factor,
    the row saying why."""
    formula = _joined(formula, [name for name in measured if "+" in name])
    widths = {name: width for name, width in (widths or {}).items() if name in formula}
    formula = {name: _at_width(formula[name], widths[name][0]) if name in widths else formula[name]
               for name in formula}
    names = list(formula) + sorted(set(measured) - set(formula))
    label = lambda name: f"{name} ({widths[name][1]})" if name in widths else name
    rows = [_row(config, rank, label(name), formula.get(name, 0), measured.get(name, 0), _backend_kind(name))
            for name in names]
    return rows + [_row(config, rank, "total", sum(formula.values()), sum(measured.values()), "total")]


def _at_width(formula_bytes, factor) -> int:
    """Bytes of a term whose every element is kept at ``factor`` times the formula's width."""
    scaled = formula_bytes * factor
    if scaled != int(scaled):
        raise ValueError(f"{formula_bytes} B at {factor} of its width is not whole bytes")
    return int(scaled)


def _joined(formula: dict, joints: list) -> dict:
    """The formula with each joint 'a+b' in place of its parts, sized as their sum."""
    for joint in joints:
        parts, rows = set(joint.split("+")), {}
        for name, value in formula.items():
            if name not in parts:
                rows[name] = value
            elif joint not in rows:
                rows[joint] = sum(formula.get(part, 0) for part in parts)
        rows.setdefault(joint, 0)
        formula = rows
    return formula


#: the reruns the harness measures (gloo.rerun_moments): megatron-core's CheckpointWithoutOutput's, and of its own
#: checkpoint's the attention core's, the MoE layer's and the shared experts' (gloo._checkpoint_unit: not the MLP's)
MEASURED_RERUNS = ("input_layernorm", "mla_up_proj", "core_attn", "pre_mlp_layernorm", "moe_act", "moe", "shared_experts")


def rerun_rows(config, rank: int, technique, arch, rows: dict, table, bindings: dict, measured: dict) -> list[dict]:
    """One ``rerun`` row a CheckpointWithoutOutput rerun either side has: actmem's moment for one layer (the
    rows ``rows`` holds, less those the rerun finds freed, plus what it remakes: engine.freed_layer_rows,
    rematerialised_bytes, bound to ``bindings``) against ``measured`` ({unit: bytes}, gloo.rerun_moments). A
    rerun is priced where the unit drops a row of ``table``, the terms the harness's layer has."""
    from actmem.memory import engine
    from actmem.memory.terms import layer_terms
    from actmem.model.recompute import rerun_units

    formula = {}
    if technique.recompute is Recompute.SELECTIVE:
        for unit in (unit for unit in rerun_units(technique.modules) if unit in MEASURED_RERUNS):
            if not any(term.module_of(arch) == unit and term in table for term in layer_terms(arch)):
                continue
            freed = sum(rows.get(term.name, 0) for term in engine.freed_layer_rows(technique, arch, unit)
                        if term.name not in engine.dispatcher_keeps(arch))     # one microbatch: the dispatcher's last
            remade = engine.exact(engine.rematerialised_bytes(technique, arch, module=unit), bindings)
            formula[unit] = sum(rows.values()) - freed + remade
    return [_row(config, rank, f"rerun {unit}", formula.get(unit, 0), measured.get(unit, 0), "rerun")
            for unit in sorted(set(formula) | set(measured))]


def _backend_kind(name: str) -> str:
    if all(part in PAPER_TERMS for part in name.split("+")):
        return "paper"
    return "residual" if name in RESIDUALS else "unnamed"


def _row(config, rank, term, formula_bytes, measured_bytes, kind) -> dict:
    error = 100 * (measured_bytes - formula_bytes) / formula_bytes if formula_bytes else None
    return {"config": config.label, "technique": config.technique.name, "rank": rank, "term": term,
            "kind": kind, "formula_bytes": int(formula_bytes), "measured_bytes": int(measured_bytes),
            "error_percent": error}


def row_error(row: dict) -> float:
    """|error| in percent; infinite where the formula has 0 bytes and the measurement does not."""
    if row["formula_bytes"]:
        return abs(row["measured_bytes"] - row["formula_bytes"]) / row["formula_bytes"] * 100
    return float("inf") if row["measured_bytes"] else 0.0


def judge(rows: list[dict], max_error: float, max_peak_gap: float | None = None) -> list[str]:
    """Mark each row 'pass', 'fail' or 'info' (its 'gate' field) and return one line a
    failure. An unnamed row fails whatever its size; a term, residual or total fails when
    off by more than max_error percent, and whatever the tolerance when one side is 0 and
    the other is not (a tensor missing, or one that should not exist). A peak fails below
    actmem's floor, and ('floor' rows) more than max_peak_gap percent above it when given."""
    failures = []
    for row in rows:
        if row["kind"] not in CHECKED:
            row["gate"] = "info"
            continue
        one_side_only = (row["formula_bytes"] == 0) != (row["measured_bytes"] == 0)
        if row["kind"] in ("floor", "floor_cp"):
            off = row["measured_bytes"] < row["formula_bytes"] or (
                row["kind"] == "floor" and max_peak_gap is not None and row_error(row) > max_peak_gap)
        else:
            off = row["kind"] == "unnamed" or one_side_only or row_error(row) > max_error
        row["gate"] = "fail" if off else "pass"
        if off:
            failures.append(_failure(row))
    return failures


def _failure(row: dict) -> str:
    where = f"{row['config']}, rank {row['rank']}: {row['term']}"
    measured, formula = f"{row['measured_bytes']:,} B", f"{row['formula_bytes']:,} B"
    if row["kind"] == "unnamed":
        return f"{where} saved {measured} that no term or named residual accounts for"
    if row["kind"] == "total":
        return f"{where}: {measured} saved, but the terms and named residuals add up to {formula}"
    if row["kind"] == "held":
        return f"{where}: the forward leaves {measured} alive, but the saved tensors filed add up to {formula}"
    if row["kind"] in ("floor", "floor_cp") and row["measured_bytes"] < row["formula_bytes"]:
        return (f"{where}: the allocator's peak, {measured}, is below actmem's floor of {formula} "
                "(main gradients, activations in flight and the rerun layer, all live at one moment)")
    if row["kind"] == "floor":
        return (f"{where}: the allocator's peak, {measured}, is {row['error_percent']:+.2f}% above "
                f"actmem's floor of {formula}, more than --max-peak-gap allows")
    if row["kind"] == "residual":
        return f"{where} (residual) measured {measured}, the harness's code saves {formula}"
    if row["kind"] == "state":
        return f"{where}: the model state's storages hold {measured}, actmem says {formula}"
    if row["kind"] == "rerun":
        return f"{where}: the rerun holds {measured} as it ends, actmem's rerun moment {formula}"
    if row["kind"] == "host":
        return f"{where}: the host copies held {measured} at their most, actmem's host line says {formula}"
    if not row["formula_bytes"]:
        return f"{where} measured {measured} where the formula has none"
    return f"{where} measured {measured}, formula {formula} ({row['error_percent']:+.4f}%)"


def worst_error(rows: list[dict]) -> float:
    """Largest |error| in percent over the rows the gate checks (infinite for an unnamed row
    or a term the formula lacks)."""
    errors = [float("inf") if row["kind"] == "unnamed" else row_error(row)
              for row in rows if row["kind"] in CHECKED and not row["kind"].startswith("floor")]
    return max(errors, default=0.0)
