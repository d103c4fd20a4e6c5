"""The frames the plots draw that no other CSV writes: every number a picture shows is here.

``actmem plot`` draws these frames and nothing else (actmem.views.plot only converts bytes to
GiB for the axes), and ``--csv`` writes each one as it is, so a picture can always be
checked against its table:

- ``memory_frame``: Table 2's techniques on the run, each split into the parts that stack
  to its peak floor (the estimate's technique rows, the parameters split into weights,
  gradients and optimizer state, and what the recompute rerun holds above the total).
- ``growth_frame``: the same rows at a list of sequence lengths (or microbatch sizes), with
  the s² terms of one layer apart from the rest and where the first overtakes the second.
- ``map_frame``: the planner's configurations, one row for each (t, c, p): the fastest
  fitting configuration there, else the leanest; ``drawn`` on the one of each t x p cell the
  map shows (chosen the same way over every c).
- ``validation_frame``: the rows of one measured run of an ``actmem validate`` CSV.
"""

from dataclasses import replace
from fractions import Fraction
from types import SimpleNamespace

import sympy

from actmem.memory import engine
from actmem.model import symbols
from actmem.errors import SpecError
from actmem.memory.terms import layer_terms

#: The plan column the map colours by and takes the leanest configuration by, when nothing
#: in a cell fits: the peak floor of the busiest stage, as plan fits on.
MAP_MEMORY_COLUMN = "peak_bytes"

#: The parts a technique's bar stacks, bottom to top; they add up to ``peak_bytes``. gradients_bytes: those held at
#: every moment; FSDP2's and ZeRO-1/2's, held at some moments only, are in transient_bytes where the peak holds them.
MEMORY_PARTS = ("layers_bytes", "extra_bytes", "weights_bytes", "gradients_bytes", "optimizer_bytes",
                "dummy_wgrads_bytes", "fp8_bytes", "gathered_bytes", "double_buffer_bytes", "transient_bytes")

#: What ``actmem validate --format csv`` writes (actmem_validate.compare: the row, then its gate).
VALIDATION_COLUMNS = ("config", "technique", "rank", "term", "kind", "formula_bytes", "measured_bytes",
                      "error_percent", "gate")

#: The sweep around the model's own s when no values are given: s/8 to 8s, in steps of
#: about x1.4 (a power of two, then 1.5 times it).
_SEQ_LEN_STEPS = tuple(Fraction(step) for step in ("1/8", "3/16", "1/4", "3/8", "1/2", "3/4", "1", "3/2",
                                                    "2", "3", "4", "6", "8"))
_MICRO_BATCHES = (1, 2, 4, 8, 16)


def run_label(spec) -> str:
    """'t=8 p=35 m=3 b=1 sp sel', as the planner labels a configuration ('sel:core_attn+layernorm'
    for recompute modules the planner does not sweep, 'uniform=2' for Megatron's uniform groups)."""
    from actmem.planner.plan import config_label
    from actmem.memory.stages import stage_layers
    from actmem.memory.techniques import PLAN_BLOCK, sweep_name

    run, policy = spec.run, spec.run.policy
    block = policy.method == "block" and policy.layers < spec.chunk_layers
    whole_chunk = policy.method == "block" and not block        # block N as large as a chunk: plain full
    name = PLAN_BLOCK if block else (sweep_name(policy) if whole_chunk or not policy.partial else None) or policy.word
    layers = stage_layers(spec)
    label = config_label(SimpleNamespace(t=run.tensor_parallel, c=run.context_parallel, p=run.pipeline_parallel,
                                         m=run.interleave, b=run.micro_batch,
                                         first_stage_layers=layers[0], last_stage_layers=layers[-1],
                                         stage_layers=layers[1] if len(layers) > 2 else layers[0],
                                         sequence_parallel=run.sequence_parallel, recompute=name,
                                         recompute_layers=policy.layers if block else 0,
                                         distributed_optimizer=run.distributed_optimizer and not run.megatron_fsdp))
    return label + (f" mfsdp:{spec.megatron_fsdp_strategy}" if run.megatron_fsdp else "")


# -- where the memory goes -----------------------------------------------------------------

