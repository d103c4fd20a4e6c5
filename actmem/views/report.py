"""An Estimate as plain records: the one source for JSON, CSV and markdown."""

import json

from actmem.memory.estimate import Estimate
from actmem.memory.side_by_side import records as code_records


def records(est: Estimate, codes=None) -> dict:
    """Everything an estimate says, as JSON-ready values; byte counts are integers. With
    ``codes`` (actmem.memory.side_by_side), the same run under each implementation too."""
    spec, run = est.spec, est.spec.run
    side = {} if codes is None else {"implementations": code_records(codes)}
    return {
        "model": {"name": spec.name, "heads": spec.model.heads, "hidden": spec.model.hidden,
                  "layers": spec.model.layers, "vocab": spec.model.vocab,
                  "padded_vocab": spec.padded_vocab, "seq_len": spec.model.seq_len},
        "architecture": spec.architecture.record(),
        "run": {"tensor_parallel": run.tensor_parallel, "pipeline_parallel": run.pipeline_parallel,
                "interleave": run.interleave, "micro_batch": run.micro_batch,
                "sequence_parallel": run.sequence_parallel, "recompute": run.recompute.value,
                "recompute_method": run.recompute_method, "recompute_layers": run.recompute_layers,
                "recompute_modules": None if run.recompute_modules is None else list(run.recompute_modules),
                "selective_ac_option": run.selective_ac_option, "recompute_policy": run.policy.label,
                "technique": est.run_row.technique.name,
                "global_batch": run.global_batch, "gpus": run.gpus,
                "data_parallel": spec.data_parallel, "microbatches_per_iteration": spec.microbatches,
                "distributed_optimizer": run.distributed_optimizer, "expert_parallel": run.expert_parallel,
                "expert_tensor_parallel": run.etp, "routing_imbalance": float(spec.effective_imbalance),
                "expert_load_layers": None if run.expert_loads is None else len(run.expert_loads),
                "expert_data_parallel": spec.expert_optimizer_shards if spec.architecture.moe else None,
                "offload_layers": run.offload_layers, "fsdp": run.fsdp, "fsdp_replicate": run.fsdp_replicate, "fsdp_reshard": run.fsdp_reshard,
                "fsdp_shards": spec.fsdp_shards if run.fsdp else None,
                "megatron_fsdp": spec.megatron_fsdp_strategy, **_zero(run.zero)},
        "stage": {"index": est.stage, "layers": est.stages[est.stage].layers,
                  "layer_activations": est.occupancy.layer_activations,
                  "embedding_microbatches": est.occupancy.microbatches,
                  "holds_output_layer": est.occupancy.holds_output_layer,
                  "schedule": est.occupancy.explanation},
        "techniques": [_technique(row, est) for row in est.techniques],
        "run_terms": [_term(row) for row in est.run_terms],
        "activations_bytes": est.activations_bytes,
        "parameters": {"count": est.parameters.count,
                       "weights_bytes": est.parameters.weights_bytes,
                       "gradients_bytes": est.parameters.gradients_bytes,
                       "optimizer_bytes": est.parameters.optimizer_bytes,
                       "dummy_wgrads_bytes": est.parameters.dummy_wgrads_bytes,
                       "fp8_bytes": est.parameters.fp8_bytes,
                       "gathered_bytes": est.parameters.gathered_bytes,
                       "double_buffer_bytes": est.parameters.double_buffer_bytes,
                       "total_bytes": est.parameters.total_bytes},
        "total_bytes": est.total_bytes,
        "peak_floor": _floor(est.peak),
        "stages": [_stage(load) for load in est.stages],
        "busiest_stage": est.busiest_stage.stage,
        "verdict_bytes": est.verdict_bytes,
        "gpu": spec.gpu_name,
        "gpu_default": spec.gpu_default,
        "gpu_memory_bytes": spec.gpu_memory_bytes,
        "reserve_bytes": spec.reserve_bytes,
        "headroom_bytes": spec.gpu_memory_bytes - est.verdict_bytes,
        "spare_bytes": est.spare_bytes,
        "verdict": est.verdict,
        "fits": est.fits,
        "host_bytes": est.host_bytes,
        "against_bf16": None if est.against_bf16 is None else vars(est.against_bf16),
        "assumptions": list(est.assumptions),
    } | side


def _floor(floor) -> dict:
    return {"moment": floor.moment, "total_bytes": floor.total_bytes,
            "rows": [{"name": row.name, "bytes": row.bytes, "source": row.source} for row in floor.rows]}


