"""`actmem plot`: pictures of an estimate, a sweep, the planner's map and a validation run.

Each command parses the flags `estimate`, `plan` or `validate` take, builds one frame
(actmem.views.plot_frames), writes it as CSV with --csv and draws it with -o (actmem.views.plot), then
says in one line what it wrote. matplotlib is an optional extra: without it -o is refused
with the line that installs it, and --csv still works. Heavy imports wait inside the
commands, so `actmem --help` stays instant.
"""

from contextlib import contextmanager
from pathlib import Path

import click

from actmem.cli.main import OneLineErrors, plan_options, plan_request
from actmem.errors import SpecError
from actmem.cli.flags import build_spec_from_flags, option, spec_options

IMAGE_SUFFIXES = (".png", ".svg")
MATPLOTLIB_MISSING = "actmem plot needs matplotlib to draw: pip install 'actmem[plot]' (or --csv alone)"
_SWEEPS = {"seq-len": "seq_len", "micro-batch": "micro_batch"}


def _image_path(ctx, param, value):
    if value is not None and Path(value).suffix.lower() not in IMAGE_SUFFIXES:
        raise click.BadParameter(f"{value}: name a .png or .svg file (the suffix picks the format)")
    return _in_a_folder(value)


def _csv_path(ctx, param, value):
    if value is not None and Path(value).suffix.lower() != ".csv":
        raise click.BadParameter(f"{value}: name a .csv file")
    return _in_a_folder(value)


def _in_a_folder(value):
    """Before any work: the folder the file goes in exists."""
    if value is not None and not Path(value).absolute().parent.is_dir():
        raise click.BadParameter(f"{value}: the folder {Path(value).absolute().parent} does not exist")
    return value


def _size_in(ctx, param, value):
    """'8x5' -> (8.0, 5.0) inches."""
    width, _, height = value.lower().partition("x")
    try:
        size = (float(width), float(height))
    except ValueError:
        raise click.BadParameter(f"{value!r}: give WIDTHxHEIGHT in inches, e.g. 8x5") from None
    if not all(0 < side <= 50 for side in size):
        raise click.BadParameter(f"{value!r}: each side must be more than 0 and at most 50 inches")
    return size


def _output_options(command):
    """-o, --csv, --size and --dpi: what every plot writes, and how large."""
    options = [
        option("-o", "--output", default=None, callback=_image_path, metavar="FILE.png|FILE.svg",
                     help="The picture; its suffix picks PNG or SVG (needs matplotlib)."),
        option("--csv", "csv_path", default=None, callback=_csv_path, metavar="FILE.csv",
                     help="Also (or only) write the frame the picture draws, as it is."),
        option("--size", "size_in", default="8x5", show_default=True, callback=_size_in,
                     metavar="WxH", help="Figure size in inches."),
        option("--dpi", type=click.IntRange(20, 600), default=100, show_default=True,
                     help="Pixels an inch (PNG)."),
    ]
    for decorator in reversed(options):
        command = decorator(command)
    return command


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
def plot():
    """Pictures (PNG or SVG) of where the memory goes, how it grows, which configurations fit,
    and formula against measurement; --csv writes the frame each one draws.

    \b
    Examples:
      actmem plot memory --model 530b -o memory.png
      actmem plot growth --model 22b --recompute none -o growth.svg
      actmem plot fit --model 530b --gpus 2240 --global-batch 2240 -o fit.png
      actmem plot validation --from validation.csv -o validation.png
    """


def _not_offloaded(spec):
    """The plots draw GPU memory alone: a run that offloads activations is refused, not drawn without its host."""
    if spec.run.offload_layers:
        raise SpecError(f"the plots do not draw CPU offloading yet (--cpu-offloading-num-layers "
                        f"{spec.run.offload_layers}): `actmem estimate` prices it, with its host memory")
    return spec


@plot.command()
@spec_options
@_output_options
def memory(output, csv_path, size_in, dpi, **flags):
    """One stacked bar a technique of Table 2 on this run (the paper's Figures 1 and 7):
    activations, weights, gradients, optimizer state and the recompute rerun, up to the
    peak floor per GPU of the first pipeline stage; the GPU's memory as a line."""
    _check_outputs(output, csv_path)
    from actmem.views.plot_frames import memory_frame

    frame = memory_frame(_not_offloaded(build_spec_from_flags(flags)))
    click.echo(_write(frame, "memory_figure", output, csv_path, size_in, dpi))


@plot.command()
@spec_options
@option("--over", type=click.Choice(list(_SWEEPS)), default="seq-len", show_default=True,
              help="What grows along the x axis.")
@option("--values", "values_text", default=None, metavar="N,N,...",
              help="The values to sweep [default: s/8 to 8s around the model's s, or b = 1 to 16; "
                   "those the run allows].")
@_output_options
def growth(over, values_text, output, csv_path, size_in, dpi, **flags):
    """Memory per GPU against the sequence length (or microbatch size), one line a technique,
    with the GPU's memory drawn, where each line first goes over it, and where a layer's
    s² terms overtake the rest (s = 34h/5a for the paper's layer when t splits both alike)."""
    _check_outputs(output, csv_path)
    from actmem.views.plot_frames import sweep_values, growth_frame

    from actmem.cli.flags import MODEL_FLAGS, RUN_FLAGS, resolve

    column = _SWEEPS[over]
    given = resolve(flags, MODEL_FLAGS + RUN_FLAGS).get(column)
    if given is not None:
        raise click.UsageError(f"--{over} is what the plot sweeps: give the values with --values, "
                               f"not --{over} {given}")
    spec = _not_offloaded(build_spec_from_flags(flags, dims_only=True))      # each swept run is checked whole
    values, refused = (_parse_values(values_text), {}) if values_text else sweep_values(spec, column)
    if not values:
        raise SpecError(f"nothing in the sweep can run: {next(iter(refused.values()))}")
    with _progress(f"sweeping {over}", len(values) + (output is not None)) as advance:
        frame = growth_frame(spec, column, values, advance)
        written = _write(frame, "growth_figure", output, csv_path, size_in, dpi, advance, over=column)
    click.echo(written)
    for skipped in _by_reason(refused):
        why = refused[skipped[0]].split(": ", 1)[-1]
        click.echo(f"left out {over} = {', '.join(map(str, skipped))}, which the run refuses; at {skipped[0]}: {why}")


