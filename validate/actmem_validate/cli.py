"""`actmem validate`: measure real layers and compare with the formulas, term by term.

Registered with actmem's CLI through the entry-point group ``actmem.commands``, so actmem
itself never imports this package; torch is imported only when the command runs.
"""

import json
import math
import os
import sys

import click

from actmem.errors import SpecError
from actmem.cli.flags import SPEC_FLAGS, build_spec_from_flags, given_flags, option, spec_options, with_megatron_args, \
    with_setting

_TORCH_MISSING = ("actmem validate needs torch: pip install 'actmem[harness]' "
                  "(on a CPU-only machine install the CPU build of torch first)")


@click.command()
@spec_options
@option("--techniques", default=None,
              help="Comma-separated: none, tp, tp-sp, tp-sel, tp-sp-sel, full, tp-sp-full "
                   "[default: all but none].")
@option("--grid", type=click.Choice(["small", "presets", "moe", "mla", "mtp", "mfsdp", "zero"]), default=None,
              help="A named grid instead of one spec: 'small' (t = 1, 2, 4 at small shapes, for "
                   "real runs), 'presets' (the Table 3 models at full scale, for --mode fake, or "
                   "--mode rank0 on a GPU), 'moe' (megatron-core's own MoELayer over gloo ranks, "
                   "expert and tensor parallel; needs megatron-core==0.16.1), 'mla' (its "
                   "MLASelfAttention over gloo ranks, TE's modules as stand-ins; the same) or 'mtp' "
                   "(its multi-token prediction block, the same way) or 'mfsdp' (its Megatron-FSDP around "
                   "a small GPTModel, every sharding strategy, each rank's model state; the same) or 'zero' "
                   "(transformers' models "
                   "under DeepSpeed's ZeRO over gloo ranks; needs deepspeed==0.19.8). "
                   "A grid sets the model, run and techniques itself.")
@option("--mode", type=click.Choice(["real", "fake", "rank0"]), default="real", show_default=True,
              help="real: t processes (gloo on CPU, NCCL on GPU); fake: rank 0 of t in one "
                   "process with FakeTensorMode, any scale, no memory used; rank0: rank 0 of t "
                   "in one process (one a configuration) with real tensors, on the GPU where there "
                   "is one, the other ranks a fake process group (collectives allocate, fill "
                   "nothing): one GPU measures any t with torch.cuda's allocator, values "
                   "unchecked. A grid measures the runs that fit this machine and names the "
                   "others.")
@option("--microbatches", type=click.IntRange(min=1, max=1024), default=None,
              help="Microbatches per iteration (default: the fewest that fill the schedule).")
@option("--max-error", type=float, default=0.0, show_default=True,
              help="Largest |error| in percent allowed on a term the paper counts and on the "
                   "total; more exits 1. A tensor no term or named residual accounts for always "
                   "fails.")
@option("--max-peak-gap", type=float, default=None, metavar="PERCENT",
              help="Largest gap in percent allowed between the allocator's peak and actmem's "
                   "floor under it; more exits 1 [default: none, only a peak below the floor "
                   "fails]. Context-parallel runs are judged from below only (the harness's "
                   "attention is not TE's ring).")
@option("--timeout", type=click.IntRange(min=1), default=300, show_default=True,
              help="Seconds a collective may wait before a real run gives up.")
@option("--format", "fmt", type=click.Choice(["rich", "json", "csv"]), default="rich", show_default=True)
@option("--output", type=click.Path(dir_okay=False), default=None,
              help="Also write the rows to this file (.json or .csv).")
