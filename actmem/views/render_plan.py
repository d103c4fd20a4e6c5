"""The planner's terminal output: the ranked table, why-not, --explain and flops."""

from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from actmem.views.render import _column_kind, _notes, _table, render_estimate, terminal as _console
from actmem.units import column_unit, format_in, gib, plural


def _shown(frame, top: int):
    """The first ``top`` rows; all of them with top = 0."""
    return frame.head(top) if top > 0 else frame


def render_plan(plan, top: int, nothing=None) -> None:
    from actmem.planner.plan import config_label

    req, console = plan.request, _console()
    model = req.model
    console.print(Text(f"actmem plan · a={model.heads} h={model.hidden} L={model.layers} "
                       f"s={model.seq_len}", style="bold"))
    console.print(f"{plural(req.gpus, 'GPU')} ({req.gpu_label}) · global batch {req.global_batch}")
    console.print(f"budget {gib(req.budget_bytes):,.2f} GiB a GPU: {gib(req.gpu_memory_bytes):,.2f} GiB "
                  f"less a reserve of {gib(req.reserve_bytes):,.2f} GiB")
    derived = f" and {plan.block_rows:,} block=N derived from them" if plan.block_rows else ""
    console.print(f"{plural(plan.swept, 'configuration')}{derived}, {len(plan.fitting):,} fit\n")
    table = _table("Fastest that fit (seconds per iteration, estimated)")
    table.padding, table.show_edge = (0, 0), False     # one space a column: fits 80 columns
    ring = bool((plan.evaluated.c > 1).any())        # a cp column only where c is swept
    experts = req.architecture.moe                   # an ep column only for a mixture of experts
    overlapped = req.overlap_grad_reduce or "fsdp" in req.architecture.code.runs
    columns = ("config", "GiB", "time", "comp", "tp") + (("cp",) if ring else ()) + (("ep",) if experts else ()) \
        + ("pp", "bub", "dp", "MFU")
    for column in columns:
        table.add_column(column, **_column_kind(text=("config",))(column))
    for row in _shown(plan.fitting, top).itertuples():
        cells = [config_label(row), f"{gib(row.peak_bytes):.1f}", f"{row.iteration_s:.2f}",
                 f"{row.compute_s:.2f}", f"{row.tensor_parallel_s:.2f}"]
        cells += [f"{row.context_parallel_s:.2f}"] if ring else []
        cells += [f"{row.expert_parallel_s:.2f}"] if experts else []
        table.add_row(*cells, f"{row.pipeline_p2p_s:.2f}", f"+{100 * (row.bubble - 1):.0f}%",
                      f"{row.data_parallel_s:.2f}", f"{100 * row.mfu:.0f}%")
    table.caption = (f"time = (comp + tp{' + cp' if ring else ''}{' + ep' if experts else ''} + pp) × (1 + bub) "
                     f"+ dp: compute; tensor-parallel, {'context-parallel, ' if ring else ''}"
                     f"{'the token dispatcher, ' if experts else ''}pipeline and data-parallel "
                     f"communication{' (what overlap leaves)' if overlapped else ''}; "
                     f"d = gpus/(t{'·c' if ring else ''}·p); --explain CONFIG shows one in full")
    table.caption_justify = "left"
    if not plan.fitting.empty:
        console.print(table)
    console.print(_why_not_table(plan))
    if nothing is not None:
        console.print(_nothing_fits(plan, nothing))
    notes = _notes()
    for note in _plan_assumptions(req):
        notes.add_row("·", Text(note))           # plain text: a shape such as [b, s] is not markup
    console.print(Text("Assumptions", style="bold"), notes)


def _why_not_table(plan) -> Table:
    from actmem.planner.plan import config_label

    table = _table("Each t at its leanest (why not t = ...?)")
    for column in ("t", "leanest config", "memory", "verdict"):
        table.add_column(column, **_column_kind(text=("leanest config", "verdict"))(column))
    why = plan.why_not()
    unit = column_unit(list(why.peak_bytes) + list(why.over_bytes))
    for row in why.itertuples():
        if row.t_fits:
            count = int((plan.fitting.t == row.t).sum())
            verdict = Text(f"{plural(count, 'configuration')} fit" if count > 1 else "1 configuration fits",
                           style="green")
        else:
            verdict = Text(f"over by {format_in(row.over_bytes, unit)}; largest part: {row.largest_part}",
                           style="red")
        table.add_row(str(row.t), config_label(row), format_in(row.peak_bytes, unit), verdict)
    return table


