"""A row of the table of saved tensors (actmem.memory.terms): a tensor the backward keeps, sized in bytes with no
parallelism, where it lives relative to the tensor-parallel blocks, what it is counted per, and which recompute
modes and modules keep or drop it."""

from dataclasses import dataclass
from enum import Enum
from typing import Callable

import sympy

from actmem.model.architecture import PAPER, always, torch_softmax
from actmem.model.recompute import Recompute
from actmem.model.symbols import b, h, s
from actmem.model.widths import LOGITS_BYTES as F32


def roundup(x, n):
    """TE's roundup (common.cpp), on sympy expressions."""
    return n * sympy.ceiling(x / n)


def gemm_input_bytes(arch) -> int:
    """Bytes an element of a saved GEMM input TE quantizes: one under FP8 (its one-byte copy: actmem.model.fp8),
    else 16-bit."""
    from actmem.model.widths import ACTIVATION_BYTES

    return 1 if arch.fp8 else ACTIVATION_BYTES


def fp8_scale_inv(arch) -> int:
    """An FP8 tensor's fp32 scale_inv, [1], kept beside it under delayed or tensorwise scaling (quantizer.cpp;
    actmem.model.fp8); 0 in 16 bits, and under the block-scaled recipes, which keep block scales instead
    (block_scales)."""
    from actmem.model.fp8 import BLOCK_RECIPES, SCALE_INV_BYTES

    return SCALE_INV_BYTES if arch.fp8 and arch.fp8 not in BLOCK_RECIPES else 0


def block_scales(rows, cols, gathered: bool):
    """The block scales of a saved input's columnwise copy, [rows, cols] (quantizer.cpp, get_scale_shape): MXFP8
    [roundup(rows/32, 4), roundup(cols, 128)] of E8M0 bytes; blockwise fp32 [ceil(rows/128), cols] in the
    gatherable COMPACT layout (the norms' outputs under SP), [ceil(rows/128), roundup(cols, 4)] GEMM_READY."""
    from actmem.model.fp8 import SCALE_INV_BYTES

    def scales(arch):
        if arch.fp8 == "mxfp8":
            return roundup(rows / 32, 4) * roundup(cols, 128)
        return SCALE_INV_BYTES * sympy.ceiling(rows / 128) * (cols if gathered else roundup(cols, 4))
    return scales


class Region(Enum):
    """Where a tensor lives relative to the tensor-parallel blocks (Figures 4 and 5)."""

    BLOCK = "block"
    """Inside an attention or MLP block: split across heads or the 4h/vocab dim, so it divides by t."""
    BOUNDARY = "boundary"
    """On a block boundary (layer norms, dropouts, block inputs): replicated under
    plain tensor parallelism, split along the sequence under sequence parallelism."""
    REPLICATED = "replicated"
    """The same on every tensor-parallel rank, SP or not: divides by nothing (the unfused
    rope's cos and sin, made for the whole sequence the attention sees)."""


class Scope(Enum):
    """What a term is counted per, on the first pipeline stage (sections 4.4, 4.5)."""

    LAYER = "layer"
    """Once per layer per microbatch in flight."""
    EMBEDDING = "embedding"
    """Once per microbatch in flight (the input embedding sits on the first stage)."""
    OUTPUT = "output"
    """Once, and only when the first stage is also the last (p = 1)."""
    BATCH = "batch"
    """Once per microbatch in flight on the stages that receive the batch: the first (as
    EMBEDDING counts them) and the last (one, as OUTPUT); none in between."""



#: the recompute modes a row is kept under: stored by the forward (none and selective recompute), always, only
#: as full recompute's checkpoint, only by a selective module's checkpoint (Term.kept_by)
STORED = frozenset({Recompute.NONE, Recompute.SELECTIVE})
ALWAYS = frozenset(Recompute)
CHECKPOINT = frozenset({Recompute.FULL})
CHECKPOINTED = frozenset({Recompute.SELECTIVE})