def validate(techniques, grid, mode, microbatches, max_error, max_peak_gap, timeout, fmt, output, **flags):
    """Measure what real tensor- and sequence-parallel layers save, against the formulas.

    Builds the first pipeline stage as Megatron does (with --implementation torch-native,
    torchtitan's Llama blocks under PyTorch's parallelize_module; with hf, transformers'
    LlamaForCausalLM, Qwen3ForCausalLM or GPT2LMHeadModel: one microbatch each), runs its
    schedule (1F1B or interleaved), records every tensor saved for backward (torch's
    saved_tensors_hooks, deduplicated by storage, parameters left out) and prints formula bytes, measured bytes
    and the error per term and rank. Terms PyTorch keeps that the paper does not count are
    listed as named residuals. 'peak' is the allocator's peak against actmem's floor under
    it (actmem.memory.peak). Exits 1 when a term is off, a saved tensor is unaccounted for, the
    total does not add up, or the peak is below the floor (or above it by more than
    --max-peak-gap).

    \b
    Examples:
      actmem validate --model 530b --mode fake
      actmem validate --heads 8 --hidden 64 --layers 4 --vocab 512 --seq-len 32 --tp 2 --pp 2 \\
          --micro-batch 2
      actmem validate --grid small
      actmem validate --grid presets --mode rank0        # one GPU, paper scale, its allocator
      torchrun --nproc-per-node 4 -m actmem_validate --heads 8 --hidden 64 --layers 2 \\
          --vocab 512 --seq-len 32 --tp 4 --micro-batch 4
    """
    if not (math.isfinite(max_error) and max_error >= 0):
        raise SpecError(f"--max-error must be a finite percentage >= 0, got {max_error}")
    if max_peak_gap is not None and not (math.isfinite(max_peak_gap) and max_peak_gap >= 0):
        raise SpecError(f"--max-peak-gap must be a finite percentage >= 0, got {max_peak_gap}")
    _check_output(output)
    try:
        import torch
    except ImportError:
        raise click.ClickException(_TORCH_MISSING)
    from actmem_validate.compare import judge

    if grid in ("moe", "mla", "mtp", "mfsdp"):
        rows = _megatron_layer_rows(grid, mode, techniques, microbatches, flags, timeout)
        failures = judge(rows, max_error, max_peak_gap)
        _emit(rows, fmt, output)
        click.echo(_summary(rows, failures), err=True)
        _exit_on(failures)
        return
    configs = _configs(grid, techniques, microbatches, flags)
    if mode == "rank0":
        configs = _rank0_runs(configs, grid)
    _check_backends(configs, mode, microbatches)
    if mode == "real" and "LOCAL_RANK" not in os.environ and not torch.cuda.is_available():
        from actmem_validate.footprint import check_fits_machine       # on a GPU the tensors are not here

        check_fits_machine(configs)
    rows = _run(configs, mode, timeout)
    failures = judge(rows, max_error, max_peak_gap)
    _emit(rows, fmt, output)
    click.echo(_summary(rows, failures), err=True)
    _exit_on(failures)


def _exit_on(failures) -> None:
    if failures:
        for line in failures[:10]:
            click.echo(f"actmem validate: {line}", err=True)
        if len(failures) > 10:
            click.echo(f"actmem validate: ... and {len(failures) - 10} more", err=True)
        sys.exit(1)


def _megatron_layer_rows(grid, mode, techniques, microbatches, flags, timeout) -> list:
    """--grid moe, mla, mtp or mfsdp: megatron-core's own MoE layer, multi-latent attention, multi-token prediction
    block (one forward a configuration) or Megatron-FSDP (a step), over real gloo ranks."""
    given = given_flags(flags) + [name for name, value in (("--techniques", techniques),
                                                           ("--microbatches", microbatches)) if value is not None]
    if given:
        raise SpecError(f"--grid {grid} sets the model, run and techniques itself; drop {', '.join(given)}")
    layer = {"moe": "MoE layer", "mla": "multi-latent attention", "mtp": "multi-token prediction",
             "mfsdp": "Megatron-FSDP"}[grid]
    if mode != "real":
        why = {"moe": "its dispatcher reads the routing's counts on the host",
               "mla": "its sequence-parallel gathers make the tensors it keeps",
               "mtp": "its sequence-parallel gathers make the tensors it keeps",
               "mfsdp": "its buffers are sharded and gathered over the ranks' group"}[grid]
        raise SpecError(f"--grid {grid} runs megatron-core's {layer} on real CPU ranks ({why}, which --mode {mode} "
                        f"cannot give): drop --mode {mode}")
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        raise click.ClickException(f"--grid {grid} runs megatron-core's own {layer}: "
                                   "pip install megatron-core==0.16.1 --no-deps (beside torch)")
    if grid == "mla":
        from actmem_validate.megatron_mla import mla_grid, rows as mla_rows

        return mla_rows(mla_grid())
    if grid == "mtp":
        from actmem_validate.megatron_mtp import mtp_grid, rows as mtp_rows

        return mtp_rows(mtp_grid())
    if grid == "mfsdp":
        from actmem_validate.megatron_fsdp import mfsdp_grid, rows as mfsdp_rows

        return mfsdp_rows(mfsdp_grid())
    from actmem_validate.megatron_moe import moe_grid, rows

    return rows(moe_grid(), timeout)


