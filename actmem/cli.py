"""The command line: each command parses flags, calls one core function, renders.

Heavy imports (sympy, pandas, rich) happen inside the commands so that --help is instant.
A user's mistake is one line on stderr and exit code 2; ACTMEM_DEBUG=1 or --debug
shows the traceback instead.
"""

import os
import sys

import click

from actmem.errors import SpecError

# (flag names, spec key, help); Megatron-LM's argument names are accepted as aliases,
# so the parallelism flags of a launch script can be pasted as they are.
_MODEL_FLAGS = (
    (("--heads", "--num-attention-heads"), "heads", "attention heads a"),
    (("--hidden", "--hidden-size"), "hidden", "hidden size h"),
    (("--layers", "--num-layers"), "layers", "transformer layers L"),
    (("--vocab", "--vocab-size"), "vocab", "vocabulary size v (padded as Megatron does)"),
    (("--seq-len", "--seq-length"), "seq_len", "sequence length s"),
)
_RUN_FLAGS = (
    (("--tp", "--tensor-model-parallel-size"), "tensor_parallel", "tensor-parallel size t"),
    (("--pp", "--pipeline-model-parallel-size"), "pipeline_parallel", "pipeline-parallel size p"),
    (("--interleave", "--num-virtual-stages-per-pipeline-rank"), "interleave",
     "interleaved schedule: model chunks per pipeline rank m (1 = plain 1F1B)"),
    (("--micro-batch", "--micro-batch-size"), "micro_batch", "microbatch size b"),
    (("--global-batch", "--global-batch-size"), "global_batch",
     "global batch, with --gpus gives the microbatches per iteration"),
    (("--gpus",), "gpus", "GPUs in the run (data parallel d = gpus/(t·p))"),
)


