"""The GPT layer of the paper's Figure 5 and the embedding/output pieces of section 4.5,
built from the tensor-parallel blocks. Each tensor the backward pass will need is labelled
with the name of its row in actmem's term table (``actmem/memory/terms.py``).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from actmem_validate.context import context_parallel_attention
from actmem_validate.fused import Norm, rotary_frequencies, rotate, scaled_causal_softmax, swiglu
from actmem_validate.layers import ColumnParallelLinear, Dropout, Fp8Save, RowParallelLinear, init_scaled, linear
from actmem_validate.ledger import label, name_of, name_saved_output, scope
from actmem_validate.offload import te_attention
from actmem_validate.mappings import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region, \
    scatter_to_sequence_parallel_region
from actmem_validate.parallel import TensorParallel, all_reduce
from actmem_validate.torch_compat import flash_rng_state, storage_key


@dataclass(frozen=True)
class LayerSpec:
    hidden: int
    heads: int
    seq_len: int
    layers: int = 1
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    recompute: str = "none"           # none | selective | full
    dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"
    ffn: int | None = None            # f; None: 4h
    activation: str = "gelu"          # gelu | swiglu | squared_relu
    normalization: str = "layernorm"  # layernorm | rmsnorm
    bias: bool = True
    qkv_bias: bool | None = None      # None: as bias
    tied_output: bool = True
    query_groups: int | None = None   # g; None: a
    head_dim: int | None = None       # d; None: h/a
    attention_core: str = "eager"     # eager | flash | flash-attn
    position_embedding: str = "learned"   # learned | rope | none
    rope_fusion: bool = True              # False: Megatron's unfused rope (--no-rope-fusion)
    qk_norm: bool = False                 # q and k normalised per head (--qk-layernorm)
    recompute_method: str = "uniform"     # with full recompute: uniform | block
    recompute_layers: int = 1             # N: layers a checkpoint, or checkpointed layers a chunk
    recompute_modules: tuple = ("core_attn",)   # with selective recompute: core_attn, layernorm, mlp
    attention_mask: bool = False          # the dataloader's [b, 1, s, s] bool mask, into each layer
    softmax_fusion: bool = True           # the local core's fused softmax runs; False: torch's fallback
    softmax_in_fp32: bool = False         # torch's fallback upcasts (--attention-softmax-in-fp32)
    position_rows: int | None = None      # rows of the learned table (--max-position-embeddings); None: s
    rotary_percent: float = 1.0           # the share of d rope rotates (--rotary-percent)
    wgrad_fusion: bool = True             # False: 16-bit weight gradients (--no-gradient-accumulation-fusion)
    fp8: str | None = None                # TE's FP8 recipe (delayed, tensorwise): its linears' saves (Fp8Save)
    fp8_history: int = 1                  # delayed scaling's amax history rows
    fp8_generation: str | None = None     # the GPU's FP8 generation: hopper keeps weight transposes
    bf16_layers: frozenset = frozenset()  # global indices of layers run in bf16 under FP8 (--first-last-layers-bf16)

    def fp8_save(self, term: str) -> Fp8Save | None:
        """What TE's FP8 linear keeps of its input, named ``term`` (actmem.model.fp8): the projection's quantized
        copy only under delayed scaling (Megatron's save_original_input elsewhere keeps its 16-bit input)."""
        if self.fp8 is None or (term == "projection_input_fp8" and self.fp8 != "delayed"):
            return None
        # blockwise: the norms' outputs in the gatherable COMPACT scale layout (under SP), GEMM_READY otherwise
        # (its scales' last dim rounded up to 4: the same bytes where h is a multiple of 4, as FP8 needs 16)
        return Fp8Save(term, self.fp8, compact=term in ("qkv_input", "fc1_input"))

    @classmethod
    def of(cls, spec, device: str = "cpu", dtype=torch.bfloat16) -> "LayerSpec":
        """The layer an actmem Spec describes, at its run's t: the local core's softmax is the fused
        kernel where Megatron runs it (actmem.model.spec.Spec.architecture_at), else torch's fallback."""

        model, arch = spec.model, spec.architecture
        fused = spec.architecture_at(spec.run.tensor_parallel).masked_softmax_fusion
        if arch.attention_core != "eager" and arch.attention_dropout:
            from actmem.errors import SpecError

            raise SpecError("the harness measures flash attention without attention dropout: SDPA's CPU "
                            "flash kernel has none (with dropout it falls back to its math kernel); give "
                            "--attention-dropout 0")
        return cls(model.hidden, model.heads, model.seq_len, model.layers, arch.attention_dropout,
                   arch.hidden_dropout, spec.run.recompute.value, dtype, device, arch.ffn_hidden,
                   arch.activation, arch.normalization, arch.bias, arch.qkv_bias, arch.tied_output, arch.query_groups,
                   arch.head_dim, arch.attention_core, arch.position_embedding, arch.rope_fusion,
                   arch.qk_norm, spec.run.recompute_method or "uniform", spec.run.recompute_layers or 1,
                   spec.run.recompute_modules or ("core_attn",), arch.attention_mask, fused, arch.softmax_in_fp32,
                   arch.position_rows, arch.rotary_percent, arch.gradient_accumulation_fusion, arch.fp8,
                   arch.fp8_amax_history_len, spec.gpu_fp8,
                   frozenset(i for i in range(model.layers) if arch.bf16_layer(i, model.layers)))

    def recomputes(self, module: str) -> bool:
        """Whether selective recompute checkpoints this module (Megatron's --recompute-modules)."""
        return self.recompute == "selective" and module in self.recompute_modules

    @property
    def ffn_hidden(self) -> int:
        return 4 * self.hidden if self.ffn is None else self.ffn

    @property
    def groups(self) -> int:
        return self.heads if self.query_groups is None else self.query_groups

    @property
    def dim(self) -> int:
        return self.hidden // self.heads if self.head_dim is None else self.head_dim


def _norm(spec: LayerSpec) -> Norm:
    return Norm(spec.hidden, spec.normalization, dtype=spec.dtype, device=spec.device)


@dataclass(frozen=True)
class LocalSoftmax:
    """The local core's FusedScaleMaskSoftmax at one run's shape (fused_softmax.py, forward):
    its fused causal kernel where is_kernel_available allows, else torch's fallback, as
    LayerSpec.of resolved it (actmem.model.rules.fused_softmax_runs, or --no-masked-softmax-fusion)."""

    heads: int            # a/t: the scores are [b, a/t, s, s] to Megatron
    fused: bool
    in_fp32: bool

    def probabilities(self, q, k, mask=None):
        """softmax(q·kᵀ/√d), causal: (b·a/t, s, s); the matmul keeps q and k. The fused path
        scales inside its kernel's stand-in; the fallback gets Megatron's scores, a baddbmm of
        its buffer (beta = 0: never read) scaled by alpha (dot_product_attention.py,
        DotProductAttention.forward), and torch's softmax of them."""
        scale = q.shape[-1] ** -0.5
        if self.fused:
            scores = torch.bmm(q, k.transpose(1, 2))
            with scope("softmax_output"):                            # the kernel keeps its output
                return scaled_causal_softmax(scores, scale)
        scores = torch.baddbmm(q.new_zeros(1, 1, 1), q, k.transpose(1, 2), beta=0.0, alpha=scale)
        return torch_softmax(scores, self.heads, self.in_fp32, mask)


def torch_softmax(scores, heads: int, in_fp32: bool, mask=None):
    """Megatron's fallback where its fused kernel does not run (fused_softmax.py,
    FusedScaleMaskSoftmax.forward_torch_softmax), op by op, so that autograd keeps what it keeps
    there: the upcast keeps nothing; masked_fill_, in place on the [b, a/t, s, s] view of the
    scores (utils.py, attention_mask_func), keeps the mask, made at each call where none is
    handed in (get_default_causal_mask); torch.nn.Softmax keeps its output; the cast back keeps
    nothing. scores: (b·a/t, s, s), already scaled. -> (b·a/t, s, s)"""
    s, sixteen_bit = scores.shape[-1], scores.dtype in (torch.float16, torch.bfloat16)
    upcast = in_fp32 and sixteen_bit                     # input_in_float16 and softmax_in_fp32
    x = scores.view(-1, heads, s, s)                     # [b, np, sq, sk]
    x = x.float() if upcast else x
    if mask is None:                                     # triu(ones(s, s), diagonal=1).bool(), not cached
        mask = label(torch.triu(torch.ones(s, s, device=scores.device), diagonal=1).bool(), "softmax_causal_mask")
    filled = x.masked_fill_(mask, -10000.0)
    with scope("softmax_output_fp32" if upcast else "softmax_output"):
        probs = torch.nn.Softmax(dim=-1)(filled)
    if upcast:                                           # .half() or .bfloat16(): ·V keeps it without dropout
        probs = label(probs.to(scores.dtype), "softmax_output")
    return probs.view(-1, s, s)                          # [b·np, sq, sk]


def attention_core(q, k, v, dropout: Dropout, softmax: LocalSoftmax, mask=None):
    """QKᵀ, softmax, dropout, ·V: the part selective recompute checkpoints. q, k, v: (b·a/t, s, hd).
    mask: the dataloader's, handed in as Megatron hands it: torch's fallback softmax fills the
    scores with it, the fused causal kernel never reads it."""
    probs = softmax.probabilities(q, k, mask)                       # QKᵀ keeps Q and K
    dropped = dropout(probs)                                         # its mask: softmax_dropout_mask
    if dropped is not probs:
        label(dropped, "softmax_dropout_output")
    return torch.bmm(dropped, v)                                     # keeps the dropout output and V


def _heads_first(x):
    """(s, b, n, d) -> (1, b·n, s, d), a view: the batch folded into the heads, so that SDPA
    writes its output in (s, b, n, d) order, as TE's kernels write the sbhd layout Megatron
    uses, and the projection's input is that output itself, not a copy. Query head j of
    sequence i meets key group (i·a + j)/(a/g) = i·g + j/(a/g): the right one."""
    s, b, n, d = x.shape
    return x.view(s, b * n, d).unsqueeze(0).transpose(1, 2)


def flash_core(q, k, v, copies_output: bool = False):
    """Causal attention by SDPA's flash kernel, which keeps q, k, v, its output and an fp32
    log-sum-exp of (b, a/t, s) (aten's _scaled_dot_product_flash_attention_for_cpu; on a
    GPU, flash-attn's and cuDNN's keep the same). k and v stay g/t groups wide (enable_gqa).
    copies_output: run as TE runs the flash-attn package, batch first, so the output is
    stored (b, s, a, d) and the projection gets a contiguous (s, b, a·d) copy when b > 1;
    otherwise as TE's cuDNN kernel writes sbhd, one storage (the batch folded into the heads).
    q: (s, b, a/t, d); k, v: (s, b, g/t, d) -> (s, b, a/t·d)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    s, b, heads, d = q.shape
    layout = _batch_first if copies_output else _heads_first
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), scope("softmax_lse"), te_attention():
        out = nn.functional.scaled_dot_product_attention(layout(q), layout(k), layout(v), is_causal=True,
                                                         enable_gqa=True)
    if out.grad_fn is not None and "Flash" not in out.grad_fn.name():
        raise RuntimeError(f"SDPA ran {out.grad_fn.name()}, not its flash kernel")
    if copies_output:                           # (b, a, s, d) stored (b, s, a, d)
        context = out.transpose(1, 2).transpose(0, 1).contiguous().view(s, b, heads * d)
    else:                                       # (1, b·a, s, d) stored (s, b, a, d)
        context = out.squeeze(0).transpose(0, 1).view(s, b, heads * d)
    for rng in flash_rng_state(out):                    # on a GPU (compare.FLASH_RNG_STATE_BYTES)
        name_saved_output(rng, "flash_rng_state")
    if storage_key(context) != storage_key(out):
        name_saved_output(out, "flash_output")          # flash-attn's own copy, b > 1
    return name_saved_output(context, "projection_input")


def _batch_first(x):
    """(s, b, n, d) -> (b, n, s, d) stored (b, s, n, d): TE hands flash-attn bshd copies of q, k
    and v (x.transpose(0, 1).contiguous(); the sbhd tensors are then freed), and flash-attn's
    output, like SDPA's, takes q's layout. The copies keep the names of the tensors copied."""
    copy = x.transpose(0, 1).contiguous()
    if storage_key(copy) != storage_key(x):
        label(copy, name_of(x))
    return copy.transpose(1, 2)


def rotate_unfused(x, freqs, mscale: float = 1.0):
    """(s, b, n, d) rotated as Megatron-Core's unfused rope does it (--no-rope-fusion;
    rope_utils.py, _apply_rotary_pos_emb_bshd and _rotate_half, the whole head dim rotated):
    plain ops, so autograd keeps what they keep, the 16-bit cos_ and sin_ (s, 1, 1, d) made
    at each call (t * cos_ keeps cos_, rotate_half(t) * sin_ keeps sin_)."""
    rot_dim = freqs.shape[-1]
    x, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    cos_ = label((torch.cos(freqs) * mscale).to(x.dtype), "rope_cos_sin")
    sin_ = label((torch.sin(freqs) * mscale).to(x.dtype), "rope_cos_sin")
    first, second = torch.chunk(x, 2, dim=-1)
    x = (x * cos_) + (torch.cat((-second, first), dim=-1) * sin_)
    return torch.cat((x, x_pass), dim=-1)


class SelfAttention(nn.Module):
    """Megatron-Core's self-attention with its local (eager) core. The QKV output is laid out
    group by group, [g, a/g + 2, d] (each group's queries, then its key and value), so a
    column-parallel split gives each rank g/t whole groups."""

    def __init__(self, spec: LayerSpec, tp: TensorParallel):
        super().__init__()
        self.spec, self.tp = spec, tp
        self.heads, self.groups = spec.heads // tp.size, spec.groups // tp.size
        kw = dict(dtype=spec.dtype, device=spec.device)
        width = (spec.heads + 2 * spec.groups) * spec.dim
        qkv_bias = spec.bias if spec.qkv_bias is None else spec.qkv_bias
        self.qkv = ColumnParallelLinear(spec.hidden, width, tp, bias=qkv_bias, fp8=spec.fp8_save("qkv_input"), **kw)
        self.projection = RowParallelLinear(spec.heads * spec.dim, spec.hidden, tp, bias=spec.bias,
                                            fp8=spec.fp8_save("projection_input_fp8"), **kw)
        init_scaled(self.projection, spec.layers)
        self.dropout = Dropout(spec.attention_dropout, "softmax_dropout_mask")
        self.softmax = LocalSoftmax(self.heads, spec.softmax_fusion, spec.softmax_in_fp32)
        if spec.qk_norm:      # TENorm over d; every rank normalises its own heads with the same weights
            self.q_norm, self.k_norm = (Norm(spec.dim, spec.normalization, summed_over_heads=True, **kw)
                                        for _ in range(2))
        if spec.position_embedding == "rope":   # model state, as Megatron's cached table is
            rotated = int(spec.dim * spec.rotary_percent)         # Megatron's RotaryEmbedding dim
            self.register_buffer("freqs", rotary_frequencies(spec.seq_len, rotated, spec.device),
                                 persistent=False)

    def forward(self, x, mask=None):
        qkv = self.qkv(x)                                     # (s, b, (a + 2g)d/t)
        s, b, _ = qkv.shape
        per_group, d = self.heads // self.groups, self.spec.dim
        qkv = qkv.view(s, b, self.groups, per_group + 2, d)  # (s, b, g/t, a/g + 2, d)
        q = qkv[:, :, :, :per_group].reshape(s, b, self.heads, d)
        if self.spec.attention_core != "eager":
            return self.projection(self._flash(q, qkv[:, :, :, per_group], qkv[:, :, :, per_group + 1], mask))
        # Megatron's local attention expands K and V to a heads where a group has several
        # (dot_product_attention.py: repeat_interleave makes copies, only when a/g > 1), so both
        # are as wide as Q: 2sb·ad/t each.
        k, v = (qkv[:, :, :, per_group + i] for i in (0, 1))
        if per_group > 1:
            k, v = (t.repeat_interleave(per_group, dim=2) for t in (k, v))
        # Copies: with one group a head, Megatron's q, k, v are views of the QKV output, saved
        # once with the same 6sb·ad/t bytes; separate storages let each be named after its own
        # term. (clone, not contiguous: a reshape already contiguous would stay a view.)
        q, k, v = (t.permute(1, 2, 0, 3).reshape(b * self.heads, s, d).clone(memory_format=torch.contiguous_format)
                   for t in (q, k, v))                        # (b·a/t, s, d)
        label(q, "query_key"), label(k, "query_key"), label(v, "value")
        if per_group == 1:        # Megatron's v is a view of the QKV output, which q and k keep too
            q = _HoldingValue.apply(q, v)
        if self.spec.recomputes("core_attn"):
            context = checkpoint(attention_core, q, k, v, self.dropout, self.softmax, mask,
                                 use_reentrant=True)           # keeps q, k, v (and the mask) only
        else:
            context = attention_core(q, k, v, self.dropout, self.softmax, mask)
        context = context.view(b, self.heads, s, d).permute(2, 0, 1, 3).reshape(s, b, self.heads * d)
        return self.projection(label(context, "projection_input"))

    def _flash(self, q, k, v, mask=None):
        """q (s, b, a/t, d), k and v (s, b, g/t, d), views of the QKV output. Rope rotates q and
        k into tensors of their own; TE makes v contiguous; so nothing keeps the QKV output.
        Without rope, TE copies q and k the same way (same bytes), unless the q and k norms
        (--qk-layernorm) already made them tensors of their own. Selective recompute of the
        core checkpoints it as Megatron's _checkpointed_attention_forward does, around TE's
        whole core: the checkpoint saves q, k and the view v, so the QKV output stays."""
        context = self.tp.context
        if self.spec.qk_norm:
            q, k = _normalise_head(q, self.q_norm), _normalise_head(k, self.k_norm)
        if self.spec.position_embedding == "rope":
            start = 0 if context is None else context.offset(q.shape[0])
            freqs = self.freqs[start:start + q.shape[0]]                # this rank's positions
            rope = rotate if self.spec.rope_fusion else rotate_unfused
            q, k = rope(q, freqs), rope(k, freqs)
        elif not self.spec.qk_norm:         # the norms' outputs are contiguous tensors of their own
            q, k = (t.clone(memory_format=torch.contiguous_format) for t in (q, k))
        label(q, "query"), label(k, "key")
        if self.spec.recomputes("core_attn"):
            label(v, "qkv_output")                   # v's storage: the whole QKV output
            return checkpoint(self._te_core, q, k, v, mask, use_reentrant=True)   # keeps q, k, v, the mask
        return self._te_core(q, k, v)

    def _te_core(self, q, k, v, mask=None):
        """TE's DotProductAttention: v made contiguous (a copy of the view), then the flash
        kernel, or under context parallelism the ring; a causal kernel never reads the mask.
        (s, b, a/t, d) -> (s, b, a/t·d)"""
        v = label(v.clone(memory_format=torch.contiguous_format), "value")
        context = self.tp.context
        if context is not None and context.size > 1:
            return context_parallel_attention(q, k, v, context)
        return flash_core(q, k, v, copies_output=self.spec.attention_core == "flash-attn")


class _HoldingValue(torch.autograd.Function):
    """q, passed through, and v held until q's backward. Without query groups Megatron's q, k and v
    are views of the QKV linear's output (dot_product_attention.py: view and reshape, no copy), so
    v's storage lives until QKᵀ's backward releases q and k, after ·V's backward has run; the
    harness copies each to name its term, and this keeps v's copy as long (one storage, counted
    once). With query groups v is Megatron's repeat_interleave copy, freed after ·V's backward."""

    @staticmethod
    def forward(ctx, q, v):
        ctx.save_for_backward(v)
        return q.view_as(q)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _normalise_head(x, norm: Norm):
    """x (s, b, n, d) normalised over d as Megatron's q_layernorm and k_layernorm run it
    (attention.py, get_query_key_value_tensors; TENorm): TE's op-based norm saves
    input_.contiguous() and fp32 statistics a row (ops/basic/rmsnorm.py, op_forward). q is
    already the reshape's copy where a rank holds several groups (a strided view where it
    holds one); k is always a strided view of the QKV output: each one storage, copied here."""
    x = label(x.contiguous(), "qk_norm_input")
    with scope("qk_norm_statistics"):
        return norm(x)


class MLP(nn.Module):
    """h -> f (GeLU) or 2f (SwiGLU: [gate | up] on each rank, as Megatron shards it) -> h."""

    def __init__(self, spec: LayerSpec, tp: TensorParallel):
        super().__init__()
        kw = dict(dtype=spec.dtype, device=spec.device)
        self.gated = spec.activation == "swiglu"
        self.squared = spec.activation == "squared_relu"
        f = spec.ffn_hidden
        self.fc1 = ColumnParallelLinear(spec.hidden, (2 if self.gated else 1) * f, tp, bias=spec.bias,
                                        fp8=spec.fp8_save("fc1_input"), **kw)
        self.fc2 = RowParallelLinear(f, spec.hidden, tp, bias=spec.bias, fp8=spec.fp8_save("fc2_input"), **kw)
        init_scaled(self.fc2, spec.layers)

    def forward(self, x):
        hidden = self.fc1(x)                                  # (s, b, f/t) or (s, b, 2f/t)
        if self.gated:
            activated = swiglu(label(hidden, "swiglu_input"))
        elif self.squared:        # megatron/core/activations.py: relu and pow save relu's output, once
            with scope("squared_relu_output"):
                activated = torch.pow(nn.functional.relu(hidden), 2)
        else:
            activated = nn.functional.gelu(label(hidden, "gelu_input"))
        return self.fc2(label(activated, "fc2_input"))        # (s, b, f/t) in


class TransformerLayer(nn.Module):
    """Layer norm, self-attention, dropout, residual; layer norm, MLP, dropout, residual."""

    def __init__(self, spec: LayerSpec, tp: TensorParallel):
        super().__init__()
        self.spec = spec
        self.norm1, self.norm2 = _norm(spec), _norm(spec)
        self.attention, self.mlp = SelfAttention(spec, tp), MLP(spec, tp)
        self.dropout1 = Dropout(spec.hidden_dropout, "attention_dropout_mask")
        self.dropout2 = Dropout(spec.hidden_dropout, "mlp_dropout_mask")

    def _forward(self, x, mask=None):
        label(x, "attention_layernorm_input")
        with scope("attention_norm_statistics"):
            normed = label(self.norm1(x), "qkv_input")
        x = label(x + self.dropout1(self.attention(normed, mask)), "mlp_layernorm_input")
        if self.spec.attention_core == "eager":    # Megatron's local spec: the norm a module of its own
            block, block_input = self.mlp, self._norm2(x)
        else:             # TE's spec: the norm fused into linear_fc1 (pre_mlp_layernorm an IdentityOp)
            block, block_input = self._norm_and_mlp, x
        if self.spec.recomputes("mlp"):       # keeps its input only: the norm's output, or x
            return x + self.dropout2(checkpoint(block, block_input, use_reentrant=True))
        return x + self.dropout2(block(block_input))

    def _norm2(self, x):
        with scope("mlp_norm_statistics"):
            return label(self.norm2(x), "fc1_input")

    def _norm_and_mlp(self, x):
        return self.mlp(self._norm2(x))

    def forward(self, x, mask=None):
        """mask: the dataloader's attention mask, which Megatron hands every layer (and its
        checkpoints save), or None."""
        if self.spec.recompute == "full":
            label(x, "layer_input_checkpoint")
            return checkpoint(self._forward, x, mask, use_reentrant=True)   # keeps x (and the mask) only
        return self._forward(x, mask)


def run_layers(layers, x, mask=None, offload=None):
    """A model chunk's layers, checkpointed as Megatron's TransformerBlock does under full
    recompute (_checkpointed_forward): 'uniform' checkpoints groups of N layers, each group
    keeping only its input; 'block' checkpoints the first N layers one by one and runs the
    rest whole. N = 1, uniform: every layer checkpointed alone (TransformerLayer.forward).
    ``offload``: CPU offloading's context around each layer and its commit after it
    (TransformerBlock.forward; actmem_validate.offload), where Megatron allows it (no recompute)."""
    if not layers:
        return x
    if offload is not None:
        for layer in layers:
            with offload.layer():
                x = layer(x, mask)
            x = offload.commit(x)
        return x
    spec = layers[0].spec
    if spec.recompute != "full" or (spec.recompute_method, spec.recompute_layers) == ("uniform", 1):
        for layer in layers:
            x = layer(x, mask)
        return x
    n = spec.recompute_layers
    if spec.recompute_method == "block":
        for index, layer in enumerate(layers):
            x = layer(x, mask) if index < n else layer._forward(x, mask)
        return x
    for start in range(0, len(layers), n):
        group = layers[start:start + n]
        label(x, "layer_input_checkpoint")
        x = checkpoint(_run_group, x, mask, *group, use_reentrant=True)   # keeps the group's input only
    return x


def _run_group(x, mask, *layers):
    for layer in layers:
        x = layer._forward(x, mask)
    return x


class Embedding(nn.Module):
    """Vocabulary-parallel word embedding + learned positions, then dropout; under SP the
    output is split along the sequence before the dropout (section 4.5: mask sbh/t)."""

    def __init__(self, vocab: int, spec: LayerSpec, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        kw = dict(dtype=spec.dtype, device=spec.device)
        self.vocab_start = tp.rank * (vocab // tp.size)
        self.words = nn.Parameter(torch.empty(vocab // tp.size, spec.hidden, **kw))
        nn.init.normal_(self.words, std=0.02)
        self.positions = None          # rope and none: no learned table
        if spec.position_embedding == "learned":
            rows = spec.seq_len if spec.position_rows is None else spec.position_rows   # Megatron's table
            self.positions = nn.Parameter(torch.empty(rows, spec.hidden, **kw))
            nn.init.normal_(self.positions, std=0.02)
        self.dropout = Dropout(spec.hidden_dropout, "embedding_dropout_mask")

    def forward(self, tokens):                                # tokens: (b, s)
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.words.shape[0])
        with scope("token_ids"):
            words = nn.functional.embedding(local.masked_fill(outside, 0), self.words)
            words = words.masked_fill(outside.unsqueeze(-1), 0)
        words = reduce_from_tensor_parallel_region(words, self.tp)
        if self.positions is not None:
            start = 0 if self.tp.context is None else self.tp.context.offset(tokens.shape[1])
            positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
            with scope("position_ids"):
                words = words + nn.functional.embedding(positions, self.positions)
        x = words.transpose(0, 1).contiguous()
        if self.tp.sequence_parallel:
            x = clone_scatter_output_in_embedding(scatter_to_sequence_parallel_region(x, self.tp))
        return self.dropout(x)                                # (s or s/t, b, h)


def clone_scatter_output_in_embedding(x):
    """The sequence scatter returns a view of the whole (s, b, h) tensor; with no dropout to
    copy it, the next layer would save that view and hold all s rows. Megatron-Core clones it
    (LanguageModelEmbedding.forward, config.clone_scatter_output_in_embedding, on by default),
    and so does the harness. (s/t, b, h)"""
    return x.clone()


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy over logits split across the vocabulary, as Megatron-Core's
    VocabParallelCrossEntropy computes it (tensor_parallel/cross_entropy.py): the fp32 copy
    of the logits is made inside the forward and every later step runs in place on it, so it
    is the one vocabulary-wide tensor, kept as the softmax (section 4.5: 4sbv/t) with the
    small target index tensors. The backward updates it in place into the fp32 gradient and
    returns that; autograd then copies it to the logits' 16-bit dtype (2sbv/t) while it is
    still live, which is the loss's transient (actmem.memory.terms.TRANSIENT_TERMS)."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, tp):
        logits = logits.float()                                           # (s, b, v/t) fp32
        logits -= all_reduce(logits.max(dim=-1, keepdim=True).values, tp, dist.ReduceOp.MAX)
        local = targets - vocab_start
        outside = (local < 0) | (local >= logits.shape[-1])
        local = local.masked_fill(outside, 0)
        picked = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        picked = all_reduce(picked, tp)
        torch.exp(logits, out=logits)
        total = all_reduce(logits.sum(dim=-1, keepdim=True), tp)
        softmax = label(logits.div_(total), "logits_fp32")
        ctx.save_for_backward(softmax, outside, local)
        return torch.log(total.squeeze(-1)) - picked

    @staticmethod
    def backward(ctx, grad):
        softmax, outside, local = ctx.saved_tensors
        grad_input = softmax                                              # in place, as Megatron
        hit = (~outside).to(grad_input.dtype)
        grad_input.scatter_add_(-1, local.unsqueeze(-1), -hit.unsqueeze(-1))
        return grad_input.mul_(grad.unsqueeze(-1)), None, None, None


class OutputHead(nn.Module):
    """Final layer norm, the output layer (the word embedding's weights, vocabulary-parallel)
    and the loss: on the first stage only when p = 1 (section 4.5)."""

    def __init__(self, embedding: Embedding, spec: LayerSpec, tp: TensorParallel):
        super().__init__()
        self.tp, self.embedding = tp, embedding
        self.norm = _norm(spec)
        self.weight = None if spec.tied_output else nn.Parameter(torch.empty_like(embedding.words).normal_(std=0.02))
        if spec.tied_output:             # Megatron zeroes the dummy wgrad of a shared embedding
            embedding.words.zero_out_wgrad = True

    def forward(self, x, targets):                            # targets: (b, s)
        label(x, "final_layernorm_input")
        with scope("final_norm_statistics"):
            x = label(self.norm(x), "output_layer_input")
        weight = self.embedding.words if self.weight is None else self.weight
        if self.tp.sequence_parallel and self.tp.size > 1:
            logits = linear(x, weight, None, self.tp, gather=True)   # keeps 2sbh/t
        else:
            logits = linear(copy_to_tensor_parallel_region(x, self.tp), weight, None, self.tp)
        with scope("cross_entropy_targets"):
            losses = _VocabParallelCrossEntropy.apply(logits, targets.t(), self.embedding.vocab_start, self.tp)
        return losses.mean()


def fp8_weights(stage: nn.Module) -> list:
    """The weights TE quantizes under FP8: the column- and row-parallel linears' of the layers that run in FP8
    (not those --first-last-layers-bf16 keeps in bf16; not the output layer's, Megatron's own
    ColumnParallelLinear, nor the embedding)."""
    return [m.weight for layer in stage.modules() if isinstance(layer, TransformerLayer) and layer.spec.fp8
            for m in layer.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


def fused_wgrad_weights(stage: nn.Module) -> list:
    """The weights whose gradients the harness's linear accumulates into main_grad, each
    with a dummy of its shape (layers.dummy_wgrad): the column- and row-parallel linears',
    and the output layer's (the word embedding's when tied)."""
    weights = [m.weight for m in stage.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    heads = [m for m in stage.modules() if isinstance(m, OutputHead)]
    return weights + [head.embedding.words if head.weight is None else head.weight for head in heads]
