"""The error table in the terminal."""

from rich.console import Console
from rich.table import Table
from rich.text import Text


def render_rows(rows: list[dict]) -> None:
    console = Console(highlight=False)
    for config in dict.fromkeys(row["config"] for row in rows):
        table = Table(title=config, title_justify="left", title_style="bold", pad_edge=False)
        for column in ("rank", "term", "formula B", "measured B", "error"):
            table.add_column(column, justify="left" if column == "term" else "right")
        for row in (r for r in rows if r["config"] == config):
            table.add_row(str(row["rank"]), _term(row), f"{row['formula_bytes']:,}",
                          f"{row['measured_bytes']:,}", _error(row))
        console.print(table)
    console.print(Text("error: (measured - formula) / formula. residual: saved by PyTorch, not "
                       "counted by the paper. total: every saved byte at the stage's peak against the "
                       "formula. allocated: all memory above the parameters at that moment; peak: the "
                       "allocator's peak during the schedule (gradients, buffers): information. "
                       "native_dropout_mask_extra: what PyTorch's own dropout, with its wider mask on "
                       "this device, would add; the harness keeps 1-byte masks as Megatron does.",
                       style="dim"))


def _term(row) -> Text:
    style = {"residual": "dim", "total": "bold", "peak": "italic", "allocated": "italic",
             "pytorch_choice": "dim"}.get(row["kind"], "")
    return Text(row["term"] + (" (residual)" if row["kind"] == "residual" else ""), style=style)


def _error(row) -> Text:
    if row["error_percent"] is None:
        return Text("–", style="dim")
    error = row["error_percent"]
    style = "green" if row["kind"] != "paper" or error == 0 else "red"
    return Text(f"{error:+.4f}%", style=style if row["kind"] in ("paper", "total") else "dim")