def _nothing_fits(plan, nothing) -> Text:
    """Why nothing fits: the leanest need, what the GPU count allows, and where to go instead."""
    from actmem.planner.plan import config_label

    req = plan.request
    leanest = plan.evaluated.loc[plan.evaluated.peak_bytes.idxmin()]
    text = Text(f"Nothing fits {gib(req.budget_bytes):,.2f} GiB: the leanest configuration, "
                f"{config_label(leanest)}, needs {gib(leanest.peak_bytes):,.2f} GiB.\n", style="bold red")
    if nothing.usable_p != nothing.all_p:
        text.append(f"On {plural(req.gpus, 'GPU')} with global batch {req.global_batch}, p must split the "
                    f"{req.model.layers} layers and divide {req.gpus}/t, and d = gpus/(t·c·p) the batch: that "
                    f"leaves t in {_listed(nothing.usable_t)} and p in {_listed(nothing.usable_p)} "
                    f"(the model allows p in {_listed(nothing.all_p)}).\n")
    if nothing.nearest:
        places = "; ".join(f"{plural(gpus, 'GPU')}: {label}" for gpus, label in nothing.nearest)
        text.append(f"Nearest GPU counts where a configuration fits: {places}.\n", style="green")
    else:
        text.append("No GPU count near this one fits either (searched the nearest that the "
                    "parameters alone could fit).\n")
    if "zero" in req.architecture.code.runs:
        text.append(f"These price DDP, the whole model state on every GPU; DeepSpeed's ZeRO shards it: try `actmem "
                    f"estimate --implementation {req.architecture.implementation} --gpus {req.gpus} --zero-stage 3` "
                    "(or --deepspeed ds_config.json).\n", style="yellow")
    return text


def _listed(values) -> str:
    return "{" + ", ".join(map(str, values)) + "}"


def _compute_assumption(req) -> str:
    from actmem.model.hardware import DEFAULT_EFFICIENCY
    from actmem.views.report import compute_source

    gpu, peak = req.gpu, f"{req.gpu.peak_flops / 1e12:.0f} TFLOP/s"
    if compute_source(req) is None:
        share = DEFAULT_EFFICIENCY if req.efficiency is None else req.efficiency
        return f"compute: hardware FLOPs (recompute included) at {share:.0%} of {peak} ({gpu.name})"
    core = ("the attention core at 60% (no table of an eager core's softmax)" if req.architecture.attention_core == "eager"
            else "")
    return (f"compute: hardware FLOPs (recompute included), each linear's GEMMs"
            f"{'' if core else ' and the attention core'} at the "
            f"speed measured on an {gpu.kernel_tables.upper()} at the shapes one rank runs{', ' + core if core else ''} "
            f"(actmem/planner/data/{gpu.kernel_tables}_*.csv, benchmarks/gpu_kernel_tables.py), of {peak} "
            f"({gpu.name}), and beside them the memory-bound kernels (norms, residual adds, rope, the "
            "activation, the loss's cross entropy) at their measured seconds an element (eager PyTorch's: Megatron "
            "fuses some); dropout, MoE permutation, the optimizer step and latencies not charged; --efficiency "
            "gives one share of the peak for all")


def _overlap_assumption(req) -> str:
    if "fsdp" in req.architecture.code.runs:
        return "FSDP2's collectives as the note below says"
    if not req.overlap_grad_reduce:
        return "nothing overlapped (Megatron's default; --overlap-grad-reduce, --overlap-param-gather)"
    gather = ("and the parameter all-gather behind the next forward (--overlap-param-gather: the distributed "
              "optimizer's configurations only, as Megatron asserts, and d·c = 1), " if req.overlap_param_gather else "")
    return ("the gradient reduction overlapped with the last microbatch's backward (--overlap-grad-reduce) "
            f"{gather}at least the last bucket (max(40M, 1M·d·c) parameters) or, interleaved, the first "
            "chunk's left waiting; the rest not overlapped")


