"""Numerical correctness: a TP (+ SP) layer against a single-device layer with the same weights.

Every rank builds the full reference layer from one seed, cuts its own shards of the
weights from it, runs both in fp32 without dropout, and compares the output, the input
gradient and every parameter gradient (its shard of the reference's, or all of it for a
replicated parameter).
"""

import json
import os

import torch

from actmem_validate import forkserver
from actmem_validate.gpt import LayerSpec, TransformerLayer
from actmem_validate.layers import allreduce_layernorm_grads
from actmem_validate.context import tensor_and_context_groups
from actmem_validate.parallel import TensorParallel, all_gather, all_reduce, split_first_dim

# How each parameter is split across t ranks: along dim 0 (column-parallel), dim 1
# (row-parallel), or not at all (replicated).
_SPLIT_DIM = {"attention.qkv.weight": 0, "attention.qkv.bias": 0, "mlp.fc1.weight": 0, "mlp.fc1.bias": 0,
              "attention.projection.weight": 1, "mlp.fc2.weight": 1}


#: the layer variants checked: the paper's, and a gated one (SwiGLU, RMSNorm, no biases, f = 96)
VARIANTS = {"paper": {}, "swiglu-rmsnorm": dict(activation="swiglu", normalization="rmsnorm", bias=False,
                                                ffn=96),
            "gqa": dict(query_groups=4, head_dim=16),    # a = 8 heads of d = 16 in 4 groups; ad = 2h
            # Megatron's local core on torch's fallback softmax (forward_torch_softmax), against a
            # reference on the fused kernel's stand-in
            "torch-softmax": dict(softmax_fusion=False),
            # today's layer: flash (SDPA's CPU flash kernel), rope, 4 groups, SwiGLU, RMSNorm
            "flash-rope-gqa": dict(attention_core="flash", position_embedding="rope", query_groups=4,
                                   activation="swiglu", normalization="rmsnorm", bias=False, ffn=96),
            "flash-attn": dict(attention_core="flash-attn", position_embedding="rope", query_groups=4),
            # Megatron's unfused rope (--no-rope-fusion): plain ops, autograd's own backward
            "flash-unfused-rope": dict(attention_core="flash", position_embedding="rope", query_groups=4,
                                       rope_fusion=False),
            # Qwen3's layer: q and k normalised per head (--qk-layernorm), their grads summed over t
            "flash-qk-norm": dict(attention_core="flash", position_embedding="rope", query_groups=4, qk_norm=True,
                                  activation="swiglu", normalization="rmsnorm", bias=False, ffn=96),
            # the q and k norms with learned positions: their outputs go to the kernel as they are
            "flash-qk-norm-learned": dict(attention_core="flash", qk_norm=True)}


def recompute_modes(variant: str) -> tuple:
    """The modes checked for a variant, 'selective:mlp' naming --recompute-modules: the attention
    core's checkpoint everywhere (under flash around TE's core, v's copy inside), the MLP's
    beside it, and under flash the MLP's alone."""
    flash = VARIANTS[variant].get("attention_core", "eager") != "eager"
    return ("none", "selective", "selective:core_attn+mlp") + (("selective:mlp",) if flash else ()) + ("full",)


def _shard(full: torch.Tensor, name: str, tp: TensorParallel, gated: bool = False) -> torch.Tensor:
    dim = _SPLIT_DIM.get(name)
    if dim is None:
        return full
    if gated and name.startswith("mlp.fc1."):
        # Megatron shards a gated fc1 so that each rank holds [its gate | its up]
        return torch.cat([half.chunk(tp.size, dim=0)[tp.rank] for half in full.chunk(2, dim=0)])
    return full.chunk(tp.size, dim=dim)[tp.rank]


