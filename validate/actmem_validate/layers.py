"""Megatron's tensor-parallel building blocks, saving what Megatron's save.

Shapes: activations are [s, b, h] (or [s/t, b, h] in the sequence-parallel region).
"""

import math
from dataclasses import dataclass

import torch
from torch import nn

from actmem_validate.ledger import label
from actmem_validate.mappings import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region, \
    reduce_scatter_to_sequence_parallel_region
from actmem_validate.parallel import TensorParallel, all_gather, all_reduce, reduce_scatter
from actmem_validate.torch_compat import fake_shortcut, storage_key


class _LinearWithGradAccumulation(torch.autograd.Function):
    """y = x·Wᵀ + b as Megatron's LinearWithGradAccumulationAndAsyncCommunication runs it.

    Under SP (gather=True) x is the local sequence shard: it is all-gathered for the GEMM and
    again in backward, and only the shard is saved (2sbh/t; saving the gathered input would
    hold t times more). With gradient accumulation fusion (Megatron's default where its CUDA
    extension is built; TE's fuse_wgrad_accumulation) the weight gradient is accumulated
    straight into the fp32 ``weight.main_grad`` (wgrad_gemm_accum_fp32), and what backward
    returns for the weight is TE's cached dummy of its shape (``dummy_wgrad``), which DDP's
    hook drops; without a main_grad (the correctness check) the gradient is returned.
    The main_grad is looked up on the parameter kept in ctx: under saved_tensors_hooks (the
    ledger's) ctx.saved_tensors returns a new tensor for a saved leaf, which has no main_grad,
    and the harness would compute a 16-bit weight gradient, which Megatron's fused wgrad does
    not (it did until a GPU's allocator trace showed one live at 530B's peak, 400 MiB)."""

    @staticmethod
    def forward(ctx, x, weight, bias, tp, gather, fp8=None):
        ctx.tp, ctx.gather, ctx.has_bias, ctx.fp8 = tp, gather, bias is not None, fp8
        if fp8 is None:
            ctx.save_for_backward(x, weight)
        else:
            ctx.save_for_backward(*fp8_copy(x, fp8), weight)
        ctx.parameter = weight         # saved_tensors hands back a new tensor, without main_grad
        total = all_gather(x, tp) if gather else x         # (s, b, h): a transient
        out = _matmul(total, weight.t())
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, grad):
        x, weight = _saved_input(ctx)
        total = all_gather(x, ctx.tp) if ctx.gather else x  # re-gathered, not stored
        if getattr(ctx.parameter, "unfused_wgrad", False):
            return _unfused_backward(ctx, grad, weight, total)
        grad_input = _matmul(grad, weight)
        if ctx.gather:
            grad_input = reduce_scatter(grad_input, ctx.tp)  # (s/t, b, h)
        grad_weight = accumulate_weight_gradient(ctx.parameter, grad.flatten(0, -2), total.flatten(0, -2))
        if grad_weight is None:                # accumulated into main_grad: hand autograd the dummy
            grad_weight = dummy_wgrad(ctx.parameter)
        grad_bias = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None


def _matmul(a, b):
    """a @ b, b a matrix. A fake run with a contiguous a: the product's storage only, what matmul makes there (it
    folds a into rows as a view, one mm, then _unsafe_view): those dispatches, one past fake mode's cache, cost
    about 1 ms a GEMM more than an empty's."""
    if fake_shortcut(a) and a.is_contiguous():
        if a.shape[-1] != b.shape[0] or a.dtype != b.dtype:
            raise RuntimeError(f"mm of {tuple(a.shape)} {a.dtype} and {tuple(b.shape)} {b.dtype}")
        return torch.empty(*a.shape[:-1], b.shape[-1], dtype=a.dtype, device=a.device)
    return a @ b


@dataclass(frozen=True)
class Fp8Save:
    """Transformer Engine's FP8 linear's save (TE 2.11; actmem.model.fp8), stood in for on a CPU: the input
    quantized, one byte an element (float8_e4m3fn here; rowwise, or on Hopper its transpose: the same bytes),
    named ``term``, with its fp32 scale_inv [1], and not the 16-bit input; under a block-scaled recipe its block
    scales instead (block_scales), named ``term`` + "_scales". TE's FP8 GEMMs need a GPU; this keeps what TE's
    keeps, read off its source, and runs its arithmetic in 16 bits."""

    term: str
    recipe: str = "delayed"
    compact: bool = False
    """blockwise: the gatherable COMPACT scale layout (a column-parallel linear's input under SP)."""


