"""Megatron-FSDP (megatron-core 0.16.1) on CPU over gloo: what model state each rank allocates for each
--data-parallel-sharding-strategy, from the ParamAndGradBuffer's own buffers and Adam's state, after building the
wrapped GPTModel and after one forward+backward+DistributedOptimizer(AdamW) step (checked against a no-FSDP run).
A session's prototype for issue 30, grown into `actmem validate --grid mfsdp`; it also checks the step's loss and
gradient norm against a run without FSDP; its findings are in docs/models.md's Megatron-FSDP section.

    python tools/megatron_fsdp_probe.py [--world 2|4] [--dtype bf16|fp32] [--no-step] [--json out.json] [--verbose]
        [--strategies no_shard,optim,...] [--grad-fp32 1,0] [--overlap safe|on|off|<ogr><opg>]
    python tools/megatron_fsdp_probe_summary.py out.json          # per-rank table, each number checked against the formulas
env: MFSDP_DIV_FUSION=1  MFSDP_CLIP_GRAD=1.0  MFSDP_LAST_MICROBATCH=safe|0|1
"""
import argparse
import contextlib
import json
import math
import os
import socket
import sys
import traceback
import warnings

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
HIDDEN, LAYERS, VOCAB, SEQ, HEADS, MBS = 64, 2, 128, 16, 4, 2
CLIP_GRAD = float(os.environ.get("MFSDP_CLIP_GRAD", "0.0"))  # megatron default 1.0; 0 = off (reference has none)


# --------------------------------------------------------------------------------------------- CPU shims
def cpu_shims(skip=()):
    """The harness's (validate/actmem_validate/megatron_fsdp.py, where the CPU stand-ins are listed)."""
    if skip:
        raise SystemExit("MFSDP_SKIP_SHIMS: the shims are the harness's now, all or none")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "validate"))
    from actmem_validate.megatron_fsdp import cpu_shims as harness_shims

    harness_shims()


# --------------------------------------------------------------------------------------------- model
def build_model(dtype):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
        params_dtype=torch.float32, bf16=dtype == torch.bfloat16, pipeline_dtype=dtype,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
                     share_embeddings_and_output_weights=True)
    if dtype == torch.bfloat16:
        # as megatron/training/training.py get_model does for --bf16 (before the DP / FSDP wrapper):
        # Float16Module casts every parameter (norms, position embeddings included) to bf16
        from megatron.core.transformer.module import Float16Module
        model = Float16Module(config, model)
    return config, model


# --------------------------------------------------------------------------------------------- measuring
def _dt(dtype):
    return str(dtype).removeprefix("torch.")


def _nbytes(t):
    return t.untyped_storage().nbytes() if t is not None else 0