def _plan_assumptions(req) -> list[str]:
    gpu = req.gpu
    return [
        "memory (GiB) is the allocator's peak from below (actmem.memory.peak) on the busiest of the first "
        "stage (the most microbatches, the embedding), the last (the logits, the output layer's "
        "weights) and, in an uneven pipeline, stage 1 (the most layers and microbatches of the "
        "stages between, which hold less than the first in an even one)",
        f"reserve {gib(req.reserve_bytes):,.2f} GiB a GPU kept free above that peak for what it "
        "does not model: the CUDA context, NCCL and cuBLAS workspaces, allocator fragmentation, "
        "and the backward's transients other than those it counts (the rerun, the loss's logits "
        "gradient, the last layer's fc1 and eager core backward, transformers' SwiGLU backward)",
        _compute_assumption(req),
        f"tensor-parallel all-reduces at {gpu.intra_node_bandwidth / 1e9:.0f} GB/s a GPU; pipeline "
        f"sends and gradient reduction at {gpu.inter_node_bandwidth / 1e9:.0f} GB/s across nodes; "
        + _overlap_assumption(req) + "; latencies and the lower efficiency of small chunks (large m) not charged",
        "pipeline bubble (p-1)/(m·n) for n microbatches a pipeline",
        "pipelines even where p divides L, else (p ≥ 3) as Llama 3 splits its 126 layers on 16 "
        "stages, 7 + 8 x 14 + 7: ⌈L/p⌉ layers on each stage between and the rest on the first and "
        "last (written as p, 'p=7+8x14+7'; interleaving in even pipelines only); the pipeline goes at the pace "
        "of its fullest stage; another split is checked with actmem estimate "
        "--first-stage-layers/--last-stage-layers",
        "context parallelism c (2c | s) under the cuDNN flash core, its ring not overlapped; full "
        "recompute of every layer alone, or of the first N layers of each chunk (block=N, "
        "Megatron's --recompute-method block --recompute-num-layers N: the least N that fits, "
        "offered where nothing recomputed does not fit, at most the first stage's chunk; "
        "uniform groups are checked with actmem estimate); selective recompute of the attention "
        "core (sel), of it and the MLP (sel+mlp), or of the MLP alone (mlp), Megatron's "
        "--recompute-modules, where actmem models them",
        f"t ≤ {req.gpus_per_node} (one node), b ≤ {req.max_micro_batch}; interleaving needs "
        "microbatches a multiple of p, as Megatron does",
    ] + ([_FUSED_SOFTMAX] if req.architecture.attention_core == "eager" and
         "softmax_switches" in req.architecture.code.has else []) + ([_experts_note(req)] if req.architecture.moe else []) \
        + ([_MTP_NOTE.format(d=req.architecture.mtp_layers)] if req.architecture.mtp_layers else []) \
        + ([_FSDP_NOTE.format(code=req.architecture.implementation)] if "fsdp" in req.architecture.code.runs else []) \
        + ([_ZERO_NOTE.format(code=req.architecture.implementation)] if "zero" in req.architecture.code.runs else []) \
        + ([_FP8_NOTE.format(format=req.architecture.fp8_format, recipe=req.architecture.fp8)]
           if req.architecture.fp8 else [])


_FP8_NOTE = ("FP8 ({format}, {recipe} scaling): its memory priced in every row as `actmem estimate` prices it (the "
             "saved inputs in one byte, TE's FP8 weight copies; docs/models.md); its time not: every GEMM is timed "
             "at the 16-bit speed measured, so FP8's faster GEMMs are not in the times or the MFU")


_ZERO_NOTE = ("{code}: every configuration's model state is DDP's (the whole model's weights, gradients and Adam on "
              "every GPU); DeepSpeed's ZeRO is priced one run at a time by `actmem estimate --zero-stage N` or "
              "`--deepspeed ds_config.json`, not swept yet")


_FSDP_NOTE = ("{code}: every configuration over d > 1 data-parallel ranks under FSDP2 as torchtitan applies it "
              "('fsdp': fp32 shards, AdamW's state, the weights each group gathers and the gradients each "
              "reduce-scatters at the moment they peak, torchtitan's default resharding; actmem.memory.fsdp), as "
              "torchtitan 018740b7 runs data parallelism (its DDP runs alone, under AMP with fp32 weights, not "
              "modelled); at d = 1, TP alone, priced as `actmem estimate` prices it (bf16 layers, mixed-precision "
              "Adam over t; torchtitan trains TP alone in fp32); FSDP2's all-gathers (bf16, forward and backward) "
              "and reduce-scatters (fp32) every microbatch, overlapped with the compute beside them but the token "
              "embedding's; HSDP and the other resharding policies with `actmem estimate`")


_MTP_NOTE = ("multi-token prediction: the last stage holds its {d} prediction layer(s), of the model's last layer's "
             "kind (none held under full recompute, which checkpoints each), their norms and projection and {d} more "
             "logits; no interleaving or block method (what actmem models of them); their FLOPs are in the compute, "
             "not in the "
             "last stage's pace")


