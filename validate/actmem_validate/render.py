"""The error table in the terminal."""

from rich.table import Table
from rich.text import Text

_GATE = {"pass": Text("✓", style="green"), "fail": Text("✗", style="bold red"), "info": Text("", style="dim")}


def render_rows(rows: list[dict]) -> None:
    from actmem.views.render import terminal

    console = terminal()
    for config in dict.fromkeys(row["config"] for row in rows):
        table = Table(title=config, title_justify="left", title_style="bold", pad_edge=False)
        for column in ("rank", "term", "formula B", "measured B", "error", "gate"):
            table.add_column(column, justify="left" if column == "term" else "right",
                             no_wrap=column != "term")
        for row in (r for r in rows if r["config"] == config):
            table.add_row(str(row["rank"]), _term(row), f"{row['formula_bytes']:,}",
                          f"{row['measured_bytes']:,}", _error(row), _GATE.get(row.get("gate"), ""))
        console.print(table)
    console.print(Text("error: (measured - formula) / formula. Checked (gate ✓/✗): every term of the "
                       "paper, in both directions; anything saved that no term or named residual "
                       "accounts for (unnamed); and total, every saved byte at the stage's peak "
                       "against the formula plus the named residuals; host_offload, under CPU offloading, "
                       "what the host copies held at their most against actmem's host line, both ways; "
                       "peak, the allocator's peak "
                       "during the schedule (above the parameters, with Megatron's fp32 main "
                       "gradients), which fails only below actmem's floor (main gradients, activations "
                       "in flight, the rerun layer): its error is the transients not modelled yet. "
                       "Information: residual (saved by "
                       "PyTorch, not counted by the paper); allocated, all memory above the parameters "
                       "at that moment; "
                       "native_dropout_mask_extra, what PyTorch's own dropout, with its wider mask on "
                       "this device, would add (the harness keeps 1-byte masks as Megatron does); "
                       "kept_for_the_process, on a GPU, what an unmeasured first pass left allocated "
                       "for the life of the process (cuBLAS's workspaces), which --reserve covers.",
                       style="dim"))


def _term(row) -> Text:
    style = {"residual": "dim", "total": "bold", "floor": "italic", "allocated": "italic",
             "pytorch_choice": "dim", "reserve": "dim", "unnamed": "bold red"}.get(row["kind"], "")
    suffix = {"residual": " (residual)", "unnamed": " (unnamed)"}.get(row["kind"], "")
    return Text(row["term"] + suffix, style=style)


def _error(row) -> Text:
    if row["error_percent"] is None:
        failed = row.get("gate") == "fail"
        return Text("new" if failed else "–", style="bold red" if failed else "dim")
    error = row["error_percent"]
    if row.get("gate") in ("pass", "fail"):
        return Text(f"{error:+.4f}%", style="green" if row["gate"] == "pass" else "bold red")
    return Text(f"{error:+.4f}%", style="dim")
