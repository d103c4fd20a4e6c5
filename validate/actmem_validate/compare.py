"""Formula against measurement, term by term: the rows of the error table."""

from actmem.estimate import Estimate
from actmem.terms import TERMS

PAPER_TERMS = [term.name for term in TERMS]


def compare(config, est: Estimate, run, rank: int, peak_bytes: int, native_mask_bytes: int = 1) -> list[dict]:
    """One row a term the formula or the measurement has; then 'total' (all saved bytes
    against the formula's activations); 'allocated' (what is allocated above the parameters
    right after the forward that made that peak) and 'peak' (the allocator's peak during
    the schedule), both information rather than checks; and, where PyTorch's own dropout
    keeps a wider mask than 1 byte, what that choice would add ('pytorch_choice')."""
    formula = {row.term.name: row.total_bytes for row in est.run_terms}
    measured = run.terms_at_peak
    names = [n for n in PAPER_TERMS if n in formula or n in measured]
    names += sorted(set(measured) - set(PAPER_TERMS))
    rows = [_row(config, rank, name, formula.get(name, 0), measured.get(name, 0),
                 "paper" if name in PAPER_TERMS else "residual") for name in names]
    rows.append(_row(config, rank, "total", est.activations_bytes, run.peak_saved_bytes, "total"))
    rows.append(_row(config, rank, "allocated", est.activations_bytes, run.allocated_at_peak, "allocated"))
    rows.append(_row(config, rank, "peak", est.activations_bytes, peak_bytes, "peak"))
    masks = sum(n for name, n in measured.items() if name.endswith("dropout_mask"))
    if native_mask_bytes > 1 and masks:
        rows.append(_row(config, rank, f"native_dropout_mask_extra ({native_mask_bytes} B/element)", 0,
                         masks * (native_mask_bytes - 1), "pytorch_choice"))
    return rows


def _row(config, rank, term, formula_bytes, measured_bytes, kind) -> dict:
    error = 100 * (measured_bytes - formula_bytes) / formula_bytes if formula_bytes else None
    return {"config": config.label, "technique": config.technique, "rank": rank, "term": term,
            "kind": kind, "formula_bytes": int(formula_bytes), "measured_bytes": int(measured_bytes),
            "error_percent": error}


def worst_error(rows: list[dict]) -> float:
    """Largest |error| over the terms the paper counts (residual terms are reported, not checked)."""
    errors = [abs(r["error_percent"]) for r in rows if r["kind"] == "paper" and r["error_percent"] is not None]
    return max(errors, default=0.0)
