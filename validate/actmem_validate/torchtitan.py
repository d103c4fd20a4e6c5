"""torchtitan's Llama 3 block, plain torch.nn, parallelised by PyTorch's own DTensor tensor and
sequence parallelism with torchtitan's plan: the torch-native implementation of actmem.

Copied from pytorch/torchtitan at commit 018740b7 (torchtitan/models/llama3/model/model.py:
apply_rotary_emb, repeat_kv, Attention, FeedForward, TransformerBlock; models/attention.py:
the SDPA wrapper; llama3/infra/parallelize.py: apply_tp's layer plan), every op on the
forward path as torchtitan runs it with its defaults (no biases, no QK-norm, the complex
rotation, sdpa; the dims passed as arguments, not ModelArgs). Two things differ, and both
keep the same tensors:
- each saved tensor is named after its row of actmem's term table (``label``: no op changes);
- the norms. torchtitan's nn.RMSNorm runs aten::_fused_rms_norm on a GPU, whose autograd
  formula saves input, rstd and weight (derivatives.yaml); torch 2.13 has no CPU kernel for
  it, and its CPU decomposition keeps two fp32 copies of the input instead. ``FusedRMSNorm``
  keeps what the GPU kernel keeps (the harness's TE norm Function, fused.py), on the
  DTensor's local shard, so a CPU run measures what a GPU run holds.
Everything else (the all-gathers PrepareModuleInput makes, the linears that save DTensors,
SDPA's kernels) is PyTorch's own code. SDPA runs under torchtitan's backend priority
(ScaledDotProductAttentionWrapper: cuDNN, flash, efficient, math): on a GPU cuDNN's kernel,
on a CPU the flash kernel for the CPU; both keep q, k, v, the output and the fp32 log-sum-exp,
and cuDNN its philox seed and offset besides (torch_native.RULES names them).
"""

from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from actmem_validate.fused import _Norm
from actmem_validate.ledger import label, name_saved_output, record, scope
from actmem_validate.torch_compat import selective_checkpoint_cache


def precompute_freqs_cis(dim: int, end: int, theta: float = 500000.0) -> torch.Tensor:
    """complex64 (end, dim/2): the rotary table, a buffer of the model (no activation).
    Llama 3.1's frequency scaling is left out: it changes values, not shapes."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    freqs = torch.outer(torch.arange(end, device=freqs.device), freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    """model.py: the complex rotation; it saves only freqs_cis (the buffer), and its outputs
    are 16-bit copies (type_as)."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[0:xq_.shape[1]].view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """model.py: (b, s, g, d) -> (b, s, g·n_rep, d); a copy, or a view when g = 1."""
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (torch.unsqueeze(x, dim=3).expand(bs, slen, n_kv_heads, n_rep, head_dim)
            .reshape(bs, slen, n_kv_heads * n_rep, head_dim))


class FusedRMSNorm(nn.RMSNorm):
    """nn.RMSNorm keeping what aten::_fused_rms_norm keeps on a GPU: its 16-bit input and fp32
    rstd, one a token (and the weight, a parameter). ``term`` names the input's row,
    ``statistics`` the rstd's."""

    def __init__(self, dim: int, term: str, statistics: str, eps: float = 1e-5):
        super().__init__(dim, eps=eps)
        self.term, self.statistics = term, statistics

    def forward(self, x):
        from torch.distributed.tensor import DTensor, Partial, Shard

        if not isinstance(x, DTensor):
            return _rms_norm(x, self.weight, self.term, self.statistics)
        # SequenceParallel: x is Shard(1), the weight Replicate; the weight's gradient from
        # this rank's tokens is a partial sum. (torch 2.13's local_map, which does the same,
        # cut the gradient to an input made by another op: the embedding's grad was wrong.)
        y = _rms_norm(x.to_local(grad_placements=[Shard(1)]), self.weight.to_local(grad_placements=[Partial()]),
                      self.term, self.statistics)
        return DTensor.from_local(y, x.device_mesh, [Shard(1)], run_check=False)


def _rms_norm(x, weight, term: str, statistics: str):
    with scope(statistics):                 # rstd, saved inside the Function
        return _Norm.apply(label(x, term), weight, None, True)