@dataclass(frozen=True)
class Term:
    name: str
    bytes: object
    """Size in bytes of one instance with no parallelism: a sympy expression, or a function
    of the architecture that returns one (the MLP's rows depend on its width f)."""
    region: Region
    kept_under: frozenset
    """The recompute modes under which the forward pass keeps it."""
    scope: Scope
    source: str
    """What it is, and where the paper counts it."""
    present: Callable = always
    """architecture -> whether the layer has this tensor at all (dropout 0 keeps no mask)."""
    module: object = None
    """The recompute module whose checkpoint drops it under selective recompute, or a function
    of the architecture that returns it: 'core_attn' (attention.py,
    _checkpointed_attention_forward: tensor_parallel.checkpoint of the core attention, keeping
    q, k and v) or 'mlp' (transformer_layer.py, _forward_mlp: tensor_parallel.checkpoint(self.mlp,
    False, pre_mlp_layernorm_output), keeping its input). None: no module drops it."""
    kept_by: str | None = None
    """The recompute module whose checkpoint alone keeps it under selective recompute (the QKV
    output that core_attn's checkpoint keeps through its view v): kept there only when that
    module is recomputed."""
    kept_under_torch_softmax: frozenset | None = None
    """Where it differs, the recompute modes under which the forward keeps it when Megatron's
    local core runs torch's softmax (architecture.torch_softmax), whichever module is recomputed:
    the dataloader's mask, which every layer's masked_fill_ keeps there (utils.py,
    attention_mask_func), not only the recompute checkpoints. None: as under the fused kernel."""
    fixed: object = 0
    """Bytes of one instance that no parallelism splits, beside ``bytes`` (a number, or a function of the
    architecture): an FP8 tensor's fp32 scale_inv (actmem.model.fp8)."""
    remade: object = None
    """Where it differs from what the forward keeps, the bytes (with no parallelism, a function of the
    architecture) of what its module's selective rerun makes again: under FP8 the experts' moe_act rerun remakes
    fc2's 16-bit input, which fc2 then saved in place of its FP8 copy (set_save_original_input); or what the
    function returns, None for the row. None: the row."""
    remade_fixed: object = 0
    """Beside ``remade``, its bytes that no parallelism splits (the scales of an FP8 copy the rerun makes)."""
    op_saved: bool = False
    """torchtitan's per-op checkpointing (selective:op, RecomputePolicy.ops) keeps it, whatever ``kept_under``
    says: the output of an op its _op_sac_save_list names, which the checkpoint caches for the rerun."""
    only_under_sp: bool = False
    """Made only under sequence parallelism (a reduce-scatter's output): none without it."""

    def size(self, arch=PAPER) -> sympy.Expr:
        """Bytes of one instance with no parallelism, for this architecture."""
        return self.bytes(arch) if callable(self.bytes) else self.bytes

    def fixed_bytes(self, arch=PAPER, remade: bool = False):
        fixed = self.remade_fixed if remade else self.fixed
        return fixed(arch) if callable(fixed) else fixed

    def module_of(self, arch=PAPER) -> str | None:
        """The recompute module that drops it in this architecture."""
        return self.module(arch) if callable(self.module) else self.module

    def kept_under_for(self, arch=PAPER) -> frozenset:
        """The recompute modes under which this architecture's forward keeps it."""
        return self.kept_under_torch_softmax if self._kept_by_torch_softmax(arch) else self.kept_under

    def kept_by_for(self, arch=PAPER) -> str | None:
        """The module whose checkpoint alone keeps it in this architecture (None: kept whichever is
        recomputed)."""
        return None if self._kept_by_torch_softmax(arch) else self.kept_by

    def _kept_by_torch_softmax(self, arch) -> bool:
        return self.kept_under_torch_softmax is not None and torch_softmax(arch)


def norm_statistics(norms: int):
    """fp32 statistics of ``norms`` norms, one value each a token: mu and rsigma for
    LayerNorm, rsigma for RMSNorm (TE's normalization.cpp: at::empty({N}, at::kFloat))."""
    return lambda arch: norms * F32 * arch.norm_statistics * s * b


SBH = s * b * h
"""Elements of one [s, b, h] activation, the size the tables' rows are most often a multiple of."""
