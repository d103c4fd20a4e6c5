"""Measure the torch-native implementation: torchtitan's Llama model under DTensor TP/SP.

One microbatch through the whole model on this rank (the embedding, the spec's L blocks, the
final norm, the output layer and torchtitan's loss under loss_parallel: the first stage at
p = 1), saved bytes by term against the estimate for --implementation torch-native. The
blocks label their tensors (torchtitan.py); the embedding, the output layer and the loss are
torch's own code, named by module and op (``RULES``). Real runs also check the parallel
blocks against the same blocks on one device. The peak is not measured here yet.
"""

import copy
from contextlib import nullcontext
from dataclasses import replace

import torch
import torch.distributed as dist

from actmem.memory.estimate import estimate
from actmem.model.recompute import Recompute
from actmem_validate.compare import CUDNN_RNG_STATE_BYTES, INDEX_BYTES, STATISTIC_BYTES, term_rows
from actmem_validate.ledger import Ledger
from actmem_validate.naming import naming
from actmem_validate.torch_compat import fake_tensor_mode
from actmem_validate.torchtitan import Transformer, cross_entropy_loss, parallelize_model

#: actmem_validate.naming's rules for what torch's own modules keep: the embedding its int64
#: token ids; the output layer its input (all-gathered under SP); the loss (under
#: loss_parallel: a vocabulary shard) its fp32 log-softmax, its int64 targets, its total weight
RULES = (
    ("tok_embeddings", "embedding.default", 1, "token_ids"),
    ("output", "mm.default", "in", "output_layer_input"),
    ("", "_log_softmax.default", "out", "logits_fp32"),
    ("", "nll_loss_forward.default", 1, "cross_entropy_targets"),
    ("", "nll_loss_forward.default", "out1", "cross_entropy_total_weight"),
    # on a GPU, cuDNN's attention (torchtitan's first choice, torchtitan.SDPA_BACKENDS): its output and
    # log-sum-exp as the flash kernel's, then its philox seed and offset (the op's other tensor outputs)
    ("attention", "_scaled_dot_product_cudnn_attention.default", "out0", "projection_input"),
    ("attention", "_scaled_dot_product_cudnn_attention.default", "out1", "softmax_lse"),
    ("attention", "_scaled_dot_product_cudnn_attention.default", "out", "sdpa_rng_state"),
)
#: under torchtitan's per-op checkpointing, what names the outputs its checkpoint caches (torchtitan.op_sac_contexts):
#: each linear's matmul by its module (under DTensor the mm above it: its partial sums for w2), the reduce-scatters
#: RowwiseParallel's output hooks make under SP (after the module's own name is popped: in its parent's), and the
#: CPU flash kernel's log-sum-exp (out0 is the block's projection_input)
OP_RULES = (
    ("attention.wq", "mm.default", "out", "query_projection_output"),
    ("attention.wv", "mm.default", "out", "value_projection_output"),
    ("feed_forward.w1", "mm.default", "out", "gate_projection_output"),
    ("feed_forward.w2", "mm.default", "out", "fc2_partial_output"),
    ("attention", "reduce_scatter_tensor.default", "out", "reduce_scatter_outputs"),
    ("feed_forward", "reduce_scatter_tensor.default", "out", "reduce_scatter_outputs"),
    ("attention", "_scaled_dot_product_flash_attention_for_cpu.default", "out1", "softmax_lse"),
)


def checkpointing(spec) -> str:
    """How torchtitan checkpoints this spec's blocks (torchtitan.Transformer): none, full, every=N or op."""
    policy = spec.run.policy
    if policy.method == "every":
        return f"every={policy.layers}"
    return "op" if policy.ops else spec.run.recompute.value


def rules_for(spec) -> tuple:
    """The naming rules of this spec's run: RULES, and OP_RULES under per-op checkpointing."""
    return RULES + OP_RULES if spec.run.policy.ops else RULES


def build_model(spec, dtype=torch.bfloat16) -> Transformer:
    """The spec's model on the CPU, in bf16 by default (parameters in bf16, as FSDP2's mixed
    precision hands them to the blocks), its blocks checkpointed as the spec's run says."""
    model, arch = spec.model, spec.architecture
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)                 # made in its dtype: fake parameters cannot be cast
    try:
        return Transformer(model.vocab, model.hidden, model.layers, model.heads, arch.query_groups_or(model.heads),
                           arch.head_dim_or(model.hidden, model.heads), arch.ffn(model.hidden), model.seq_len,
                           checkpointing(spec))
    finally:
        torch.set_default_dtype(default)