def buffer_report(fsdp):
    """Each bucket (parameter group) of the ParamAndGradBuffer: its params, chunk factor, unpadded and
    padded sizes, and each of the three buffers' local data (numel, dtype, bytes, sharded?)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import to_local_if_dtensor
    pgb = fsdp.param_and_grad_buffer
    buckets = []
    for gid, g in enumerate(pgb.parameter_groups):
        names = [pgb.param_to_name[p] for p in g.params]
        shapes = [tuple(to_local_if_dtensor(p).shape) for p in g.params]
        unpadded = sum(math.prod(s) for s in shapes)
        row = dict(bucket=gid, dtype=_dt(g.dtype) if not isinstance(g.dtype, str) else g.dtype,
                   fsdp_unit=g.fsdp_unit_id, n_params=len(names), names=names, shapes=shapes,
                   chunk_size_factor=g.chunk_size_factor, unpadded=unpadded,
                   row_sizes=sorted({math.prod(s[1:]) for s in shapes}))
        for key, buf in (("wbuf", g.model_weight_buffer), ("mbuf", g.main_weight_buffer),
                         ("gbuf", g.main_grad_buffer)):
            if buf is None:
                row[key] = None
                continue
            data = getattr(buf, "data", None)
            row[key] = dict(dtype=_dt(buf.dtype), sharded=buf.is_data_distributed,
                            padded_bucket=buf.bucket_index.size, local_numel=buf.data_size,
                            data_numel=None if data is None else data.numel(),
                            data_bytes=None if data is None else data.numel() * data.element_size(),
                            storage_bytes=_nbytes(data),
                            # offsets of each item in the padded bucket (layout)
                            layout=[(it.global_data_index, it.size) for it in
                                    sorted(buf.item_index_map.values(), key=lambda i: i.global_data_index)])
        buckets.append(row)
    return buckets


def state_bytes(fsdp, optimizer=None):
    """Bytes of live, distinct storages by role: weights (model compute weights: wbuf.data, or the module's
    own parameter storages where no wbuf), main weights (mbuf.data), grads (gbuf.data / the all-in-one
    pgb.buffer), temporary buckets (allocator buckets alive now), dist_main_grad (the optimizer-facing grad
    copies), optimizer state (Adam exp_avg/exp_avg_sq/step)."""
    import torch
    from torch.distributed.tensor import DTensor
    pgb = fsdp.param_and_grad_buffer
    seen = {}

    def add(role, t):
        if t is None:
            return
        if isinstance(t, DTensor):
            t = t._local_tensor
        s = t.untyped_storage()
        if s.nbytes() == 0:
            return
        key = s.data_ptr()
        if key not in seen:
            seen[key] = (role, s.nbytes())

    for g in pgb.parameter_groups:
        if g.model_weight_buffer is not None:
            add("weights", g.model_weight_buffer.data)
        if g.main_weight_buffer is not None:
            add("main_weights", g.main_weight_buffer.data)
        if g.main_grad_buffer is not None:
            add("grads", g.main_grad_buffer.data)
    for v in getattr(pgb, "buffer", {}).values():
        add("grads", v)                                     # the all-in-one per-dtype grad buffer
    for g in pgb.parameter_groups:
        if g.model_weight_buffer is None:
            for p in g.params:                              # no_shard: module keeps its own parameter storage
                add("weights", p.data)
    for alloc_name in ("weight_alloc", "transpose_weight_alloc", "main_grad_alloc"):
        alloc = getattr(pgb, alloc_name, None)
        for b in (getattr(alloc, "buckets", {}) or {}).values():
            add("temp_buckets", b.data)
    for g in pgb.parameter_groups:                          # temporary grad buckets (default allocator)
        if g.main_grad_buffer is not None:
            for b in getattr(g.main_grad_buffer.temporary_bucket_allocator, "buckets", {}).values():
                add("temp_buckets", b.data)
    for v in pgb.dist_main_grad.values():
        add("dist_main_grad", v)
    for m in fsdp.module.parameters():                      # anything the module holds now, not counted above
        add("module_other", m.data)
    opt_rows = []
    if optimizer is not None:
        inner = getattr(optimizer, "optimizer", optimizer)
        for p, st in inner.state.items():
            for k, v in st.items():
                if torch.is_tensor(v):
                    add("optimizer", v)
                    lt = v._local_tensor if isinstance(v, DTensor) else v
                    opt_rows.append((k, tuple(lt.shape), lt.numel(), _dt(lt.dtype)))
    totals = {}
    for role, nb in seen.values():
        totals[role] = totals.get(role, 0) + nb
    return totals, opt_rows


def sharded_params(fsdp):
    """Which optimizer-facing parameters are sharded: their global shape, local numel on this rank, placement."""
    from torch.distributed.tensor import DTensor
    rows = []
    for name, p in fsdp.param_and_grad_buffer.optimizer_named_parameters:
        loc = p._local_tensor if isinstance(p, DTensor) else p
        rows.append((name, tuple(p.shape), loc.numel(), _dt(loc.dtype),
                     str(p.placements) if isinstance(p, DTensor) else "plain"))
    return rows


def batch(rank):
    import torch
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
    return tokens, torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ), labels


def reference_losses(world, dtype):
    """No FSDP: the same model, every rank's batch, grads averaged over ranks (bf16 param grads summed in
    fp32, x 1/dp), AdamW on fp32 master copies with megatron's groups (no weight decay on biases / norms),
    then each rank's loss on its batch again: what one Megatron-FSDP step should give."""
    import torch
    torch.manual_seed(1234)
    _, model = build_model(dtype)
    params = [p for p in model.parameters()]
    names = [n for n, _ in model.named_parameters()]
    grads = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    losses = []
    for r in range(world):
        t, pos, lab = batch(r)
        loss = model(t, pos, None, labels=lab).float().mean()
        losses.append(float(loss))
        gs = torch.autograd.grad(loss, params)
        for acc, g in zip(grads, gs):
            acc += g.float() / world
    grad_sq = float(sum((g.double() ** 2).sum() for g in grads))
    master = [p.detach().float().clone().requires_grad_() for p in params]
    for m, g in zip(master, grads):
        m.grad = g
    decay = [m for m, n, p in zip(master, names, params) if not (n.endswith(".bias") or p.ndim == 1)]
    no_decay = [m for m, n, p in zip(master, names, params) if n.endswith(".bias") or p.ndim == 1]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=0.01), dict(params=no_decay, weight_decay=0.0)],
                            lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    opt.step()
    with torch.no_grad():
        for p, m in zip(params, master):
            p.copy_(m)
        after = [float(model(*batch(r)[:2], None, labels=batch(r)[2]).float().mean()) for r in range(world)]
    return losses, after, grad_sq