class Attention(nn.Module):
    """model.py Attention, sdpa with is_causal=True (torchtitan's ScaledDotProductAttention
    wrapper prefers cuDNN, then flash; on a CPU SDPA's flash kernel runs)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int):
        super().__init__()
        self.n_rep, self.head_dim = n_heads // n_kv_heads, head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        label(x, "qkv_input")                      # under SP: the all-gathered (b, s, h)
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys, values = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        label(xq, "query")
        label(keys, "repeated_key_value")
        label(values, "repeated_key_value")
        output = _sdpa(xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2))
        output = output.transpose(1, 2).contiguous()    # a view: the kernel stores (b, s, a/t, d)
        return self.wo(output.view(bs, seqlen, -1))


#: models/attention.py, ScaledDotProductAttentionWrapper.sdpa_backends, in torchtitan's order
SDPA_BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def _sdpa(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with scope("softmax_lse"), sdpa_kernel([getattr(SDPBackend, name) for name in SDPA_BACKENDS], set_priority=True):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if out.grad_fn is not None and not any(kernel in out.grad_fn.name() for kernel in ("Flash", "Cudnn")):
        raise RuntimeError(f"SDPA ran {out.grad_fn.name()}, not a flash or cuDNN kernel")
    return name_saved_output(out, "projection_input")


class FeedForward(nn.Module):
    """model.py FeedForward: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        label(x, "fc1_input")                      # under SP: the all-gathered (b, s, h)
        gate, up = label(self.w1(x), "swiglu_input"), label(self.w3(x), "swiglu_input")
        return self.w2(label(label(F.silu(gate), "silu_output") * up, "fc2_input"))


class TransformerBlock(nn.Module):
    """model.py TransformerBlock: pre-norm residuals around attention and the feed-forward."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, hidden_dim: int):
        super().__init__()
        self.attention = Attention(dim, n_heads, n_kv_heads, head_dim)
        self.feed_forward = FeedForward(dim, hidden_dim)
        self.attention_norm = FusedRMSNorm(dim, "attention_layernorm_input", "attention_norm_statistics")
        self.ffn_norm = FusedRMSNorm(dim, "mlp_layernorm_input", "mlp_norm_statistics")

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


def op_sac_save_list() -> set:
    """models/llama3/infra/parallelize.py @018740b7, _op_sac_save_list: the ops of a bf16 Llama block it names
    (its float8 max, flex and varlen attention, and inductor's compiled code do not run here), and, on a CPU, SDPA's
    CPU flash kernel: the stand-in for the GPU kernels the list names (it keeps the same output and log-sum-exp;
    cuDNN's philox state besides is torch_native.RULES')."""
    ops = torch.ops.aten
    return {ops.mm.default, ops._scaled_dot_product_efficient_attention.default,
            ops._scaled_dot_product_flash_attention.default, ops._scaled_dot_product_cudnn_attention.default,
            ops._scaled_dot_product_attention_math.default,
            ops._scaled_dot_product_fused_attention_overrideable.default,
            torch.ops._c10d_functional.reduce_scatter_tensor.default, ops.max.default,
            ops._scaled_dot_product_flash_attention_for_cpu.default}


def op_sac_contexts(caches: list):
    """distributed/activation_checkpoint.py @018740b7, _apply_op_sac's context_fn: save the listed ops' outputs but
    every second mm's. Its shapes forced to recompute (per_op_sac_force_recompute_mm_shapes_by_fqns, by default
    ["moe.router.gate"]) match no linear of a dense Llama block, so that test is left out. Its counter keeps the
    forward's and the rerun's apart; torch 2.13's rerun (_CachedTorchDispatchMode) no longer asks the policy, and
    takes each call's cached outputs back in order. ``caches`` gets each call's caching mode, whose tensors the
    ledger is shown (Transformer.forward)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save_list, meta = op_sac_save_list(), defaultdict(int)

    def _custom_policy(ctx, func, *args, **kwargs):
        if (func == torch.ops.aten._to_copy.default and "cuda" in str(args[0].device) and "device" in kwargs
                and str(kwargs["device"]) == "cpu"):
            return CheckpointPolicy.MUST_SAVE
        mode = "recompute" if ctx.is_recompute else "forward"
        mm_count_key = f"{mode}_mm_count"
        if func == torch.ops.aten.mm.default:
            meta[mm_count_key] += 1
        # Saves output of all compute ops, except every second mm
        to_save = func in save_list and not (func == torch.ops.aten.mm.default and meta[mm_count_key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if to_save else CheckpointPolicy.PREFER_RECOMPUTE

    caching, cached = create_selective_checkpoint_contexts(_custom_policy)
    caches.append(caching)
    return caching, cached


def _every(checkpointing: str) -> int:
    """N of 'every=N', 1 for none, full and op; anything else refused."""
    every = checkpointing.removeprefix("every=")
    if checkpointing not in ("none", "full", "op") and not (every.isdecimal() and int(every) > 0):
        raise ValueError(f"checkpointing must be none, full, every=N or op, not {checkpointing!r}")
    return int(every) if every.isdecimal() else 1


class Transformer(nn.Module):
    """model.py Transformer: the word embedding, the blocks, the final norm and the untied
    output layer; freqs_cis a buffer. ``checkpointing`` wraps each block as torchtitan's activation
    checkpointing does (distributed/activation_checkpoint.py: checkpoint_wrapper, non-reentrant,
    preserve_rng_state=False, and its config's early_stop=False: the rerun runs the whole block), which keeps the
    block's input: 'full'; 'every=N', its layer policy
    (_apply_layer_sac: the blocks whose count from 1 N divides, the others not at all); or 'op', its per-op
    selective policy (_apply_op_sac: with its context_fn and torchtitan's early_stop=False), whose cache the
    ledger is shown after each block (the checkpoint's own saved-tensor hooks hide the rest of the block from it)."""

    def __init__(self, vocab: int, dim: int, layers: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 hidden_dim: int, max_seq_len: int, checkpointing: str = "none"):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, n_heads, n_kv_heads, head_dim, hidden_dim)
                                    for _ in range(layers))
        self.norm = FusedRMSNorm(dim, "final_layernorm_input", "final_norm_statistics")
        self.output = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(head_dim, max_seq_len), persistent=False)
        _every(checkpointing)                      # a checkpointing named otherwise is refused here
        self.checkpointing = checkpointing

    @property
    def every(self) -> int:
        """N of 'every=N' (1 otherwise)."""
        return _every(self.checkpointing)

    def forward(self, tokens):
        from torch.utils.checkpoint import checkpoint

        h = self.tok_embeddings(tokens)
        for count, block in enumerate(self.layers, start=1):
            if self.checkpointing == "full" or self.checkpointing.startswith("every=") and count % self.every == 0:
                h = checkpoint(block, label(h, "layer_input_checkpoint"), self.freqs_cis, use_reentrant=False,
                               preserve_rng_state=False, early_stop=False)
            elif self.checkpointing == "op":
                caches = []
                h = checkpoint(block, label(h, "layer_input_checkpoint"), self.freqs_cis, use_reentrant=False,
                               preserve_rng_state=False, early_stop=False,
                               context_fn=lambda: op_sac_contexts(caches))
                for tensor in selective_checkpoint_cache(caches[0]):
                    record(tensor)
            else:
                h = block(h, self.freqs_cis)
        return self.output(self.norm(h))


