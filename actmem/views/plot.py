"""Drawing only: each function takes a frame of actmem.views.plot_frames and returns a matplotlib Figure.

No number is computed here: bytes become GiB (or MiB) for the axes, and the frames say the
rest (what fits, the run, the crossover, the best configuration). matplotlib is imported
inside the functions, Agg-backed through ``matplotlib.figure.Figure``, never pyplot, so no
global state is touched and ``import actmem.views.plot`` works without it.
"""

from pathlib import Path

from actmem.memory.pipeline import split_text
from actmem.views.plot_frames import MAP_MEMORY_COLUMN, MEMORY_PARTS
from actmem.units import column_unit

GIB = 2**30
SIZE_IN = (8.0, 5.0)
DPI = 100

#: the parts of a bar: activations in blues, the model state in greens, the transient hatched
_PARTS = {
    "layers_bytes": ("activations: layers (Eq 5)", "#3b6fb6"),
    "extra_bytes": ("activations: embedding, output, masks", "#9dbde6"),
    "weights_bytes": ("weights", "#2e7d4f"),
    "gradients_bytes": ("gradients held throughout", "#6fb386"),
    "optimizer_bytes": ("optimizer: master weights, Adam", "#b9dcc4"),
    "dummy_wgrads_bytes": ("dummy weight gradients (16-bit, TE's)", "#c9d98c"),
    "fp8_bytes": ("FP8 weight copies and scaling state (TE's)", "#e3c98c"),
    "gathered_bytes": ("weights gathered through the step (Megatron-FSDP's)", "#a9c4e0"),
    "double_buffer_bytes": ("Megatron-FSDP's double buffers (its fixed pools)", "#7fa7cf"),
    "transient_bytes": ("at the peak: rerun, gradients, buffers", "#d9d9d9"),
}
_GPU_LINE = {"color": "#c0392b", "linestyle": "--", "linewidth": 1.2}


def _figure(size_in, dpi, **kw):
    from matplotlib.figure import Figure

    return Figure(figsize=size_in, dpi=dpi, layout="constrained", **kw)


def _plain_axes(ax):
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.tick_params(labelsize=8)


def _gib_formatter():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda value, _: f"{value:,.0f}")


def _title(fig, headline: str, detail: str) -> None:
    fig.suptitle(f"{headline}\n{detail}", fontsize=10, x=0.01, ha="left")


# -- where the memory goes -----------------------------------------------------------------

def memory_figure(frame, size_in=SIZE_IN, dpi=DPI):
    """One stacked bar a technique: activations, model state and the recompute rerun, up
    to the peak floor; the GPU's memory as a line. Bars far above it are cut and labelled."""
    import numpy as np

    fig = _figure(size_in, dpi)
    ax = fig.add_subplot()
    positions = np.arange(len(frame))
    bottom = np.zeros(len(frame))
    stack = []
    for part in MEMORY_PARTS:
        label, colour = _PARTS[part]
        heights = frame[part].to_numpy(dtype=float) / GIB
        stack.append(ax.bar(positions, heights, 0.65, bottom=bottom, color=colour, label=label, edgecolor="white",
                            linewidth=0.5, hatch="///" if part == "transient_bytes" else None))
        bottom += heights
    gpu_gib = frame.gpu_memory_bytes.iloc[0] / GIB
    line = ax.axhline(gpu_gib, **_GPU_LINE, label=f"GPU memory, {gpu_gib:,.0f} GiB")
    _label_bars(ax, positions, frame.peak_bytes.to_numpy() / GIB, top_gib=2.5 * gpu_gib)
    ax.set_xticks(positions, [f"{name}\n(this run)" if run else name
                              for name, run in zip(frame.technique, frame.is_run)])
    ax.set_ylabel("GiB per GPU", fontsize=9)
    ax.yaxis.set_major_formatter(_gib_formatter())
    _plain_axes(ax)
    ax.legend(handles=[line, *reversed(stack)], loc="upper left", bbox_to_anchor=(1.01, 1),   # as stacked
              frameon=False, fontsize=8)
    first = frame.iloc[0]
    _title(fig, f"Where the memory goes: {first.model}, {first.config}",
           "per GPU of the first pipeline stage, at its allocator-peak floor, for each technique of Table 2")
    return fig


def _label_bars(ax, positions, peaks_gib, top_gib: float) -> None:
    """The peak above each bar; a bar above ``top_gib`` is cut there, its value at the cut."""
    cut = peaks_gib.max() > top_gib
    ax.set_ylim(0, top_gib if cut else peaks_gib.max() * 1.12)
    for x, peak in zip(positions, peaks_gib):
        y = min(peak, top_gib)
        text = f"{peak:,.0f} ↑" if peak > top_gib else f"{peak:,.1f}"
        ax.text(x, y, text, ha="center", va="top" if peak > top_gib else "bottom", fontsize=7,
                color="white" if peak > top_gib else "black", fontweight="bold" if peak > top_gib else None)