# --------------------------------------------------------------------------------------------- one config
# (overlap_grad_reduce, overlap_param_gather, is_last_microbatch set through fsdp.no_sync()) per strategy that give
# the reference gradient and step in 0.16.1 on gloo (checked: grad norm^2 and loss after one step vs a no-FSDP run):
# - no_shard needs overlap_param_gather (off: start_param_sync calls async_bucket_gather on buckets that have
#   no model_weight_buffer -> AttributeError) and is_last_microbatch (the pipeline all-reduce in the root
#   post-backward hook); the synchronous fallback ParamAndGradBuffer.all_reduce_gradients is a no-op
#   ("if gbuf is not None: continue") -> without the pipeline, no all-reduce at all.
# - optim is right only through the synchronous reduce_scatter_gradients (overlap_grad_reduce off, and NOT
#   is_last_microbatch): the pipeline path (_bucket_group_gradient_reduce) reduce-scatters into a fresh shard and
#   adds it to gbuf's local shard, which for an unsharded gbuf is the bucket's own pre-reduction data:
#   grad = g_rank/dp + mean (pipeline alone) or 2*mean/dp (pipeline then the sync reduce-scatter).
# - optim_grads / optim_grads_params force overlap_grad_reduce (and _params overlap_param_gather); right always.
SAFE_LAST_MICROBATCH = dict(no_shard=True, optim=False, optim_grads=True, optim_grads_params=True)
SAFE_OVERLAP = dict(no_shard=(True, True), optim=(False, False), optim_grads=(True, False),
                    optim_grads_params=(True, True))