def _by_reason(refused: dict) -> list[list[int]]:
    """The refused values grouped by the rule that refused them: their messages alike but for
    the numbers in them."""
    import re

    groups = {}
    for value, why in refused.items():
        groups.setdefault(re.sub(r"\d[\d,]*", "#", why.split(": ", 1)[-1]), []).append(value)
    return list(groups.values())


def _parse_values(text: str) -> list[int]:
    try:
        values = [int(word) for word in text.split(",") if word.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r}: give whole numbers separated by commas", param_hint="--values")
    if not values or min(values) <= 0:
        raise click.BadParameter(f"{text!r}: give positive whole numbers", param_hint="--values")
    return sorted(set(values))


def _request_options(command):
    """The flags `actmem plan` builds its request from; not its --top, --explain or --format,
    which choose what it prints."""
    command = plan_options(command)
    command.__click_params__ = [param for param in command.__click_params__
                                if param.name not in ("top", "config", "fmt")]
    return command


@plot.command()
@_request_options
@_output_options
def fit(output, csv_path, size_in, dpi, **flags):
    """The planner's t x p grid, each cell coloured by the memory of its fastest fitting
    configuration over every c (else its leanest) against the budget, its c written in it,
    hatched where nothing fits, the planner's choice framed; --csv keeps every (t, c, p).
    Takes the flags of `actmem plan`."""
    _check_outputs(output, csv_path)
    from actmem.planner.plan import plan as run_plan
    from actmem.views.plot_frames import map_frame

    name, request, _ = plan_request(flags)
    with _progress("planning", 2 if output else 1) as advance:
        frame = map_frame(run_plan(request), name)
        advance()
        written = _write(frame, "map_figure", output, csv_path, size_in, dpi, advance)
    click.echo(written)


@plot.command()
@option("--from", "source", required=True, type=click.Path(exists=True, dir_okay=False),
              metavar="FILE.csv", help="A table of `actmem validate --format csv` (or its --output).")
@option("--config", default=None, metavar="LABEL",
              help="Which measured run, as its config column says [default: the file's first].")
@option("--rank", type=click.IntRange(min=0), default=0, show_default=True, help="Which rank.")
@_output_options
def validation(source, config, rank, output, csv_path, size_in, dpi):
    """Formula against measurement, term by term, for one measured run: formula and measured
    bytes side by side with the error, and apart, the residuals PyTorch keeps that the paper
    leaves out."""
    _check_outputs(output, csv_path)
    from actmem.views.plot_frames import validation_frame

    frame = validation_frame(source, config, rank)
    click.echo(_write(frame, "validation_figure", output, csv_path, size_in, dpi))


def _check_outputs(output, csv_path) -> None:
    """Before any work: something to write, no picture setting without a picture to use it,
    and matplotlib where a picture is asked for."""
    if output is None and csv_path is None:
        raise click.UsageError("give -o FILE.png or FILE.svg for the picture, --csv FILE.csv for its "
                               "frame, or both")
    given = _given(click.get_current_context(), "size_in", "dpi")
    if output is None and given:
        raise click.UsageError(f"--{given[0].removesuffix('_in')} sizes the picture: give -o FILE.png "
                               "or FILE.svg with it")
    if output is not None and output.lower().endswith(".svg") and "dpi" in given:
        raise click.UsageError("--dpi sets a PNG's pixels; an SVG has none (--size sets its inches)")
    if output is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.ClickException(MATPLOTLIB_MISSING) from None


def _given(ctx, *names) -> list:
    """Which of these options the user gave (not their defaults)."""
    from click.core import ParameterSource

    return [name for name in names if ctx.get_parameter_source(name) is not ParameterSource.DEFAULT]


def _write(frame, draw: str, output, csv_path, size_in, dpi, advance=lambda: None, **kw) -> str:
    """The frame to --csv, the picture to -o; returns the line that says where."""
    written = []
    if csv_path is not None:
        _writing(csv_path, lambda: frame.to_csv(csv_path, index=False))
        written.append(csv_path)
    if output is not None:
        from actmem.views import plot as drawing

        figure = getattr(drawing, draw)(frame, size_in=size_in, dpi=dpi, **kw)
        _writing(output, lambda: drawing.save(figure, output))
        advance()
        width, height = size_in
        size = (f"{round(width * dpi)} x {round(height * dpi)} px" if output.lower().endswith(".png")
                else f"{width:g} x {height:g} in")
        written.insert(0, f"{output} ({size})")
    return f"actmem plot: wrote {' and '.join(written)}"


def _writing(path, write) -> None:
    """A file that cannot be written is one line, not a traceback."""
    try:
        write()
    except OSError as error:
        raise SpecError(f"cannot write {path}: {error.strerror or error}") from None


@contextmanager
def _progress(description: str, steps: int):
    """A transient progress bar on stderr, only where stderr is a terminal; yields advance()."""
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)
    with Progress(transient=True, console=console, disable=not console.is_terminal) as progress:
        task = progress.add_task(description, total=steps)
        yield lambda: progress.advance(task)