def _rank0_runs(configs, grid):
    """--mode rank0: a grid keeps the runs it measures and names the rest on stderr; one
    spec it cannot measure is refused (footprint.rank0_runs)."""
    import torch

    from actmem_validate.footprint import available_bytes, rank0_runs

    if torch.cuda.is_available():
        kept, left_out = rank0_runs(configs, gpu_free=torch.cuda.mem_get_info()[0])
    else:
        kept, left_out = rank0_runs(configs, gpu_free=None, host_free=available_bytes())
    if left_out and grid is None:
        raise SpecError(f"--mode rank0: {left_out[0]}")
    for line in left_out:
        click.echo(f"actmem validate: left out: {line}", err=True)
    if not kept:
        raise SpecError(f"--grid {grid} --mode rank0: no run of the grid can be measured here")
    return kept


def _check_backends(configs, mode: str, microbatches) -> None:
    """The torch-native and hf backends measure one microbatch's forward: torch-native on the CPU,
    hf on a GPU too."""
    import torch

    if any(config.spec.run.zero for config in configs) and (mode != "real" or torch.cuda.is_available()):
        raise SpecError("ZeRO is measured with DeepSpeed's CPU accelerator over gloo ranks: --mode real on a "
                        "machine without a GPU (DeepSpeed is not installed on the lent GPUs)")
    others = {config.spec.architecture.implementation for config in configs} - {"megatron"}
    if not others:
        return
    if microbatches not in (None, 1) and not all(config.spec.run.zero for config in configs):    # ZeRO: a step
        raise SpecError(f"the {', '.join(sorted(others))} backend measures one microbatch's forward: "
                        f"drop --microbatches {microbatches}")
    if mode == "fake" or not torch.cuda.is_available():
        return
    if "torch-native" in others and mode == "real":
        raise SpecError("the torch-native backend runs on the CPU so far; on a GPU measure --implementation "
                        "megatron or hf, FSDP2 (--fsdp) with --mode rank0, or use --mode fake")


def _check_output(output) -> None:
    """Before any work: a place the rows can be written, in a format named by its suffix."""
    if output is None:
        return
    if not output.endswith((".json", ".csv")):
        raise SpecError(f"--output {output}: name a .json or .csv file")
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise SpecError(f"--output {output}: the folder {folder} does not exist or is not writable")


#: flags a measurement sets itself: each technique its SP and recompute; one data-parallel
#: rank with --microbatches; no GPU to fit. Given, they would be ignored, so they are refused.
#: every spelling of those settings (the Trainer's --gradient_checkpointing and --gradient_accumulation_steps too)
_SET_BY_TECHNIQUES = tuple(spelling for flag in SPEC_FLAGS if flag.key in (
    "sequence_parallel", "recompute", "gpus", "global_batch", "gradient_accumulation", "distributed_optimizer",
    "gpu_memory") for name in flag.names for spelling in name.split("/"))