# -- how it grows ----------------------------------------------------------------------------

def growth_figure(frame, over="seq_len", size_in=SIZE_IN, dpi=DPI):
    """Peak memory per GPU against s (log-log: the s² terms show as slope 2) or b, one line a
    technique; an X where a line first goes over the GPU; dotted, where the s² terms of a
    layer overtake the rest."""
    from matplotlib.ticker import LogLocator, NullFormatter

    fig = _figure(size_in, dpi)
    ax = fig.add_subplot()
    for name, rows in frame.groupby("technique", sort=False):
        run = rows.is_run.iloc[0]
        (line,) = ax.plot(rows[over], rows.peak_bytes / GIB, marker="o", markersize=3,
                          linewidth=2.6 if run else 1.4, label=f"{name} (this run)" if run else name)
        for first in rows[rows.first_over_gpu].itertuples():
            ax.plot(getattr(first, over), first.peak_bytes / GIB, marker="X", markersize=9,
                    color=line.get_color(), markeredgecolor="black", linestyle="none")
    gpu_gib = frame.gpu_memory_bytes.iloc[0] / GIB
    ax.axhline(gpu_gib, **_GPU_LINE, label=f"GPU memory, {gpu_gib:,.0f} GiB")
    ax.plot([], [], marker="X", color="grey", markeredgecolor="black", linestyle="none",
            label="first point over the GPU")
    if over == "seq_len":
        _mark_crossovers(ax, frame)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
    ax.yaxis.set_major_formatter(_gib_formatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylabel("GiB per GPU (log)", fontsize=9)
    _sweep_axis(ax, frame, over)
    _plain_axes(ax)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False, fontsize=8)
    first = frame.iloc[0]
    swept = "sequence length s" if over == "seq_len" else "microbatch size b"
    _title(fig, f"How it grows: {first.model}, {first.config}",
           f"peak floor per GPU of the first pipeline stage as the {swept} grows")
    return fig


def _sweep_axis(ax, frame, over: str) -> None:
    from matplotlib.ticker import FixedLocator, NullFormatter

    values = sorted(frame[over].unique())
    if over == "seq_len":
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length s (log)", fontsize=9)
    else:
        ax.set_xlabel("microbatch size b", fontsize=9)
    ax.xaxis.set_major_locator(FixedLocator(values))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(values, [f"{value:,}" for value in values], rotation=45 if len(values) > 8 else 0)


def _mark_crossovers(ax, frame) -> None:
    """One dotted line at each s where a layer's s² terms overtake the rest, naming the
    techniques that cross there (34h/5a for the paper's layer when t splits both alike: no
    parallelism, or tensor + sequence parallel)."""
    crossings = frame.dropna(subset=["attention_overtakes_seq_len"]).groupby(
        "attention_overtakes_seq_len", sort=True).technique.unique()
    for s, names in crossings.items():
        ax.axvline(s, color="#777777", linestyle=":", linewidth=1)
        ax.text(s, 0.98, f"s = {s:,.1f}: s² terms pass the rest ({', '.join(names)})  ",
                transform=ax.get_xaxis_transform(), rotation=90, ha="right", va="top", fontsize=7,
                color="#555555", bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})


# -- which configurations fit ---------------------------------------------------------------

def map_figure(frame, size_in=SIZE_IN, dpi=DPI):
    """The planner's t x p grid, each cell coloured by the memory of its fastest fitting
    configuration over every c (else its leanest) against the budget, with its c written
    where the plan swept more than one; hatched where nothing fits; the plan's choice framed."""
    from matplotlib.colors import TwoSlopeNorm

    fig = _figure(size_in, dpi)
    ax = fig.add_subplot()
    cells = frame[frame.drawn]          # one row a (t, p); the frame keeps every c for --csv
    contexts = sorted(frame.c.unique())
    first = frame.iloc[0]
    budget_gib = first.budget_bytes / GIB
    memory_gib = cells[MAP_MEMORY_COLUMN] / GIB
    norm = TwoSlopeNorm(vcenter=budget_gib, vmin=min(memory_gib.min(), 0.5 * budget_gib),
                        vmax=max(min(memory_gib.max(), 2 * budget_gib), 1.01 * budget_gib))
    image = _map_panel(ax, cells, norm, with_c=len(contexts) > 1)
    bar = fig.colorbar(image, ax=ax, shrink=0.9,
                       extend="max" if memory_gib.max() > norm.vmax else "neither")   # cut above 2x budget
    bar.set_label(f"GiB per GPU ({MAP_MEMORY_COLUMN.removesuffix('_bytes')})", fontsize=8)
    bar.ax.axhline(budget_gib, color="black", linewidth=1.5)
    bar.ax.tick_params(labelsize=7)
    best = frame[frame.is_best]
    chosen = f"best: {best.config.iloc[0]}" if len(best) else "nothing fits"
    over_c = f" over every c swept ({contexts[0]:,} to {contexts[-1]:,})" if len(contexts) > 1 else ""
    _title(fig, f"Which configurations fit: {first.model} on {first.gpus_total:,} x {first.gpu}, "
                f"global batch {first.global_batch:,}",
           f"budget {budget_gib:,.0f} GiB (GPU {first.gpu_memory_bytes / GIB:,.0f} GiB less "
           f"{first.reserve_bytes / GIB:,.0f} GiB reserve); {chosen}\n"
           f"a cell shows its fastest fitting configuration{over_c}, else its leanest; hatched: none fits")
    _fit_cell_texts(fig, ax, len(cells.t.unique()), len(cells.p.unique()))
    return fig


