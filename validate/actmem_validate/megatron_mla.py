"""Megatron-Core's own multi-latent attention, measured: megatron-core's MLASelfAttention (the
PyPI release this harness pins, 0.16.1) run forward on a CPU over real gloo ranks (tensor and
sequence parallelism), every tensor autograd saves recorded, and the MLA rows of actmem's table
(terms.py: qkv_input, MLA_TERMS, softmax_lse, projection_input) compared with them, rank by rank.

The layer's own code runs: its projections' wiring, the splits, the sequence-parallel gathers, the
contiguous copies and Megatron's fused YaRN rope Functions (fused_mla_yarn_rope_apply.py), which
allocate and save what they do; only their four Triton kernels, which need a GPU, are launched as
torch functions writing the same tensors in place. Transformer Engine's modules, which need a GPU, are
replaced in the layer spec by stand-ins that keep what TE's keep (TE at d0067d0, see each class):
TELinear, TEColumnParallelLinear, TELayerNormColumnParallelLinear, TERowParallelLinear and
DotProductAttention's fused (cuDNN) path, whose int64[2] RNG state a layer (16 B) the stand-in does not
keep (actmem leaves it out, and says so). The shims that let the layer run (``_cpu_shims``) make
or keep no tensor.

A saved tensor counts where its storage is still alive when the forward ends, once a storage; the
layer's parameters and buffers (the cached cos and sin) are model state, not counted. Each is named
by its dtype and shape, and where two rows share both (the q latent and its norm's output, q and
k) by the order the layer saves them (``_named``); any other is unnamed and fails the gate.
"""

from dataclasses import dataclass

from actmem.memory.techniques import Technique, run_technique
from actmem.model.architecture import Architecture
from actmem.model.recompute import NONE, Recompute, RecomputePolicy
from actmem.model.spec import Model, Run, Spec

MEGATRON_CORE = "0.16.1"


@dataclass(frozen=True)
class MLAConfig:
    """One layer of MLA and a SwiGLU MLP measured over ``world_size`` gloo ranks (t of them)."""

    spec: Spec
    technique: Technique

    @property
    def label(self) -> str:
        arch, run = self.spec.architecture, self.spec.run
        q = "q from h" if arch.q_lora_rank is None else f"q_r={arch.q_lora_rank}"
        policy = self.technique.policy
        recompute = (f" selective:{'+'.join(policy.ordered_modules)}"
                     if policy.granularity is Recompute.SELECTIVE else "")
        rope = "" if arch.rope_fusion else f" unfused {arch.rope_type or 'yarn'}"
        rope += f" fp8 {arch.fp8}" if arch.fp8 else ""
        return (f"mla {q} kv_r={arch.kv_lora_rank}{' norms' if arch.qk_norm else ''}{rope} t={run.tensor_parallel}"
                f"{' sp' if run.sequence_parallel else ''} b={run.micro_batch}{recompute}")

    @property
    def world_size(self) -> int:
        return self.spec.run.tensor_parallel


#: the FP8 layer's dims (h, q_r, kv_r, d_qk, d_rope, d_v, f): TE's FP8 GEMMs need every quantized width a multiple
#: of 16 (rules.py, _fp8_dims_fit; 32 under MXFP8, whose kv_r + d_rope too, so d_rope 32)
FP8_DIMS = {None: (32, 48, 16, 8, 8, 8, 64), "mxfp8": (32, 64, 32, 8, 32, 8, 64)}


def mla_spec(t: int = 1, q_rank: int | None = 18, norms: bool = True, sp: bool | None = None, b: int = 2,
             rope: str | None = None, fp8: str | None = None) -> Spec:
    """A small layer whose saved tensors' shapes are all distinct where they must be: h = 16, a = 4, s = 16,
    q_r = 18, kv_r = 12, d_qk = 6, d_rope = 4 (YaRN's kernel needs a multiple of 4), d_v = 10, f = 14.
    rope: None for the fused YaRN kernel, 'yarn' or 'rope' for the unfused rope of that type. ``fp8``: under that
    recipe, on a Hopper (MXFP8: a Blackwell), at FP8_DIMS (q_r is then theirs where given)."""
    h, q_r, kv_r, d_qk, d_rope, d_v, f = (16, q_rank, 12, 6, 4, 10, 14) if fp8 is None else \
        FP8_DIMS.get(fp8, FP8_DIMS[None])
    arch = Architecture(multi_latent_attention=True, q_lora_rank=q_r if q_rank else None, kv_lora_rank=kv_r,
                        qk_head_dim=d_qk, qk_pos_emb_head_dim=d_rope, v_head_dim=d_v, qk_norm=norms,
                        activation="swiglu", ffn_hidden=f,
                        bias=False, normalization="rmsnorm", attention_core="flash", position_embedding="rope",
                        attention_dropout=0.0, hidden_dropout=0.0, tied_output=False, rope_type=rope,
                        rope_fusion=rope is None, fp8_format=fp8 and "e4m3", fp8_recipe=fp8)
    run = Run(tensor_parallel=t, sequence_parallel=t > 1 if sp is None else sp, micro_batch=b)
    generation = "blackwell" if fp8 == "mxfp8" else "hopper"
    gpu = {"gpu_name": f"a {generation.capitalize()} GPU", "gpu_fp8": generation} if fp8 else {}
    return Spec(Model(heads=4, hidden=h, layers=1, vocab=64, seq_len=16), run, name="mla", architecture=arch, **gpu)


