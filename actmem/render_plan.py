"""The planner's terminal output: the ranked table, why-not, --explain and flops."""

from rich.table import Table
from rich.text import Text

from actmem.render import _console, _table, render_estimate
from actmem.units import format_gib, gib


def render_plan(plan, top: int) -> None:
    from actmem.plan import config_label

    req, console = plan.request, _console()
    model = req.model
    console.print(Text(f"actmem plan · a={model.heads} h={model.hidden} L={model.layers} "
                       f"s={model.seq_len} on {req.gpus} × {req.gpu.name}, global batch "
                       f"{req.global_batch}", style="bold"))
    console.print(f"budget {format_gib(req.budget_bytes)} a GPU "
                  f"({format_gib(req.gpu_memory_bytes)} less {format_gib(req.reserve_bytes)} reserve); "
                  f"{len(plan.evaluated):,} configurations, {len(plan.fitting):,} fit\n")
    table = _table("Fastest that fit (seconds per iteration, estimated)")
    table.collapse_padding = True
    for column in ("config", "GiB", "time", "comp", "tp", "pp", "bubble", "dp", "MFU"):
        table.add_column(column, justify="left" if column == "config" else "right", no_wrap=True)
    for row in plan.fitting.head(top).itertuples():
        table.add_row(config_label(row), f"{gib(row.total_bytes):.1f}", f"{row.iteration_s:.2f}",
                      f"{row.compute_s:.2f}", f"{row.tensor_parallel_s:.2f}", f"{row.pipeline_p2p_s:.2f}",
                      f"+{100 * (row.bubble - 1):.1f}%", f"{row.data_parallel_s:.2f}", f"{100 * row.mfu:.1f}%")
    table.caption = ("time = (comp + tp + pp) × (1 + bubble) + dp: compute; tensor-parallel, "
                     "pipeline and data-parallel communication; d = gpus/(t·p); --explain CONFIG "
                     "shows one in full")
    table.caption_justify = "left"
    if not plan.fitting.empty:
        console.print(table)
    console.print(_why_not_table(plan))
    if plan.fitting.empty:
        leanest = plan.evaluated.loc[plan.evaluated.total_bytes.idxmin()]
        console.print(Text(f"Nothing fits {format_gib(req.budget_bytes)}: the leanest configuration, "
                           f"{config_label(leanest)}, needs {format_gib(leanest.total_bytes)}.",
                           style="bold red"))
    notes = Table.grid(padding=(0, 1))
    notes.add_column(style="dim")
    notes.add_column(style="dim")
    for note in _plan_assumptions(req):
        notes.add_row("·", note)
    console.print(Text("Assumptions", style="bold"), notes)


def _why_not_table(plan) -> Table:
    from actmem.plan import config_label

    table = _table("Each t at its leanest (why not t = ...?)")
    for column in ("t", "leanest config", "memory", "verdict"):
        table.add_column(column, justify="right" if column in ("t", "memory") else "left")
    for row in plan.why_not().itertuples():
        if row.t_fits:
            count = int((plan.fitting.t == row.t).sum())
            verdict = Text(f"{count} configurations fit", style="green")
        else:
            verdict = Text(f"over by {format_gib(row.over_bytes)}; largest part: {row.largest_part}",
                           style="red")
        table.add_row(str(row.t), config_label(row), format_gib(row.total_bytes), verdict)
    return table


def _plan_assumptions(req) -> list[str]:
    gpu = req.gpu
    return [
        f"compute: hardware FLOPs (recompute included) at {req.efficiency:.0%} of "
        f"{gpu.peak_flops / 1e12:.0f} TFLOP/s ({gpu.name})",
        f"tensor-parallel all-reduces at {gpu.intra_node_bandwidth / 1e9:.0f} GB/s a GPU; pipeline "
        f"sends and gradient reduction at {gpu.inter_node_bandwidth / 1e9:.0f} GB/s across nodes; "
        "nothing overlapped; latencies and the lower efficiency of small chunks (large m) not charged",
        "pipeline bubble (p-1)/(m·n) for n microbatches a pipeline; memory is the first stage's "
        "(actmem estimate), which holds the most",
        f"t ≤ {req.gpus_per_node} (one node), b ≤ {req.max_micro_batch}; interleaving needs "
        "microbatches a multiple of p, as Megatron does",
    ]


def render_explain(est, row) -> None:
    render_estimate(est)
    table = _table("Time per iteration (estimated)")
    table.add_column("part")
    table.add_column("seconds", justify="right")
    for part, value in (("compute (hardware FLOPs)", row.compute_s),
                        ("tensor-parallel communication", row.tensor_parallel_s),
                        ("pipeline point-to-point communication", row.pipeline_p2p_s),
                        (f"pipeline bubble × {row.bubble:.4f}",
                         (row.compute_s + row.tensor_parallel_s + row.pipeline_p2p_s) * (row.bubble - 1)),
                        ("data-parallel gradient reduction", row.data_parallel_s),
                        ("iteration", row.iteration_s)):
        table.add_row(part, f"{value:.3f}")
    table.caption = f"model FLOPs utilisation {100 * row.mfu:.1f}%"
    table.caption_justify = "left"
    _console().print(table)


def render_flops(name: str, report: dict) -> None:
    console = _console()
    console.print(Text(f"actmem flops · {name} · global batch {report['global_batch']}", style="bold"))
    console.print(f"model FLOPs per iteration: {report['model_flops']:.4e} "
                  "(72·B·s·L·h²·(1 + s/(6h) + v/(12hL)))")
    table = _table("Hardware FLOPs per iteration")
    for column in ("recompute", "hardware FLOPs", "overhead", "HFU"):
        table.add_column(column, justify="left" if column == "recompute" else "right")
    for row in report["hardware"]:
        hfu = f"{100 * row['hfu']:.1f}%" if "hfu" in row else "–"
        table.add_row(row["recompute"], f"{row['hardware_flops']:.4e}", f"+{100 * row['overhead']:.2f}%", hfu)
    console.print(table)
    if report["iteration_s"] is not None:
        console.print(f"MFU {100 * report['mfu']:.1f}% at {report['iteration_s']} s an iteration on "
                      f"{report['gpus']} GPUs of {report['peak_flops'] / 1e12:.0f} TFLOP/s peak")