def memory_frame(spec):
    """One row a technique of the estimate (Table 2 and full recompute under SP) on the first
    pipeline stage, with the parts its bar stacks up to its peak floor; shares technique,
    label, is_run, per_layer_bytes, layers_bytes, extra_bytes, total_bytes, peak_bytes and
    fits with the techniques section of ``actmem estimate --format csv``."""
    import pandas as pd
    from actmem.memory.estimate import estimate

    return pd.DataFrame(_technique_rows(estimate(spec)))


def _technique_rows(est) -> list[dict]:
    spec = est.spec
    rows = []
    for row in est.techniques:
        params = row.parameters
        s2 = _s_squared_per_layer_bytes(spec, row.technique)
        rows.append({"model": spec.name, "config": run_label(spec), "technique": row.technique.name,
                     "label": row.technique.label, "is_run": row is est.run_row, "seq_len": spec.model.seq_len,
                     "micro_batch": spec.run.micro_batch, "per_layer_bytes": row.per_layer_bytes,
                     "attention_s2_per_layer_bytes": s2, "other_per_layer_bytes": row.per_layer_bytes - s2,
                     "layers_bytes": row.layers_bytes, "extra_bytes": row.extra_bytes,
                     "weights_bytes": params.weights_bytes,
                     "gradients_bytes": 0 if params.transient_gradients else params.gradients_bytes,
                     "optimizer_bytes": params.optimizer_bytes, "dummy_wgrads_bytes": params.dummy_wgrads_bytes,
                     "fp8_bytes": params.fp8_bytes, "gathered_bytes": params.gathered_bytes,
                     "double_buffer_bytes": params.double_buffer_bytes,
                     "total_bytes": row.total_bytes,
                     "transient_bytes": row.transient_bytes, "peak_bytes": row.peak_bytes,
                     "gpu_memory_bytes": spec.gpu_memory_bytes, "fits": est.technique_fits(row)})
    return rows


def _s_squared_per_layer_bytes(spec, technique) -> int:
    """One layer's terms quadratic in s (the attention scores: 5as²b/t in the paper's
    layer); 0 under recompute that drops them or a flash core that never keeps them."""
    t = spec.run.tensor_parallel if technique.tensor_parallel else 1     # 'none' is t = 1
    bindings = spec.bindings_at(t)
    arch = spec.architecture
    quadratic = [engine.term_bytes(term, technique, arch) for term in layer_terms(arch) if _quadratic_in_s(term.size(arch))]
    return engine.exact(sympy.Add(*quadratic), bindings)


def _quadratic_in_s(size) -> bool:
    """A row with s squared in it, expanded (the scores' as²b); a second derivative would also call a ceiling, a
    floor or a Min of s (the MoE rows) quadratic, where sympy leaves a step's derivative standing."""
    return any(power.base == symbols.s and power.exp >= 2 for power in sympy.expand(size).atoms(sympy.Pow))


# -- how it grows ----------------------------------------------------------------------------

def growth_frame(spec, over: str = "seq_len", values=None, advance=lambda: None):
    """``memory_frame`` rows at each value of s (over='seq_len') or b (over='micro_batch'),
    technique by technique, and for each technique the s where its s² terms overtake the
    rest of a layer (``attention_overtakes_seq_len``; NaN where they never do in the sweep)."""
    import pandas as pd
    from actmem.memory.estimate import estimate

    values = sweep_values(spec, over)[0] if values is None else list(values)
    rows = []
    for value in values:
        rows += _technique_rows(estimate(_swept(spec, over, value)))
        advance()
    order = list(dict.fromkeys(row["technique"] for row in rows))     # the estimate's order
    frame = pd.DataFrame(sorted(rows, key=lambda row: (order.index(row["technique"]), row[over])))
    crossover = {name: attention_overtakes(group) if over == "seq_len" else float("nan")
                 for name, group in frame.groupby("technique", sort=False)}
    return frame.assign(attention_overtakes_seq_len=frame.technique.map(crossover),
                        first_over_gpu=_first_over_gpu(frame))


def _first_over_gpu(frame):
    """True where a technique's line stops fitting: its first sweep point over the GPU right
    after one that fit (the frame is in sweep order within each technique)."""
    def first_stop(fits):
        stops = fits.shift(fill_value=False) & ~fits
        return stops & (stops.cumsum() == 1)

    return frame.groupby("technique", sort=False).fits.transform(first_stop)