def _map_panel(ax, cells, norm, with_c: bool):
    from matplotlib.patches import Rectangle

    grid = cells.pivot(index="t", columns="p", values=MAP_MEMORY_COLUMN) / GIB
    image = ax.imshow(grid.to_numpy(dtype=float), cmap=_budget_colours(), norm=norm, aspect="auto")
    rows, columns = list(grid.index), list(grid.columns)
    for cell in cells.itertuples():
        x, y = columns.index(cell.p), rows.index(cell.t)
        if not cell.fits:
            ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, hatch="//", edgecolor="#b2182b55",
                                   linewidth=0))
        if cell.is_best:
            ax.add_patch(Rectangle((x - 0.47, y - 0.47), 0.94, 0.94, fill=False, edgecolor="black",
                                   linewidth=2.5))
        ax.text(x, y, _cell_text(cell, with_c), ha="center", va="center", fontsize=_CELL_FONT,
                fontweight="bold" if cell.is_best else None)
    ax.set_xticks(range(len(columns)), [_pipeline_tick(cells[cells.p == p].iloc[0]) for p in columns])
    ax.set_yticks(range(len(rows)), [str(t) for t in rows])
    ax.set_xlabel("pipeline-parallel size p", fontsize=9)
    ax.set_ylabel("tensor-parallel size t", fontsize=9)
    ax.tick_params(labelsize=8, length=0)
    return image


#: A cell's text in points where it has room; smaller cells shrink it to fit, and below
#: _SMALLEST_CELL_FONT a cell keeps only its first two lines (memory; c, m, b): the CSV has the rest.
_CELL_FONT = 6.5
_SMALLEST_CELL_FONT = 5.0


def _fit_cell_texts(fig, ax, rows: int, columns: int) -> None:
    """One font size for every cell's text, and one for the pipeline ticks, the largest (up
    to their own) at which each lies inside its cell or column, so that nothing runs into
    its neighbour."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)                      # measures text as PNG and SVG draw it (in points)
    fig.draw_without_rendering()              # the constrained layout sets the cells' size
    ticks = ax.get_xticklabels()
    _set_font(ticks, _fitting_font(fig, ticks, ax.bbox.width / columns, float("inf")))
    fig.draw_without_rendering()              # smaller ticks leave the cells more room
    cell = (ax.bbox.width / columns, ax.bbox.height / rows)
    size = _fitting_font(fig, ax.texts, *cell)
    if size < _SMALLEST_CELL_FONT:
        for text in ax.texts:
            text.set_text("\n".join(text.get_text().splitlines()[:2]))
        size = _fitting_font(fig, ax.texts, *cell)
    _set_font(ax.texts, size)


def _fitting_font(fig, texts, width: float, height: float) -> float:
    """The font size at which the widest and the tallest of these texts fill 92% of a box
    (text grows in proportion to its size), at most the size they have."""
    renderer = fig.canvas.get_renderer()
    extents = [text.get_window_extent(renderer) for text in texts if text.get_text()]
    scale = min([min(0.92 * width / box.width, 0.92 * height / box.height) for box in extents], default=1)
    return texts[0].get_fontsize() * min(scale, 1)


def _set_font(texts, size: float) -> None:
    for text in texts:
        text.set_fontsize(size)


def _budget_colours():
    """Greens under the budget, reds over it; light at both ends, so black text reads on all."""
    from matplotlib.colors import LinearSegmentedColormap

    return LinearSegmentedColormap.from_list("budget", ["#4dac26", "#b8e186", "#f7f7f7", "#f4a582", "#d6604d"])


def _cell_text(cell, with_c: bool) -> str:
    """'40.6 GiB / m=3 b=1 / sp sel dopt / 44 of 144 fit', with 'c=16' first on the second line
    where the plan swept more than one c; the count is the cell's, over every c."""
    words = [word for word in cell.config.split() if not word.startswith(("t=", "c=", "p="))]
    sizes, switches = (" ".join(word for word in words if ("=" in word) == named) for named in (True, False))
    if with_c:
        sizes = f"c={cell.c:,} {sizes}"
    tried = cell.cell_configurations
    verdict = f"{cell.cell_fitting:,} of {tried:,} fit" if cell.fits else f"none of {tried:,} fits"
    return f"{getattr(cell, MAP_MEMORY_COLUMN) / GIB:,.1f} GiB\n{sizes}\n{switches}\n{verdict}"


