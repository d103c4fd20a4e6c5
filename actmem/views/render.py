"""All terminal output: rich tables and bars. The only module that knows the terminal."""

from rich import box
from rich.console import Console, Group
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from actmem.memory.estimate import FITS, NO_FIT, TIGHT, Estimate
from actmem.memory.stages import split_of, stage_name
from actmem.memory.stage_model import LAYER_MOMENT_ROWS
from actmem.units import column_unit, format_in, gib, plural
from actmem.model.widths import GRADIENT_BYTES, WEIGHT_BYTES
from actmem.views.report import against_bf16_line

_BAR_WIDTH = 24
_VERDICT_BAR, _VERDICT_BAR_LEAST = 30, 6   # the verdict's bar shrinks to keep its line whole


_TEXT_FLOOR = 10   # characters a text column keeps, however narrow the console: it wraps, folding long words


class _Console(Console):
    """rich's console (the terminal's width, COLUMNS where set, else 80), except that a table
    too wide for it gives way in this order: its text columns wrap (down to _TEXT_FLOOR
    characters), the gaps between its columns close to one space, and last it is printed past
    that width: rich would cut its numbers with '…' (issue 25)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.width = self.width            # fixed for the run, so that print can widen and restore it

    def print(self, *objects, **kwargs) -> None:
        width = self.width
        for table in _tables(objects):
            if _least_width(self, table) > width:
                top, _, bottom, _ = table.padding
                table.padding = (top, 0, bottom, 0)
        self.width = max([width, *(_least_width(self, table) for table in _tables(objects))])
        try:
            super().print(*objects, **kwargs)
        finally:
            self.width = width

    def on_broken_pipe(self) -> None:
        """Rich would exit 1, which the planner uses for "nothing fits": let the CLI end it."""
        self.quiet = True
        raise BrokenPipeError


def _tables(objects):
    for item in objects:
        if isinstance(item, Table):
            yield item
        elif isinstance(item, Group):
            yield from _tables(item.renderables)


def _least_width(console: Console, table: Table) -> int:
    """The width at which each no_wrap column (the numbers) is whole and each text column keeps
    _TEXT_FLOOR characters (or its min_width) or its widest cell: rich narrows the wrapping
    columns before others."""
    wide = console.options.update_width(_UNBOUNDED)
    widest = [max(Measurement.get(console, wide, cell).maximum for cell in (column.header, *column.cells))
              for column in table.columns]
    frame = Measurement.get(console, wide, table).maximum - sum(widest)       # padding, rules, edges
    return frame + sum(cells if column.no_wrap else min(cells, max(_TEXT_FLOOR, column.min_width or 0))
                       for cells, column in zip(widest, table.columns))


_UNBOUNDED = 10_000


_NUMBERS = {"justify": "right", "no_wrap": True}   # a number is never wrapped, so never cut (_Console)
_TEXT = {"justify": "left", "overflow": "fold"}    # text wraps, folding a word longer than its column
_WHOLE = {"justify": "left", "no_wrap": True}      # a name, a bar or a formula: kept whole, as a number


def _column_kind(text=(), whole=()):
    """The column settings for a header: _TEXT for those in ``text``, _WHOLE for those in ``whole``,
    _NUMBERS for the rest."""
    return lambda header: _TEXT if header in text else _WHOLE if header in whole else _NUMBERS


def terminal() -> Console:
    """Where all of actmem's terminal output goes."""
    return _Console(highlight=False)


def _table(title: str) -> Table:
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                 title_style="bold")


def _notes() -> Table:
    """Two dim columns, a mark and its note: prose, which wraps (a long flag folds, never cut)."""
    notes = Table.grid(padding=(0, 1))
    notes.add_column(style="dim")
    notes.add_column(style="dim", overflow="fold")
    return notes


def _bar(fraction: float, width: int = _BAR_WIDTH, style: str = "cyan") -> Text:
    filled = max(0, min(width, round(fraction * width)))
    return Text("█" * filled, style=style) + Text("·" * (width - filled), style="dim")