class _OneLineErrors(click.Group):
    """Turn usage and spec errors into one line on stderr and exit code 2."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except (click.ClickException, SpecError) as error:
            if _debug():
                raise
            message = error.format_message() if isinstance(error, click.ClickException) else str(error)
            click.echo(f"actmem: error: {message}", err=True)
            sys.exit(2)
        except click.Abort:
            click.echo("actmem: aborted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


def _debug() -> bool:
    return os.environ.get("ACTMEM_DEBUG", "") not in ("", "0")


def _set_debug(ctx, param, value):
    if value:
        os.environ["ACTMEM_DEBUG"] = "1"


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="actmem")
@click.option("--debug", is_flag=True, expose_value=False, is_eager=True, callback=_set_debug,
              help="Show the full traceback on errors (or set ACTMEM_DEBUG=1).")
def cli():
    """Activation memory of large transformer training runs, term by term.

    The equations are Korthikanti et al. (2022), "Reducing Activation Recomputation in
    Large Transformer Models": Table 2, Eqs 1-6, sections 4.4-4.5.
    """


def spec_options(command):
    """The model and run flags shared by every command that takes a spec."""
    for names, key, help_text in reversed(_MODEL_FLAGS + _RUN_FLAGS):
        command = click.option(*names, key, type=int, default=None, help=help_text)(command)
    options = [
        click.option("--model", "-m", "preset", metavar="NAME|PATH",
                     help="Preset name or alias (see `actmem presets`) or a preset .toml file; "
                          "its run is the default, and flags override it."),
        click.option("--sp/--no-sp", "--sequence-parallel/--no-sequence-parallel",
                     "sequence_parallel", default=None, help="Sequence parallelism."),
        click.option("--recompute", type=click.Choice(["none", "selective", "full"]), default=None,
                     help="Activation recomputation."),
        click.option("--recompute-granularity", type=click.Choice(["selective", "full"]),
                     default=None, help="Megatron's name for --recompute."),
        click.option("--recompute-activations", is_flag=True, default=False,
                     help="Megatron's older flag for --recompute selective."),
        click.option("--distributed-optimizer/--no-distributed-optimizer",
                     "--use-distributed-optimizer", "distributed_optimizer", default=None,
                     help="Shard the optimizer state over data parallel ranks (6 + 12/d B a parameter)."),
        click.option("--num-layers-per-virtual-pipeline-stage", "layers_per_chunk", type=int,
                     default=None, help="Megatron's older way to ask for interleaving: m = (L/p)/N."),
        click.option("--gpu-memory", default=None, metavar="SIZE",
                     help="Memory of one GPU, e.g. 80GiB, 40GB, 81920MiB (default 80GiB)."),
        click.option("--make-vocab-size-divisible-by", "vocab_divisible_by", type=int, default=None,
                     help="Megatron pads the vocabulary to a multiple of this times t (default 128)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def build_spec_from_flags(flags: dict):
    """Merge a preset with the flags into a validated Spec (raises SpecError)."""
    from actmem.presets import load_preset
    from actmem.spec import build_spec, interleave_from_layers_per_chunk, merge_recompute
    from actmem.units import parse_bytes

    preset = load_preset(flags["preset"]) if flags["preset"] else None
    model = dict(preset.model) if preset else {}
    run = dict(preset.run) if preset else {}
    model.update({key: flags[key] for _, key, _ in _MODEL_FLAGS if flags[key] is not None})
    run.update({key: flags[key] for _, key, _ in _RUN_FLAGS if flags[key] is not None})
    for key in ("sequence_parallel", "distributed_optimizer"):
        if flags[key] is not None:
            run[key] = flags[key]
    if flags["layers_per_chunk"] is not None:
        if flags["interleave"] is not None:
            raise SpecError("give the interleave once: --interleave or "
                            "--num-layers-per-virtual-pipeline-stage, not both")
        run["interleave"] = interleave_from_layers_per_chunk(
            model.get("layers", 0), run.get("pipeline_parallel", 1), flags["layers_per_chunk"])
    recompute = merge_recompute(flags["recompute"], flags["recompute_granularity"],
                                flags["recompute_activations"])
    if recompute is not None:
        run["recompute"] = recompute
    options = {}
    if flags["gpu_memory"] is not None:
        options["gpu_memory_bytes"] = parse_bytes(flags["gpu_memory"])
    if flags["vocab_divisible_by"] is not None:
        options["vocab_divisible_by"] = flags["vocab_divisible_by"]
    if preset is None and not model:
        raise SpecError("give a preset with --model (see `actmem presets`) or the model dims "
                        "--heads, --hidden, --layers, --vocab, --seq-len")
    return build_spec(model, run, name=preset.name if preset else "custom", **options)


@cli.command()
@spec_options
@click.option("--format", "fmt", type=click.Choice(["rich", "json", "csv", "markdown"]),
              default="rich", show_default=True, help="Output format.")
def estimate(fmt, **flags):
    """Activation, parameter and optimizer memory per GPU of the first pipeline stage.

    Shows the six techniques of Table 2 on this run, the run's own terms, parameters
    and optimizer state, and whether the total fits the GPU.

    \b
    Examples:
      actmem estimate --model 530b
      actmem estimate --model gpt3 --no-sp --recompute none --format json
      actmem estimate --heads 32 --hidden 4096 --layers 32 --vocab 50257 --seq-len 4096 --tp 4
    """
    from actmem.estimate import estimate as run_estimate

    result = run_estimate(build_spec_from_flags(flags))
    if fmt == "rich":
        from actmem.render import render_estimate

        render_estimate(result)
    else:
        from actmem import report

        writer = {"json": report.to_json, "csv": report.to_csv, "markdown": report.to_markdown}[fmt]
        click.echo(writer(result), nl=fmt == "json")


@cli.command()
@click.option("--latex", is_flag=True, help="Print LaTeX instead of pretty text.")
def formulas(latex):
    """Table 2, Eqs 1-6 and the term table, as the engine composes them."""
    from actmem.render import render_formulas

    render_formulas(latex)


@cli.command()
@click.option("--format", "fmt", type=click.Choice(["rich", "json"]), default="rich",
              show_default=True, help="Output format.")
def presets(fmt):
    """The model presets, with the run each was trained with."""
    from actmem.presets import all_presets
    from actmem.render import render_presets

    if fmt == "json":
        import json

        click.echo(json.dumps([vars(p) | {"aliases": list(p.aliases)} for p in all_presets()], indent=2))
    else:
        render_presets(all_presets())


def main():
    cli(prog_name="actmem")