def run_config(rank, world, strategy, grad_fp32, dtype, do_step, overlap="safe"):
    import torch
    ogr, opg = (SAFE_OVERLAP[strategy] if overlap == "safe" else
                dict(on=(True, True), off=(False, False))[overlap] if overlap in ("on", "off") else
                (overlap[0] == "1", overlap[1] == "1"))
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    torch.manual_seed(1234)
    config, model = build_model(dtype)
    n_unpadded = sum(p.numel() for p in model.parameters())
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy, grad_reduce_in_fp32=grad_fp32,
        use_distributed_optimizer=True,
        overlap_grad_reduce=ogr, overlap_param_gather=opg, gradient_reduce_div_fusion=os.environ.get("MFSDP_DIV_FUSION") == "1",
        check_for_nan_in_grad=False, bucket_size=None)
    fsdp = FullyShardedDataParallel(config, ddp_config, model, device=torch.device("cpu"))
    out = dict(rank=rank, world=world, strategy=strategy, grad_reduce_in_fp32=grad_fp32, dtype=_dt(dtype),
               overlap=(fsdp.ddp_config.overlap_grad_reduce, fsdp.ddp_config.overlap_param_gather),
               N=n_unpadded, buckets=buffer_report(fsdp), sharded=sharded_params(fsdp))
    out["built"], _ = state_bytes(fsdp)

    if not do_step:
        return out
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=dtype == torch.bfloat16, params_dtype=dtype,
                                 use_distributed_optimizer=True, clip_grad=CLIP_GRAD)
    stage = "get_megatron_optimizer"
    try:
        optimizer = get_megatron_optimizer(opt_config, [fsdp])
        stage = "forward"
        fsdp.zero_grad_buffer()
        optimizer.zero_grad()
        tokens, position_ids, labels = batch(rank)
        # the last (only) microbatch: what megatron-core's schedules do by leaving fsdp.no_sync() before it
        # (config.no_sync_func); no_shard / optim reduce in the backward hooks only when is_last_microbatch
        last = os.environ.get("MFSDP_LAST_MICROBATCH", "safe")
        if SAFE_LAST_MICROBATCH[strategy] if last == "safe" else last == "1":
            with fsdp.no_sync():
                pass
        loss = fsdp(tokens, position_ids, None, labels=labels).float().mean()
        stage = "backward"
        loss.backward()
        stage = "finish_grad_sync"
        fsdp.finish_grad_sync()
        out["after_backward"], _ = state_bytes(fsdp)
        # the optimizer-facing grads (param.grad of the optimizer params, set by update_main_grads): their
        # squared norm over the whole model, against the reference's mean gradient
        from torch.distributed.tensor import DTensor
        sq = torch.zeros(1, dtype=torch.float64)
        for _, p in fsdp.param_and_grad_buffer.optimizer_named_parameters:
            if p.grad is not None:
                lg = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                sq += (lg.double() ** 2).sum()
        if strategy != "no_shard":
            torch.distributed.all_reduce(sq)
        out["grad_sq"] = float(sq)
        stage = "optimizer.step"
        ok, grad_norm, _ = optimizer.step()
        out["step"] = dict(loss=float(loss), update_successful=bool(ok),
                           grad_norm=None if grad_norm is None else float(grad_norm))
        out["after_step"], out["adam"] = state_bytes(fsdp, optimizer)
        out["opt_class"] = f"{type(optimizer).__name__}({type(getattr(optimizer, 'optimizer', None)).__name__})"
        stage = "second forward"
        fsdp.zero_grad_buffer()
        optimizer.zero_grad()
        loss2 = fsdp(tokens, position_ids, None, labels=labels).float().mean()
        out["step"]["loss2"] = float(loss2)
    except Exception as e:
        out["step_error"] = f"{stage}: {type(e).__name__}: {e}"
        out["step_traceback"] = traceback.format_exc()
    return out