def render_estimate(est: Estimate, all_stages: bool = False, codes=None) -> None:
    console = terminal()
    console.print(_header(est))
    console.print(_techniques_table(est))
    console.print(_terms_table(est))
    console.print(_memory_table(est))
    if all_stages:
        console.print(_stages_table(est))
    console.print(_verdict(est, console.width))
    if codes is not None:
        console.print(_codes_table(est, codes))
    notes = _notes()
    for note in est.assumptions:
        notes.add_row("·", Text(note))           # plain text: a shape such as [b, s] is not markup
    console.print(Text("Assumptions", style="bold"), notes)


def _codes_table(est: Estimate, codes):
    """The same model and run under each implementation (actmem.memory.side_by_side); why an
    implementation is not modelled is a line under the table."""
    table = _table("The same model and run, by implementation (the busiest stage's peak decides)")
    kind = _column_kind(text=("implementation",), whole=("",))
    for name in ("implementation", "per layer", "activations", "peak, at least", ""):
        table.add_column(name, **kind(name))
    modelled = [row.estimate for row in codes if row.estimate is not None]
    layer = column_unit(other.run_row.per_layer_bytes for other in modelled)
    stage = column_unit(other.verdict_bytes for other in modelled)
    why = _notes()
    for row in codes:
        if row.estimate is None:
            table.add_row(row.name, "", "", "", Text("not modelled", style="dim"))
            why.add_row(f"{row.name}:", row.not_modelled)
            continue
        other = row.estimate
        mark = " ◀" if other.spec.architecture == est.spec.architecture else ""
        table.add_row(row.name + mark, format_in(other.run_row.per_layer_bytes, layer),
                      format_in(other.activations_bytes, stage), format_in(other.verdict_bytes, stage),
                      Text(f"{_MARKS[other.verdict]} {other.verdict}", style=_VERDICT_STYLES[other.verdict]))
    return Group(table, why) if why.row_count else table


def _header(est: Estimate) -> Group:
    """The model, run, architecture, code and batch, a label a line; a long value wraps under its own column."""
    spec, run, model = est.spec, est.spec.run, est.spec.model
    lines = Table.grid(padding=(0, 2, 0, 0))
    lines.add_column(no_wrap=True)
    lines.add_column()
    lines.add_row("model", f"a={model.heads} h={model.hidden} L={model.layers} v={spec.padded_vocab} s={model.seq_len}")
    cp = f" c={run.context_parallel}" if run.context_parallel > 1 else ""
    if spec.architecture.moe:           # the experts' layout, as plan writes it
        cp += (f" ep={run.expert_parallel}" if run.expert_parallel > 1 else "") + (
            f" etp={run.etp}" if run.etp != run.tensor_parallel else "")
    split = f" ({split_of(spec)})" if split_of(spec) else ""          # an uneven pipeline: '(7+8x14+7)'
    offload = f" · {plural(run.offload_layers, 'layer')} offloaded to the host" if run.offload_layers else ""
    if run.fsdp:
        offload += (f" · FSDP2 over d={spec.data_parallel}" if run.fsdp_replicate == 1 else
                     f" · HSDP: {run.fsdp_replicate} replicas of FSDP2 over {spec.fsdp_shards}")
    if run.zero:
        offload += f" · DeepSpeed {run.zero.label} over d={spec.data_parallel}"
    if run.megatron_fsdp:
        offload += f" · Megatron-FSDP {spec.megatron_fsdp_strategy} over {_dc(spec)}"
    lines.add_row("run", f"t={run.tensor_parallel}{cp} p={run.pipeline_parallel}{split} m={run.interleave} "
                         f"b={run.micro_batch} · SP {'on' if run.sequence_parallel else 'off'} · "
                         f"recompute {run.policy.label}{offload}")
    arch = spec.architecture
    lines.add_row("arch", f"{arch.describe()}\ndropout: attention {arch.attention_dropout:g}, "
                          f"hidden {arch.hidden_dropout:g}")
    lines.add_row("code", arch.code.label_for(arch))
    if spec.microbatches is not None:
        lines.add_row("batch", f"{plural(run.gpus, 'GPU')}, d={spec.data_parallel} · global batch "
                               f"{run.global_batch} · {plural(spec.microbatches, 'microbatch')} per iteration")
    return Group(Text(f"actmem · {spec.name}", style="bold"), lines, Text(""))