def layer_differences(tp: TensorParallel, recompute: str, variant: str = "paper", s=16, b=2, h=64, a=8) -> dict:
    """Largest absolute differences from the reference: output, input grad, parameter grads.
    With context parallelism (tp.context) each rank takes its s/c slice of the sequence first,
    and the weight gradients are summed over the context-parallel ranks, as Megatron does."""
    arch = VARIANTS[variant]
    gated = arch.get("activation") == "swiglu"
    recompute, _, modules = recompute.partition(":")
    spec = LayerSpec(h, a, s, layers=2, attention_dropout=0.0, hidden_dropout=0.0, recompute=recompute,
                     dtype=torch.float32, recompute_modules=tuple(modules.split("+")) if modules else ("core_attn",),
                     **arch)
    torch.manual_seed(0)
    fused = {key: value for key, value in arch.items() if key != "softmax_fusion"}   # the reference's softmax
    reference = TransformerLayer(LayerSpec(h, a, s, 2, 0.0, 0.0, "none", torch.float32, **fused), TensorParallel())
    layer = TransformerLayer(spec, tp)
    with torch.no_grad():
        for (name, param), full in zip(layer.named_parameters(), reference.parameters()):
            param.copy_(_shard(full, name, tp, gated))
    x = torch.randn(s, b, h, generator=torch.Generator().manual_seed(1)).requires_grad_()
    grad_out = torch.randn(s, b, h, generator=torch.Generator().manual_seed(2))
    expected = reference(x)
    expected.backward(grad_out)

    sp = tp.sequence_parallel and tp.size > 1
    cp = tp.context if tp.context is not None and tp.context.size > 1 else None
    local = lambda t: split_first_dim(t, tp) if sp else t.clone()
    if cp is not None:
        local = (lambda inner: lambda t: inner(split_first_dim(t, cp)))(local)
    x_local = local(x.detach()).requires_grad_()
    out = layer(x_local)
    out.backward(local(grad_out))
    allreduce_layernorm_grads(layer, tp)
    if cp is not None:
        for param in layer.parameters():
            param.grad = all_reduce(param.grad, cp)
    gathered = (lambda t: all_gather(t.contiguous(), tp)) if sp else (lambda t: t)
    if cp is not None:
        gathered = (lambda inner: lambda t: all_gather(inner(t).contiguous(), cp))(gathered)
    diffs = {"output": (gathered(out.detach()) - expected.detach()).abs().max().item(),
             "input_grad": (gathered(x_local.grad) - x.grad).abs().max().item()}
    for (name, param), full in zip(layer.named_parameters(), reference.parameters()):
        diffs[name] = (param.grad - _shard(full.grad, name, tp, gated)).abs().max().item()
    return diffs


def check_context(t: int, c: int) -> dict:
    """{'flash-rope-gqa c=2 sp=on recompute=none': largest difference, ...} over t·c ranks."""
    import tempfile

    from actmem_validate.gloo import free_port

    with tempfile.TemporaryDirectory() as folder:
        forkserver.start(_context_rank, (t, c, folder, free_port()), t * c)
        with open(os.path.join(folder, "result.json")) as file:
            return json.load(file)


def _context_rank(rank: int, t: int, c: int, folder: str, port: int) -> None:
    import torch.distributed as dist
    from datetime import timedelta

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=t * c, timeout=timedelta(seconds=120))
    results = {}
    for sp in (False, True) if t > 1 else (False,):
        tp = tensor_and_context_groups(t, c, sp)
        for recompute in recompute_modes("flash-rope-gqa"):
            diffs = layer_differences(tp, recompute, "flash-rope-gqa")
            results[f"flash-rope-gqa c={c} sp={'on' if sp else 'off'} recompute={recompute}"] = max(diffs.values())
    worst = [None] * (t * c) if rank == 0 else None
    dist.gather_object(results, worst, dst=0)
    if rank == 0:
        with open(os.path.join(folder, "result.json"), "w") as file:
            json.dump({key: max(r[key] for r in worst) for key in results}, file)
    dist.destroy_process_group()


def check_all(t: int) -> dict:
    """{'paper sp=on recompute=full': largest difference, ...} over t gloo ranks."""
    import tempfile

    from actmem_validate.gloo import free_port

    with tempfile.TemporaryDirectory() as folder:
        forkserver.start(_rank, (t, folder, free_port()), t)
        with open(os.path.join(folder, "result.json")) as file:
            return json.load(file)


def _rank(rank: int, t: int, folder: str, port: int) -> None:
    import torch.distributed as dist
    from datetime import timedelta

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=t, timeout=timedelta(seconds=120))
    results = {}
    for variant in VARIANTS:
        for sp in (False, True):
            for recompute in recompute_modes(variant):
                diffs = layer_differences(TensorParallel(t, rank, None, sp), recompute, variant)
                results[f"{variant} sp={'on' if sp else 'off'} recompute={recompute}"] = max(diffs.values())
    worst = [None] * t if rank == 0 else None
    dist.gather_object(results, worst, dst=0)
    if rank == 0:
        merged = {key: max(r[key] for r in worst) for key in results}
        with open(os.path.join(folder, "result.json"), "w") as file:
            json.dump(merged, file)
    dist.destroy_process_group()