def mla_grid() -> list:
    """The paths MLA's layer takes: one rank, with q through its latent and the latents normalised
    (DeepSeek-V3's shape); t = 2 with SP (the up projections gather the latents, the rope key is gathered
    for the kv kernel); t = 2 without SP (the down projections see the whole sequence); q straight from
    the hidden state (--q-lora-rank unset: DeepSeek-V2-Lite) without the latent norms, at t = 2 with SP.
    Selective recompute: mla_up_proj, layernorm and mlp (Megatron's DeepSeek-V3 recipes) at t = 2 with SP;
    mla_up_proj alone on one rank; core_attn at t = 2 with SP, alone and beside mla_up_proj (whose discarded
    q, k and v the core's checkpoint saved); mla_up_proj with q from h (its checkpoint keeps the input norm's
    output as the q latent) beside layernorm. The unfused rope (--no-rope-fusion): YaRN on one rank, plain rope
    at t = 2 with SP, and YaRN beside the core's, the norm's and the MLP's recompute."""
    def selective(*modules):
        return RecomputePolicy(Recompute.SELECTIVE, frozenset(modules))

    layouts = ((mla_spec(), NONE), (mla_spec(t=2), NONE), (mla_spec(t=2, sp=False, b=1), NONE),
               (mla_spec(t=2, q_rank=None, norms=False), NONE),
               (mla_spec(t=2), selective("mla_up_proj", "layernorm", "mlp")), (mla_spec(), selective("mla_up_proj")),
               (mla_spec(t=2), selective("core_attn")), (mla_spec(t=2), selective("core_attn", "mla_up_proj")),
               (mla_spec(t=2, q_rank=None, norms=False), selective("mla_up_proj", "layernorm")),
               (mla_spec(rope="yarn"), NONE), (mla_spec(t=2, rope="rope"), NONE),
               (mla_spec(t=2, rope="yarn"), selective("core_attn", "layernorm", "mlp")),
               # FP8 (TE's linears' stand-ins keeping their inputs' one-byte copies): tensorwise at t = 2 with SP in
               # DeepSeek-V3's shape; delayed with q from h and no latent norms (the projection's quantized input);
               # mla_up_proj recomputed under both (its checkpoint keeps the 16-bit q latent, or the norm's output);
               # MXFP8 and blockwise on one rank
               (mla_spec(t=2, fp8="tensorwise"), NONE), (mla_spec(t=2, q_rank=None, norms=False, fp8="delayed"), NONE),
               (mla_spec(t=2, norms=False, fp8="tensorwise"), selective("mla_up_proj")),
               (mla_spec(t=2, fp8="tensorwise"), selective("mla_up_proj")),
               (mla_spec(t=2, q_rank=None, norms=False, fp8="delayed"), selective("mla_up_proj", "core_attn")),
               (mla_spec(fp8="mxfp8"), NONE), (mla_spec(norms=False, fp8="blockwise"), NONE),
               # ... with the input norm recomputed (layernorm): the down projections keep its 16-bit output,
               # which the checkpoint frees; without a q latent the q projection keeps its own copy
               (mla_spec(t=2, fp8="tensorwise"), selective("layernorm")),
               (mla_spec(t=2, q_rank=None, norms=False, fp8="tensorwise"), selective("layernorm")))
    return [MLAConfig(spec, run_technique(spec.run.sequence_parallel, policy)) for spec, policy in layouts]


