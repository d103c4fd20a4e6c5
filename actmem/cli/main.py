"""The command line: each command parses flags, calls one core function, renders.

Heavy imports (sympy, pandas, rich) happen inside the commands so that --help is instant.
A user's mistake is one line on stderr and exit code 2; ACTMEM_DEBUG=1 or --debug
shows the traceback instead. A closed pipe (`actmem estimate | head`) ends quietly with
exit code 141, as a shell reports SIGPIPE, never with the 1 that means "nothing fits".
"""

import functools
import gc
import math
import os
import sys

import click

from actmem.model import defaults
from actmem.errors import SpecError
from actmem.cli.flags import (ARCHITECTURE_FLAGS, GLOBAL_BATCH, GPU, GPU_FLAGS, GPUS, MEGATRON_ARGS, MOE_IMBALANCE, MOE_LOADS,
                              STATE_FLAGS,
                              VOCAB_PADDING, add_flags, build_spec_from_flags, model_from_flags, model_options,
                              option, resolve, spec_options)
from actmem.model.hardware import DEFAULT_EFFICIENCY

EXIT_BROKEN_PIPE = 141   # 128 + SIGPIPE


def _short_lived(command):
    """A command that computes from the engine, prints and ends: the cyclic garbage collector is off while it runs.
    What it makes lives until it ends anyway, and each collection walks every object alive, sympy's expressions and
    caches the most: 0.1-0.15 s of a cold `actmem estimate --model 530b`'s 1.1-1.3 (benchmarks/cold_start.py).
    validate and plot, which run long or hand memory to other libraries, keep it."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        collecting = gc.isenabled()
        gc.disable()
        try:
            return command(*args, **kwargs)
        finally:
            if collecting:
                gc.enable()

    return run


class OneLineErrors(click.Group):
    """Turn usage and spec errors into one line on stderr and exit code 2."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as error:     # `actmem` alone: the help
            click.echo(error.ctx.get_help())
            sys.exit(0)
        except (click.ClickException, SpecError) as error:
            if _debug():
                raise
            click.echo(f"actmem: error: {_message(error)}", err=True)
            sys.exit(2)
        except click.Abort:
            click.echo("actmem: aborted", err=True)
            sys.exit(1)
        except BrokenPipeError:
            # the reader went away: nothing more to say, and Python must not complain at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(EXIT_BROKEN_PIPE)
        sys.exit(code if isinstance(code, int) else 0)


def _estimate_options() -> set:
    """Every spelling `actmem estimate` takes as an option."""
    command = cli.get_command(None, "estimate")
    return {name for param in command.params if isinstance(param, click.Option)
            for name in param.opts + param.secondary_opts}


def _message(error) -> str:
    if isinstance(error, click.NoSuchOption) and error.option_name.startswith("--"):
        from actmem.sources import megatron_table

        if error.option_name in megatron_table.arguments():
            if error.option_name in _estimate_options():         # read by estimate, not by this command
                command = error.ctx.info_name if error.ctx is not None and error.ctx.parent is not None else None
                if command is None:
                    return (f"{error.option_name} is a setting that `actmem estimate` reads: give it after the "
                            f"command (`actmem estimate {error.option_name} ...`)")
                return (f"{error.option_name} is a setting that `actmem estimate` reads; `{command}` does not take it "
                        f"(`actmem {command} --help` lists what it does)")
            from actmem.sources.megatron_args import SETTINGS

            if error.option_name in SETTINGS:
                return (f"{error.option_name} is a Megatron-LM argument that actmem reads inside --megatron-args "
                        f"(a pasted launch script or argument list), not as a flag of its own")
            kind, why = megatron_table.classify(error.option_name)
            if kind == megatron_table.NOT_MODELLED:
                return f"{error.option_name} is a Megatron-LM argument that actmem does not model yet: {why}"
            return (f"{error.option_name} is a Megatron-LM argument that cannot change memory ({why}); "
                    "actmem takes it inside --megatron-args, where it is listed as ignored")
    extra = _stray_modules(error)
    if extra:
        return (f"unexpected extra argument{'s' * (len(extra) > 1)} {' '.join(extra)}: --recompute-modules takes its "
                f"modules as one word, comma-separated (e.g. --recompute-modules core_attn,{','.join(extra)}); "
                "Megatron's space-separated form is read inside --megatron-args")
    return error.format_message() if isinstance(error, click.ClickException) else str(error)