def cross_entropy_loss(pred, labels):
    """components/loss.py: the logits in fp32, over (b·s) rows; run under loss_parallel when the
    output layer is vocabulary-parallel."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def model_plan(sequence_parallel: bool) -> dict:
    """apply_tp's model-level plan (loss_parallel on): the embedding row-parallel over the
    vocabulary, its output sharded along the sequence under SP; the final norm sequence-
    parallel; the output layer column-parallel over the vocabulary, its logits left sharded
    for loss_parallel. Without SP (not torchtitan's) the embedding's output is replicated."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if not sequence_parallel:
        return {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    return {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}


def layer_plan(sequence_parallel: bool) -> dict:
    """apply_tp's plan for one block (infra/parallelize.py @018740b7, bf16, no float8). Without
    sequence parallelism (not torchtitan's: it always shards the sequence) the norms stay
    replicated and the linears take and give replicated tensors."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, \
        SequenceParallel

    if not sequence_parallel:
        return {name: ColwiseParallel() for name in ("attention.wq", "attention.wk", "attention.wv",
                                                     "feed_forward.w1", "feed_forward.w3")} | \
            {name: RowwiseParallel() for name in ("attention.wo", "feed_forward.w2")}
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


def parallelize(block: TransformerBlock, mesh, sequence_parallel: bool) -> TransformerBlock:
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(block, mesh, layer_plan(sequence_parallel))


def parallelize_model(model: Transformer, mesh, sequence_parallel: bool) -> Transformer:
    """apply_tp: the model-level plan, then each block's."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh, model_plan(sequence_parallel))
    for block in model.layers:
        parallelize(block, mesh, sequence_parallel)
    return model