def _configs(grid, techniques, microbatches, flags):
    from actmem_validate import grid as grids

    given = list(dict.fromkeys(given_flags(flags) + given_flags(with_megatron_args(flags)[0])))
    if grid is not None:
        overridden = given + [name for name, value in (
            ("--techniques", techniques), ("--microbatches", microbatches)) if value is not None]
        if overridden:
            raise SpecError(f"--grid {grid} sets the model, run and techniques itself; drop "
                            f"{', '.join(overridden)}")
        return grids.GRIDS[grid]()
    # a pasted script's run (its SP, recompute, batch, GPUs) is the script's, not a request: each
    # measured run sets its own, as for a preset; flags given beside it are refused
    ignored = [name for name in given_flags(flags) if name in _SET_BY_TECHNIQUES
               and not (name == "--gpus" and {"--fsdp", "--zero-stage", "--deepspeed"} & set(given))]
    # FSDP2's and ZeRO's d ranks are measured
    if ignored:
        raise SpecError(f"validate measures each --techniques entry with its own SP and recompute, "
                        f"on one data-parallel rank (--microbatches); drop {', '.join(ignored)}")
    shaped = any(name in given for name in ("--recompute-method", "--recompute-num-layers"))
    mode = "full" if shaped else "selective" if "--recompute-modules" in given else \
        "option" if "--selective-ac-option" in given else None
    # dims_only: the preset's gpus and global batch (and its kernels' rules at its own run) wait,
    # as validate measures one data-parallel rank of its own; configs_for checks each run whole
    recompute = "selective" if mode == "option" else mode   # torchtitan's option refines its selective mode
    spec = build_spec_from_flags(with_setting(flags, "recompute", recompute) if mode else flags, dims_only=True)
    if spec.architecture.moe:
        raise SpecError("validate measures mixture-of-experts layers with --grid moe (megatron-core's own "
                        "MoELayer at small shapes) so far, not a model's whole stage")
    if spec.architecture.mtp_layers:
        raise SpecError("validate measures multi-token prediction with --grid mtp (megatron-core's own "
                        "MultiTokenPredictionBlock at small shapes) so far, not a model's whole stage")
    if spec.architecture.multi_latent_attention:
        raise SpecError("validate measures multi-latent attention with --grid mla (megatron-core's own "
                        "MLASelfAttention at small shapes) so far, not a model's whole stage")
    if techniques is None:
        chosen = grids.default_techniques(spec)
    else:
        chosen = grids.techniques_named([name.strip() for name in techniques.split(",") if name.strip()])
    if mode == "option":      # torchtitan's option: the run's own policy, with and without SP where t > 1
        chosen = grids.option_techniques(spec) if techniques is None else chosen
        others = [t.name for t in chosen if t.policy != spec.run.policy]
    else:
        others = [t.name for t in chosen if t.recompute.value != mode] if mode else []
    if techniques is None:
        chosen = [t for t in chosen if t.name not in others]
    elif others:
        shape = ("--recompute-method and --recompute-num-layers shape full recompute: measure them with full "
                 "or tp-sp-full" if shaped else "--recompute-modules shapes selective recompute: measure it "
                 "with tp-sel or tp-sp-sel" if mode == "selective" else f"--selective-ac-option is torchtitan's "
                 f"{spec.run.policy.label}: measure it with "
                 f"{' or '.join(t.name for t in grids.option_techniques(spec))} or leave out --techniques")
        raise SpecError(f"{shape}, not {', '.join(others)}")
    return grids.configs_for(spec, chosen, microbatches)


def _run(configs, mode, timeout):
    from rich.progress import Progress

    from actmem_validate.launch import HarnessError, run_fake, run_rank, run_rank0, run_real

    if "LOCAL_RANK" in os.environ and mode == "real":              # under torchrun
        return _run_under_torchrun(configs, timeout, run_rank)
    with Progress(transient=True, console=_stderr_console()) as progress:
        task = progress.add_task(f"measuring ({mode})", total=len(configs))
        advance = lambda config: progress.advance(task)
        try:
            if mode == "real":
                return run_real(configs, timeout, advance)
            return (run_fake if mode == "fake" else run_rank0)(configs, advance)
        except HarnessError as error:
            raise click.ClickException(str(error))


def _run_under_torchrun(configs, timeout, run_rank):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    elsewhere = sorted({config.technique.name for config in configs if config.world_size != world})
    if elsewhere:
        raise SpecError(f"torchrun started {world} ranks, but {', '.join(elsewhere)} runs on "
                        f"{configs[0].world_size if configs[0].world_size != world else 1}: "
                        f"give --techniques that run on {world}, and the others separately")
    mine = configs
    rows = run_rank(rank, world, mine, timeout, gather=True)
    if rank != 0:
        sys.exit(0)
    return rows


def _summary(rows, failures) -> str:
    from actmem_validate.compare import worst_error

    runs = {(row["config"], row["rank"]) for row in rows}
    residual = {}
    for row in rows:
        if row["kind"] == "residual":
            residual[row["term"]] = max(residual.get(row["term"], 0), row["measured_bytes"])
    named = ", ".join(f"{term} (up to {n:,} B)" for term, n in sorted(residual.items())) or "none"
    verdict = "failed" if failures else "passed"
    return (f"{len(runs)} measured runs (config x rank), gate {verdict}: worst error on a checked "
            f"row {worst_error(rows):.4f}%; named residual terms: {named}")


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
