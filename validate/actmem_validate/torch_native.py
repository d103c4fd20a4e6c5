"""Measure the torch-native implementation: torchtitan's Llama blocks under DTensor TP/SP.

One microbatch through the spec's layers on this rank (the layers' activations of one
microbatch: what actmem's per-layer terms count, times L), saved bytes by term against the
engine's rows for --implementation torch-native. The embedding, the output layer and the
peak are not measured here yet. Real runs also check the parallel blocks against the same
blocks on one device.
"""

import copy
from contextlib import nullcontext

import torch
import torch.distributed as dist

from actmem import engine
from actmem.terms import layer_terms
from actmem_validate.compare import term_rows
from actmem_validate.ledger import Ledger, label
from actmem_validate.torch_compat import fake_tensor_mode, local_tensor
from actmem_validate.torchtitan import TransformerBlock, parallelize, precompute_freqs_cis


def build_blocks(spec) -> torch.nn.ModuleList:
    """The spec's L blocks in bf16 on the CPU (parameters in bf16, as FSDP2's mixed precision
    hands them to the blocks)."""
    model, arch = spec.model, spec.architecture
    groups, dim = arch.query_groups_or(model.heads), arch.head_dim_or(model.hidden, model.heads)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)        # made in bf16: fake parameters cannot be cast
    try:
        return torch.nn.ModuleList(
            TransformerBlock(model.hidden, model.heads, groups, dim, arch.ffn(model.hidden))
            for _ in range(model.layers))
    finally:
        torch.set_default_dtype(default)


def run_blocks(blocks, x, freqs_cis, full_recompute: bool):
    """torchtitan's forward over the blocks; full activation checkpointing wraps each block
    (distributed/activation_checkpoint.py: checkpoint_wrapper, non-reentrant,
    preserve_rng_state=False), which keeps the block's input."""
    from torch.utils.checkpoint import checkpoint

    for block in blocks:
        if full_recompute:
            x = checkpoint(block, label(x, "layer_input_checkpoint"), freqs_cis, use_reentrant=False,
                           preserve_rng_state=False)
        else:
            x = block(x, freqs_cis)
    return x


def measure(config, rank: int, device: str = "cpu", fake: bool = False) -> list[dict]:
    """Saved bytes by term of one microbatch's forward on this rank, against actmem; a real
    run first checks the parallel blocks against one device."""
    from torch.distributed.device_mesh import init_device_mesh

    spec, run = config.spec, config.spec.run
    t, sp = run.tensor_parallel, run.sequence_parallel
    if device != "cpu":          # validate refuses it in one line first (cli._check_backends)
        raise NotImplementedError("the torch-native backend runs on the CPU only so far")
    if t > 1 and not fake:
        check_against_one_device(spec, rank)
    torch.manual_seed(1234)
    mesh = init_device_mesh("cpu", (t,)) if t > 1 else None      # outside the fake mode: it reads data
    with fake_tensor_mode() if fake else nullcontext():
        blocks = build_blocks(spec)
        if mesh is not None:
            for block in blocks:
                parallelize(block, mesh, sp)
        x, freqs = _inputs(spec, rank)
        ledger = Ledger([*blocks.parameters(), *blocks.buffers(), freqs])
        with ledger.recording():
            out = run_blocks(blocks, x, freqs, run.recompute.value == "full")
        measured = ledger.by_term()
        out.float().sum().backward()
    return _compare(config, rank, measured)


def _inputs(spec, rank: int):
    """This rank's block input, (b, s/t, h) under SP (what the embedding's RowwiseParallel
    hands the first block), else (b, s, h); and the rotary table."""
    model, run = spec.model, spec.run
    tokens = model.seq_len // (run.tensor_parallel if run.sequence_parallel else 1)
    x = torch.randn(run.micro_batch, tokens, model.hidden, dtype=torch.bfloat16).requires_grad_()
    dim = spec.architecture.head_dim_or(model.hidden, model.heads)
    return x, precompute_freqs_cis(dim, model.seq_len)


def _compare(config, rank: int, measured: dict) -> list[dict]:
    """The engine's bytes a term, times L, against the ledger's; then the total."""
    spec, technique = config.spec, config.technique
    arch, bindings = spec.architecture, spec.bindings()
    formula = {term.name: spec.model.layers * engine.exact(engine.term_bytes(term, technique, arch), bindings)
               for term in layer_terms(arch)}
    return term_rows(config, rank, {name: n for name, n in formula.items() if n}, measured)


def check_against_one_device(spec, rank: int) -> None:
    """The parallel blocks give the one-device blocks' output and input gradient (bf16
    tolerances), on real gloo ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    run = spec.run
    t, sp = run.tensor_parallel, run.sequence_parallel
    torch.manual_seed(1234)
    reference = build_blocks(spec)
    blocks = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (t,))
    for block in blocks:
        parallelize(block, mesh, sp)
    torch.manual_seed(99)
    full = torch.randn(run.micro_batch, spec.model.seq_len, spec.model.hidden, dtype=torch.bfloat16)
    dim = spec.architecture.head_dim_or(spec.model.hidden, spec.model.heads)
    freqs = precompute_freqs_cis(dim, spec.model.seq_len)
    mine = (full.chunk(t, dim=1)[rank] if sp else full).clone().requires_grad_()
    theirs = full.clone().requires_grad_()
    out, expected = run_blocks(blocks, mine, freqs, False), run_blocks(reference, theirs, freqs, False)
    out = local_tensor(out)
    out.float().sum().backward()
    expected.float().sum().backward()
    want_out = expected.chunk(t, dim=1)[rank] if sp else expected
    want_grad = theirs.grad.chunk(t, dim=1)[rank] if sp else theirs.grad
    torch.testing.assert_close(out, want_out, atol=0.05, rtol=0.05)
    torch.testing.assert_close(mine.grad, want_grad, atol=0.05, rtol=0.05)
    dist.barrier()