def _pipeline_tick(cell) -> str:
    """'35', or an uneven pipeline's p over its split: '16' / '3+7x14+4'."""
    layers = (cell.first_stage_layers, cell.stage_layers, cell.last_stage_layers)
    if len(set(layers)) == 1:
        return str(cell.p)
    return f"{cell.p}\n{split_text(*layers, cell.p)}"


# -- formula against measurement --------------------------------------------------------------

def validation_figure(frame, size_in=SIZE_IN, dpi=DPI):
    """Formula and measured bytes of each term of the paper side by side, with the error;
    beside them, apart, the residuals (what PyTorch keeps that the paper leaves out) against
    what the harness's code saves."""
    fig = _figure(size_in, dpi)
    terms_ax, residuals_ax = fig.subplots(1, 2, width_ratios=(3, 2))
    _paired_bars(terms_ax, frame[frame.kind == "paper"], "terms of the paper", "formula")
    residuals = frame[frame.kind.isin(["residual", "unnamed"])]
    if len(residuals):
        _paired_bars(residuals_ax, residuals, "residuals, apart", "the harness's code saves")
    else:
        residuals_ax.set_axis_off()
        residuals_ax.text(0.5, 0.5, "no residuals", ha="center", va="center", fontsize=9)
    first = frame.iloc[0]
    _title(fig, f"Formula against measurement: {first.config}, rank {first['rank']}", _totals(frame))
    return fig


def _paired_bars(ax, rows, title: str, expected: str) -> None:
    import numpy as np

    unit = column_unit(list(rows.formula_bytes) + list(rows.measured_bytes))
    positions = np.arange(len(rows))
    ax.barh(positions - 0.2, rows.formula_bytes / unit[1], 0.4, color="#9dbde6", label=expected)
    ax.barh(positions + 0.2, rows.measured_bytes / unit[1], 0.4, color="#3b6fb6", label="measured")
    for y, row in zip(positions, rows.itertuples()):
        unnamed = row.kind == "unnamed"
        no_formula = row.error_percent != row.error_percent          # NaN: the formula has 0 bytes
        error = "unnamed" if unnamed else "—" if no_formula else f"{row.error_percent:+.2f}%"
        ax.text(max(row.formula_bytes, row.measured_bytes) / unit[1], y, f" {error}", va="center", fontsize=6.5,
                color="#c0392b" if unnamed or row.gate == "fail" else "#555555")
    ax.set_yticks(positions, list(rows.term))
    ax.invert_yaxis()
    ax.set_xlabel(unit[0], fontsize=9)
    ax.set_xmargin(0.18)
    ax.set_title(title, fontsize=9, loc="left")
    _plain_axes(ax)
    ax.tick_params(axis="y", labelsize=7)
    ax.legend(fontsize=7, frameon=False, loc="best")


def _totals(frame) -> str:
    """The 'total' and 'peak' rows of the run, as one line."""
    parts = []
    for kind, text in (("total", "saved in all: measured {m}, terms + residuals {f}"),
                       ("floor", "allocator peak {m}, actmem's floor {f}")):
        rows = frame[frame.kind == kind]
        if len(rows):
            row = rows.iloc[0]
            parts.append(text.format(m=f"{row.measured_bytes / GIB:,.2f} GiB",
                                     f=f"{row.formula_bytes / GIB:,.2f} GiB"))
    return "\n".join(parts) or "the rows of one measured run of actmem validate"


# -- files -----------------------------------------------------------------------------------

def save(fig, path) -> None:
    """PNG or SVG by the suffix, without the date and software stamps, so a file drawn twice
    from the same frame is the same file."""
    kind = Path(path).suffix.lower().lstrip(".")
    stamps = {"png": {"Software": None}, "svg": {"Date": None, "Creator": None}}[kind]
    fig.savefig(path, format=kind, dpi=fig.dpi, metadata=stamps)