def formula(spec: Spec, technique: Technique) -> dict:
    """{term: bytes} of the layer's rows on a rank (every row of one layer the table has)."""
    from actmem.memory import engine
    from actmem.memory.terms import layer_terms

    arch = spec.architecture
    bindings = spec.bindings_at(spec.run.tensor_parallel)
    rows = {term.name: engine.exact(engine.term_bytes(term, technique, arch), bindings) for term in layer_terms(arch)}
    if technique.recompute is Recompute.SELECTIVE and "core_attn" in technique.policy.modules:
        rows["core_attn_mask_type"] = 4           # a residual (compare.RESIDUALS), not a row of the table
    return {name: n for name, n in rows.items() if n}


def layer_saves(spec: Spec) -> list:
    """(dtype, shape, row) of what one layer of MLA and a SwiGLU MLP in TE's spec saves, in order (the rows a
    technique keeps are a subsequence); its input is named by its storage, not here."""
    arch, run = spec.architecture, spec.run
    if arch.fp8:
        return _fp8_layer_saves(spec)
    t, s, b, h = run.tensor_parallel, spec.model.seq_len, run.micro_batch, spec.model.hidden
    n, heads, f = (s // t if run.sequence_parallel else s), spec.model.heads // t, arch.ffn(h) // t
    qk = arch.qk_head_dim + arch.qk_pos_emb_head_dim
    return [
        ("float32", (n, b, 1), "attention_norm_statistics"), ("bfloat16", (n, b, h), "qkv_input"),
        ("bfloat16", (n, b, arch.q_lora_rank), "mla_q_latent"), ("float32", (n, b, 1), "mla_q_latent_statistics"),
        ("bfloat16", (n, b, arch.q_lora_rank), "mla_q_latent_normed"),
        ("bfloat16", (n, b, arch.kv_lora_rank), "mla_kv_latent"), ("float32", (n, b, 1), "mla_kv_latent_statistics"),
        ("bfloat16", (n, b, arch.kv_lora_rank), "mla_kv_latent_normed"),
        ("bfloat16", (n, b, arch.kv_lora_rank), "mla_kv_down_output"),        # the checkpoint's view of it
        ("bfloat16", (s, b, arch.qk_pos_emb_head_dim), "mla_rope_key_gathered"),
        # the unfused rope's cos_ and sin_, for q and again for k (rope_utils.py, _apply_rotary_pos_emb_bshd)
        *[("bfloat16", (s, 1, 1, arch.qk_pos_emb_head_dim), "rope_cos_sin")] * 4,
        ("bfloat16", (s, b, heads, qk), "mla_query"), ("bfloat16", (s, b, heads, qk), "mla_key"),
        ("bfloat16", (s, b, heads, arch.v_head_dim), "mla_value"), ("float32", (b, heads, s), "softmax_lse"),
        ("bfloat16", (s, b, heads * arch.v_head_dim), "projection_input"),
        ("bfloat16", (n, b, h), "mlp_layernorm_input"), ("float32", (n, b, 1), "mlp_norm_statistics"),
        ("bfloat16", (n, b, h), "fc1_input"), ("bfloat16", (s * b, 2 * f), "swiglu_input"),
        ("bfloat16", (s, b, f), "fc2_input")]


def _fp8_layer_saves(spec: Spec) -> list:
    """layer_saves under FP8 (actmem.model.fp8, TE 2.11): each linear's GEMM input as its one-byte copy and scales
    (an fp32 scale_inv [1], named after the row, or block scales, the row's *_scales): the q and kv linears on the
    norm's output a copy each, the latents (the fused norms' outputs under --qk-layernorm, whose inputs stay
    16-bit), the projection's input under delayed scaling, fc1's norm output and fc2's input; what the mla_up_proj
    checkpoint keeps, 16-bit."""
    arch, run = spec.architecture, spec.run
    t, s, b, h = run.tensor_parallel, spec.model.seq_len, run.micro_batch, spec.model.hidden
    n, heads, f = (s // t if run.sequence_parallel else s), spec.model.heads // t, arch.ffn(h) // t
    qk, q_r, kv_r = arch.qk_head_dim + arch.qk_pos_emb_head_dim, arch.q_lora_rank, arch.kv_lora_rank

    def quantized(shape, name, scales):
        rows, cols = 1, shape[-1]
        for size in shape[:-1]:
            rows *= size
        if arch.fp8 == "mxfp8":
            scale = ("uint8", (-(-(rows // 32) // 4) * 4, -(-cols // 128) * 128), scales)
        elif arch.fp8 == "blockwise":
            scale = ("float32", (-(-rows // 128), cols), scales)
        else:
            scale = ("float32", (1,), name)
        return [("float8_e4m3fn", shape, name), scale]

    def latent_saves(width, latent, normed, statistics):
        if not arch.qk_norm:
            return quantized((n, b, width), latent if latent != "mla_q_latent" else "mla_q_latent_fp8",
                             f"{latent}_scales")
        return [("bfloat16", (n, b, width), latent), ("float32", (n, b, 1), statistics),
                *quantized((n, b, width), normed, f"{latent}_scales")]

    return [
        ("float32", (n, b, 1), "attention_norm_statistics"),
        *quantized((n, b, h), "qkv_input_q_fp8", "qkv_input_q_scales"),
        *quantized((n, b, h), "qkv_input", "qkv_input_scales"),
        # the mla_up_proj checkpoint's 16-bit arguments
        ("bfloat16", (n, b, h), "mla_norm_output_checkpointed"),
        *([("bfloat16", (n, b, q_r), "mla_q_latent_checkpointed")] if q_r else []),
        ("bfloat16", (n, b, kv_r), "mla_kv_down_output"), ("bfloat16", (s, b, arch.qk_pos_emb_head_dim),
                                                          "mla_rope_key_gathered"),
        *(latent_saves(q_r, "mla_q_latent", "mla_q_latent_normed", "mla_q_latent_statistics") if q_r else []),
        *latent_saves(kv_r, "mla_kv_latent", "mla_kv_latent_normed", "mla_kv_latent_statistics"),
        ("bfloat16", (s, b, heads, qk), "mla_query"), ("bfloat16", (s, b, heads, qk), "mla_key"),
        ("bfloat16", (s, b, heads, arch.v_head_dim), "mla_value"), ("float32", (b, heads, s), "softmax_lse"),
        ("bfloat16", (s, b, heads * arch.v_head_dim), "projection_input"),
        *quantized((s, b, heads * arch.v_head_dim), "projection_input_fp8", "projection_input_scales"),
        ("bfloat16", (n, b, h), "mlp_layernorm_input"), ("float32", (n, b, 1), "mlp_norm_statistics"),
        *quantized((n, b, h), "fc1_input", "fc1_input_scales"), ("bfloat16", (s * b, 2 * f), "swiglu_input"),
        *quantized((s, b, f), "fc2_input", "fc2_input_scales")]


def _named(saved: list, spec: Spec, technique: Technique, x_key) -> dict:
    """{term: bytes} of the saved storages (key, dtype, shape, bytes) in the order saved: the layer's input
    by its storage, the rest by dtype and shape, in the order the technique's rows are saved."""
    kept = formula(spec, technique)
    order = {}
    for dtype, shape, name in layer_saves(spec) + [("int32", (1,), "core_attn_mask_type")]:
        if name in kept:
            order.setdefault((dtype, shape), []).append(name)
    named = {}
    for key, dtype, shape, n_bytes in saved:
        rows = order.get((dtype, shape))
        name = ("attention_layernorm_input" if key == x_key else rows.pop(0) if rows
                else f"unnamed {dtype} {list(shape)}")
        named[name] = named.get(name, 0) + n_bytes
    return named


def _stand_ins(fp8: str | None = None):
    """Transformer Engine's modules as the layer spec names them, each keeping what TE's keeps (module/
    linear.py, _Linear.forward: saved_inputmat = inputmat, the local shard under SP; module/
    layernorm_linear.py, _LayerNormLinear.forward: inputmat, ln_out (before SP's gather), mu, rsigma;
    base.py, prepare_forward: a non-contiguous input is copied contiguous first; dot_product_attention/
    backends.py, FusedAttnFunc: q, k, v, out and the fp32 softmax statistics, [b, a/t, s] here). Under the
    ``fp8`` recipe every linear keeps its GEMM input's one-byte copy and scales in place of the 16-bit input
    (the fused norm's output, ln_out, for the LayerNormLinear; the norm keeps its own input), unless told to
    save its original input (save_original_input); TE's FP8 weight copies are model state, not stood in for."""
    import torch
    from megatron.core.tensor_parallel.mappings import (_gather_along_first_dim, _reduce_scatter_along_first_dim,
                                                        reduce_from_tensor_model_parallel_region,
                                                        reduce_scatter_to_sequence_parallel_region)
    from megatron.core.utils import get_pg_size, get_tensor_model_parallel_group_if_none

    from actmem_validate.fused import Norm

    class _GatheredLinear(torch.autograd.Function):
        """y = gather(x)·Wᵀ, saving x as given (the local shard under SP) and re-gathering in backward; under
        ``quantize`` (FP8) x's one-byte copy and its scales in its place (_fp8_saved)."""

        @staticmethod
        def forward(ctx, x, weight, group, gather, quantize=False):
            ctx.save_for_backward(*(_fp8_saved(x, gather) if quantize else (x,)), weight)
            ctx.group, ctx.gather, ctx.quantize = group, gather, quantize
            total = _gather_along_first_dim(x, group) if gather else x
            return total @ weight.t()

        @staticmethod
        def backward(ctx, grad):
            saved = ctx.saved_tensors
            x, weight = (saved[0].to(grad.dtype) if ctx.quantize else saved[0]), saved[-1]
            total = _gather_along_first_dim(x, ctx.group) if ctx.gather else x
            grad_x = grad @ weight
            if ctx.gather:
                grad_x = _reduce_scatter_along_first_dim(grad_x, ctx.group)
            return grad_x, grad.flatten(0, -2).t() @ total.flatten(0, -2), None, None, None

    def _fp8_saved(x, gathered: bool) -> tuple:
        """What TE 2.11's linears keep of an FP8 GEMM's input (actmem.model.fp8): its one-byte copy (rowwise, the
        rank's shard, where a column-parallel linear gathers it under SP; else columnwise: the same bytes) and
        its fp32 scale_inv [1], or under a block recipe its block scales (COMPACT where gathered)."""
        from actmem_validate.layers import block_scales

        scales = (torch.ones(1, dtype=torch.float32) if fp8 not in ("mxfp8", "blockwise")
                  else block_scales(x.numel() // x.shape[-1], x.shape[-1], fp8, compact=gathered, device=x.device))
        return x.to(torch.float8_e4m3fn), scales

    class TELinear(torch.nn.Module):
        """TE's Linear: 'duplicated' (the down projections: whole weight, no communication), 'column'
        (split output, the input gathered under SP) or 'row' (split input, the output reduced)."""

        def __init__(self, input_size, output_size, *, config, parallel_mode="duplicated", tp_group=None,
                     input_is_parallel=False, **kwargs):
            super().__init__()
            if parallel_mode != "duplicated":     # Megatron's TE wrappers take the model's group where given none
                tp_group = get_tensor_model_parallel_group_if_none(tp_group)
            t = 1 if parallel_mode == "duplicated" else get_pg_size(tp_group)
            rows, cols = (output_size // t, input_size) if parallel_mode != "row" else (output_size, input_size // t)
            self.weight = torch.nn.Parameter(torch.randn(rows, cols, dtype=torch.bfloat16) * 0.02)
            self.parallel_mode, self.tp_group, self.t = parallel_mode, tp_group, t
            self.sequence_parallel = config.sequence_parallel and t > 1
            self.save_original_input = False       # Megatron's set_save_original_input (see _rank)

        def forward(self, x):
            x = x.contiguous()                                  # prepare_forward
            out = _GatheredLinear.apply(x, self.weight, self.tp_group,
                                        self.parallel_mode == "column" and self.sequence_parallel,
                                        fp8 is not None and not self.save_original_input)
            if self.parallel_mode == "row" and self.t > 1:
                out = (reduce_scatter_to_sequence_parallel_region(out, group=self.tp_group) if self.sequence_parallel
                       else reduce_from_tensor_model_parallel_region(out, group=self.tp_group))
            return out, None

    class TEColumnParallelLinear(TELinear):
        def __init__(self, input_size, output_size, *, config, tp_group=None, **kwargs):
            super().__init__(input_size, output_size, config=config, parallel_mode="column", tp_group=tp_group)

    class TERowParallelLinear(TELinear):
        def __init__(self, input_size, output_size, *, config, tp_group=None, **kwargs):
            super().__init__(input_size, output_size, config=config, parallel_mode="row", tp_group=tp_group)

    class TELayerNormColumnParallelLinear(TEColumnParallelLinear):
        """The norm fused before the column-parallel GEMM: the norm keeps its (contiguous) input and
        rsigma (fused.Norm), the GEMM its output, ln_out."""

        def __init__(self, input_size, output_size, *, config, tp_group=None, **kwargs):
            super().__init__(input_size, output_size, config=config, tp_group=tp_group)
            self.norm = Norm(input_size, config.normalization.lower(), dtype=torch.bfloat16)

        def forward(self, x):
            return super().forward(self.norm(x.contiguous()))

    class TENorm(torch.nn.Module):
        """TE's RMSNorm (ops/basic/rmsnorm.py): keeps its (contiguous) input and fp32 rsigma (fused.Norm)."""

        def __init__(self, config, hidden_size, eps=1e-5, **kwargs):
            super().__init__()
            self.norm = Norm(hidden_size, config.normalization.lower(), dtype=torch.bfloat16)

        def forward(self, x):
            return self.norm(x.contiguous())

    class _FusedAttention(torch.autograd.Function):
        """Causal attention saving q, k, v, out and the fp32 log-sum-exp, as TE's FusedAttnFunc does; q and
        k (s, b, n, d_qk), v (s, b, n, d_v) -> out (s, b, n·d_v). The math runs in fp32 outside autograd."""

        @staticmethod
        def forward(ctx, q, k, v, scale):
            s, b, n, _ = q.shape
            scores = torch.einsum("sbnd,tbnd->bnst", q.float(), k.float()) * scale
            scores.masked_fill_(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
            lse = torch.logsumexp(scores, dim=-1)                                  # (b, n, s) fp32
            out = torch.einsum("bnst,tbnd->sbnd", (scores - lse[..., None]).exp(), v.float())
            out = out.to(q.dtype).reshape(s, b, -1)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.scale = scale
            return out

        @staticmethod
        def backward(ctx, grad):
            q, k, v, out, lse = ctx.saved_tensors
            s, b, n, _ = q.shape
            scores = torch.einsum("sbnd,tbnd->bnst", q.float(), k.float()) * ctx.scale
            scores.masked_fill_(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
            probs = (scores - lse[..., None]).exp()
            grad = grad.float().view(s, b, n, -1)
            grad_v = torch.einsum("bnst,sbnd->tbnd", probs, grad)
            grad_p = torch.einsum("sbnd,tbnd->bnst", grad, v.float())
            grad_s = probs * (grad_p - (grad_p * probs).sum(-1, keepdim=True)) * ctx.scale
            grad_q = torch.einsum("bnst,tbnd->sbnd", grad_s, k.float())
            grad_k = torch.einsum("bnst,sbnd->tbnd", grad_s, q.float())
            return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None

    class TEDotProductAttention(torch.nn.Module):
        def __init__(self, *, config, softmax_scale=None, k_channels=None, **kwargs):
            super().__init__()
            # (the Attention base class builds one first, unscaled; MLA's own replaces it)
            self.scale = softmax_scale if softmax_scale is not None else 1.0

        def forward(self, query, key, value, attention_mask, **kwargs):
            return _FusedAttention.apply(query, key, value, self.scale)

    return dict(linear=TELinear, column=TEColumnParallelLinear, row=TERowParallelLinear,
                layernorm_column=TELayerNormColumnParallelLinear, core=TEDotProductAttention, norm=TENorm)


class _Kernel:
    """A Triton kernel's launch, ``kernel[grid](*args)``, done by a torch function on the CPU."""

    def __init__(self, run):
        self.run = run

    def __getitem__(self, grid):
        return self.run


def _rotated(x, cos, sin, batch: int, inverse: bool = False):
    """x (T, n, d) rotated by the cached cos and sin ([s, 1, 1, d]) of its token's position, T = s·b in
    sbhd order (rotate-half; the fused kernel's layout of the values does not change a byte)."""
    import torch

    position = torch.arange(x.shape[0]) // batch
    cos, sin = cos.view(cos.shape[0], -1)[position, None, :], sin.view(sin.shape[0], -1)[position, None, :]
    first, second = x.chunk(2, dim=-1)
    half = torch.cat((-second, first), dim=-1)
    return x * cos - half * sin if inverse else x * cos + half * sin


def _rope_q(q, cos, sin, qk_dim, emb_dim, heads, batch, *rest):
    q[..., qk_dim:] = _rotated(q[..., qk_dim:], cos, sin, batch)


def _rope_q_backward(grad, cos, sin, qk_dim, emb_dim, heads, batch, *rest):
    grad[..., qk_dim:] = _rotated(grad[..., qk_dim:], cos, sin, batch, inverse=True)


def _rope_kv(kv, k_pos_emb, key, value, cos, sin, emb_dim, k_dim, v_dim, heads, batch, *rest):
    key[..., :k_dim] = kv[..., :k_dim]
    key[..., k_dim:] = _rotated(k_pos_emb.view(-1, 1, emb_dim), cos, sin, batch)
    value.copy_(kv[..., k_dim:])


def _rope_kv_backward(d_key, d_value, d_kv, d_emb, cos, sin, emb_dim, k_dim, v_dim, heads, batch, *rest):
    d_kv[..., :k_dim] = d_key[..., :k_dim]
    d_kv[..., k_dim:] = d_value
    d_emb.copy_(_rotated(d_key[..., k_dim:], cos, sin, batch, inverse=True).sum(1, keepdim=True))


def _cpu_shims(stand_ins: dict) -> None:
    """What lets megatron-core 0.16.1's MLA layer run on a CPU; none makes or keeps a tensor.
    - multi_latent_attention.TELinear: the module chooses the down projections' 'duplicated' mode by
      comparing the spec's class with TE's TELinear (None where TE does not import): the stand-in's;
    - torch.cuda.current_device: the rotary embedding places its frequencies on the GPU: here the CPU;
    - the fused YaRN rope's four Triton kernels, which need a GPU: each launch done by torch on the
      tensors the Functions (ApplyMLARotaryEmbQ, ApplyMLARotaryEmbKV) allocated, writing them in place
      as the kernels do; the Functions themselves, what they allocate and save, run as they are;
    - the CUDA RNG tracker and state, which Megatron forks around dropout under SP and copies onto the
      recompute checkpoints' contexts (tensor_parallel/random.py: not saved tensors): a tracker whose
      fork does nothing and no CUDA state, a CPU having none (every dropout here is 0);
    - Transformer Engine's FP8 state, which the recompute checkpoints ask: FP8 off, its contexts no-ops."""
    import torch
    from megatron.core.fusions import fused_mla_yarn_rope_apply as rope
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.TELinear = stand_ins["linear"]
    torch.cuda.current_device = lambda: "cpu"
    rope.rotary_fwd_q_kernel, rope.rotary_bwd_q_kernel = _Kernel(_rope_q), _Kernel(_rope_q_backward)
    rope.rotary_fwd_kv_kernel, rope.rotary_bwd_kv_kernel = _Kernel(_rope_kv), _Kernel(_rope_kv_backward)
    multi_latent_attention.fused_apply_mla_rope_for_q = rope.fused_apply_mla_rope_for_q
    multi_latent_attention.fused_apply_mla_rope_for_kv = rope.fused_apply_mla_rope_for_kv
    rng_shims()


def rng_shims() -> None:
    """The CUDA RNG tracker and state, and TE's FP8 state, as Megatron's recompute checkpoints and dropout
    forks ask them (tensor_parallel/random.py), on a CPU (see _cpu_shims); none makes or keeps a tensor."""
    import contextlib

    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random

    class _Tracker:
        def fork(self, *args, **kwargs):
            return contextlib.nullcontext()

        def get_states(self):
            return {}

        def set_states(self, states):
            pass

    class _NoFP8:
        @staticmethod
        def is_fp8_enabled():
            return False

    tracker = _Tracker()
    tensor_parallel.get_cuda_rng_tracker = random.get_cuda_rng_tracker = lambda *args, **kwargs: tracker
    random._get_cuda_rng_state = random._set_cuda_rng_state = lambda *args, **kwargs: None
    # CheckpointWithoutOutput(fp8=False) sets self.fp8 = fp8 is not None, True, and asks TE's FP8 state
    # (random.py, CheckpointWithoutOutputFunction.forward), which does not import here: FP8 off, and TE's
    # activation_recompute_forward and fp8_autocast, which with FP8 off keep nothing, as no-op contexts
    random.FP8GlobalStateManager = _NoFP8
    random.activation_recompute_forward = random.fp8_autocast = lambda *args, **kwargs: contextlib.nullcontext()


def config_for(spec: Spec, technique: Technique, **extra):
    """megatron-core's MLATransformerConfig of this spec and technique."""
    import torch
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    arch, run, model = spec.architecture, spec.run, spec.model
    from actmem_validate.gloo import recompute_settings

    recompute = recompute_settings(technique)
    return MLATransformerConfig(
        num_layers=1, hidden_size=model.hidden, num_attention_heads=model.heads, ffn_hidden_size=arch.ffn(model.hidden),
        multi_latent_attention=True, q_lora_rank=arch.q_lora_rank, kv_lora_rank=arch.kv_lora_rank,
        qk_head_dim=arch.qk_head_dim, qk_pos_emb_head_dim=arch.qk_pos_emb_head_dim, v_head_dim=arch.v_head_dim,
        rope_type=arch.rope_type or "yarn", rotary_scaling_factor=40, qk_layernorm=arch.qk_norm, normalization="RMSNorm",
        add_bias_linear=False, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        bias_activation_fusion=True, attention_dropout=0.0, hidden_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        use_cpu_initialization=True, tensor_model_parallel_size=run.tensor_parallel,
        sequence_parallel=run.sequence_parallel, apply_rope_fusion=arch.rope_fusion, **recompute, **extra)


def layer_spec(arch, stand_ins: dict):
    """TE's layer spec for MLA and a dense MLP (gpt_layer_specs.py, get_gpt_layer_with_transformer_engine_spec,
    multi_latent_attention=True: input_layernorm a TENorm, pre_mlp_layernorm an IdentityOp, the MLP's norm
    fused into linear_fc1), its TE modules the stand-ins."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    up = stand_ins["layernorm_column"] if arch.qk_norm else stand_ins["column"]
    attention = ModuleSpec(module=MLASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                           submodules=MLASelfAttentionSubmodules(
                               linear_q_proj=stand_ins["column"], linear_q_down_proj=stand_ins["linear"],
                               linear_q_up_proj=up, linear_kv_down_proj=stand_ins["linear"], linear_kv_up_proj=up,
                               core_attention=stand_ins["core"], linear_proj=stand_ins["row"],
                               q_layernorm=IdentityOp, kv_layernorm=IdentityOp))
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=stand_ins["norm"], self_attention=attention, self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=IdentityOp, mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(
            linear_fc1=stand_ins["layernorm_column"], linear_fc2=stand_ins["row"])), mlp_bda=get_bias_dropout_add))


def _rank(rank: int, world: int, port: int, config: MLAConfig, results) -> None:
    """One rank: build the layer, run it forward recording what autograd saves, then backward."""
    import torch

    from actmem_validate.gloo import held_storages, rank_group, recorder, rerun_moments

    spec, run = config.spec, config.spec.run
    stand_ins = _stand_ins(spec.architecture.fp8)
    with rank_group(rank, world, port, lambda: _cpu_shims(stand_ins), run.tensor_parallel):
        from megatron.core.transformer.spec_utils import build_module

        torch.manual_seed(0)
        layer = build_module(layer_spec(spec.architecture, stand_ins), config=config_for(spec, config.technique),
                             layer_number=1)
        # Megatron hands the projection save_original_input under every FP8 recipe but delayed
        # (multi_latent_attention.py, __init__; it asks TE's version, which does not import here)
        layer.self_attention.linear_proj.save_original_input = spec.architecture.fp8 not in (None, "delayed")
        if spec.architecture.fp8 and "layernorm" in config.technique.modules:
            # as transformer_layer.py's __init__ does under FP8 (built here without it): Megatron's own choice of
            # the linears that then keep the norm's 16-bit output, set_save_original_input on the stand-ins
            layer.self_attention.set_for_recompute_input_layernorm()
        torch.manual_seed(1 + rank)
        rows = spec.model.seq_len // (run.tensor_parallel if run.sequence_parallel else 1)
        x = torch.randn(rows, run.micro_batch, spec.model.hidden, dtype=torch.bfloat16, requires_grad=True)
        saved, pack = recorder()
        # (patched before the forward: the checkpoints register their rerun as a bound hook there)
        with rerun_moments(layer, saved, {}) as moments:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                out, _ = layer(hidden_states=x, attention_mask=None)
            named = _named(held_storages(saved, layer), spec, config.technique, x.untyped_storage().data_ptr())
            out.float().sum().backward()
        results.put((rank, named, moments))


def measure(config: MLAConfig) -> list[tuple]:
    """(rank, {term: bytes saved}, {rerun: bytes held as it ends}) of every rank of one configuration."""
    from actmem_validate.gloo import spawn

    return spawn(_rank, config)


def rows(configs) -> list[dict]:
    """The error table's rows of every rank of every configuration: compare.term_rows, then compare.rerun_rows."""
    from actmem.memory.terms import layer_terms
    from actmem_validate.compare import rerun_rows, term_rows
    from actmem_validate.gloo import spawn_each

    table, measured = [], spawn_each(_rank, configs)
    for config in configs:
        spec, technique = config.spec, config.technique
        expected = formula(spec, technique)
        layer = layer_terms(spec.architecture)
        for rank, named, moments in measured[config]:
            table += term_rows(config, rank, expected, named)
            table += rerun_rows(config, rank, technique, spec.architecture, expected, layer,
                                spec.bindings_at(spec.run.tensor_parallel), moments)
    return table