def measure(config, rank: int, device: str = "cpu", fake: bool = False) -> list[dict]:
    """Saved bytes by term of one microbatch's forward and loss on this rank, against actmem;
    a real run first checks the parallel blocks against one device."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    spec, run = config.spec, config.spec.run
    t, sp = run.tensor_parallel, run.sequence_parallel
    if device != "cpu":          # validate refuses it in one line first (cli._check_backends)
        raise NotImplementedError("the torch-native backend runs on the CPU only so far")
    if t > 1 and not fake:
        check_against_one_device(spec, rank)
    torch.manual_seed(1234)
    mesh = init_device_mesh("cpu", (t,)) if t > 1 else None      # outside the fake mode: it reads data
    with fake_tensor_mode() if fake else nullcontext():
        model = build_model(spec)
        if mesh is not None:
            parallelize_model(model, mesh, sp)
        tokens, labels = (torch.randint(0, spec.model.vocab, (run.micro_batch, spec.model.seq_len)) for _ in "tl")
        ledger = Ledger([*model.parameters(), *model.buffers()])
        with ledger.recording(), naming(model, rules_for(spec)), loss_parallel() if mesh is not None else nullcontext():
            loss = cross_entropy_loss(model(tokens), labels)
        ledger.drop_freed()
        measured = ledger.by_term()
        with loss_parallel() if mesh is not None else nullcontext():
            loss.backward()
    return _compare(config, rank, measured)


def _compare(config, rank: int, measured: dict, device: str = "cpu") -> list[dict]:
    """The estimate's terms (one microbatch, every layer: p = 1) and the residuals torch keeps
    (int64 token ids and targets, 8 B a token each, whole on every rank; the loss's fp32 total
    weight; on a GPU, cuDNN's philox state a layer, unless the blocks are recomputed whole),
    against the ledger's; then the total."""
    spec = config.spec
    tokens = spec.model.seq_len * spec.run.micro_batch
    residuals = {"token_ids": tokens * INDEX_BYTES, "cross_entropy_targets": tokens * INDEX_BYTES,
                 "cross_entropy_total_weight": STATISTIC_BYTES}
    if device.startswith("cuda") and spec.run.recompute.value != "full":
        residuals["sdpa_rng_state"] = spec.model.layers * CUDNN_RNG_STATE_BYTES
    return term_rows(config, rank, {row.term.name: row.total_bytes for row in estimate(spec).run_terms} | residuals,
                     measured)


def check_against_one_device(spec, rank: int) -> None:
    """The parallel model, checkpointed as the run is, gives the one-device model's loss and gradients, on real gloo
    ranks:
    the weights of a block's attention and norm (a partial sum under SP, all-reduced), of the
    output layer and of the embedding. In fp32, so the tolerance can be tight in each
    gradient's own scale (bf16 sums of many tokens differ by their order alone)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    torch.manual_seed(1234)
    reference = build_model(replace(spec, run=replace(spec.run, recompute=Recompute.NONE, selective_ac_option=None)),
                            dtype=torch.float32)
    twin = copy.deepcopy(reference)
    twin.checkpointing = checkpointing(spec)            # the run's own checkpointing, rerun in its backward
    parallel = parallelize_model(twin, init_device_mesh("cpu", (spec.run.tensor_parallel,)), spec.run.sequence_parallel)
    torch.manual_seed(99)
    tokens, labels = (torch.randint(0, spec.model.vocab, (spec.run.micro_batch, spec.model.seq_len)) for _ in "tl")
    expected = cross_entropy_loss(reference(tokens), labels)
    expected.backward()
    with loss_parallel():
        loss = cross_entropy_loss(parallel(tokens), labels)
        loss.backward()
    torch.testing.assert_close(_whole(loss), expected, atol=1e-4, rtol=1e-4)
    grads = dict(parallel.named_parameters())
    for name, weight in reference.named_parameters():
        if name.startswith(("layers.0.attention.", "layers.0.attention_norm", "output.", "tok_embeddings.")):
            scale = weight.grad.abs().max().item()      # gradients are small: tolerances in their scale
            torch.testing.assert_close(_whole(grads[name].grad), weight.grad, atol=1e-3 * scale, rtol=1e-3,
                                       msg=lambda text, name=name: f"{name}: {text}")
    dist.barrier()


def _whole(tensor):
    """A DTensor's full value (its shards gathered, partial sums reduced); a tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
