"""The rules a model and run must obey, written once.

``check`` applies them to one spec (plain ints) and raises the first that fails, with the
arithmetic in the message; ``valid`` applies them to the planner's sweep (numpy arrays,
one element a configuration) and returns which rows obey them all. One definition serves
both; numpy is imported only for arrays, so a single estimate does not pay for it.
"""

from dataclasses import dataclass
from typing import Callable

from actmem.model.architecture import torch_softmax_possible
from actmem.errors import SpecError


def _implies(condition, consequence):
    """condition → consequence, for plain booleans or numpy arrays alike."""
    if isinstance(condition, bool) and isinstance(consequence, bool):
        return not condition or consequence
    import numpy as np

    return np.logical_or(np.logical_not(condition), consequence)


def _not_in(value, excluded):
    """value is none of ``excluded``: a plain string, or a numpy array of them."""
    if isinstance(value, str):
        return value not in excluded
    import numpy as np

    return np.logical_not(np.isin(np.asarray(value), list(excluded)))


def _uneven(v) -> bool:
    """First or last stage layers are given (one spec; in the planner's sweep, its uneven
    rows, which it checks apart from the even ones)."""
    return v.first is not None or v.last is not None


def _middle_stages(v):
    return v.p - (v.first is not None) - (v.last is not None)


def _middle_layers(v):
    return v.layers - (0 if v.first is None else v.first) - (0 if v.last is None else v.last)


def _even_middle(v):
    """The stages between share their layers evenly (none when there is no stage between);
    arithmetic and & only, so it runs on ints and on the sweep's arrays alike."""
    stages, layers = _middle_stages(v), _middle_layers(v)
    return ((layers > 0) == (stages > 0)) & (layers >= 0) & (layers % (stages + (stages == 0)) == 0)


def _uneven_message(v) -> str:
    if _middle_layers(v) < 0:
        return (f"the first and last stages' layers ({v.layers - _middle_layers(v)}) are more than the "
                f"model's {v.layers}")
    return (f"the stages between the first and last must share the other layers evenly: "
            f"{_middle_layers(v)} layers over {_middle_stages(v)} stages")


#: Megatron's fused causal softmax (megatron/core/fusions/fused_softmax.py,
#: FusedScaleMaskSoftmax.is_kernel_available) runs only for 16 < sk <= 4096: Megatron-Core's
#: bound (the older megatron/model/fused_softmax.py had 2048; some copies elsewhere 16384)
FUSED_SOFTMAX_MAX_SEQ_LEN = 4096


def _batches_per_block(s: int) -> int:
    """scaled_masked_softmax.h, get_batch_per_block: 128 threads a block in warps of
    min(2^⌈log2 sk⌉, 32) lanes, two rows a warp while 2^⌈log2 sk⌉ <= 128: 8 rows for
    16 < sk <= 128, else 4 (CUDA's 32-lane warps; ROCm's 64 make blocks no larger)."""
    return 8 if s <= 128 else 4