def _experts_note(req) -> str:
    arch, r = req.architecture, req.routing_imbalance
    return (f"mixture of experts: EP dividing the {arch.num_experts} experts and ETP 1 or t (written ep= where EP > 1, "
            "etp= where ETP is not t), ETP·EP·p dividing the GPUs, SP at t > 1 (Megatron's MoELayer needs it); "
            + ("the busiest rank at each EP of the load histogram (--moe-load-histogram), whose memory decides"
               if req.expert_loads is not None else
               "balanced routing (--moe-imbalance for a busier rank)" if r == 1 else
               f"the busiest rank's experts receive {r} x the balanced rows (--moe-imbalance, at most EP), whose memory "
               "decides")
            + f"; the {arch.moe_dispatcher} dispatcher's dispatch and combine, forward and backward, not overlapped, "
            "inside a node where ETP·EP fits one; compute: the k experts a token is routed to, balanced; the experts' "
            "gradients reduced over d·c like the rest (Megatron reduces them over the expert data-parallel ranks); "
            "the MLP's recompute (mlp, sel+mlp) not swept where every layer has experts: it leaves a MoE layer whole")


_FUSED_SOFTMAX = ("Megatron's local attention core with its fused softmax where the kernel runs (16 < s ≤ 4096, "
                  "b·a/t a multiple of 8 up to s = 128, else 4), and at the t and b where it does not, torch's "
                  "fallback softmax (forward_torch_softmax: the causal mask it fills, s² bytes a layer, and under "
                  "--attention-softmax-in-fp32 its fp32 output)")


def render_explain(est, row, rank: dict | None = None) -> None:
    """The estimate, then the modelled time part by part, beside the plan's first pick where the
    explained configuration is not it (rank: explain.ranking)."""
    from actmem.planner.explain import TIME_PARTS, time_parts

    render_estimate(est)
    first = rank["first"] if rank and rank["first"] is not None and rank["rank"] != 1 else None
    table = _table("Time per iteration (estimated)")
    columns = ("part", "seconds") + (("first pick", "difference") if first is not None else ())
    for column in columns:
        table.add_column(column, **_column_kind(text=("part",))(column))
    mine, theirs = time_parts(row), time_parts(first) if first is not None else None
    for column, part in TIME_PARTS:
        label = part if column != "bubble_s" else f"{part} × {row.bubble:.4f}" + (
            f" (first pick × {first.bubble:.4f})" if first is not None else "")
        cells = [f"{mine[column]:.3f}"]
        if theirs is not None:
            cells += [f"{theirs[column]:.3f}", f"{mine[column] - theirs[column]:+.3f}"]
        table.add_row(label, *cells)
    table.caption = (f"model FLOPs utilisation {100 * row.mfu:.1f}%; compute at {row.layers_efficiency:.0%} of "
                     f"the peak in the layers (their matmuls and the memory-bound kernels beside them), "
                     f"{row.scores_efficiency:.0%} in the attention core and {row.logits_efficiency:.0%} in the "
                     f"logits (with the loss)" + _standing(rank))
    table.caption_justify = "left"
    _console().print(table)


def _standing(rank: dict | None) -> str:
    """Where the explained configuration ranks in the plan, and the first pick beside it."""
    if rank is None:
        return ""
    if rank["rank"] == 1:
        return f"; the plan's first pick of {rank['fitting']:,} that fit"
    first = "" if rank["first_label"] is None else f"; first pick (beside it): {rank['first_label']}"
    where = (f"ranks {rank['rank']:,} of {rank['fitting']:,} that fit" if rank["rank"] is not None
             else "does not fit, so not ranked" if not rank["fits"] else "not among the plan's sweep")
    return f"; {where}{first}"


def render_flops(name: str, report: dict) -> None:
    console = _console()
    console.print(Text(f"actmem flops · {name} · global batch {report['global_batch']}", style="bold"))
    formula = report["model_flops_formula"]
    console.print(f"model FLOPs per iteration: {report['model_flops']:.4e} = {formula['formula']}")
    for line in (*formula["where"], formula["counts"]):
        console.print(Padding(Text(line, style="dim"), (0, 0, 0, 2)))
    table = _table("Hardware FLOPs per iteration")
    for column in ("recompute", "hardware FLOPs", "overhead", "HFU"):
        table.add_column(column, **_column_kind(text=("recompute",))(column))
    for row in report["hardware"]:
        hfu = f"{100 * row['hfu']:.1f}%" if "hfu" in row else "–"
        table.add_row(row["recompute"], f"{row['hardware_flops']:.4e}", f"+{100 * row['overhead']:.2f}%", hfu)
    console.print(table)
    if report["iteration_s"] is not None:
        console.print(f"MFU {100 * report['mfu']:.1f}% at {report['iteration_s']} s an iteration on "
                      f"{report['gpus']} GPUs of {report['peak_flops'] / 1e12:.0f} TFLOP/s peak ({report['peak_of']})")