def _stray_modules(error) -> tuple:
    """The recompute modules a usage error found as stray words: Megatron's `--recompute-modules a b` typed as
    actmem's flag, which takes one comma-separated value; () for any other error."""
    import re

    from actmem.model.recompute import RECOMPUTE_MODULES

    found = re.fullmatch(r"Got unexpected extra arguments? \((.*)\)", error.format_message()) \
        if isinstance(error, click.UsageError) else None
    words = tuple(found.group(1).split()) if found else ()
    return words if words and set(words) <= set(RECOMPUTE_MODULES) else ()


class _Commands(OneLineErrors):
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
@option("--debug", is_flag=True, expose_value=False, is_eager=True, callback=_set_debug,
              help="Show the full traceback on errors (or set ACTMEM_DEBUG=1).")
def cli():
    """Activation memory of large transformer training runs, term by term.

    The equations are Korthikanti et al. (2022), "Reducing Activation Recomputation in
    Large Transformer Models": Table 2, Eqs 1-6, sections 4.4-4.5.
    """


@cli.command()
@spec_options
@option("--format", "fmt", type=click.Choice(["rich", "json", "csv", "markdown"]),
              default="rich", show_default=True, help="Output format.")
@option("--stage", "stage_text", default="first", show_default=True, metavar="first|last|N|all",
              help="The pipeline stage whose techniques, terms and memory are shown (N counts from "
                   "0); 'all' adds every stage's peak. The verdict is always the busiest stage's.")
@option("--compare-implementations", "compare", is_flag=True,
              help="Add the same model and run under each implementation (Megatron, torch-native, "
                   "transformers eager and sdpa): per layer, per GPU, and whether it fits.")
@_short_lived
def estimate(fmt, stage_text, compare, **flags):
    """Activation, parameter and optimizer memory per GPU of a pipeline stage (the first).

    Shows the six techniques of Table 2 (and full recompute under SP; at t = 1 each
    distinct one once) on this run, the
    run's own terms, parameters and optimizer state, the allocator's peak from below, and
    whether the busiest stage's peak fits the GPU.

    \b
    Examples:
      actmem estimate --model 530b
      actmem estimate --model gpt3 --no-sp --recompute none --format json
      actmem estimate --model llama-3.1-405b --stage all
      actmem estimate --model llama-3.1-8b --tp 8 --sp --compare-implementations
      actmem estimate --heads 32 --hidden 4096 --layers 32 --vocab 50257 --seq-len 4096 --tp 4
    """
    from actmem.memory.estimate import estimate as run_estimate
    from actmem.memory.stages import parse_stage

    spec = build_spec_from_flags(flags)
    stage = parse_stage(stage_text, spec.run.pipeline_parallel, fmt)
    result = run_estimate(spec, 0 if stage is None else stage)
    codes = None
    if compare:
        from actmem.memory.side_by_side import side_by_side

        codes = side_by_side(spec, result.stage)
    if fmt == "rich":
        from actmem.views.render import render_estimate

        render_estimate(result, all_stages=stage is None, codes=codes)
    else:
        from actmem.views import report

        writer = {"json": report.to_json, "csv": report.to_csv, "markdown": report.to_markdown}[fmt]
        click.echo(writer(result, codes), nl=fmt == "json")


@cli.command()
@option("--latex", is_flag=True, help="Print LaTeX lines (no table) to copy into a document.")
@_short_lived
def formulas(latex):
    """Table 2, Eqs 1-6 and the term table, as the engine composes them."""
    from actmem.views.render import render_formulas, render_formulas_latex

    render_formulas_latex() if latex else render_formulas()


