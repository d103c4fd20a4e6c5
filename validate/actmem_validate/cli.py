"""`actmem validate`: measure real layers and compare with the formulas, term by term.

Registered with actmem's CLI through the entry-point group ``actmem.commands``, so actmem
itself never imports this package; torch is imported only when the command runs.
"""

import json
import os
import sys

import click

from actmem.cli import build_spec_from_flags, spec_options
from actmem.errors import SpecError

_TORCH_MISSING = ("actmem validate needs torch: pip install 'actmem[harness]' "
                  "(on a CPU-only machine install the CPU build of torch first)")


@click.command()
@spec_options
@click.option("--techniques", default="tp,tp-sp,tp-sel,tp-sp-sel,full,tp-sp-full", show_default=True,
              help="Comma-separated: none, tp, tp-sp, tp-sel, tp-sp-sel, full, tp-sp-full.")
@click.option("--grid", type=click.Choice(["small", "presets"]), default=None,
              help="A named grid instead of one spec: 'small' (t = 1, 2, 4 at small shapes, for "
                   "real runs) or 'presets' (the Table 3 models at full scale, for --mode fake).")
@click.option("--mode", type=click.Choice(["real", "fake"]), default="real", show_default=True,
              help="real: t processes (gloo on CPU, NCCL on GPU); fake: rank 0 of t in one "
                   "process with FakeTensorMode, any scale, no memory used.")
@click.option("--microbatches", type=int, default=None,
              help="Microbatches per iteration (default: the fewest that fill the schedule).")
@click.option("--dropout", type=float, default=0.1, show_default=True)
@click.option("--max-error", type=float, default=0.0, show_default=True,
              help="Largest |error| in percent allowed on a term the paper counts; more exits 1.")
@click.option("--timeout", type=int, default=300, show_default=True,
              help="Seconds a collective may wait before a real run gives up.")
@click.option("--format", "fmt", type=click.Choice(["rich", "json", "csv"]), default="rich", show_default=True)
@click.option("--output", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Also write the rows to this file (.json or .csv).")
def validate(techniques, grid, mode, microbatches, dropout, max_error, timeout, fmt, output, **flags):
    """Measure what real tensor- and sequence-parallel layers save, against the formulas.

    Builds the first pipeline stage as Megatron does, runs its schedule (1F1B or
    interleaved), records every tensor saved for backward (torch's saved_tensors_hooks,
    deduplicated by storage, parameters left out) and prints formula bytes, measured bytes
    and the error per term and rank. Terms PyTorch keeps that the paper does not count are
    listed as residuals; 'peak' is the allocator's peak, for information.

    \b
    Examples:
      actmem validate --model 530b --mode fake
      actmem validate --heads 8 --hidden 64 --layers 4 --vocab 512 --seq-len 32 --tp 2 --pp 2
      actmem validate --grid small
      torchrun --nproc-per-node 4 -m actmem_validate --heads 8 --hidden 64 --layers 2 \\
          --vocab 512 --seq-len 32 --tp 4
    """
    try:
        import torch  # noqa: F401
    except ImportError:
        raise click.ClickException(_TORCH_MISSING)
    from actmem_validate import grid as grids
    from actmem_validate.compare import worst_error

    configs = _configs(grids, grid, techniques, microbatches, dropout, flags)
    rows = _run(configs, mode, timeout)
    _emit(rows, fmt, output)
    worst = worst_error(rows)
    click.echo(_summary(rows, worst), err=True)
    if worst > max_error:
        click.echo(f"actmem validate: a term the paper counts is off by {worst:.4f}% "
                   f"(--max-error {max_error}%)", err=True)
        sys.exit(1)


def _configs(grids, grid, techniques, microbatches, dropout, flags):
    if grid is not None:
        return grids.GRIDS[grid]()
    from actmem_validate.measure import TECHNIQUES

    chosen = [name.strip() for name in techniques.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in TECHNIQUES]
    if unknown or not chosen:
        raise SpecError(f"unknown techniques {', '.join(unknown) or '(none given)'}; "
                        f"known: {', '.join(TECHNIQUES)}")
    if not 0 <= dropout < 1:
        raise SpecError(f"dropout must be in [0, 1), got {dropout}")
    return grids.configs_for(build_spec_from_flags(flags), chosen, microbatches, dropout)


def _run(configs, mode, timeout):
    from rich.progress import Progress

    from actmem_validate.launch import HarnessError, run_fake, run_rank, run_real

    if "LOCAL_RANK" in os.environ and mode == "real":              # under torchrun
        return _run_under_torchrun(configs, timeout, run_rank)
    with Progress(transient=True, console=_stderr_console()) as progress:
        task = progress.add_task(f"measuring ({mode})", total=len(configs))
        advance = lambda config: progress.advance(task)
        try:
            return run_fake(configs, advance) if mode == "fake" else run_real(configs, timeout, advance)
        except HarnessError as error:
            raise click.ClickException(str(error))


def _run_under_torchrun(configs, timeout, run_rank):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    mine = [config for config in configs if config.world_size == world]
    if not mine:
        raise SpecError(f"torchrun started {world} ranks but no technique runs on {world} "
                        f"(t = {configs[0].t}; 'none' runs on 1)")
    rows = run_rank(rank, world, mine, timeout, gather=True)
    if rank != 0:
        sys.exit(0)
    return rows


def _summary(rows, worst) -> str:
    runs = {(row["config"], row["rank"]) for row in rows}
    residual = {}
    for row in rows:
        if row["kind"] == "residual":
            residual[row["term"]] = max(residual.get(row["term"], 0), row["measured_bytes"])
    named = ", ".join(f"{term} (up to {n:,} B)" for term, n in sorted(residual.items())) or "none"
    return (f"{len(runs)} measured runs (config x rank); worst error on a term the paper counts: "
            f"{worst:.4f}%; residual terms: {named}")


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def _emit(rows, fmt, output):
    import pandas as pd

    table = pd.DataFrame(rows)
    if output:
        if output.endswith(".json"):
            with open(output, "w") as file:
                json.dump(rows, file, indent=1)
        else:
            table.to_csv(output, index=False)
    if fmt == "json":
        click.echo(json.dumps(rows, indent=1))
    elif fmt == "csv":
        click.echo(table.to_csv(index=False), nl=False)
    else:
        from actmem_validate.render import render_rows

        render_rows(rows)