def fp8_copy(x, fp8: Fp8Save):
    """(the quantized copy, its scale_inv or block scales)."""
    quantized = label(x.detach().to(torch.float8_e4m3fn), fp8.term)
    if fp8.recipe not in ("mxfp8", "blockwise"):
        return quantized, label(torch.ones(1, dtype=torch.float32, device=x.device), fp8.term)
    rows, cols = x.numel() // x.shape[-1], x.shape[-1]
    return quantized, label(block_scales(rows, cols, fp8.recipe, fp8.compact, x.device), fp8.term + "_scales")


def _up(x: int, n: int) -> int:
    return -(-x // n) * n


def block_scales(rows: int, cols: int, recipe: str, compact: bool, device) -> torch.Tensor:
    """A [rows, cols] tensor's columnwise block scales (TE 2.11, quantizer.cpp, get_scale_shape): MXFP8's E8M0
    [roundup(rows/32, 4), roundup(cols, 128)]; blockwise's fp32 [ceil(rows/128), cols] (COMPACT) or
    [ceil(rows/128), roundup(cols, 4)] (GEMM_READY)."""
    if recipe == "mxfp8":
        return torch.empty(_up(rows // 32, 4), _up(cols, 128), dtype=torch.uint8, device=device)
    return torch.ones(-(-rows // 128), cols if compact else _up(cols, 4), dtype=torch.float32, device=device)


def _saved_input(ctx):
    """(the input in 16 bits, the weight) from what the forward saved: the input, or its FP8 copy."""
    saved = ctx.saved_tensors
    if ctx.fp8 is None:
        return saved
    quantized, scales, weight = saved            # the stand-in's arithmetic: a per-tensor scale, or none
    return quantized.to(weight.dtype) * (scales.to(weight.dtype) if scales.numel() == 1 else 1), weight


def _unfused_backward(ctx, grad, weight, total):
    """Without gradient accumulation fusion (--no-gradient-accumulation-fusion), in TE's order
    (linear.py, _Linear backward): the input gradient, its reduce-scatter launched (under SP),
    then the weight gradient, a 16-bit tensor of the weight's shape (the wgrad GEMM with no
    out), made while both of them and the gathered input are live; autograd hands it to DDP's
    hook, which adds it to main_grad and drops it (attach_main_grads)."""
    full = _matmul(grad, weight)
    grad_input = reduce_scatter(full, ctx.tp) if ctx.gather else full
    grad_weight = grad.flatten(0, -2).t() @ total.flatten(0, -2)
    del full
    grad_bias = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
    return grad_input, grad_weight, grad_bias, None, None, None


def accumulate_weight_gradient(weight, grad_2d, input_2d):
    """gradᵀ·input into weight.main_grad (fp32, in place) when it has one; else returned.
    A 16-bit GEMM that accumulates into fp32 is aten's addmm.dtype_out: CUDA and fake tensors
    have it (with no transient: measured on an H100, torch 2.11); a CPU has none, so there the
    16-bit product is made and added, a transient of one weight's size."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        return grad_2d.t() @ input_2d
    kind = (type(main_grad), main_grad.device.type, grad_2d.dtype)
    if _FP32_ACCUMULATING_GEMM.get(kind) and fake_shortcut(main_grad):
        # a fake run, the GEMM known to accumulate in place: it allocates nothing, and its out= dispatch is one of
        # fake mode's dearest (about 2 ms, past its cache); its shapes are checked instead
        if main_grad.shape != (grad_2d.shape[-1], input_2d.shape[-1]) or grad_2d.shape[0] != input_2d.shape[0]:
            raise RuntimeError(f"weight gradient {tuple(grad_2d.shape)}ᵀ·{tuple(input_2d.shape)} does not fit "
                               f"main_grad {tuple(main_grad.shape)}")
        return None
    if _FP32_ACCUMULATING_GEMM.get(kind, True):
        try:
            torch.addmm(main_grad, grad_2d.t(), input_2d, out_dtype=torch.float32, out=main_grad)
            _FP32_ACCUMULATING_GEMM[kind] = True
            return None
        except (NotImplementedError, RuntimeError, TypeError):    # TypeError: torch 2.11's fake kernel
            if kind in _FP32_ACCUMULATING_GEMM:        # it ran before: a real error, not a missing kernel
                raise
            _FP32_ACCUMULATING_GEMM[kind] = False
    main_grad.add_(grad_2d.t() @ input_2d)
    return None


_FP32_ACCUMULATING_GEMM: dict = {}
"""Whether addmm.dtype_out runs for (tensor type, device, dtype): tried once, on the first
weight gradient of that kind; afterwards only an error where it once ran is raised."""


def attach_main_grads(module: nn.Module) -> torch.Tensor:
    """Megatron's DDP gradient buffer: one zeroed fp32 buffer for the module's parameters,
    allocated once before the step (param_and_grad_buffer.py), each parameter's main_grad a
    view into it. The linears accumulate into it directly; the parameters whose gradients
    autograd materialises in 16 bits (norms, biases, the embedding) add them in through a
    hook and drop them, as DDP's does (param.main_grad.add_(param.grad); param.grad = None).
    Returns the buffer."""
    params = [param for param in module.parameters() if param.requires_grad]
    first = params[0]
    buffer = torch.zeros(sum(param.numel() for param in params), dtype=torch.float32, device=first.device)
    offset = 0
    for param in params:
        if not hasattr(param, "main_grad"):            # attached again after free_main_grads
            param.register_post_accumulate_grad_hook(_add_to_main_grad)
        param.main_grad = buffer[offset:offset + param.numel()].view(param.shape)
        offset += param.numel()
    return buffer


def free_main_grads(module: nn.Module) -> None:
    """Release the buffer attach_main_grads made (its views are its only references); the
    hooks stay, for the next attach_main_grads."""
    for param in module.parameters():
        if hasattr(param, "main_grad"):
            param.main_grad = None


def _add_to_main_grad(param: torch.Tensor) -> None:
    """DDP's hook: add autograd's gradient in and drop it; a linear that accumulated into
    main_grad itself handed autograd a dummy, which is only dropped."""
    dummies = {storage_key(dummy) for dummy in _DUMMY_WGRADS.values()}
    if param.grad is not None and storage_key(param.grad) not in dummies and not fake_shortcut(param.grad):
        param.main_grad.add_(param.grad)          # in place (a fake run skips it: it allocates nothing)
    param.grad = None


_DUMMY_WGRADS: dict = {}
_FP8_STATE: list = []


def make_fp8_state(weights, recipe: str | None, generation: str | None, history: int) -> None:
    """TE's FP8 weight state (actmem.model.fp8), made by an iteration's first microbatch and kept: each
    weight quantized into its workspace (base.py, get_weight_workspace), one byte an element, and on Hopper
    its transpose; its fp32 scale_inv [1]; under delayed scaling each module's fp32 scales and amax history,
    [history, 3] forward and [history, 2] backward (quantization.py, DelayedScalingRecipeState); under
    tensorwise each of its 5 quantizers' fp32 scale and amax, [1] each (Float8CurrentScalingQuantizer). None: clear."""
    _FP8_STATE.clear()
    if recipe is None:
        return
    for weight in weights:
        kw = dict(device=weight.device)
        if recipe in ("mxfp8", "blockwise"):        # rowwise and columnwise copies, each with its block scales
            rows, cols = weight.shape
            _FP8_STATE.extend(torch.empty(weight.shape, dtype=torch.float8_e4m3fn, **kw) for _ in range(2))
            if recipe == "mxfp8":
                _FP8_STATE.extend((torch.empty(_up(rows, 128), _up(cols // 32, 4), dtype=torch.uint8, **kw),
                                   torch.empty(_up(rows // 32, 4), _up(cols, 128), dtype=torch.uint8, **kw)))
            else:                                    # 128x128 blocks, fp32, of the weight and its transpose
                _FP8_STATE.extend((torch.ones(-(-rows // 128), _up(-(-cols // 128), 4), **kw),
                                   torch.ones(-(-cols // 128), _up(-(-rows // 128), 4), **kw)))
            continue
        _FP8_STATE.append(torch.empty(weight.shape, dtype=torch.float8_e4m3fn, **kw))
        if generation == "hopper":
            _FP8_STATE.append(torch.empty(tuple(reversed(weight.shape)), dtype=torch.float8_e4m3fn, **kw))
        _FP8_STATE.append(torch.ones(1, dtype=torch.float32, **kw))
        if recipe == "delayed":
            for quantizers in (3, 2):
                _FP8_STATE.extend((torch.ones(quantizers, dtype=torch.float32, **kw),
                                   torch.zeros(history, quantizers, dtype=torch.float32, **kw)))
        else:
            _FP8_STATE.extend(torch.ones(1, dtype=torch.float32, **kw) for _ in range(2 * 5))


def dummy_wgrad(weight: torch.Tensor) -> torch.Tensor:
    """TE's get_dummy_wgrad (transformer_engine/pytorch/module/base.py; Megatron's own
    ColumnParallelLinear takes it from TE): under Megatron's DDP a linear with fused wgrad
    accumulation returns an uncomputed 16-bit tensor of its weight's shape, so that DDP's
    hooks run on the main backward thread; one is cached per (shape, dtype) for the process
    and handed out detached (AccumulateGrad takes it over as .grad, without a copy). A weight
    marked zero_out_wgrad (the word embedding tied to the output layer, as Megatron marks
    it) gets it zeroed, since autograd adds the embedding's real gradient to it."""
    key = (tuple(weight.shape), weight.dtype, weight.device)
    if key not in _DUMMY_WGRADS:
        _DUMMY_WGRADS[key] = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    if getattr(weight, "zero_out_wgrad", False):
        _DUMMY_WGRADS[key].zero_()
    return _DUMMY_WGRADS[key].detach()


def make_dummy_wgrads(weights) -> None:
    """A new cache, made now for these weights: from the second iteration on, a run holds
    every dummy before its step starts (the harness measures one step, and makes them
    inside it so that its peak, like Megatron's, holds them)."""
    _DUMMY_WGRADS.clear()
    for weight in weights:
        dummy_wgrad(weight)



def linear(x, weight, bias, tp: TensorParallel, gather: bool = False, fp8: Fp8Save | None = None):
    """The one linear of the harness (see _LinearWithGradAccumulation); ``fp8``: TE's FP8 save."""
    return _LinearWithGradAccumulation.apply(x, weight, bias, tp, gather, fp8)


class ColumnParallelLinear(nn.Module):
    """Weight split along its output dim; the input is replicated (TP) or sequence-split (SP)."""

    def __init__(self, in_features, out_features, tp: TensorParallel, bias=True, dtype=None, device=None,
                 fp8: Fp8Save | None = None):
        super().__init__()
        self.tp, self.fp8 = tp, fp8
        kw = dict(dtype=dtype, device=device)
        self.weight = nn.Parameter(torch.empty(out_features // tp.size, in_features, **kw))
        self.bias = nn.Parameter(torch.zeros(out_features // tp.size, **kw)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        if self.tp.sequence_parallel and self.tp.size > 1:
            return linear(x, self.weight, self.bias, self.tp, gather=True, fp8=self.fp8)
        x = copy_to_tensor_parallel_region(x, self.tp)
        return linear(x, self.weight, self.bias, self.tp, fp8=self.fp8)        # saves x: 2sbh


class RowParallelLinear(nn.Module):
    """Weight split along its input dim; the partial outputs are summed: all-reduce under TP,
    reduce-scatter into the sequence-parallel region under SP. The bias is replicated and
    added after the reduction."""

    def __init__(self, in_features, out_features, tp: TensorParallel, bias=True, dtype=None, device=None,
                 fp8: Fp8Save | None = None):
        super().__init__()
        self.tp, self.fp8 = tp, fp8
        kw = dict(dtype=dtype, device=device)
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp.size, **kw))
        self.bias = nn.Parameter(torch.zeros(out_features, **kw)) if bias else None
        if bias:
            self.bias.sequence_parallel = True        # replicated; grads all-reduced under SP
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        partial = linear(x, self.weight, None, self.tp, fp8=self.fp8)            # saves x: 2sbh/t
        if self.tp.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(partial, self.tp)
        else:
            out = reduce_from_tensor_parallel_region(partial, self.tp)
        return out if self.bias is None else out + self.bias


class _Dropout(torch.autograd.Function):
    """Dropout as CUDA's fused kernel runs it: one 1-byte mask and one output, and one output
    in backward (PyTorch's own dropout keeps a float mask on CPU, and x·mask·scale in plain
    ops would allocate two products). aten's native_dropout_backward is that one kernel:
    grad·mask·scale; forward applies the same product to x."""

    @staticmethod
    def forward(ctx, x, p, term):
        mask = torch.empty_like(x, dtype=torch.bool)                          # 1 byte an element
        if not fake_shortcut(mask):                   # in place: a fake run skips it, which allocates nothing
            mask.bernoulli_(1.0 - p)
        label(mask, term)
        ctx.scale = 1.0 / (1.0 - p)
        ctx.save_for_backward(mask)
        return torch.ops.aten.native_dropout_backward(x, mask, ctx.scale)

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return torch.ops.aten.native_dropout_backward(grad, mask, ctx.scale), None, None


class Dropout(nn.Module):
    def __init__(self, p: float, mask_term: str):
        super().__init__()
        self.p, self.mask_term = p, mask_term

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        return _Dropout.apply(x, self.p, self.mask_term)


def init_scaled(module: nn.Module, layers: int) -> None:
    """Megatron scales the output layers' init by 1/sqrt(2L); harmless, keeps values sane."""
    nn.init.normal_(module.weight, std=0.02 / math.sqrt(2 * layers))


def allreduce_layernorm_grads(module: nn.Module, tp: TensorParallel) -> None:
    """Under SP each rank's layer-norm and row-bias grads cover its own sequence shard; the q
    and k norms' grads cover each rank's own heads, SP or not. Megatron all-reduces both over
    t after backward (finalize_model_grads.py, _allreduce_layernorm_grads)."""
    if tp.size == 1:
        return
    for name, param in module.named_parameters():
        if param.grad is None:
            continue
        if (tp.sequence_parallel and getattr(param, "sequence_parallel", False)) \
                or getattr(param, "summed_over_heads", False):
            param.grad = all_reduce(param.grad, tp)