@cli.command()
@option("--format", "fmt", type=click.Choice(["rich", "json"]), default="rich",
              show_default=True, help="Output format.")
@_short_lived
def presets(fmt):
    """The model presets, with the run each was trained with."""
    from actmem.sources.presets import all_presets
    from actmem.views.render import render_presets

    if fmt == "json":
        import json

        click.echo(json.dumps([vars(p) | {"aliases": list(p.aliases)} for p in all_presets()], indent=2))
    else:
        render_presets(all_presets())


def _gpus_and_batch(command):
    return add_flags(command, (GPUS, GLOBAL_BATCH))


def plan_options(command):
    """The flags of `actmem plan` beyond the model's."""
    options = [
        option("--gpus-per-node", type=click.IntRange(min=1), default=defaults.GPUS_PER_NODE,
                     show_default=True,
                     help="Tensor parallelism stays inside a node: t <= this."),
        option("--efficiency", type=float, default=None,
                     help="Share of the GPU's peak every FLOP reaches (scales compute time alike). "
                          "Default: the kernels measured on the GPU (H100, H200) at each configuration's "
                          f"shapes, else {DEFAULT_EFFICIENCY}."),
        option("--overlap-grad-reduce", is_flag=True, default=False,
                     help="Megatron's switch (off by default): the data-parallel gradient reduction overlaps "
                          "the last microbatch's backward; a pasted --megatron-args turns it on too."),
        option("--overlap-param-gather", is_flag=True, default=False,
                     help="Megatron's switch (off by default; needs --overlap-grad-reduce and keeps only the "
                          "distributed optimizer's configurations): its all-gather overlaps the next forward."),
        option("--max-micro-batch", type=click.IntRange(min=1), default=defaults.MAX_MICRO_BATCH,
                     show_default=True,
                     help="Largest b to try."),
        option("--top", type=click.IntRange(min=0), default=10, show_default=True,
                     help="How many configurations to show; 0 shows all."),
        option("--explain", "config", metavar="CONFIG", default=None,
                     help="Show one configuration in full, as the table prints it: "
                          "'t=8 p=8 m=3 b=1 sp sel' (recompute none, sel, sel+mlp, mlp, full or "
                          "block=N, and op under torch-native; an uneven pipeline as p=7+8x14+7); what it leaves "
                          "out comes from the preset. Shown on the terminal (not with --format or --top)."),
        option("--format", "fmt", type=click.Choice(["rich", "json", "csv"]), default="rich",
                     show_default=True, help="Output format."),
    ]
    command = MEGATRON_ARGS(add_flags(_gpus_and_batch(command), ARCHITECTURE_FLAGS + STATE_FLAGS + GPU_FLAGS
                                      + (VOCAB_PADDING, MOE_IMBALANCE, MOE_LOADS)))
    for decorator in reversed(options):
        command = decorator(command)
    return model_options(command)