def _techniques_table(est: Estimate) -> Table:
    from actmem.memory.stages import mtp_layers_held

    offloaded = est.spec.run.offload_layers
    held = plural(est.occupancy.layer_activations, 'layer activation')
    mtp = (mtp_layers_held(est.spec, est.stage, full_recompute=False) * est.occupancy.layer_activations
           // max(est.stages[est.stage].layers, 1))            # a layer each for the microbatches the stage holds
    if mtp:          # the multi-token-prediction layers, counted as the stage's (stages.mtp_layers_held)
        held += f" and {plural(mtp, 'multi-token-prediction layer activation')}"
    where = (f"{held}, {est.occupancy.layer_activations - offloaded} on the GPU and {offloaded} on the host under CPU "
             f"offloading (the rows that recompute, which Megatron does not offload, keep all on the GPU)"
             if offloaded else f"{held} held")
    table = _table(f"Activations per GPU, {_shown(est)}, {where} (Table 2)")
    for column in ("technique", "per layer", "this stage" if est.stage else "first stage", "vs tp", "",
                   "+ params"):
        table.add_column(column, **_column_kind(whole=("technique", ""))(column))
    units = {name: column_unit(values) for name, values in (
        ("layer", [row.per_layer_bytes for row in est.techniques]),
        ("stage", [row.first_stage_bytes for row in est.techniques]),
        ("total", [_with_state(row) for row in est.techniques]))}
    for row in est.techniques:
        is_run = row is est.run_row
        share = row.per_layer_bytes / est.baseline.per_layer_bytes
        verdict = est.technique_verdict(row)
        table.add_row(Text(row.technique.name + (" ◀" if is_run else ""), style="bold" if is_run else ""),
                      format_in(row.per_layer_bytes, units["layer"]),
                      format_in(row.first_stage_bytes, units["stage"]), f"{100 * share:.0f}%",
                      _bar(share, width=12, style="yellow" if is_run else "cyan") + (">" if share > 1 else " "),
                      Text(f"{format_in(_with_state(row), units['total'])} {_MARKS[verdict]}",
                           style=_VERDICT_STYLES[verdict]))
    code = est.spec.architecture.code
    at_t = " at the row's t" if "tensor" in code.runs else ""
    if "tensor" in code.runs:
        share = ("vs tp: per-layer bytes as a share of the tensor-parallel baseline (Figure 7"
                 + ("; at t = 1, where tp is none and each SP row its twin, each row is shown once"
                    if est.spec.run.tensor_parallel == 1 else "") + "); ")
    else:
        share = (f"vs tp: per-layer bytes as a share of the row without recompute (the paper's tensor-parallel "
                 f"baseline, Figure 7, at t = 1: --implementation {code.name} runs a whole model a GPU); ")
    if est.parameters.transient_gradients:
        state = (f"+ params: with the weights and optimizer state{at_t} (the gradients, held only at some moments, "
                 "are in the peak); ")
    else:
        state = ("+ params: with weights, gradients, optimizer state"
                 + (" and TE's dummy weight gradients" if "wgrad_fusion" in code.has else "") + f"{at_t}; ")
    table.caption = (share + state + "✓ where the row's peak floor and the reserve fit on every stage, ~ where only "
                     "the floor does (tight); ◀ this run")
    table.caption_justify = "left"
    return table


def _with_state(row) -> int:
    """A technique row's activations and the model state held throughout (FSDP2's and ZeRO-1/2's gradients, held
    at some moments only, are the peak's)."""
    return row.first_stage_bytes + row.parameters.held_bytes


def _terms_table(est: Estimate) -> Table:
    table = _table(f"This run, term by term ({_shown(est)}, one GPU)")
    for column in ("term", "region", "each", "× held", "bytes", "share"):
        table.add_column(column, **_column_kind(text=("region",), whole=("term",))(column))
    total = est.activations_bytes
    unit = column_unit([row.total_bytes for row in est.run_terms] + [total])
    for row in est.run_terms:
        table.add_row(row.term.name, row.term.region.value, f"{row.bytes_each:,}", f"{row.count:,}",
                      format_in(row.total_bytes, unit), f"{100 * row.total_bytes / total:.1f}%")
    table.add_row(Text("activations", style="bold"), "", "", "", Text(format_in(total, unit), style="bold"), "")
    return table


def _memory_table(est: Estimate) -> Table:
    params = est.parameters
    table = _table(f"Memory per GPU, {_shown(est)}")
    for column in ("item", "bytes", "GiB", ""):
        table.add_column(column, **_column_kind(text=("item", ""))(column))
    per_param = f"{params.count:,} parameters × "
    shards = est.spec.optimizer_shards if est.spec.run.distributed_optimizer else 1
    optimizer = f"{est.spec.optimizer.bytes_per_parameter} B" + ("" if shards == 1 else
                                          f" / d={shards}" if est.spec.run.context_parallel == 1 else
                                          f" / d·c={shards}")
    if est.spec.architecture.moe and est.spec.run.distributed_optimizer:     # experts: over their own ranks
        optimizer += f" (the experts' / {est.spec.expert_optimizer_shards})"
    rows = (("activations", est.activations_bytes, "the run's terms above"),) + (
        _fsdp_state_rows(est) if params.fsdp else _zero_state_rows(est) if params.zero else
        _megatron_fsdp_state_rows(est) if params.megatron_fsdp else (
            ("weights", params.weights_bytes, per_param + f"{WEIGHT_BYTES} B"
             + (", less 1 B an element of the linears' weights, FP8 (--fp8-param-gather)"
                if est.spec.architecture.fp8_param_gather else "")),
            ("gradients", params.gradients_bytes, per_param + f"{est.spec.gradient_bytes} B "
             + ("(fp32)" if est.spec.gradient_bytes == GRADIENT_BYTES else "(16-bit)")),
            ("optimizer state", params.optimizer_bytes, per_param + optimizer)))
    if params.dummy_wgrads_bytes:
        rows += (("dummy weight gradients", params.dummy_wgrads_bytes,
                  "16-bit, one a linear's weight shape, kept by TE (get_dummy_wgrad)"),)
    if params.gathered_bytes:
        rows += (("gathered weights", params.gathered_bytes, "16-bit, outside Megatron-FSDP's units (embedding, "
                  "output layer, final norm): gathered from the forward to the backward's end"),)
    if params.double_buffer_bytes:
        rows += (("double buffers", params.double_buffer_bytes, "Megatron-FSDP's fixed pools (--fsdp-double-buffer): "
                  "min(L, 2) of a unit's padded buckets for each sharded buffer (weights, gradients), held"),)
    if params.fp8_bytes:
        rows += (("FP8 weight state", params.fp8_bytes, "TE's FP8 scaling state (Megatron-FSDP drops the FP8 "
                  "weights' transposes at each unit's release)" if params.buckets and params.buckets.fp8_shard else
                  "TE's FP8 copies of the linears' weights (Hopper: and transposes), scales, amax history"),)
    for item, n_bytes, note in rows:
        table.add_row(item, f"{n_bytes:,}", f"{gib(n_bytes):,.2f}", Text(note, style="dim"))
    peak = est.peak
    table.add_row(Text("total", style="bold"), f"{est.total_bytes:,}", f"{gib(est.total_bytes):,.2f}", Text(
        "every part summed: the gradients are not held with all the activations" if peak.total_bytes
        < est.total_bytes else "", style="dim"))
    if params.fsdp or params.zero:
        table.add_row(Text("peak, at least", style="bold"), f"{peak.total_bytes:,}", f"{gib(peak.total_bytes):,.2f}",
                      Text(f"at {peak.moment}: " + ", ".join(
                          _peak_part(row) for row in peak.rows
                          if row.name not in ("weights", "optimizer_state", "gradient_buffers")), style="dim"))
    elif peak.total_bytes != est.total_bytes:
        rerun, loss = peak.bytes_of("rematerialised"), peak.bytes_of("logits_gradient_16bit", "cross_entropy_fp32_gradients")
        op = peak.bytes_of(*LAYER_MOMENT_ROWS)
        made = rerun + op
        parts = (f"{gib(rerun):,.2f} GiB rerun, " if rerun else "") + (f"{gib(op):,.2f} GiB of its gradients, "
                                                                       if op else "")
        freed = est.total_bytes + made - peak.total_bytes
        what = "16-bit logits gradient" if peak.bytes_of("logits_gradient_16bit") else "fp32 logits gradients"
        note = (f"at {peak.moment}: " + (f"{gib(loss):,.2f} GiB {what}" if loss else
                (f"{parts}{gib(freed):,.2f} GiB already freed" if freed else parts.rstrip(", "))))
        table.add_row(Text("peak, at least", style="bold"), f"{peak.total_bytes:,}",
                      f"{gib(peak.total_bytes):,.2f}", Text(note, style="dim"))
    return table


def _peak_part(row) -> str:
    """A row of a sharded run's peak moment, as the memory table's note names it ('less' what it frees)."""
    name = row.name.replace("_", " ")
    return f"{gib(row.bytes):,.2f} GiB {name}" if row.bytes >= 0 else f"less {gib(-row.bytes):,.2f} GiB {name}"


def _zero_state_rows(est: Estimate) -> tuple:
    """The memory table's model state under DeepSpeed's ZeRO (actmem.memory.zero)."""
    from actmem.memory.zero import ADAM_BYTES, MASTER_BYTES

    params, zero, d = est.parameters, est.spec.run.zero, est.spec.data_parallel
    state = (f"fp32 master weights and AdamW's two moments ({MASTER_BYTES} + {ADAM_BYTES} B) of rank 0's "
             f"partition (of {d}), step counters, the gradient norm")
    if zero.stage == 3:
        return (("weights", params.weights_bytes, f"bf16: rank 0's partition of every parameter (ceil(n/{d}) "
                 f"elements each), and whole the parameters of at most {zero.persistence_threshold:,} elements"),
                ("gradients", params.gradients_bytes, f"bf16: the gradient partition, and the reduce bucket of "
                 f"{zero.reduce_bucket_size:,} elements, both kept for the whole run"),
                ("optimizer state", params.optimizer_bytes, state))
    held = ("every parameter's, at the backward's end" if zero.stage == 1 else
            "of the parameters in rank 0's partition, from their reduce to the step")
    return (("weights", params.weights_bytes, f"bf16, whole on every rank: each optimizer group's flat buffer, "
             f"padded to a multiple of 2·d"),
            ("gradients", params.gradients_bytes, f"bf16, {held}: the peak counts them where they are held"),
            ("optimizer state", params.optimizer_bytes, state))


def _dc(spec) -> str:
    """The data-parallel ranks the model state shards over, as a run line writes them: 'd=8' or 'd·c=16'."""
    return f"d={spec.optimizer_shards}" if spec.run.context_parallel == 1 else f"d·c={spec.optimizer_shards}"


def _megatron_fsdp_state_rows(est: Estimate) -> tuple:
    """The memory table's model state under Megatron-FSDP (actmem.memory.megatron_fsdp): what its strategy shards."""
    from actmem.memory.megatron_fsdp import MAIN_WEIGHT_BYTES
    from actmem.model.implementation import MEGATRON_FSDP_STRATEGIES

    spec, params = est.spec, est.parameters
    strategy = spec.megatron_fsdp_strategy
    sharded = MEGATRON_FSDP_STRATEGIES[strategy]
    buckets = f"its {'buckets' if strategy == 'no_shard' else 'padded buckets'}' {params.buckets.padded:,} elements"
    per = lambda width, shards: f"{buckets} × {width} B" + (f" / {_dc(spec)}" if shards else ", whole")
    grads = "fp32" if spec.gradient_bytes == GRADIENT_BYTES else "16-bit"
    weights = per(WEIGHT_BYTES, sharded[0]) if strategy != "no_shard" else f"{params.count:,} parameters × 2 B, whole"
    if params.buckets.fp8_shard:
        weights += f", less 1 B an element of its FP8 groups' {params.buckets.fp8_shard:,} (--fp8-param-gather)"
    return (("weights", params.weights_bytes, weights + (
                " (the units gathered to compute: the last layer's backward moments)" if sharded[0] else "")),
            ("gradients", params.gradients_bytes, per(spec.gradient_bytes, sharded[1]) + f" ({grads}: "
             "--megatron-fsdp-main-grads-dtype)"),
            ("optimizer state", params.optimizer_bytes, per(MAIN_WEIGHT_BYTES, sharded[2]) + " (fp32 main weights) + Adam's two fp32 "
             "moments of " + ("the parameters in the rank's shard" if sharded[2] else "every parameter")))


def _fsdp_state_rows(est: Estimate) -> tuple:
    """The memory table's model state under FSDP2 (actmem.memory.fsdp)."""
    from actmem.memory.fsdp import ADAM_BYTES, PARAMETER_BYTES, REDUCE_BYTES, STEP_BYTES

    params, shards = est.parameters, est.spec.fsdp_shards
    shard = f"{params.count:,} elements of the shard (of {shards}) × "
    return (("weights", params.weights_bytes, shard + f"{PARAMETER_BYTES} B (fp32; each group gathers bf16 copies "
             "to compute)"),
            ("gradients", params.gradients_bytes, shard + f"{REDUCE_BYTES} B (fp32), from each group's reduce-scatter "
             "to the next zero_grad: the peak counts them where they are held"),
            ("optimizer state", params.optimizer_bytes, shard + f"{ADAM_BYTES} B (AdamW's two moments, fp32) and "
             f"{STEP_BYTES} B a parameter tensor's step"))


def _verdict(est: Estimate, width: int) -> Text:
    """The verdict, on one line of ``width`` where its bar can shrink to fit."""
    budget = est.spec.gpu_memory_bytes
    used = est.verdict_bytes / budget
    text = Text()
    busiest, p = est.busiest_stage, est.spec.run.pipeline_parallel
    where = stage_name(busiest.stage, p, article=True)
    if busiest.stage != est.stage:
        text.append(f"{where[0].upper()}{where[1:]} holds the most ({plural(busiest.layers, 'layer')}, "
                    f"{plural(busiest.occupancy.layer_activations, 'layer activation')} in flight, "
                    f"{gib(busiest.activations_bytes):,.2f} GiB of activations and "
                    f"{gib(busiest.parameters.total_bytes):,.2f} GiB of model state): "
                    f"the verdict is its peak floor (--stage {_stage_flag(busiest.stage, p)} shows it)\n", style="yellow")
    word, numbers, margin = _verdict_words(est, where)
    bar = max(_VERDICT_BAR_LEAST, min(_VERDICT_BAR, width - len(word) - len(numbers)))  # one line if it can
    style = _VERDICT_STYLES[est.verdict]
    text.append(word, style=f"bold {style}")
    text.append_text(_bar(used, width=bar, style=style))
    text.append(numbers + "\n")
    text.append(" " * len(word) + margin + "\n", style=style)
    if est.against_bf16 is not None:
        text.append(against_bf16_line(est) + "\n")
    state = busiest.parameters.total_bytes
    if state + est.spec.reserve_bytes > budget:       # no activation technique can help: say so
        params = busiest.parameters
        caches = " and TE's caches" if params.dummy_wgrads_bytes or params.fp8_bytes else ""
        text.append(f"Model state alone (weights, gradients, optimizer state{caches}: {gib(state):,.2f} GiB on {where}) "
                    f"and the reserve are over the GPU: no activation recompute or offloading makes it fit; "
                    + _shard_advice(est.spec) + "\n", style=style)
    if est.host_bytes:
        text.append(_host_line(est))
    return text


def _shard_advice(spec) -> str:
    """How to make the model state smaller in the run shapes this implementation has."""
    runs = spec.architecture.code.runs
    flags = [flag for flag, shape in (("--tp", "tensor"), ("--pp", "pipeline")) if shape in runs]
    split = f"split the model ({', '.join(flags)})" if flags else "use a GPU with more memory"
    if spec.run.fsdp or spec.megatron_fsdp_strategy == "optim_grads_params":
        return f"shard it over more GPUs (--gpus) or {split}"
    if spec.run.megatron_fsdp:
        return f"shard more of it (--data-parallel-sharding-strategy optim_grads_params) over more GPUs, or {split}"
    if spec.run.zero and spec.run.zero.stage == 3:
        return (f"shard it over more GPUs (--gpus) or {split}; ZeRO-Offload (offload_optimizer, offload_param), "
                "which moves it to the host, is not modelled yet")
    if "zero" in runs:
        return ("shard it with DeepSpeed's ZeRO-3 (--zero-stage 3, or --deepspeed with your ds_config.json) over "
                "more GPUs (--gpus); ZeRO-Offload, which moves it to the host, is not modelled yet")
    if "fsdp" in runs:
        return f"shard it with --fsdp (FSDP2) over more GPUs (--gpus), or {split}"
    if "distributed_optimizer" in runs:
        return f"shard the optimizer state (--distributed-optimizer over more GPUs) or {split}"
    return "use a GPU with more memory: this implementation is modelled on one GPU (--implementation megatron shards it)"


#: GPUs a node of the GPUs actmem knows (DGX and HGX H100, H200, B200; MI300X platforms): for the host line
GPUS_A_NODE = 8


def _host_line(est: Estimate) -> str:
    """The host memory CPU offloading needs, a GPU and a node of 8 GPUs (or of the run's GPUs, where fewer)."""
    n, gpus = est.spec.run.offload_layers, est.spec.run.gpus
    node = min(GPUS_A_NODE, gpus) if gpus else GPUS_A_NODE
    return (f"host: {gib(est.host_bytes):,.2f} GiB of pinned memory a GPU for CPU offloading ({plural(n, 'layer')} of "
            f"one microbatch), {gib(node * est.host_bytes):,.2f} GiB a node of {plural(node, 'GPU')}; PyTorch's pinned "
            f"allocator rounds each tensor's block up to a power of two, so it may reserve more, at most twice\n")


_VERDICT_STYLES = {FITS: "green", TIGHT: "yellow", NO_FIT: "red"}
_MARKS = {FITS: "✓", TIGHT: "~", NO_FIT: "✗"}


def _verdict_words(est: Estimate, where: str) -> tuple[str, str, str]:
    """('fits ', ' 59.50 of 79.22 GiB (75%) on the first stage', the margin): the margin
    beyond the reserve is always said, and the GPU it is measured against."""
    spec = est.spec
    memory, reserve = spec.gpu_memory_bytes, spec.reserve_bytes
    numbers = f" {gib(est.verdict_bytes):,.2f} of {gib(memory):,.2f} GiB ({100 * est.verdict_bytes / memory:.0f}%) on {where}"
    gpu = f"({spec.gpu_label})"
    if est.verdict == FITS:
        return "fits ", numbers, f"{gib(est.spare_bytes):,.2f} GiB to spare beyond the reserve of {gib(reserve):,.2f} GiB {gpu}"
    if est.verdict == TIGHT:
        into = est.verdict_bytes + reserve - memory
        return "tight ", numbers, f"{gib(into):,.2f} GiB into the reserve of {gib(reserve):,.2f} GiB for the uncounted {gpu}"
    return "does not fit ", numbers, f"{gib(est.verdict_bytes - memory):,.2f} GiB over {gpu}"


def _stage_flag(stage: int, p: int) -> str:
    return "first" if stage == 0 else "last" if stage == p - 1 else str(stage)


def _shown(est: Estimate) -> str:
    return stage_name(est.stage, est.spec.run.pipeline_parallel)


def _stages_table(est: Estimate) -> Table:
    """Every stage's peak floor by part, the busiest marked (--stage all)."""
    table = _table("Peak per GPU, every pipeline stage (at least: actmem.memory.peak)")
    for column in ("stage", "layers", "held", "activations", "model state", "backward", "peak"):
        table.add_column(column, **_column_kind(whole=("stage",))(column))
    budget, busiest = est.spec.gpu_memory_bytes, est.busiest_stage
    unit = column_unit([load.peak.total_bytes for load in est.stages])
    for load in est.stages:
        peak, mark = load.peak.total_bytes, " ◀" if load is busiest else ""
        table.add_row(Text(f"{load.stage}{mark}", style="bold" if mark else ""), str(load.layers),
                      f"{load.occupancy.layer_activations:,}", format_in(load.activations_bytes, unit),
                      format_in(load.parameters.total_bytes, unit), format_in(peak - load.total_bytes, unit),
                      Text(format_in(peak, unit), style="green" if peak <= budget else "red"))
    table.caption = (f"held: layer activations in flight at the stage's first backward; model state: "
                     f"{_model_state_words(est.spec, est.stages)}; backward: what that backward adds at the "
                     "stage's peak moment beyond what it frees first (a rerun, the loss's logits gradient, a "
                     "layer's gradients: each stage's moment is peak_floor.moment in --format json); the parts "
                     "add to the peak; ◀ the verdict's")
    table.caption_justify = "left"
    return table


def _model_state_words(spec, stages) -> str:
    """What the stage table's model state holds, as this run holds it: the main gradients' dtype, and TE's dummy
    weight gradients and FP8 state where a stage holds them."""
    parts = ["weights", f"{'fp32' if spec.gradient_bytes == 4 else '16-bit'} main gradients", "optimizer state"]
    if any(load.parameters.dummy_wgrads_bytes for load in stages):
        parts.append("TE's dummy weight gradients")
    if any(load.parameters.fp8_bytes for load in stages):
        parts.append("TE's FP8 weight copies and scaling state")
    return ", ".join(parts)


def inline(expr) -> str:
    """One line a person reads: 2·a·b·s², not 2*a*b*s**2."""
    import re

    import sympy

    superscript = str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹")
    text = re.sub(r"\*\*(\d+)", lambda match: match.group(1).translate(superscript), sympy.sstr(expr))
    return text.replace("*", "·")


def render_formulas() -> None:
    import sympy

    from actmem.memory.equations import equations, table_2
    from actmem.memory.terms import TERMS
    from actmem.model.recompute import Recompute

    console = terminal()
    show = lambda e: sympy.pretty(e, use_unicode=True)
    table = Table(title="Table 2: activation bytes per layer, one microbatch", title_justify="left",
                  show_lines=True)
    for column in ("technique", "bytes", "meaning"):
        table.add_column(column, **_column_kind(text=("technique", "meaning"), whole=("bytes",))(column))
    for eq in table_2():
        table.add_row(eq.label, show(eq.display), eq.meaning)
    console.print(table)
    table = Table(title="First pipeline stage (sections 4.4, 4.5)", title_justify="left", show_lines=True)
    for column in ("", "bytes", "meaning"):
        table.add_column(column, **_column_kind(text=("", "meaning"), whole=("bytes",))(column))
    for eq in equations():
        table.add_row(eq.label, show(eq.display), eq.meaning)
    console.print(table)
    table = _table("The term table (sections 4.1, 4.5): bytes with no parallelism")
    table.add_column("term · what it is (section, paper's size)", **_TEXT,
                     min_width=max(len(term.name) for term in TERMS))   # names whole; sources wrap
    for column in ("bytes", "region", "n s f", "per"):
        table.add_column(column, **_WHOLE)
    for term in TERMS:
        kept = "".join("●" if mode in term.kept_under else "·" for mode in Recompute)
        when = "" if term.present.__name__ == "always" else f"; only when {term.present.__doc__}"
        name = Text(term.name, style="bold") + Text(f"\n{term.source}{when}", style="dim")
        table.add_row(name, inline(term.size()), term.region.value, kept, term.scope.value)
    table.caption = ("kept under recompute none / selective / full; block: split t ways; boundary: "
                     "replicated under plain TP, split along the sequence under SP; replicated: on "
                     "every rank")
    table.caption_justify = "left"
    console.print(table)


def render_formulas_latex() -> None:
    """Plain lines, no table, so each can be copied whole: '% label: meaning' then the LaTeX."""
    import click
    import sympy

    from actmem.memory.equations import equations, table_2
    from actmem.memory.terms import TERMS

    lines = []
    for eq in [*table_2(), *equations()]:
        lines += [f"% {eq.label}: {eq.meaning}", sympy.latex(eq.display), ""]
    for term in TERMS:
        lines += [f"% term {term.name}: {term.source}", sympy.latex(term.size()), ""]
    click.echo("\n".join(lines).rstrip())


def render_presets(presets) -> None:
    table = _table("Presets: actmem estimate --model NAME")
    table.collapse_padding = True
    for column in ("name", "aliases", "a", "h", "L", "v", "s", "t", "p", "m", "b", "gpus"):
        table.add_column(column, **_column_kind(text=("aliases",), whole=("name",))(column))
    for preset in presets:
        model, run = preset.model, preset.run
        table.add_row(preset.name, ", ".join(preset.aliases),
                      *(str(model.get(k, "")) for k in ("heads", "hidden", "layers", "vocab", "seq_len")),
                      *(str(run.get(k, "")) for k in ("tensor_parallel", "pipeline_parallel",
                                                       "interleave", "micro_batch", "gpus")))
    table.caption = "\n".join(f"{p.name}: {p.description} ({p.source})" for p in presets)
    table.caption_justify = "left"
    terminal().print(table)