def rank_main(rank, world, port, configs, dtype_name, do_step, overlap, results):
    import datetime
    warnings.filterwarnings("ignore")
    import logging
    logging.disable(logging.WARNING)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
      try:
        cpu_shims(tuple(filter(None, os.environ.get("MFSDP_SKIP_SHIMS", "").split(","))))
        from megatron.core import parallel_state
        parallel_state.initialize_model_parallel(1, 1)
        dtype = dict(bf16=torch.bfloat16, fp32=torch.float32)[dtype_name]
        outs = []
        if do_step:
            try:
                outs.append(dict(reference=reference_losses(world, dtype)))
            except Exception as e:
                outs.append(dict(reference_error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()))
        for strategy, grad_fp32 in configs:
            try:
                outs.append(run_config(rank, world, strategy, grad_fp32, dtype, do_step, overlap))
            except Exception as e:
                outs.append(dict(rank=rank, strategy=strategy, grad_reduce_in_fp32=grad_fp32,
                                 error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:]))
            dist.barrier()
        results.put((rank, outs))
        parallel_state.destroy_model_parallel()
      except Exception as e:        # never leave the parent waiting on this rank's result
        results.put((rank, [dict(rank=rank, strategy="setup", grad_reduce_in_fp32=None,
                                 error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())]))
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------- formulas
def padded_size(shapes, world, strategy):
    """Reproduce build_data_parallel_buffer_index's bucket size (no fragments-in-gap subtleties needed when
    every numel is a multiple of its row size; handled in general by replaying the algorithm)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
        build_data_parallel_buffer_index)
    import torch

    class C:  # minimal ddp_config
        data_parallel_sharding_strategy = strategy
    f = 1
    for s in sorted(shapes, key=lambda s: -math.prod(s[1:])):
        r = math.prod(s[1:])
        if not (r == f or (f % r == 0 and math.prod(s) % f == 0) or math.prod(s) < f):
            f = math.lcm(f, r)
    _, bi, _ = build_data_parallel_buffer_index([torch.Size(s) for s in shapes], 0, world, True, C, 0, f)
    return f, bi.size


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--no-step", action="store_true")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--grad-fp32", default="1,0", help="grad_reduce_in_fp32 values to run, e.g. 1,0")
    ap.add_argument("--json", default=None)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--overlap", default="safe", choices=["safe", "on", "off", "00", "01", "10", "11"],
                    help="overlap_grad_reduce/overlap_param_gather: safe = SAFE_OVERLAP per strategy; on/off = both "
                         "(optim_grads* force some on); or two digits <overlap_grad_reduce><overlap_param_gather>")
    args = ap.parse_args()
    configs = [(s, bool(int(g))) for s in args.strategies.split(",") for g in args.grad_fp32.split(",")]

    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    context = mp.start_processes(
        rank_main, args=(args.world, free_port(), configs, args.dtype, not args.no_step, args.overlap, results),
        nprocs=args.world, start_method="spawn", join=False)
    per_rank = dict(results.get() for _ in range(args.world))   # read before joining: a big put blocks its rank
    while not context.join():
        pass
    if args.json:
        with open(args.json, "w") as f:
            json.dump(per_rank, f, indent=1, default=str)
    report(per_rank, args)


def report(per_rank, args):
    W = args.world
    B = {"bfloat16": 2, "float32": 4, "float16": 2}
    for i in range(max(len(v) for v in per_rank.values())):
        print("=" * 100)
        for rank in sorted(per_rank):
            if i >= len(per_rank[rank]):
                continue
            o = per_rank[rank][i]
            if "reference_error" in o:
                print(f"[rank {rank}] reference ERROR", o["reference_error"]); print(o["traceback"]); continue
            if "reference" in o:
                print(f"[rank {rank}] reference (no FSDP) losses before/after one AdamW step:", o["reference"])
                continue
            head = f"[rank {rank}] strategy={o['strategy']} grad_reduce_in_fp32={o['grad_reduce_in_fp32']}"
            if "error" in o:
                print(head, "ERROR", o["error"]); print(o["traceback"]); continue
            print(head, f"dtype={o['dtype']} N={o['N']} dp={W} (overlap_grad_reduce, overlap_param_gather)={o['overlap']}")
            for b in o["buckets"]:
                f, padded = padded_size(b["shapes"], W, o["strategy"])
                print(f"  bucket {b['bucket']}: {b['n_params']} params, row sizes {b['row_sizes']}, "
                      f"chunk_factor={b['chunk_size_factor']} (replayed {f}), unpadded={b['unpadded']}, "
                      f"padded={[b[k]['padded_bucket'] for k in ('wbuf','mbuf','gbuf') if b[k]]} (replayed {padded})")
                for k in ("wbuf", "mbuf", "gbuf"):
                    v = b[k]
                    print(f"     {k}: " + ("-" if v is None else
                          f"{v['dtype']} sharded={v['sharded']} local_numel={v['local_numel']} "
                          f"data_numel={v['data_numel']} storage_bytes={v['storage_bytes']}"))
                    if args.verbose and v:
                        print("        layout", v["layout"])
            if args.verbose:
                for r in o["sharded"]:
                    print("   opt-param", r)
            print("  built       :", o["built"])
            if "after_backward" in o:
                print("  after bwd   :", o["after_backward"])
            if "after_step" in o:
                print("  after step  :", o["after_step"], o.get("opt_class"), o.get("step"))
                ad = {}
                for k, shape, n, dt in o["adam"]:
                    ad.setdefault((k, dt), 0)
                    ad[(k, dt)] += n
                print("  adam numel  :", {f"{k}/{dt}": n for (k, dt), n in ad.items()})
            if "step_error" in o:
                print("  STEP ERROR  :", o["step_error"]); print(o["step_traceback"])


if __name__ == "__main__":
    main()