def _stage(load) -> dict:
    """One pipeline stage: its load and its peak floor by row."""
    return {"stage": load.stage, "layers": load.layers,
            "layer_activations": load.occupancy.layer_activations,
            "embedding_microbatches": load.occupancy.microbatches,
            "holds_output_layer": load.occupancy.holds_output_layer,
            "activations_bytes": load.activations_bytes, "parameters_bytes": load.parameters.total_bytes,
            "total_bytes": load.total_bytes, "peak_floor": _floor(load.peak)}


def _technique(row, est: Estimate) -> dict:
    return {"technique": row.technique.name, "label": row.technique.label,
            "per_layer_bytes": row.per_layer_bytes, "layers_bytes": row.layers_bytes,
            "extra_bytes": row.extra_bytes, "first_stage_bytes": row.first_stage_bytes,
            "percent_of_tp": round(100 * row.per_layer_bytes / est.baseline.per_layer_bytes, 2),
            "parameters_bytes": row.parameters.total_bytes, "total_bytes": row.total_bytes,
            "peak_bytes": row.peak_bytes, "busiest_peak_bytes": est.busiest_peak_bytes(row),
            "verdict": est.technique_verdict(row), "fits": est.technique_fits(row), "is_run": row is est.run_row}


def _term(row) -> dict:
    return {"term": row.term.name, "region": row.term.region.value, "scope": row.term.scope.value,
            "bytes_each": row.bytes_each, "count": row.count, "bytes": row.total_bytes,
            "source": row.term.source}


def to_json(est: Estimate, codes=None) -> str:
    return json.dumps(records(est, codes), indent=2)


def settings(est: Estimate) -> list[dict]:
    """The model, architecture and run an estimate is for, and its verdict, as (setting, value)."""
    rec = records(est)
    rows = [("model", rec["model"]["name"])]
    rows += [(key, value) for key, value in rec["model"].items() if key != "name"]
    rows += list(rec["architecture"].items())
    rows += list(rec["run"].items())
    rows += [("stage", est.stage), ("busiest_stage", rec["busiest_stage"]),
             ("verdict_bytes", rec["verdict_bytes"]), ("gpu", rec["gpu"]), ("gpu_default", rec["gpu_default"]),
             ("gpu_memory_bytes", rec["gpu_memory_bytes"]), ("reserve_bytes", rec["reserve_bytes"]),
             ("verdict", rec["verdict"]), ("fits", rec["fits"])]
    rows += [(f"against_bf16_{key}", value) for key, value in (rec["against_bf16"] or {}).items()]
    return [{"setting": key, "value": "" if value is None else str(value).lower()
             if isinstance(value, bool) else str(value)} for key, value in rows]


def frames(est: Estimate, codes=None) -> dict:
    """The tables the csv and markdown formats write (and plots draw), by section name."""
    import pandas as pd   # only the csv and markdown formats pay for pandas

    rec = records(est, codes)
    params = rec["parameters"]
    memory = [{"item": item, "bytes": n_bytes} for item, n_bytes in (
        ("activations", rec["activations_bytes"]), ("weights", params["weights_bytes"]),
        ("gradients", params["gradients_bytes"]), ("optimizer", params["optimizer_bytes"]),
        ("dummy_wgrads", params["dummy_wgrads_bytes"]), ("fp8_weight_state", params["fp8_bytes"]),
        ("gathered_weights", params["gathered_bytes"]), ("double_buffers", params["double_buffer_bytes"]),
        ("total", rec["total_bytes"]), ("peak_floor", rec["peak_floor"]["total_bytes"]),
        ("verdict", rec["verdict_bytes"]), ("gpu_memory", rec["gpu_memory_bytes"]),
        ("reserve", rec["reserve_bytes"]), ("headroom", rec["headroom_bytes"]), ("spare", rec["spare_bytes"]),
        ("host_offload", rec["host_bytes"]))]
    stages = [{key: value for key, value in stage.items() if key != "peak_floor"}
              | {"peak_bytes": stage["peak_floor"]["total_bytes"]} for stage in rec["stages"]]
    stage_peaks = [{"stage": stage["stage"], "moment": stage["peak_floor"]["moment"], "term": row["name"],
                    "bytes": row["bytes"]} for stage in rec["stages"] for row in stage["peak_floor"]["rows"]]
    return {"settings": pd.DataFrame(settings(est)),
            "techniques": pd.DataFrame(rec["techniques"]),
            "run_terms": pd.DataFrame(rec["run_terms"]).drop(columns="source"),
            "memory": pd.DataFrame(memory),
            "stages": pd.DataFrame(stages),
            "stage_peaks": pd.DataFrame(stage_peaks)} | \
        ({} if codes is None else {"implementations": pd.DataFrame(rec["implementations"]).convert_dtypes()})