def _swept(spec, over: str, value: int):
    """The spec at one sweep value, its run checked whole (the base spec may be dims_only, so
    that a run refused at its own b or s still sweeps the values it allows); a value the
    run's rules refuse names itself."""
    try:
        if over == "seq_len":
            return replace(spec, model=replace(spec.model, seq_len=value), dims_only=False)
        return replace(spec, run=replace(spec.run, micro_batch=value), dims_only=False)
    except SpecError as error:
        raise SpecError(f"the sweep at {over} = {value}: {error}") from None


def sweep_values(spec, over: str) -> tuple[list[int], dict[int, str]]:
    """s/8 to 8s around the model's s, or b = 1 to 16: those the run can take, and {value:
    why} for those it cannot (the caller says so: a line that stops early is not silent)."""
    if over == "seq_len":
        s = spec.model.seq_len
        candidates = [int(s * step) for step in _SEQ_LEN_STEPS if (s * step).denominator == 1]
    else:
        candidates = list(_MICRO_BATCHES)
    usable, refused = [], {}
    for value in candidates:
        try:
            _swept(spec, over, value)
            usable.append(value)
        except SpecError as error:
            refused[value] = str(error)
    return usable, refused


def attention_overtakes(rows) -> float:
    """The s where one layer's s² terms equal the rest, from a technique's sweep rows: their
    ratio is linear in s (s² terms over terms linear in s), so it is interpolated exactly
    between the two rows that straddle 1. For the paper's layer (section 4.1) 5as²b against
    34sbh, s = 34h/5a, where t splits both alike (no parallelism, TP + SP); NaN where the
    sweep holds no crossing."""
    rows = rows.sort_values("seq_len")
    ratio = (rows.attention_s2_per_layer_bytes / rows.other_per_layer_bytes).to_list()
    seq = rows.seq_len.to_list()
    for (s0, r0), (s1, r1) in zip(zip(seq, ratio), zip(seq[1:], ratio[1:])):
        if r0 <= 1 <= r1 and r1 > r0:
            return s0 + (1 - r0) * (s1 - s0) / (r1 - r0)
    return float("nan")


# -- which configurations fit ---------------------------------------------------------------

def map_frame(plan, model_name: str):
    """One row for each (t, c, p) the planner swept: the fastest configuration there that
    fits, else the leanest by MAP_MEMORY_COLUMN; with how many it tried and how many fit, and
    ``is_best`` on the plan's overall choice. The picture has one cell for each (t, p), so
    ``drawn`` marks the row it shows there, chosen the same way over every c, and
    ``cell_configurations`` and ``cell_fitting`` count that cell over every c. The plan
    columns are those of ``actmem plan --format csv``, the request's settings beside them."""
    from actmem.planner.plan import config_label
    from actmem.views.report import PLAN_COLUMNS

    keys, cell = ["t", "c", "p"], ["t", "p"]
    counts = plan.evaluated.groupby(keys).fits.agg(configurations="size", fitting="sum")
    cell_counts = plan.evaluated.groupby(cell).fits.agg(cell_configurations="size", cell_fitting="sum")
    best = plan.fitting.index[0] if not plan.fitting.empty else None
    frame = plan.evaluated.loc[_fastest_else_leanest(plan.evaluated, keys)]
    drawn = _fastest_else_leanest(plan.evaluated, cell)     # a (t, p) choice is its (t, c, p) choice too
    table = frame[PLAN_COLUMNS].assign(is_best=frame.index == best, drawn=frame.index.isin(drawn))
    table = (table.merge(counts, left_on=keys, right_index=True)
             .merge(cell_counts, left_on=cell, right_index=True).sort_values(["c", "t", "p"]))
    table.insert(0, "config", [config_label(row) for row in table.itertuples()])
    return table.assign(**_request_settings(plan.request, model_name)).reset_index(drop=True)


def _fastest_else_leanest(evaluated, keys: list[str]) -> list:
    """The index of each group's row the map shows: rows keep the plan's order (fitting
    first, fastest first), so the first where any fits, else the least MAP_MEMORY_COLUMN."""
    return [group.index[0] if group.fits.any() else group[MAP_MEMORY_COLUMN].idxmin()
            for _, group in evaluated.groupby(keys, sort=True)]