@cli.command()
@plan_options
@_short_lived
def plan(fmt, top, config, **flags):
    """Choose t, c, p, m, b, sequence parallelism, recompute and the distributed optimizer.

    Enumerates every valid configuration for the model on --gpus GPUs at --global-batch
    (pipelines even, or where p does not divide the layers split as Llama 3's 7+8x14+7),
    keeps those whose peak (the busiest pipeline stage's, from below) fits the GPU less the
    reserve, and ranks them by a simple iteration-time model (compute, pipeline bubble,
    tensor- and data-parallel communication, each shown). Under --implementation torch-native
    every configuration is FSDP2's, as torchtitan shards data parallelism (rows end in 'fsdp').
    Exits 1 when nothing fits.

    \b
    Examples:
      actmem plan --model 530b
      actmem plan --model 1t --gpus 3072 --global-batch 3072 --gpu h100
      actmem plan --model gpt3 --explain "t=8 p=8 m=3 b=1 sp sel"
      actmem plan --model llama-3.1-70b --gpus 256 --global-batch 256 --gpu h100
      actmem plan --model llama-3.1-405b --gpu h100 --explain "t=8 p=7+8x14+7 b=1 sp none dopt"
      actmem plan --model llama-3.1-70b --implementation torch-native --gpus 256 --global-batch 256
    """
    from actmem.planner import plan as planner

    name, request, preset_run = plan_request(flags)
    if config is not None:
        context = click.get_current_context()
        ignored = [f"--{name}" for name in ("format", "top")
                   if context.get_parameter_source("fmt" if name == "format" else name).name != "DEFAULT"]
        if ignored:
            raise SpecError(f"--explain shows one configuration in full on the terminal; {' and '.join(ignored)} "
                            f"{'shape' if len(ignored) > 1 else 'shapes'} the sweep's table: drop "
                            f"{'them' if len(ignored) > 1 else 'it'}")
        from actmem.planner.explain import explain, ranking
        from actmem.views.render_plan import render_explain

        est, row = explain(request, config, name, preset_run)
        render_explain(est, row, ranking(request, row))
        return
    result = planner.plan(request)
    nothing = None
    if result.fitting.empty:
        from actmem.planner.nearest import nothing_fits

        nothing = nothing_fits(result)
    if fmt == "rich":
        from actmem.views.render_plan import render_plan

        render_plan(result, top, nothing)
    else:
        from actmem.views import report

        writer = report.plan_json if fmt == "json" else report.plan_csv
        click.echo(writer(result, top, nothing), nl=fmt == "json")
    if nothing is not None:
        sys.exit(1)


def plan_request(flags: dict):
    """(model name, PlanRequest, the preset's run values)."""
    from actmem.cli.flags import chosen_gpu, gpu_options
    from actmem.planner.plan import PlanRequest
    from actmem.sources.expert_loads import loads_for

    choice = model_from_flags(flags)
    if choice.preset_run.get("offload_layers"):
        raise SpecError(f"plan does not sweep CPU offloading yet (--cpu-offloading-num-layers "
                        f"{choice.preset_run['offload_layers']}): `actmem estimate` prices one offloaded run")
    if choice.preset_run.get("fsdp_replicate", 1) > 1 or choice.preset_run.get("fsdp_reshard", "default") != "default":
        raise SpecError("plan sweeps FSDP2 itself under --implementation torch-native (its rows end in 'fsdp', at "
                        "torchtitan's default resharding, over all d ranks): the preset's run sets fsdp_replicate "
                        "or fsdp_reshard, which `actmem estimate` prices for one run; drop them from the preset")
    if choice.preset_run.get("megatron_fsdp") or choice.preset_run.get("fsdp_sharding"):
        raise SpecError("plan does not sweep Megatron-FSDP yet (--use-megatron-fsdp, "
                        "--data-parallel-sharding-strategy): `actmem estimate` prices one run of it")
    if choice.architecture.fp8_first_last_bf16:
        raise SpecError("plan does not sweep --first-last-layers-bf16 yet (its stages' FP8 and bf16 layers): "
                        "`actmem estimate` prices one run of it")
    if choice.gpus is None or choice.global_batch is None:
        raise SpecError("plan needs --gpus and --global-batch (the preset gives neither)")
    flags = resolve(flags, GPU_FLAGS + (MOE_IMBALANCE, MOE_LOADS))
    gpu, default = chosen_gpu(flags["gpu_name"], choice.gpu)
    memory = gpu_options(flags, choice.gpu)
    request = PlanRequest(model=choice.model, gpus=choice.gpus, global_batch=choice.global_batch, gpu=gpu,
                          gpu_memory_bytes=memory["gpu_memory_bytes"], reserve_bytes=memory["reserve_bytes"],
                          gpu_default=memory["gpu_default"],
                          gpus_per_node=flags["gpus_per_node"], efficiency=flags["efficiency"],
                          overlap_grad_reduce=flags["overlap_grad_reduce"] or "--overlap-grad-reduce" in choice.pasted,
                          overlap_param_gather=flags["overlap_param_gather"] or "--overlap-param-gather" in choice.pasted,
                          max_micro_batch=flags["max_micro_batch"],
                          vocab_divisible_by=choice.architecture.code.vocab_divisible_by(
                              choice.vocab_divisible_by, defaults.VOCAB_DIVISIBLE_BY),
                          architecture=choice.architecture,
                          optimizer=choice.optimizer,
                          routing_imbalance=choice.preset_run.get("routing_imbalance", 1)
                          if flags["routing_imbalance"] is None else flags["routing_imbalance"],
                          expert_loads=loads_for(flags["expert_loads"], choice.architecture.num_experts),
                          **({} if choice.gradient_bytes is None else {"gradient_bytes": choice.gradient_bytes}))
    return choice.name, request, choice.preset_run