def to_csv(est: Estimate, codes=None) -> str:
    """One long table: a 'section' column says which table a row is from (settings, with the
    fits verdict; techniques; run_terms; memory; stages, each with its peak floor; stage_peaks,
    each stage's peak floor by term at its moment; and with --compare-implementations,
    implementations)."""
    import pandas as pd

    parts = [df.assign(section=name) for name, df in frames(est, codes).items()]
    table = pd.concat(parts, ignore_index=True).convert_dtypes()  # ints stay ints beside blanks
    columns = ["section"] + [c for c in table.columns if c != "section"]
    return table[columns].to_csv(index=False)


def to_markdown(est: Estimate, codes=None) -> str:
    from actmem.memory.stages import stage_name

    shown = stage_name(est.stage, est.spec.run.pipeline_parallel)
    title = {"settings": "Model and run", "techniques": f"Table 2 techniques, {shown}",
             "run_terms": f"This run, term by term, {shown}", "memory": f"Memory per GPU, {shown}",
             "stages": "Every pipeline stage, with its peak floor",
             "stage_peaks": "The peak floor of every stage, by term, at its worst moment",
             "implementations": "The same model and run under each implementation"}
    where = f"{stage_name(est.busiest_stage.stage, est.spec.run.pipeline_parallel, article=True)}, the busiest"
    head = (f"# actmem · {est.spec.name}: {est.verdict}\n\n{est.verdict_bytes / 2**30:,.2f} of "
            f"{est.spec.gpu_memory_bytes / 2**30:,.2f} GiB per GPU ({est.spec.gpu_label}) of {where}; "
            f"{est.spare_bytes / 2**30:,.2f} GiB beyond a reserve of {est.spec.reserve_bytes / 2**30:,.2f} GiB.\n"
            + (f"\n{against_bf16_line(est)}.\n" if est.against_bf16 is not None else ""))
    parts = [f"## {title[name]}\n\n{df.astype(object).fillna('').to_markdown(index=False)}\n"
             for name, df in frames(est, codes).items()]          # a blank, not <NA>, where none
    notes = "\n".join(f"- {note}" for note in est.assumptions)
    return head + "\n" + "\n".join(parts) + f"\n## Assumptions\n\n{notes}\n"


PLAN_COLUMNS = ["t", "c", "p", "first_stage_layers", "stage_layers", "last_stage_layers", "m", "b", "d", "n", "ep", "etp",
                "sequence_parallel", "recompute", "recompute_layers", "distributed_optimizer", "fsdp", "activations_bytes",
                "weights_bytes",
                "gradients_bytes", "optimizer_bytes", "dummy_wgrads_bytes", "fp8_bytes", "transient_bytes", "total_bytes",
                "first_peak_bytes", "middle_peak_bytes", "last_peak_bytes", "peak_bytes", "peak_stage", "fits",
                "layers_efficiency", "scores_efficiency", "logits_efficiency", "compute_s", "tensor_parallel_s", "context_parallel_s", "expert_parallel_s", "pipeline_p2p_s", "bubble",
                "data_parallel_s", "iteration_s", "mfu"]
"""A plan row as JSON and CSV write it: the split of its pipeline (plan.STAGE_LAYERS), N of a
full recompute by Megatron's block method (recompute_layers; 0: every layer alone, or none), the
first stage's peak floor by part, each sized stage's peak (middle: stage 1, 0 where p < 3),
the busiest, and the time model's parts."""


def compute_source(req) -> str | None:
    """The measured kernel tables the plan's compute time reads, or None (one efficiency for all)."""
    return req.gpu.kernel_tables if req.efficiency is None else None


def _plan_rows(frame, top: int) -> list[dict]:
    from actmem.planner.plan import config_label

    rows = frame.head(top) if top > 0 else frame
    return [{"config": config_label(row), **{k: _plain(getattr(row, k)) for k in PLAN_COLUMNS}}
            for row in rows.itertuples()]