def fused_softmax_runs(v):
    """Megatron's local (eager) core runs its fused causal softmax, for sq = sk = s and b·a/t
    attention batches a rank: 16 < s <= 4096, 4 | s and batches_per_block | b·a/t (its
    ``attn_batches % 4`` follows). Elsewhere it falls back to forward_torch_softmax, which
    keeps other tensors: actmem counts them (architecture.Architecture.with_fused_softmax)."""
    s = v.seq_len
    if not (16 < s <= FUSED_SOFTMAX_MAX_SEQ_LEN and s % 4 == 0):
        return False
    return v.b * (v.heads // v.t) % _batches_per_block(s) == 0


def fused_softmax_reason(v) -> str:
    """Why the fused kernel does not run at one configuration: the condition it breaks."""
    s, per_block = v.seq_len, _batches_per_block(v.seq_len)
    if not 16 < s <= FUSED_SOFTMAX_MAX_SEQ_LEN:
        return f"it needs 16 < s <= {FUSED_SOFTMAX_MAX_SEQ_LEN} (s = {s})"
    if s % 4:
        return f"it needs s a multiple of 4 (s = {s})"
    return (f"it needs b·a/t a multiple of {per_block} at s = {s} "
            f"(b·a/t = {v.b}·{v.heads}/{v.t} = {v.b * (v.heads // v.t)} attention batches a rank)")


def _torch_softmax_handed_the_mask(v):
    """Megatron's local core runs torch's softmax and the dataloader makes a mask (arrays alike)."""
    arch = v.architecture
    if not (arch.attention_mask and torch_softmax_possible(arch)):
        return False
    if not arch.masked_softmax_fusion:
        return True
    runs = fused_softmax_runs(v)
    if isinstance(runs, bool):
        return not runs
    import numpy as np

    return np.logical_not(runs)


def _mask_reaches_every_layer(v):
    """The dataloader's mask reaches every layer of every stage: it arrives with the batch on the
    first and last stages only (core/utils.py, get_batch_on_this_tp_rank), the layers of one model
    chunk of each."""
    return (v.p <= 2) & (v.m == 1)


def _layers_making_their_own_mask(v) -> str:
    return ("under torch's fallback softmax with the dataloader's mask, the layers that mask does not reach (it "
            "arrives with the batch on the first and last stages, in their first and last model chunks) make "
            f"causal masks of their own (get_default_causal_mask), s² bytes a layer, which actmem does not count "
            f"beside it yet (p = {v.p}, m = {v.m}: it counts p <= 2 without interleaving): give "
            "--no-attention-mask (Megatron's --no-create-attention-mask-in-dataloader: every layer makes its "
            "own), or --attention-core flash")


def _learned_positions_reach(arch, seq_len) -> bool:
    """A learned position table (--max-position-embeddings rows) covers every position."""
    rows = arch.position_rows
    return arch.position_embedding != "learned" or rows is None or rows >= seq_len


@dataclass(frozen=True)
class Rule:
    holds: Callable
    """values -> bool (or a boolean array)."""
    message: Callable
    """values -> the line a user reads when it fails."""
    needs: tuple = ()
    """Values that must be known for the rule to apply (a spec may lack gpus or a batch)."""


#: The largest value each input may take: {rule value name: (the name a user reads, bound)}.
#: Far above any published dense model, so no real run is refused, and low enough that a slip
#: (a run of extra zeros, 2^40) is named instead of printed as a 60-digit percentage. Each is at
#: least plan.LIMITS' bound for the same input, so the planner's sweep loses no row to them.
LARGEST = {
    # 25,600 for Megatron's 1T (Narayanan et al. 2021; the 1t preset), 18,432 for PaLM 540B: 40x
    "hidden": ("hidden", 2**20),
    # a divides h, so a is at most h; the 1T's 160 heads
    "heads": ("heads", 2**20),
    # 128 for the 1T, 126 for Llama 3.1 405B, 1,000 for DeepNet (Wang et al. 2022), the deepest
    # trained: 100x
    "layers": ("layers", 100_000),
    # 131,072 for Llama 3.1's long-context run (the llama-3.1-405b-128k preset), a 10M-token
    # context for Llama 4 Scout: 13x
    "seq_len": ("seq_len", 2**27),
    # 256,000 for PaLM and Gemma, some 262,000 for Gemma 3: 64x
    "vocab": ("vocab", 2**24),
    # a microbatch is part of a global batch: the same bound
    "b": ("micro_batch", 2**24),
    # 65,536 sequences for BERT under LAMB (You et al. 2020), the largest published batch: 256x
    "global_batch": ("global_batch", 2**24),
    # 16,384 H100s for Llama 3.1 405B: 64x (5x the largest cluster built, xAI's of some 200,000)
    "gpus": ("gpus", 2**20),
    # f = 4h at the largest h (the 1T's f is 102,400)
    "ffn": ("ffn_hidden", 4 * 2**20),
    # d is 128 or 256 in published models; no wider than the largest h
    "head_dim": ("head_dim", 2**20),
    # Megatron's default 128
    "vocab_divisible_by": ("vocab_divisible_by", 2**20),
    # 288 GB on the largest GPUs (B300, MI355X): 1 PiB is 3,900x
    "gpu_memory_bytes": ("gpu_memory_bytes", 2**50),
}


def _at_most(key: str, label: str, largest: int) -> Rule:
    return Rule(lambda v: getattr(v, key) <= largest,
                lambda v: f"{label} ({getattr(v, key):,}) must be at most {largest:,}", (key,))


def _offloading(v):
    return v.offload_layers > 0


#: Megatron's whole-layer CPU offloading (--cpu-offloading-num-layers N; transformer_config.py,
#: __post_init__, core_v0.16.1 lines 1137-1152, and Transformer Engine v2.11's cpu_offload.py), then
#: what actmem has not read for it yet: each a refusal, not a guess
OFFLOADING_RULES = (
    Rule(lambda v: _implies(_offloading(v), v.offload_layers < v.layers),
         lambda v: f"--cpu-offloading-num-layers ({v.offload_layers}) must be less than the model's layers ({v.layers}): "
                   f"Megatron offloads at most L - 1 (the last layer's activations stay)"),
    Rule(lambda v: _implies(_offloading(v), v.p == 1),
         lambda v: f"Megatron has no CPU offloading under pipeline parallelism (p = {v.p}): "
                   f"--cpu-offloading-num-layers needs p = 1"),
    Rule(lambda v: _implies(_offloading(v), v.recompute == "none"),
         lambda v: f"Megatron's CPU offloading does not work with activation recomputation (this run's is "
                   f"{v.recompute}): --cpu-offloading-num-layers needs --recompute none"),
    Rule(lambda v: _implies(_offloading(v), "cpu_offloading" in v.code.runs),
         lambda v: _unmodelled_run(v, "CPU offloading (--cpu-offloading-num-layers)")),
    Rule(lambda v: _implies(_offloading(v), v.core == "flash"),
         lambda v: f"CPU offloading beside the {v.core} attention core is not modelled yet: actmem has read which saved "
                   f"tensors Transformer Engine offloads under its cuDNN core (--attention-core flash) only"),
    Rule(lambda v: _implies(_offloading(v), v.c == 1),
         lambda v: f"CPU offloading beside context parallelism (c = {v.c}) is not modelled yet: which of the ring "
                   f"attention's saved tensors Transformer Engine can offload is not read"),
    Rule(lambda v: not (_offloading(v) and _first_last_bf16(v)),
         lambda v: "CPU offloading beside --first-last-layers-bf16 is not modelled yet: the offloaded first layers "
                   "and the bf16 ones overlap, and actmem counts each kind whole", ("architecture",)),
    Rule(lambda v: _implies(_offloading(v), (v.dense is True) & (v.latent is None) & (v.mtp is None)),
         lambda v: "CPU offloading beside experts, latent attention or multi-token prediction is not modelled yet: "
                   "their saved views (the experts' split inputs) and host tensors are not read"),
)


def _expert_layout_hint(v) -> str:
    """What to change where the expert layout does not fit the GPUs: ETP follows t unless given (Megatron's
    --expert-tensor-parallel-size defaults to --tensor-model-parallel-size)."""
    hint = f"; give --gpus a multiple of {v.etp * v.ep * v.p}, or a smaller --ep or --pp"
    if v.etp == 1:
        return hint
    return hint + (" or --etp (ETP is t unless given: Megatron's --expert-tensor-parallel-size defaults to "
                   "--tensor-model-parallel-size)")


def _first_last_bf16(v) -> bool:
    return bool(v.architecture is not None and v.architecture.fp8 and v.architecture.fp8_first_last_bf16)


#: --first-last-layers-bf16: Megatron's bound (transformer_config.py, __post_init__: at most the layers of a
#: pipeline stage each), then what actmem has not counted yet
FIRST_LAST_BF16_RULES = (
    Rule(lambda v: not _first_last_bf16(v) or (
        (v.architecture.fp8_bf16_start <= v.layers // v.p) & (v.architecture.fp8_bf16_end <= v.layers // v.p)),
         lambda v: f"--num-layers-at-start-in-bf16 ({v.architecture.fp8_bf16_start}) and --num-layers-at-end-in-bf16 "
                   f"({v.architecture.fp8_bf16_end}) must each be at most the layers of a pipeline stage, "
                   f"L/p = {v.layers // v.p} (Megatron's check)", ("architecture",)),
    Rule(lambda v: not _first_last_bf16(v) or ((v.m == 1) & (v.recompute_shape is None)),
         lambda v: f"--first-last-layers-bf16 is modelled without interleaving and without --recompute-method "
                   f"(this run: m = {v.m}{', --recompute-method ' + str(v.recompute_shape[0]) if v.recompute_shape else ''}): "
                   f"which layers a model chunk or a checkpoint holds in bf16 is not counted yet",
         ("architecture",)),
)


#: The rules of the data-parallel run (gpus, the global batch, the distributed optimizer's
#: shards) wait with the kernels' where the run is not known (Spec.dims_only): `validate`
#: measures one data-parallel rank and sets its own, a plot sweeps b.
_DATA_PARALLEL = ("gpus", "run_known")


#: PyTorch's FSDP2 as torchtitan applies it (--fsdp; actmem.memory.fsdp): where it runs, and what
#: actmem has not read for it yet, each a refusal
FSDP_RULES = (
    Rule(lambda v: _implies(v.fsdp, "fsdp" in v.code.runs),
         lambda v: f"--fsdp is PyTorch's FSDP2 as torchtitan applies it, modelled under --implementation torch-native "
                   f"only, not {v.code.name} (Megatron shards its optimizer state with --use-distributed-optimizer, "
                   f"its model state with --use-megatron-fsdp; its --use-torch-fsdp2 is not modelled yet)", ("code",)),
    Rule(lambda v: _implies(v.fsdp, v.gpus is not None),
         lambda v: "--fsdp shards the model state over the d data-parallel ranks: give --gpus (d = gpus/t)",
         ("run_known",)),
    Rule(lambda v: _implies(v.fsdp, v.d > 1),
         lambda v: f"--fsdp shards over the d data-parallel ranks, and d = gpus/(t·p) = {v.gpus}/{v.t * v.p} = {v.d} "
                   f"shards nothing (torchtitan applies no FSDP over one rank): give more --gpus",
         _DATA_PARALLEL),
    # torchtitan 018740b7 shards data parallelism with FSDP2 or runs DDP alone (models/llama3/infra/parallelize.py:
    # "DDP has not supported > 1D parallelism"), and DDP under AMP, fp32 weights and autocast's casts
    # (distributed/utils.py, maybe_enable_amp), not the bf16 layers FSDP2's mixed precision runs, which actmem prices
    Rule(lambda v: _implies(("fsdp" in v.code.runs) & (v.d > 1), v.fsdp),
         lambda v: f"--implementation {v.code.name} over d = {v.d} data-parallel ranks is torchtitan's FSDP2: give "
                   f"--fsdp ('fsdp' in a plan's label; torchtitan 018740b7 runs DDP only alone, under AMP with fp32 "
                   f"weights, which actmem does not model; with TP it raises 'DDP has not supported > 1D "
                   f"parallelism')", ("code", *_DATA_PARALLEL)),
    Rule(lambda v: _implies(v.fsdp_reshard != "default", v.fsdp),
         lambda v: f"--fsdp-reshard-after-forward {v.fsdp_reshard} is FSDP2's policy: give --fsdp too"),
    Rule(lambda v: _implies(v.fsdp_replicate > 1, v.fsdp),
         lambda v: f"--fsdp-replicate {v.fsdp_replicate} is HSDP's replicas of FSDP2's shards: give --fsdp too"),
    Rule(lambda v: _implies(v.fsdp_replicate > 1, (v.d % v.fsdp_replicate == 0) & (v.d // v.fsdp_replicate > 1)),
         lambda v: f"--fsdp-replicate R ({v.fsdp_replicate}) must divide the d = {v.d} data-parallel ranks and leave "
                   f"at least 2 to shard over (R = d is DDP, replicated, not FSDP2)", _DATA_PARALLEL),
    Rule(lambda v: _implies("fsdp" in v.code.runs, v.gradient_bytes == 4),
         lambda v: f"--grad-dtype sets Megatron's main-gradient buffer; {v.code.name}'s FSDP2 keeps its gradients in "
                   "its reduce dtype, fp32 (torchtitan's mixed_precision_reduce default): leave --grad-dtype out",
         ("code", "gradient_bytes")),
    Rule(lambda v: _implies(v.fsdp, v.params_dtype == "bf16"),
         lambda v: f"--params-dtype {v.params_dtype} is Megatron's; FSDP2 computes in its mixed-precision param dtype, "
                   f"bf16 (torchtitan's mixed_precision_param default): leave --params-dtype out", ("params_dtype",)),
)


#: megatron-core's own FSDP (--use-megatron-fsdp, --data-parallel-sharding-strategy; actmem.memory.megatron_fsdp):
#: where it runs, and what actmem has not read for it yet, each a refusal
MEGATRON_FSDP_RULES = (
    Rule(lambda v: _implies(v.megatron_fsdp, "megatron_fsdp" in v.code.runs),
         lambda v: f"--use-megatron-fsdp is megatron-core's own FSDP, modelled under --implementation megatron, not "
                   f"{v.code.name} (torch-native shards its model state with --fsdp, hf with --zero-stage)", ("code",)),
    Rule(lambda v: _implies(v.fsdp_sharding is not None, v.megatron_fsdp),
         lambda v: f"--data-parallel-sharding-strategy {v.fsdp_sharding} is Megatron-FSDP's, read only beside "
                   "--use-megatron-fsdp: give that too, or leave it out"),
    Rule(lambda v: _implies(v.fsdp_double_buffer, v.megatron_fsdp),
         lambda v: "--fsdp-double-buffer is Megatron-FSDP's (its units' buffers in a fixed pool of two): give "
                   "--use-megatron-fsdp too, or leave it out"),
    Rule(lambda v: _implies(v.megatron_fsdp, v.gpus is not None),
         lambda v: "--use-megatron-fsdp shards the model state over the d·c data-parallel ranks: give --gpus "
                   "(d = gpus/(t·c·p))", ("run_known",)),
    Rule(lambda v: _implies(v.megatron_fsdp, v.p == 1),
         lambda v: f"--use-megatron-fsdp is modelled at p = 1 (this run: p = {v.p}): its buffers beside a "
                   f"pipeline's stages are not read yet"),
    Rule(lambda v: _implies(v.megatron_fsdp, v.architecture is None or not v.architecture.moe),
         lambda v: "--use-megatron-fsdp is modelled for dense models: its experts' buffers over the expert "
                   "data-parallel group are not read yet", ("architecture",)),
    Rule(lambda v: _implies(v.megatron_fsdp, v.architecture is None or not (v.architecture.multi_latent_attention
                                                                           or v.architecture.mtp_layers)),
         lambda v: "--use-megatron-fsdp is modelled for standard attention without multi-token prediction: the "
                   "order of multi-latent attention's and the prediction layers' parameters in its padded buckets is "
                   "not read yet", ("architecture",)),
    Rule(lambda v: _implies(_megatron_fsdp_fp8(v),
                            v.architecture is not None and v.architecture.fp8 in ("delayed", "tensorwise")),
         lambda v: f"--use-megatron-fsdp under --fp8-recipe {v.architecture.fp8} is not modelled yet (its block "
                   "scales and transpose buffers in Megatron-FSDP's buckets): delayed and tensorwise are",
         ("architecture",)),
    Rule(lambda v: _implies(_megatron_fsdp_fp8(v) and v.architecture.fp8_param_gather,
                            v.fsdp_sharding in (None, "optim_grads_params")),
         lambda v: f"--use-megatron-fsdp with --fp8-param-gather is modelled for --data-parallel-sharding-strategy "
                   f"optim_grads_params (its default), not {v.fsdp_sharding}: the FP8 weights' transposes where the "
                   "weights are not sharded are not read yet", ("architecture",)),
    Rule(lambda v: _implies(_megatron_fsdp_fp8(v),
                            v.architecture is not None and not v.architecture.fp8_first_last_bf16),
         lambda v: "--use-megatron-fsdp beside --first-last-layers-bf16 is not modelled yet (units of two kinds, "
                   "bf16 and FP8, in its buckets and double buffers)", ("architecture",)),
    Rule(lambda v: _implies(v.megatron_fsdp, not v.precision_aware),
         lambda v: "--use-megatron-fsdp beside --use-precision-aware-optimizer is not modelled yet (Megatron-FSDP "
                   "keeps its own main-weight buffer)"),
    Rule(lambda v: _implies(v.megatron_fsdp, v.offload_layers == 0),
         lambda v: "--use-megatron-fsdp beside --cpu-offloading-num-layers is not modelled yet"),
)


def _megatron_fsdp_fp8(v) -> bool:
    return bool(v.megatron_fsdp and v.architecture is not None and v.architecture.fp8)


#: DeepSpeed's ZeRO as the Hugging Face Trainer runs it (--zero-stage, --deepspeed; actmem.memory.zero)
ZERO_RULES = (
    Rule(lambda v: _implies(v.zero > 0, "zero" in v.code.runs),
         lambda v: f"--zero-stage and --deepspeed are DeepSpeed's ZeRO as the Hugging Face Trainer runs it, modelled "
                   f"under --implementation hf only, not {v.code.name} (megatron shards its optimizer state with "
                   f"--use-distributed-optimizer, torch-native its model state with --fsdp)", ("code",)),
    Rule(lambda v: _implies(v.zero > 0, v.gpus is not None),
         lambda v: f"ZeRO-{v.zero} partitions over the data-parallel ranks: give --gpus (d = gpus)", ("run_known",)),
    Rule(lambda v: _implies(v.zero > 0, v.gradient_bytes == 4),
         lambda v: f"--grad-dtype sets Megatron's main-gradient buffer; ZeRO-{v.zero} keeps its gradients in the "
                   "model's dtype, bf16 (DeepSpeed's grad_accum_dtype default): leave --grad-dtype out",
         ("gradient_bytes",)),
    Rule(lambda v: _implies(v.zero > 0, _and_not(v.params_dtype == "bf16", v.precision_aware)),
         lambda v: f"--params-dtype and --use-precision-aware-optimizer are Megatron's; ZeRO-{v.zero} keeps bf16 "
                   "weights and an fp32 master copy with AdamW's fp32 moments: leave them out",
         ("params_dtype", "precision_aware")),
)


def _and_not(x, y):
    """x and not y, for plain booleans or numpy arrays alike."""
    if isinstance(x, bool) and isinstance(y, bool):
        return x and not y
    import numpy as np

    return np.logical_and(x, np.logical_not(y))


RULES = (
    *(_at_most(key, label, largest) for key, (label, largest) in LARGEST.items()),
    Rule(lambda v: v.recompute == "full",
         lambda v: f"--recompute-method and --recompute-num-layers shape full recompute; this run's recompute is "
                   f"{v.recompute}: give --recompute full", ("recompute_shape",)),
    Rule(lambda v: None not in v.recompute_shape,
         lambda v: "give --recompute-method and --recompute-num-layers together, as Megatron requires",
         ("recompute_shape",)),
    Rule(lambda v: v.recompute == "selective",
         lambda v: f"--recompute-modules chooses what selective recompute recomputes (Megatron reads it only then; "
                   f"a preset names it recompute_modules); this run's recompute is {v.recompute}: give --recompute "
                   f"selective",
         ("recompute_modules",)),
    # torchtitan's activation_checkpoint.selective_ac_option (distributed/activation_checkpoint.py @018740b7,
    # _apply_ac_to_transformer_block): "op" or a positive int, read only under mode "selective"
    Rule(lambda v: v.code.op_checkpointing,
         lambda v: f"--selective-ac-option is torchtitan's (torch-native's selective checkpointing); "
                   f"--implementation {v.code.name} has no such option", ("selective_ac_option", "code")),
    Rule(lambda v: v.recompute == "selective",
         lambda v: f"--selective-ac-option chooses what torchtitan's selective checkpointing keeps; this run's "
                   f"recompute is {v.recompute}: give --recompute selective", ("selective_ac_option",)),
    Rule(lambda v: v.selective_ac_option == "op" or (str(v.selective_ac_option).isdecimal()
                                                     and int(v.selective_ac_option) > 0),
         lambda v: f"--selective-ac-option {v.selective_ac_option}: give op (torchtitan's per-op policy) or a "
                   f"positive whole number N (its layer policy: every N-th block checkpointed; torchtitan reads 0 as "
                   f"every block, which is --recompute full)", ("selective_ac_option",)),
    Rule(lambda v: v.recompute_modules is None,
         lambda v: "--recompute-modules are Megatron's; torchtitan's selective checkpointing (--selective-ac-option) "
                   "chooses by its own ops or layers: give one or the other",
         ("selective_ac_option", "recompute_modules")),
    Rule(lambda v: _learned_positions_reach(v.architecture, v.seq_len),
         lambda v: f"the learned position table has {v.architecture.position_rows:,} rows "
                   f"(--max-position-embeddings), fewer than the sequence's {v.seq_len:,} positions: Megatron "
                   f"cannot look them up", ("architecture",)),
    Rule(lambda v: 0 <= v.reserve_bytes < v.gpu_memory_bytes,
         lambda v: f"reserve ({v.reserve_bytes:,} B) must be less than the GPU memory ({v.gpu_memory_bytes:,} B)",
         ("reserve_bytes", "gpu_memory_bytes")),
    Rule(lambda v: v.hidden % v.t == 0, lambda v: f"t ({v.t}) must divide hidden ({v.hidden})"),
    Rule(lambda v: v.heads % v.t == 0, lambda v: f"t ({v.t}) must divide heads ({v.heads})"),
    Rule(lambda v: v.ffn % v.t == 0, lambda v: f"t ({v.t}) must divide ffn_hidden ({v.ffn})", ("ffn",)),
    Rule(lambda v: v.heads % v.groups == 0,
         lambda v: f"query_groups ({v.groups}) must divide heads ({v.heads})", ("groups",)),
    Rule(lambda v: v.groups % v.t == 0,
         lambda v: f"t ({v.t}) must divide query_groups ({v.groups}): each rank keeps whole groups",
         ("groups",)),
    Rule(lambda v: _implies(v.sequence_parallel, v.t > 1),
         lambda v: f"sequence parallelism splits the sequence over the tensor-parallel ranks: "
                   f"it needs t > 1 (t = {v.t})"),
    Rule(lambda v: _implies(v.sequence_parallel, v.seq_len % (v.t * v.c) == 0),
         lambda v: f"t ({v.t}) must divide seq_len ({v.seq_len}) "
                   f"(sequence parallelism splits the sequence t ways)" if v.c == 1 else
                   f"t·c ({v.t}·{v.c}) must divide seq_len ({v.seq_len}) (context parallelism splits "
                   f"the sequence c ways and sequence parallelism each part t ways)"),
    Rule(lambda v: _implies(v.c > 1, v.seq_len % (2 * v.c) == 0),
         lambda v: f"2c ({2 * v.c}) must divide seq_len ({v.seq_len}): Megatron splits each sequence into "
                   f"2c chunks, two a context-parallel rank, to balance the causal mask"),
    Rule(lambda v: _implies(v.c > 1, v.core == "flash"),
         lambda v: "context parallelism runs Transformer Engine's attention: actmem models it with the "
                   "cuDNN flash core (--attention-core flash), which keeps no s² term", ("core",)),
    Rule(lambda v: _implies(not _uneven(v), v.layers % v.p == 0),
         lambda v: f"p ({v.p}) must divide layers ({v.layers}), or give an uneven pipeline's first and last "
                   f"stages, without interleaving (--first-stage-layers N --last-stage-layers N, Megatron's "
                   f"--decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers)"),
    Rule(lambda v: not _uneven(v) or (v.p > 1) & (v.m == 1),
         lambda v: f"an uneven pipeline (first or last stage layers given) needs p > 1 and no "
                   f"interleave (p = {v.p}, m = {v.m})"),
    Rule(lambda v: not _uneven(v) or _even_middle(v), lambda v: _uneven_message(v)),
    Rule(lambda v: _implies(v.m > 1, v.p > 1),
         lambda v: f"interleave m ({v.m}) needs pipeline parallelism: p must be > 1"),
    Rule(lambda v: _uneven(v) or (v.layers // v.p) % v.m == 0,
         lambda v: f"interleave m ({v.m}) must divide the layers per stage "
                   f"L/p = {v.layers}/{v.p} = {v.layers // v.p}"),
    Rule(lambda v: v.gpus % (v.t * v.c * v.p) == 0,
         lambda v: (f"t·p ({v.t}·{v.p} = {v.t * v.p})" if v.c == 1 else
                    f"t·c·p ({v.t}·{v.c}·{v.p} = {v.t * v.c * v.p})") + f" must divide gpus ({v.gpus})",
         _DATA_PARALLEL),
    Rule(lambda v: v.global_batch % (v.b * v.d) == 0,
         lambda v: f"micro_batch·data_parallel ({v.b}·{v.d} = {v.b * v.d}) must divide "
                   f"global_batch ({v.global_batch})", _DATA_PARALLEL + ("global_batch",)),
    Rule(lambda v: _implies(v.m > 1, v.n % v.p == 0),
         lambda v: f"the interleaved schedule needs the microbatches per iteration ({v.n}) to be "
                   f"a multiple of p ({v.p}), as Megatron requires", ("n", "run_known")),
    Rule(lambda v: v.recompute_layers <= v.chunk_layers,
         lambda v: f"--recompute-num-layers ({v.recompute_layers}) must not exceed the layers of a model "
                   f"chunk on the first stage ({v.chunk_layers})", ("recompute_layers", "chunk_layers")),
    Rule(lambda v: _implies(v.t > 1, "tensor" in v.code.runs),
         lambda v: _unmodelled_run(v, f"tensor parallelism (t = {v.t})"), ("code",)),
    Rule(lambda v: _implies(v.p > 1, "pipeline" in v.code.runs),
         lambda v: _unmodelled_run(v, f"pipeline parallelism (p = {v.p})"), ("code",)),
    Rule(lambda v: _implies(v.c > 1, "context" in v.code.runs),
         lambda v: _unmodelled_run(v, f"context parallelism (c = {v.c})"), ("code",)),
    Rule(lambda v: _implies(v.precision_aware, v.distributed_optimizer),
         lambda v: "--use-precision-aware-optimizer needs the distributed optimizer (Megatron raises: "
                   "optimizer/__init__.py, 'only supported with distributed optimizer')", ("precision_aware",)),
    Rule(lambda v: _implies((v.ep > 1) | (v.imbalance > 1) | v.load_histogram, "expert" in v.code.runs),
         lambda v: _unmodelled_run(v, f"expert parallelism (EP = {v.ep})") if v.ep > 1 else
         f"{'--moe-load-histogram' if v.load_histogram else f'--moe-imbalance {v.imbalance}'}: under --implementation "
         f"{v.code.name} every expert sits on the one device, whose expert rows are k·N whatever the routing",
         ("code", "experts")),
    Rule(lambda v: _implies(v.distributed_optimizer, "distributed_optimizer" in v.code.runs),
         lambda v: _unmodelled_run(v, "Megatron's distributed optimizer"), ("code",)),
    Rule(lambda v: _implies(v.code.flash_head_dim_limit is not None and v.core == "flash",
                            v.head_dim <= (v.code.flash_head_dim_limit or 0)),
         lambda v: f"--implementation {v.code.name} at d = {v.head_dim}: {v.code.flash_head_dim_why}",
         ("code", "head_dim")),
    Rule(lambda v: _implies(_torch_softmax_handed_the_mask(v), _mask_reaches_every_layer(v)),
         _layers_making_their_own_mask, ("architecture", "run_known")),
    Rule(lambda v: "partial_recompute" in v.code.runs,
         lambda v: _unmodelled_run(v, "partial full recompute (--recompute-method)"), ("code", "recompute_layers")),
    Rule(lambda v: _implies(v.t > 1, v.sequence_parallel), lambda v: f"a mixture-of-experts layer at t = {v.t} needs "
         "sequence parallelism (--sequence-parallel): Megatron's MoELayer refuses to train without it (moe_layer.py, "
         "MoELayer.forward)", ("experts",)),
    Rule(lambda v: v.experts % v.ep == 0,
         lambda v: f"EP ({v.ep}) must divide the experts ({v.experts}): each rank holds E/EP of them", ("experts",)),
    Rule(lambda v: v.expert_ffn % v.etp == 0,
         lambda v: f"ETP ({v.etp}) must divide the experts' hidden size f_e ({v.expert_ffn})", ("experts",)),
    Rule(lambda v: v.shared_ffn is None or v.shared_ffn % v.t == 0,
         lambda v: f"t ({v.t}) must divide the shared experts' hidden size f_s ({v.shared_ffn})", ("experts",)),
    Rule(lambda v: isinstance(v.moe_freq, int) or len(v.moe_freq) == v.layers,
         lambda v: f"--moe-layer-freq lists {len(v.moe_freq)} layers; the model has {v.layers} (Megatron asserts "
                   "the pattern's length: gpt_layer_specs.py)", ("experts",)),
    Rule(lambda v: not v.mixed_layers or ((v.m == 1) & (v.recompute_shape is None)),
         lambda v: f"dense layers among MoE layers (--moe-layer-freq) are modelled without interleaving and without "
                   f"--recompute-method (m = {v.m}): which layers a model chunk or a checkpoint holds is not "
                   "counted yet", ("experts",)),
    Rule(lambda v: not _block_fp8(v.architecture) or _implies(v.t > 1, v.sequence_parallel),
         lambda v: f"--fp8-recipe {v.architecture.fp8} at t = {v.t} is modelled with sequence parallelism "
                   "(--sequence-parallel): actmem counts the saved inputs' block scales of the rank's s·b/t rows",
         ("architecture", "run_known")),
    Rule(lambda v: not v.architecture.fp8 or _fp8_dims_fit(v, 8, 16),
         lambda v: f"FP8 GEMMs need their inputs' and weights' rows divisible by 8 and their last dims by 16 "
                   f"(Transformer Engine asserts it: utils.py, assert_dim_for_fp8_exec): the rows a rank quantizes, "
                   f"{_rows(v)}, h = {v.hidden}, f/t and the linears' widths over t = {v.t}{_fp8_widths(v)}",
         ("architecture", "run_known")),
    Rule(lambda v: v.architecture.fp8 != "mxfp8" or _fp8_dims_fit(v, 32, 32),
         lambda v: f"--fp8-recipe mxfp8 needs every quantized tensor's dims divisible by 32 (Transformer Engine "
                   f"asserts it: quantizer.cpp): the rows a rank quantizes, {_rows(v)}, h = {v.hidden}, f/t, and "
                   f"the linears' widths over t = {v.t}{_fp8_widths(v)}", ("architecture", "run_known")),
    Rule(lambda v: v.architecture.fp8 != "blockwise" or _implies(v.sequence_parallel, (
        (_rows(v) % 128 == 0) & (v.hidden % 128 == 0) & _latents_gather(v.architecture))),
         lambda v: f"--fp8-recipe blockwise under sequence parallelism gathers the norms' quantized outputs, which "
                   f"needs their rows and h divisible by 128 (Transformer Engine asserts it: layernorm_linear.py, "
                   f"assert_dim_for_all_gather): {_rows(v)} rows a rank, h = {v.hidden}"
                   + (f", and MLA's latents, q_r = {v.architecture.q_lora_rank}, kv_r = {v.architecture.kv_lora_rank}"
                      if v.architecture.multi_latent_attention else ""), ("architecture", "run_known")),
    Rule(lambda v: v.architecture.fp8 != "delayed" or not {"moe_act", "layernorm"} & set(v.recompute_modules or ()),
         lambda v: "--recompute-modules moe_act or layernorm under FP8 delayed scaling: Megatron refuses them "
                   "(transformer_config.py: 'Delayed scaling does not support moe_act and layernorm recompute for "
                   "fp8'); give another --fp8-recipe", ("architecture",)),
    Rule(lambda v: not v.architecture.fp8_param_gather or v.distributed_optimizer,
         lambda v: "--fp8-param-gather needs the distributed optimizer (--use-distributed-optimizer): Megatron "
                   "raises without it (arguments.py)", ("architecture", "run_known")),
    Rule(lambda v: not _padded_alltoall(v.architecture) or _capacity(v) <= _rows(v),
         lambda v: f"--moe-pad-expert-input-to-capacity under the alltoall dispatcher needs each expert's capacity "
                   f"C = ⌈k·N/E·factor⌉ ({_capacity(v):.0f}) at most the N = {_rows(v)} tokens a rank routes: "
                   "an expert's column holds at most N, so Megatron's permute fails (moe_utils.py, permute: "
                   "view(E, C)), and fused, TE's is handed E·C rows its map cannot fill; lower "
                   "--moe-expert-capacity-factor", ("experts", "architecture", "run_known")),
    Rule(lambda v: _implies((v.t > 1) & (v.recompute == "selective") & ("mla_up_proj" in (v.recompute_modules or ())),
                            v.sequence_parallel),
         lambda v: f"--recompute-modules mla_up_proj at t = {v.t} is modelled with sequence parallelism "
                   "(--sequence-parallel): without it the checkpoint's rope key is a view, not the gathered copy "
                   "actmem counts", ("latent",)),
    Rule(lambda v: v.architecture.rope_fusion or "mla_up_proj" not in (v.recompute_modules or ()),
         lambda v: "--recompute-modules mla_up_proj beside multi-latent attention's unfused rope (--no-rope-fusion) is "
                   "not modelled yet: its checkpoint takes the rope's fp32 freqs as an input too, not measured",
         ("latent", "architecture")),
    Rule(lambda v: v.c == 1, lambda v: f"context parallelism (c = {v.c}) with multi-latent attention is not "
         "modelled yet (TE's ring attention over MLA's unequal q, k and v widths keeps what actmem has not read)",
         ("latent",)),
    Rule(lambda v: (v.m == 1) & (v.c == 1) & _every_layer_alone(v.recompute_shape),
         lambda v: "multi-token prediction is modelled without interleaving and context parallelism, and with full "
                   "recompute of every layer alone (Megatron checkpoints its layers uniform 1, asserting N = 1, and "
                   f"not at all under block): m = {v.m}, c = {v.c}, --recompute-method "
                   f"{' '.join(str(x) for x in v.recompute_shape or ('uniform', 1) if x is not None)}", ("mtp",)),
    Rule(lambda v: _implies(v.t > 1, v.sequence_parallel),
         lambda v: f"multi-token prediction at t = {v.t} is modelled with sequence parallelism (--sequence-parallel)",
         ("mtp",)),
    Rule(lambda v: (v.ep == 1) & (v.etp == v.t) & (v.imbalance == 1),
         lambda v: "--expert-model-parallel-size, --expert-tensor-parallel-size and --moe-imbalance shape a "
                   "mixture-of-experts layer: give --num-experts", ("dense",)),
    Rule(lambda v: v.gpus % (v.etp * v.ep * v.p) == 0,
         lambda v: f"ETP·EP·p ({v.etp}·{v.ep}·{v.p} = {v.etp * v.ep * v.p}) must divide gpus ({v.gpus}): Megatron "
                   "lays the experts out over the same GPUs (parallel_state.py, initialize_model_parallel)"
                   + _expert_layout_hint(v),
         ("experts",) + _DATA_PARALLEL),
    Rule(lambda v: _not_in(v.recompute, v.unmodelled_recompute),
         lambda v: v.unmodelled_recompute[v.recompute], ("recompute", "unmodelled_recompute")),
    *OFFLOADING_RULES,
    *FIRST_LAST_BF16_RULES,
    *FSDP_RULES,
    *MEGATRON_FSDP_RULES,
    *ZERO_RULES,
)


@dataclass
class Values:
    """The names the rules read: the model's dims and one configuration (ints or arrays)."""

    heads: object
    hidden: object
    layers: object
    seq_len: object
    t: object
    p: object
    m: object
    b: object
    sequence_parallel: object
    distributed_optimizer: object
    gpus: object = None
    global_batch: object = None
    d: object = 1
    """gpus/(t·c·p); 1 when the GPU count is unknown."""
    c: object = 1
    """Context-parallel size."""
    core: object = None
    """The attention core (context parallelism needs 'flash')."""
    n: object = None
    """Microbatches per iteration, global_batch/(b·d); None when unknown."""
    ffn: object = None
    """The MLP's hidden size f when given (4h, which t divides with h, when not)."""
    groups: object = None
    """Query groups g when given (a, which t divides, when not)."""
    recompute: object = None
    """'none', 'selective' or 'full' for one spec; the planner's names (techniques.PLAN_RECOMPUTE,
    'selective:mlp', ...) in a sweep (strings, or an array of them)."""
    first: object = None
    """Layers of an uneven pipeline's first stage (Megatron's --decoder-first-pipeline-num-layers)."""
    last: object = None
    """... and of its last stage."""
    recompute_layers: object = None
    """N of a partial full recompute (--recompute-num-layers), when given."""
    chunk_layers: object = None
    """Layers of one model chunk of the first stage, when N is given."""
    unmodelled_recompute: dict = None
    """{mode: why}: the recompute modes actmem does not model for this architecture."""
    code: object = None
    """The implementation (actmem.model.implementation.Implementation): the run shapes it has."""
    head_dim: object = None
    """d, the attention head dim (h/a when not given)."""
    run_known: object = True
    """None where only the model's dims are checked (Spec.dims_only): the run's b and t are not
    known yet, so rules of its kernels and of its data-parallel run wait."""
    vocab: object = None
    """v before padding, when given (the planner bounds it itself: plan.LIMITS)."""
    vocab_divisible_by: object = None
    """What Megatron pads the vocabulary to a multiple of (times t), when given."""
    gpu_memory_bytes: object = None
    """The GPU's memory, when given."""
    architecture: object = None
    """The Architecture, when given: the rules of Megatron's torch fallback softmax read its switches."""
    precision_aware: object = None
    """TE's precision-aware optimizer (--use-precision-aware-optimizer), when given."""
    reserve_bytes: object = None
    """What is kept free above the peak floor (--reserve), when given."""
    experts: object = None
    """E, where the MLP is a mixture of experts."""
    dense: object = None
    """True where it is not (the rules of the experts' parallelism then refuse it)."""
    ep: object = 1
    """EP, the expert-parallel size."""
    etp: object = None
    """ETP, the expert-tensor-parallel size."""
    imbalance: object = 1
    """r, the routing imbalance asked for: the busiest rank's expert rows over the balanced count."""
    load_histogram: object = False
    """True where a per-expert load histogram gives r (--moe-load-histogram)."""
    expert_ffn: object = None
    """f_e, an expert's hidden size."""
    shared_ffn: object = None
    """f_s, the shared experts' hidden size, where there are shared experts."""
    moe_freq: object = 1
    """--moe-layer-freq: an int, or a tuple of 0 and 1 a layer."""
    latent: object = None
    """True where the attention is multi-latent (--multi-latent-attention)."""
    mtp: object = None
    """True where the model has multi-token-prediction layers (--mtp-num-layers)."""
    mixed_layers: object = False
    """Dense layers among the MoE layers."""
    recompute_shape: object = None
    """(--recompute-method, --recompute-num-layers) where either is given."""
    recompute_modules: object = None
    """--recompute-modules, where given."""
    selective_ac_option: object = None
    """torchtitan's selective_ac_option (--selective-ac-option), where given."""
    offload_layers: object = 0
    """N of --cpu-offloading-num-layers: layers whose saved activations go to host memory (0: none)."""
    fsdp: object = False
    """--fsdp: FSDP2 shards the model state over the d data-parallel ranks (actmem.memory.fsdp)."""
    fsdp_replicate: object = 1
    """R of --fsdp-replicate: HSDP's replicas (the model state sharded over d/R ranks)."""
    fsdp_reshard: object = "default"
    """--fsdp-reshard-after-forward: torchtitan's policy."""
    gradient_bytes: object = None
    """Bytes a main-gradient element (--grad-dtype), when given."""
    params_dtype: object = None
    """The 16-bit weights' dtype (--params-dtype), when given."""
    zero: object = 0
    """DeepSpeed's ZeRO stage (--zero-stage, --deepspeed), 0 where none (actmem.memory.zero)."""
    megatron_fsdp: object = False
    """--use-megatron-fsdp: megatron-core's own FSDP (actmem.memory.megatron_fsdp)."""
    fsdp_sharding: object = None
    """--data-parallel-sharding-strategy, where given."""
    fsdp_double_buffer: object = False
    """--fsdp-double-buffer (or --use-nccl-ub): Megatron-FSDP's fixed pool of two buffers."""


def _fp8_widths(v) -> str:
    """The experts' and latents' widths an FP8 dims rule checks, for its message."""
    arch, t = v.architecture, v.t
    widths = []
    if arch.moe:
        widths.append(f"f_e/ETP = {arch.expert_ffn(v.hidden) // (t if v.etp is None else v.etp)}")
        if arch.moe_shared_ffn is not None:
            widths.append(f"f_s/t = {arch.moe_shared_ffn // t}")
    if arch.multi_latent_attention:
        widths += [f"kv_r = {arch.kv_lora_rank}", f"kv_r + d_rope = {arch.kv_lora_rank + arch.qk_pos_emb_head_dim}"]
        widths += [f"q_r = {arch.q_lora_rank}"] * (arch.q_lora_rank is not None)
    return f" ({', '.join(widths)})" if widths else ""


def _latents_gather(arch) -> bool:
    """Multi-latent attention's latents, which its column-parallel up projections all-gather under SP quantized:
    divisible by 128 under blockwise scaling (float8_blockwise_tensor.py, is_quantizable); True without MLA."""
    if not arch.multi_latent_attention:
        return True
    return arch.kv_lora_rank % 128 == 0 and (arch.q_lora_rank is None or arch.q_lora_rank % 128 == 0)


def _block_fp8(arch) -> bool:
    from actmem.model.fp8 import BLOCK_RECIPES

    return arch.fp8 in BLOCK_RECIPES


def _rows(v):
    """The tokens a rank holds of a microbatch, the rows its MoE layer routes and TE quantizes of a norm's output:
    (s/c)·b, over t under sequence parallelism (the divisor t where SP is on, 1 where it is off: a bool, or a
    sweep's column of them)."""
    return v.seq_len // v.c * v.b // (1 + (v.t - 1) * v.sequence_parallel)


def _fp8_dims_fit(v, rows: int, cols: int):
    """TE's quantized tensors' rows divisible by ``rows`` and last dims by ``cols``: the norms' outputs
    [(s/c)·b(/t), h], fc2's input [(s/c)·b, f/t], the projection's [(s/c)·b, a·d/t], and the weights [out, in]
    (QKV's (ad + 2gd)/t and fc1's width over t their rows)."""
    arch, heads, t = v.architecture, v.heads, v.t
    attention = arch.attention_width(v.hidden, heads) // t
    fits = (_rows(v) % rows == 0) & ((v.seq_len // v.c * v.b) % rows == 0)
    for width in (v.hidden, arch.ffn(v.hidden) // t, attention):
        fits = fits & (width % cols == 0)
    for width in ((arch.attention_width(v.hidden, heads) + 2 * arch.kv_width(v.hidden, heads)) // t,
                  arch.fc1_width * arch.ffn(v.hidden) // t):
        fits = fits & (width % rows == 0)
    if arch.moe:     # the experts' fc2 input [T_pad, f_e/ETP] and fc1's weight rows, 2f_e/ETP (the rows are padded)
        expert = arch.expert_ffn(v.hidden) // (t if v.etp is None else v.etp)
        fits = fits & (expert % cols == 0) & ((2 * expert) % rows == 0)
        if arch.moe_shared_ffn is not None:      # the shared experts' fc2 input [(s/c)·b, f_s/t], fc1's rows 2f_s/t
            fits = fits & ((arch.moe_shared_ffn // t) % cols == 0) & ((2 * arch.moe_shared_ffn // t) % rows == 0)
    if arch.multi_latent_attention:    # the latents (the up projections' inputs) and every projection's width
        from actmem.model.latent import query_width

        latents = (arch.kv_lora_rank,) + ((arch.q_lora_rank,) if arch.q_lora_rank is not None else ())
        for width in latents:
            fits = fits & (width % cols == 0)
        for width in (*latents, arch.kv_lora_rank + arch.qk_pos_emb_head_dim, query_width(arch, heads) // t,
                      heads * (arch.qk_head_dim + arch.v_head_dim) // t):
            fits = fits & (width % rows == 0)
    return fits


def _padded_alltoall(arch) -> bool:
    return arch.moe and arch.moe_pad_to_capacity and arch.moe_dispatcher == "alltoall"


def _capacity(v):
    """C = ⌈k·N/E·factor⌉ in floating point, as get_capacity computes it (actmem.model.experts.capacity)."""
    from actmem.model.experts import capacity

    return capacity(v.architecture, _rows(v))


def _every_layer_alone(shape) -> bool:
    """--recompute-method and --recompute-num-layers, where given, are uniform and 1: each layer its own checkpoint."""
    return shape is None or (shape[0] in (None, "uniform") and shape[1] in (None, 1))


def _unmodelled_run(v, what: str) -> str:
    return f"{what} is not modelled for --implementation {v.code.name}; actmem models it for megatron"


def _applies(rule: Rule, values: Values) -> bool:
    return all(getattr(values, name) is not None for name in rule.needs)


def check(values: Values) -> None:
    """Raise SpecError with the first rule one configuration breaks."""
    for rule in RULES:
        if _applies(rule, values) and not rule.holds(values):
            raise SpecError(rule.message(values))


def valid(values: Values):
    """Which configurations obey every rule (a boolean array over the sweep)."""
    import numpy as np

    results = [np.asarray(rule.holds(values)) for rule in RULES if _applies(rule, values)]
    return np.logical_and.reduce(np.broadcast_arrays(*results))   # a rule of the model alone is a scalar