@cli.command()
@model_options
@_gpus_and_batch
@MEGATRON_ARGS
@lambda command: add_flags(command, (GPU,))
@option("--iteration-time", type=float, default=None, metavar="SECONDS",
              help="Measured seconds per iteration: gives MFU and HFU.")
@option("--peak-tflops", type=float, default=None, help="Override the GPU's peak, TFLOP/s.")
@option("--format", "fmt", type=click.Choice(["rich", "json"]), default="rich",
              show_default=True, help="Output format.")
@_short_lived
def flops(fmt, iteration_time, peak_tflops, **flags):
    """FLOPs per iteration (the paper's appendix) and, given a time, MFU and HFU.

    \b
    Example (Table 5 of the paper):
      actmem flops --model 530b --iteration-time 37.83
    """
    from actmem.cli.flags import chosen_gpu
    from actmem.model.hardware import DEFAULT_GPU_WORDS
    from actmem.planner.flops import flops_report

    choice = model_from_flags(flags)
    global_batch, gpus = choice.global_batch, choice.gpus
    if global_batch is None:
        raise SpecError("flops needs --global-batch (the preset gives none)")
    for flag, value in (("--global-batch", global_batch), ("--gpus", gpus)):
        if value is not None and value <= 0:
            raise SpecError(f"{flag} must be a positive integer, got {value}")
    if iteration_time is not None:
        if not (math.isfinite(iteration_time) and iteration_time > 0):
            raise SpecError(f"--iteration-time must be a positive, finite number of seconds, "
                            f"got {iteration_time}")
        if gpus is None:
            raise SpecError("MFU needs --gpus with --iteration-time (the preset gives none)")
    gpu, default = chosen_gpu(resolve(flags, (GPU,))["gpu_name"], choice.gpu)
    peak = gpu.peak_flops if peak_tflops is None else peak_tflops * 1e12
    if not (math.isfinite(peak) and peak > 0):
        raise SpecError(f"--peak-tflops must be positive and finite, got {peak_tflops}")
    report = flops_report(choice.model, global_batch, gpus, peak, iteration_time, choice.architecture)
    report["peak_of"] = ("--peak-tflops" if peak_tflops is not None else
                         f"{gpu.name}, {DEFAULT_GPU_WORDS}" if default else gpu.name)
    if iteration_time is not None and report["mfu"] > 1:   # model FLOPs: the least any run computes
        raise SpecError(f"MFU would be {100 * report['mfu']:,.0f}%, above the GPUs' peak: check "
                        f"--iteration-time ({iteration_time}), --gpus ({gpus}) and the peak "
                        f"({peak / 1e12:g} TFLOP/s)")
    name = choice.name
    if fmt == "json":
        import json

        click.echo(json.dumps(report, indent=2))
    else:
        from actmem.views.render_plan import render_flops

        render_flops(name, report)


def main():
    """The console script (and `python -m actmem`): the process ends with the command. What is alive then (sympy's
    expressions and caches above all) is frozen out of the collections the interpreter runs as it shuts down: 0.1-0.2 s
    of a cold `actmem estimate`'s 1.1-1.5 (atexit and weakref.finalize callbacks still run, before them). Not in
    `cli` itself, which tests call in their own long-lived process."""
    try:
        cli(prog_name="actmem")
    finally:
        gc.freeze()