def _plain(value):
    """numpy scalars to Python ones, for json."""
    return value.item() if hasattr(value, "item") else value


def _nothing_fits(nothing) -> dict | None:
    if nothing is None:
        return None
    return {"usable_t": nothing.usable_t, "usable_p": nothing.usable_p, "model_p": nothing.all_p,
            "nearest_fitting": [{"gpus": gpus, "config": label} for gpus, label in nothing.nearest]}


def plan_json(plan, top: int, nothing=None) -> str:
    req = plan.request
    why_not = plan.why_not()
    return json.dumps({
        "request": {"model": vars(req.model), "architecture": req.architecture.record(),
                    "gpus": req.gpus, "global_batch": req.global_batch,
                    "gpu": req.gpu.name, "gpu_default": req.gpu_default, "gpu_memory_bytes": req.gpu_memory_bytes,
                    "reserve_bytes": req.reserve_bytes, "budget_bytes": req.budget_bytes,
                    "efficiency": req.efficiency, "kernel_tables": compute_source(req),
                    "overlap_grad_reduce": req.overlap_grad_reduce, "overlap_param_gather": req.overlap_param_gather},
        "evaluated": plan.swept,
        "block_rows": plan.block_rows,
        "fitting": len(plan.fitting),
        "best": _plan_rows(plan.fitting, top),
        "why_not": [{"t": int(row.t), "any_fits": bool(row.t_fits), "leanest": _plan_rows(
            why_not.iloc[[i]], 1)[0], "over_bytes": int(row.over_bytes),
                     "largest_part": row.largest_part} for i, row in enumerate(why_not.itertuples())],
        "nothing_fits": _nothing_fits(nothing),
    }, indent=2)


def plan_csv(plan, top: int, nothing=None) -> str:
    """The fitting configurations, fastest first (all of them with --top 0), each row with
    the request's settings. When nothing fits, the leanest configuration of each t instead,
    so the file says how far off it is."""
    import pandas as pd

    req = plan.request
    frame = plan.fitting if nothing is None else plan.why_not()
    table = pd.DataFrame(_plan_rows(frame, top), columns=["config"] + PLAN_COLUMNS)
    return table.assign(**plan_settings(req)).to_csv(index=False)


def against_bf16_line(est: Estimate) -> str:
    """FP8's net against the same run in bf16 (Estimate.against_bf16): what it saves in activations and adds in
    model state, one line for the terminal and markdown."""
    from actmem.memory.stages import stage_name
    from actmem.units import gib

    net, p = est.against_bf16, est.spec.run.pipeline_parallel

    def signed(n: int) -> str:
        return f"{'+' if n > 0 else '−' if n < 0 else '±'}{abs(gib(n)):,.2f} GiB"

    shrink = ", less a byte a weight element under --fp8-param-gather" if est.spec.architecture.fp8_param_gather else ""
    if shrink and est.spec.run.megatron_fsdp:
        shrink += " in Megatron-FSDP's buffers, gathered buckets and pools"
    return (f"FP8 against this run in bf16: {signed(net.verdict_delta_bytes)} at the peak "
            f"({gib(est.verdict_bytes):,.2f} against {gib(net.bf16_verdict_bytes):,.2f} GiB); on "
            f"{stage_name(net.stage, p, article=True)} the activations {signed(net.activations_delta_bytes)}, the "
            f"model state {signed(net.model_state_delta_bytes)} (TE's FP8 weight copies and scaling state{shrink})")


def plan_settings(req) -> dict:
    """What `actmem plan --format csv` writes beside each row: the request's GPUs, batch and budget."""
    return {"gpus_total": req.gpus, "global_batch": req.global_batch, "gpu": req.gpu.name,
            "gpu_default": req.gpu_default, "gpu_memory_bytes": req.gpu_memory_bytes,
            "reserve_bytes": req.reserve_bytes, "budget_bytes": req.budget_bytes}


def _zero(zero) -> dict:
    """DeepSpeed's ZeRO settings as priced (actmem.model.deepspeed.ZeroConfig); stage 0 where none."""
    return {"zero_stage": zero.stage if zero else 0,
            "zero_reduce_bucket_size": zero.reduce_bucket_size if zero else None,
            "zero_persistence_threshold": zero.persistence_threshold if zero and zero.stage == 3 else None,
            "zero_optimizer": zero.optimizer if zero else None, "zero_config": zero.source if zero else None}