def _request_settings(req, model_name: str) -> dict:
    """What ``actmem plan --format csv`` writes beside each row, and the model's name."""
    from actmem.views.report import plan_settings

    return {"model": model_name} | plan_settings(req)


# -- formula against measurement --------------------------------------------------------------

def validation_frame(path: str, config: str | None = None, rank: int = 0):
    """The rows of one measured run (config and rank) of an ``actmem validate --format csv``
    file, as written: the first config in the file unless one is named."""
    table = _validation_table(path)
    configs = list(dict.fromkeys(table["config"]))
    if not configs:
        raise SpecError(f"--from {path}: it has a header and no rows")
    config = configs[0] if config is None else config
    rows = table[(table["config"] == config) & (table["rank"] == rank)]
    if rows.empty:
        raise SpecError(f"--from {path}: no rows for config {config!r} at rank {rank}; it has "
                        f"{'; '.join(configs)}")
    return rows.reset_index(drop=True)


def _validation_table(path: str):
    """The file's rows, each field the plot reads checked and typed: one that is not what
    ``actmem validate`` writes is named with its line (the header is line 1), not found by
    the drawing."""
    import pandas as pd

    header, records = _csv_records(path)
    missing = [column for column in VALIDATION_COLUMNS if column not in header]
    if missing:
        raise SpecError(f"--from {path}: not a table of `actmem validate --format csv`, it lacks "
                        f"{', '.join(missing)}")
    rows = []
    for line, fields in records:
        if len(fields) != len(header):
            raise SpecError(f"--from {path}: line {line} has {len(fields)} fields, the header {len(header)}")
        row = dict(zip(header, fields))
        rows.append(row | {column: _field(f"--from {path}: line {line}", column, row[column], read)
                           for column, read in _VALIDATION_FIELDS.items()})
    return pd.DataFrame(rows, columns=header)


def _csv_records(path: str) -> tuple[list[str], list[tuple[int, list[str]]]]:
    """The header and each row that is not blank, with the line it ends on. The csv module,
    not pandas, so that a row is never silently shifted to an index or cut to the header."""
    import csv

    try:
        with open(path, newline="", encoding="utf-8-sig") as file:     # -sig: a spreadsheet's BOM
            reader = csv.reader(file)
            header = next(reader, None)
            records = [(reader.line_num, fields) for fields in reader if any(field.strip() for field in fields)]
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise SpecError(f"--from {path}: cannot read it as CSV ({error})") from None
    if not header:
        raise SpecError(f"--from {path}: it is empty, not a table of `actmem validate --format csv`")
    return header, records


def _field(where: str, column: str, field: str, read):
    """One field through its reader, which returns (value, None) or (None, what the field
    should be); one that is not what validate writes is named with where it is."""
    value, wanted = read(field.strip())
    if wanted is None:
        return value
    if not field.strip():
        raise SpecError(f"{where}: {column} is blank" + (f", not {wanted}" if wanted else ""))
    raise SpecError(f"{where}: {column} {field!r} is not {wanted}")


def _whole_number(wanted: str):
    """A reader of counts: 4096 (or 4096.0, 4.096e3), at least 0 and within int64."""
    def read(field: str):
        try:
            value = Fraction(field)
        except (ValueError, ZeroDivisionError):
            return None, wanted
        if value.denominator != 1 or value < 0:
            return None, wanted
        if value >= 2**63:
            return None, f"{wanted} under 2^63"
        return int(value), None
    return read


def _percent(field: str):
    """A percentage, or blank where the formula has 0 bytes (validate writes no error then)."""
    if not field:
        return float("nan"), None
    try:
        return float(field), None
    except ValueError:
        return None, "a percentage (or blank)"


def _named(field: str):
    """Text that names something (a run, a term, a kind of row): blank is all it can fail by."""
    return (field, None) if field else (None, "")


_BYTES = "a whole number of bytes"

#: The reader of each column the plot reads: (value, None), or (None, what the field should be).
#: The other columns (technique, gate, any added) are kept as text.
_VALIDATION_FIELDS = {"config": _named, "rank": _whole_number("a rank (0, 1, 2, ...)"), "term": _named,
                      "kind": _named, "formula_bytes": _whole_number(_BYTES), "measured_bytes": _whole_number(_BYTES),
                      "error_percent": _percent}
