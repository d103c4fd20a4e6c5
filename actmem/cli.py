"""The command line: each command parses flags, calls one core function, renders.

Heavy imports (sympy, pandas, rich) happen inside the commands so that --help is instant.
A user's mistake is one line on stderr and exit code 2; ACTMEM_DEBUG=1 or --debug
shows the traceback instead.
"""

import os
import sys

import click

from actmem.errors import SpecError
from actmem.hardware import DEFAULT_EFFICIENCY

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


class _Commands(_OneLineErrors):
    """The built-in commands, plus those other packages register under the entry-point group
    'actmem.commands' (the harness registers `validate`): actmem imports none of them."""

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(_plugins()))

    def get_command(self, ctx, name):
        command = super().get_command(ctx, name)
        if command is None and name in _plugins():
            command = _plugins()[name].load()
        return command


def _plugins() -> dict:
    from importlib.metadata import entry_points

    return {point.name: point for point in entry_points(group="actmem.commands")}


def _debug() -> bool:
    return os.environ.get("ACTMEM_DEBUG", "") not in ("", "0")


def _set_debug(ctx, param, value):
    if value:
        os.environ["ACTMEM_DEBUG"] = "1"


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
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
    for names, key, help_text in reversed(_RUN_FLAGS):
        command = click.option(*names, key, type=int, default=None, help=help_text)(command)
    options = [
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
    return model_options(command)


def model_options(command):
    """--model and the model dims, shared by every command that takes a model."""
    for names, key, help_text in reversed(_MODEL_FLAGS):
        command = click.option(*names, key, type=int, default=None, help=help_text)(command)
    return click.option("--model", "-m", "preset", metavar="NAME|PATH",
                        help="Preset name or alias (see `actmem presets`) or a preset .toml file; "
                             "flags override it.")(command)


def _preset_and_flags(flags: dict) -> tuple:
    """(name, model values, run values): the preset's, overridden by the flags given."""
    from actmem.presets import load_preset

    preset = load_preset(flags["preset"]) if flags["preset"] else None
    model = dict(preset.model) if preset else {}
    run = dict(preset.run) if preset else {}
    model.update({key: flags[key] for _, key, _ in _MODEL_FLAGS if flags.get(key) is not None})
    run.update({key: flags[key] for _, key, _ in _RUN_FLAGS if flags.get(key) is not None})
    if preset is None and not model:
        raise SpecError("give a preset with --model (see `actmem presets`) or the model dims "
                        "--heads, --hidden, --layers, --vocab, --seq-len")
    return (preset.name if preset else "custom"), model, run


def _model_from_flags(flags: dict) -> tuple:
    """(name, validated Model, the preset's run values) for commands that choose the run."""
    from actmem.spec import build_spec

    name, model, run = _preset_and_flags(flags)
    return name, build_spec(model, {}).model, run     # checks the dims, names what is missing


def build_spec_from_flags(flags: dict):
    """Merge a preset with the flags into a validated Spec (raises SpecError)."""
    from actmem.spec import build_spec, interleave_from_layers_per_chunk, merge_recompute
    from actmem.units import parse_bytes

    name, model, run = _preset_and_flags(flags)
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
    return build_spec(model, run, name=name, **options)


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


@cli.command()
@model_options
@click.option("--gpus", type=int, default=None, help="GPUs for the run (default: the preset's).")
@click.option("--global-batch", "--global-batch-size", "global_batch", type=int, default=None,
              help="Sequences per iteration (default: the preset's).")
@click.option("--gpu", "gpu_name", default="a100", show_default=True,
              help="GPU kind: a100 or h100 (peak FLOP/s, memory, bandwidths).")
@click.option("--gpu-memory", default=None, metavar="SIZE", help="Override the GPU's memory, e.g. 40GiB.")
@click.option("--reserve", default="0GiB", show_default=True, metavar="SIZE",
              help="Headroom kept free for the allocator, workspaces and communication buffers.")
@click.option("--gpus-per-node", type=int, default=8, show_default=True,
              help="Tensor parallelism stays inside a node: t <= this.")
@click.option("--efficiency", type=float, default=DEFAULT_EFFICIENCY, show_default=True,
              help="Share of the GPU's peak the matmuls reach (scales compute time).")
@click.option("--max-micro-batch", type=int, default=16, show_default=True, help="Largest b to try.")
@click.option("--make-vocab-size-divisible-by", "vocab_divisible_by", type=int, default=128,
              show_default=True, help="Megatron's vocabulary padding (times t).")
@click.option("--top", type=int, default=10, show_default=True, help="How many configurations to show.")
@click.option("--explain", "config", metavar="CONFIG", default=None,
              help="Show one configuration in full, as the table prints it: 't=8 p=8 m=3 b=1 sp sel'.")
@click.option("--format", "fmt", type=click.Choice(["rich", "json", "csv"]), default="rich",
              show_default=True, help="Output format.")
def plan(fmt, top, config, **flags):
    """Choose t, p, m, b, sequence parallelism, recompute and the distributed optimizer.

    Enumerates every valid configuration for the model on --gpus GPUs at --global-batch,
    keeps those whose first pipeline stage fits the GPU, and ranks them by a simple
    iteration-time model (compute, pipeline bubble, tensor- and data-parallel
    communication, each shown). Exits 1 when nothing fits.

    \b
    Examples:
      actmem plan --model 530b
      actmem plan --model 1t --gpus 3072 --global-batch 3072 --gpu h100
      actmem plan --model gpt3 --explain "t=8 p=8 m=3 b=1 sp sel"
    """
    from actmem import plan as planner

    request = _plan_request(flags)
    if config is not None:
        from actmem.render_plan import render_explain

        render_explain(*planner.explain(request, config))
        return
    result = planner.plan(request)
    if fmt == "rich":
        from actmem.render_plan import render_plan

        render_plan(result, top)
    else:
        from actmem import report

        click.echo(report.plan_json(result, top) if fmt == "json" else report.plan_csv(result, top),
                   nl=fmt == "json")
    if result.fitting.empty:
        sys.exit(1)


def _given_or(flag, default):
    """A flag's value when given (even 0, which validation then rejects), else the preset's."""
    return default if flag is None else flag


def _plan_request(flags: dict):
    from actmem.hardware import gpu_named
    from actmem.plan import PlanRequest
    from actmem.units import parse_bytes

    _, model, run = _model_from_flags(flags)
    gpus = _given_or(flags["gpus"], run.get("gpus"))
    global_batch = _given_or(flags["global_batch"], run.get("global_batch"))
    if gpus is None or global_batch is None:
        raise SpecError("plan needs --gpus and --global-batch (the preset gives neither)")
    gpu = gpu_named(flags["gpu_name"])
    memory = gpu.memory_bytes if flags["gpu_memory"] is None else parse_bytes(flags["gpu_memory"])
    return PlanRequest(model=model, gpus=gpus, global_batch=global_batch, gpu=gpu,
                       gpu_memory_bytes=memory, reserve_bytes=parse_bytes(flags["reserve"], allow_zero=True),
                       gpus_per_node=flags["gpus_per_node"], efficiency=flags["efficiency"],
                       max_micro_batch=flags["max_micro_batch"],
                       vocab_divisible_by=flags["vocab_divisible_by"])


@cli.command()
@model_options
@click.option("--global-batch", "--global-batch-size", "global_batch", type=int, default=None,
              help="Sequences per iteration (default: the preset's).")
@click.option("--iteration-time", type=float, default=None, metavar="SECONDS",
              help="Measured seconds per iteration: gives MFU and HFU.")
@click.option("--gpus", type=int, default=None, help="GPUs in the run (default: the preset's).")
@click.option("--gpu", "gpu_name", default="a100", show_default=True, help="GPU kind for the peak.")
@click.option("--peak-tflops", type=float, default=None, help="Override the GPU's peak, TFLOP/s.")
@click.option("--format", "fmt", type=click.Choice(["rich", "json"]), default="rich",
              show_default=True, help="Output format.")
def flops(fmt, iteration_time, peak_tflops, **flags):
    """FLOPs per iteration (the paper's appendix) and, given a time, MFU and HFU.

    \b
    Example (Table 5 of the paper):
      actmem flops --model 530b --iteration-time 37.83
    """
    from actmem.flops import flops_report
    from actmem.hardware import gpu_named

    name, dims, run = _model_from_flags(flags)
    global_batch = _given_or(flags["global_batch"], run.get("global_batch"))
    gpus = _given_or(flags["gpus"], run.get("gpus"))
    if not isinstance(global_batch, int) or global_batch <= 0:
        raise SpecError(f"flops needs a positive --global-batch, got {global_batch!r}")
    if iteration_time is not None and not (iteration_time > 0 and isinstance(gpus, int) and gpus > 0):
        raise SpecError(f"MFU needs a positive --iteration-time ({iteration_time}) and --gpus ({gpus})")
    peak = gpu_named(flags["gpu_name"]).peak_flops if peak_tflops is None else peak_tflops * 1e12
    if peak <= 0:
        raise SpecError(f"--peak-tflops must be positive, got {peak_tflops}")
    report = flops_report(dims, global_batch, gpus, peak, iteration_time)
    if fmt == "json":
        import json

        click.echo(json.dumps(report, indent=2))
    else:
        from actmem.render_plan import render_flops

        render_flops(name, report)


def main():
    cli(prog_name="actmem")
