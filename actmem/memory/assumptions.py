"""What an estimate assumes and leaves out, in words: the notes its outputs print under the
numbers (widths, dropout, the attention core, recompute, the mask, the pipeline, the peak,
parameters and model state). Text only: the numbers come from actmem.memory.estimate."""

from dataclasses import replace

from actmem.memory import backward, engine
from actmem.model import rules
from actmem.model.architecture import PAPER, Architecture, counts_norm_statistics, latent, megatron_moe, moe, qk_norm, \
    te_layer_spec, torch_softmax, unfused_weight_gradients
from actmem.memory.parameters import ParameterBytes
from actmem.memory.pipeline import StageOccupancy
from actmem.model.spec import Spec
from actmem.model.recompute import Recompute
from actmem.units import plural
from actmem.model.widths import ACTIVATION_BYTES, GRADIENT_BYTES, LOGITS_BYTES, MASK_BYTES, WEIGHT_BYTES


def _positions_note(arch, s: int) -> str:
    rows = arch.position_rows
    if rows is None or rows == s:
        return ", learned position embedding of s rows"
    return (f", learned position embedding of {rows:,} rows (--max-position-embeddings; "
            f"{rows - s:,} more than the s positions a sequence reads, parameters all the same)")


def _layer_formula(arch) -> str:
    """The paper's 12h² + 13h, or the weights of this architecture's layer."""
    no_weights = ("attention_dropout", "hidden_dropout", "attention_core", "position_embedding", "rope_fusion",
                  "rotary_percent", "position_rows", "implementation", "masked_softmax_fusion", "softmax_in_fp32",
                  "fp8_format", "fp8_recipe", "fp8_param_gather", "fp8_amax_history_len", "fp8_first_last_bf16",
                  "fp8_bf16_start", "fp8_bf16_end")
    plain = not (arch.qk_norm or arch.moe or arch.multi_latent_attention)
    if plain and replace(arch, **{name: getattr(PAPER, name) for name in no_weights}) == PAPER:
        return "12h² + 13h"
    attention = "4h²" if arch.query_groups is None and arch.head_dim is None else "h·(ad + 2gd) + ad·h"
    if arch.multi_latent_attention:
        q = "h·a(d_qk + d_rope)/t" if arch.q_lora_rank is None else "h·q_r + q_r·a(d_qk + d_rope)/t"
        attention = f"MLA's {q} + h·(kv_r + d_rope) + kv_r·a(d_qk + d_v)/t + a·d_v·h/t (down projections whole)"
    f = "4h" if arch.ffn_hidden is None else "f"
    mlp = (f"{arch.fc1_width + 1}h·{f}" if not arch.moe else
           "a router's E·h (whole on every rank) + E/EP experts of 3h·f_e/ETP"
           + (" + shared experts of 3h·f_s/t" if arch.moe and arch.moe_shared_ffn else ""))
    return (f"{attention} + {mlp} weights, {arch.activation}, {arch.normalization}"
            + ("" if arch.biases == "biases" else f", {arch.biases}")
            + (f", q and k {arch.normalization}s of d" if qk_norm(arch) else "")
            + (f", latent {arch.normalization}s of q_r and kv_r" if arch.multi_latent_attention and arch.qk_norm else ""))


def _attention_notes(spec: Spec, rows: tuple) -> list:
    """What the attention core keeps, and the rows it leaves out."""
    arch = spec.architecture
    if arch.code.notes:                            # another code's notes say what its attention keeps
        return [f"technique rows left out: {why}"
                for why in dict.fromkeys(arch.unmodelled_recompute(spec.model.heads).values())]
    if arch.attention_core == "eager":
        return _eager_core_notes(spec, rows)
    notes = ["attention core: flash (Transformer Engine's cuDNN fused attention, Megatron-Core's default "
             "on Hopper and newer): keeps q, k, v, its output and an fp32 log-sum-exp, no s² term; its "
             "16-byte RNG state per layer is not counted" if arch.attention_core == "flash" else
             "attention core: flash-attn through Transformer Engine: keeps q, k, v, its output and an fp32 "
             "log-sum-exp, no s² term, and at b > 1 the projection's input is a copy of that output; its "
             "16-byte RNG state per layer is not counted"]
    if arch.attention_dropout:
        notes.append("flash attention regenerates its dropout mask from the RNG state and keeps none "
                     "(flash_attn_interface.py); the CPU harness cannot measure this (SDPA's CPU flash "
                     "kernel has no dropout), so it rests on the kernels' source")
    if arch.multi_latent_attention:
        notes += _latent_notes(spec)
    elif arch.position_embedding == "rope" and arch.rope_fusion:
        notes.append("rotary embedding as Megatron-Core's fused kernel applies it: q and k are rotated "
                     "into tensors of their own; its fp32 frequency table (4sd bytes, cached once) is "
                     "held like a buffer, not counted as activations")
    elif arch.position_embedding == "rope":
        notes.append("rotary embedding unfused (--no-rope-fusion; Megatron-Core's rope_utils.py): q and k are "
                     "rotated into tensors of their own, and the 16-bit cos and sin made for each are kept "
                     "(rope_cos_sin, whole on every rank); the fp32 frequency table is held like a buffer")
    if qk_norm(arch):
        notes.append("q and k normalised per head (--qk-layernorm; TENorm, Transformer Engine's op-based "
                     f"{arch.normalization}, as in TE 2): each keeps its input made contiguous, a copy out of the "
                     "QKV output, and fp32 statistics a head a token (qk_norm_input, qk_norm_statistics)")
    if "selective" not in arch.unmodelled_recompute(spec.model.heads, spec.run.recompute_modules) \
            and "core_attn" in (spec.run.recompute_modules or ("core_attn",)) and not arch.multi_latent_attention:
        notes.append("selective recompute of the attention core (core_attn) under flash: Megatron's checkpoint "
                     "keeps its inputs, the rotated q and k and v, a view of the QKV output, so that whole output "
                     "(qkv_output); it drops only TE's copy of v, the log-sum-exp and flash-attn's output copy. "
                     "Against no recompute it keeps 2sb·(a + g)d/t more and 4b·as/t less: more at every size "
                     "under TE's cuDNN core; under flash-attn at b > 1 also 2sb·ad/t less, so more unless "
                     "g·d < 2a" + ("" if _every_layer_moe(arch) else ". --recompute-modules mlp saves memory instead"))
    c = spec.run.context_parallel
    if c > 1:
        notes.append(f"context parallelism c = {c}: each rank keeps s/c = {spec.model.seq_len // c:,} tokens of "
                     "every sequence, so every term is counted at s/c; its ring attention (TE's "
                     "AttnFuncWithCPAndKVP2P, Megatron's default p2p) keeps q, its own k and v, its output "
                     "and the log-sum-exp, not the keys and values it receives (a few small index and RNG "
                     "tensors a layer are not counted)")
    left_out = arch.unmodelled_recompute(spec.model.heads)
    notes += [f"technique rows left out: {why}" for why in left_out.values()]
    return notes


def _latent_notes(spec: Spec) -> list:
    """What multi-latent attention keeps, in words (terms.MLA_TERMS), and what it leaves out."""
    arch = spec.architecture
    notes = ["multi-latent attention as megatron-core 0.16.1's MLASelfAttention runs it in TE's layer spec: the "
             "down projections keep the input norm's output (qkv_input); the up projections keep the latents "
             + ("and, under --qk-layernorm, their norms' outputs and fp32 statistics " if arch.qk_norm else "")
             + "(mla_q_latent, mla_kv_latent: the kv latent a contiguous copy TE makes of a view); the fused "
             "attention keeps q and k, a·(d_qk + d_rope) wide, v and its output, a·d_v wide (mla_query, mla_key, "
             "mla_value, projection_input), and the log-sum-exp",
             "rope: Megatron's fused YaRN kernel (fused_mla_yarn_rope_apply.py) rotates q in place and writes k and "
             "v new, keeping only the layer's cached cos and sin, s x d_rope each in 16 bits, buffers of the "
             "layer (4s·d_rope bytes a layer), not counted as activations; --rotary-scaling-factor and --mscale "
             "change values only",
             "MLA's core: TE's cuDNN fused attention, as TE picks it on Hopper (cuDNN 9.5 or newer) for d_qk + d_rope "
             "!= d_v; under FlashAttention 3 (NVTE_FUSED_ATTN=0) TE copies q, k and v and, at b > 1, the output "
             "(2sb·a·d_v/t more), and on A100 it falls back to its unfused attention: neither is modelled",
             "peak within the forward: the kv down projection's whole output, [N, kv_r + d_rope], stays referenced "
             "until the attention returns (a transient of the layer being run, not counted)"]
    if arch.head_dim is not None:
        notes.append(f"--kv-channels {arch.head_dim} is not read by multi-latent attention (its widths are "
                     "--qk-head-dim, --qk-pos-emb-head-dim and --v-head-dim)")
    return notes


def _mtp_notes(spec: Spec) -> list:
    """What multi-token prediction adds, and where."""
    d = spec.architecture.mtp_layers
    if not d:
        return []
    return [f"multi-token prediction (--mtp-num-layers {d}): megatron-core 0.16.1's MultiTokenPredictionBlock on the "
            f"last stage: {d} more layer{'s' if d > 1 else ''} of the model's last kind, counted as layers of that "
            "stage (none under full recompute, where each is checkpointed whole and keeps its arguments, the "
            "embedding's output and the hidden states), each with its tokens, norms, eh_proj input and, under SP, "
            "the whole gathered input its layer's first norm keeps (mtp_*); the output layer keeps the main and the "
            f"{d} predictions' hidden states as one tensor and the loss {d} more fp32 logits; at p > 1 the last stage "
            "holds its own copy of the word embedding (parameters); the losses' [b, s] tensors are not counted"]


def _eager_core_notes(spec: Spec, rows: tuple) -> list:
    """The local core's softmax: the fused kernel where it runs; where it does not (or is switched
    off), torch's fallback, what it keeps, and the paper's rows with the kernel's bytes beside."""
    arch, values = spec.architecture, spec.rule_values()
    if not torch_softmax(spec.architecture_at(spec.run.tensor_parallel)):
        return ["attention core: eager (Megatron-Core's local DotProductAttention, the paper's): keeps the s² "
                "softmax output of its fused causal softmax, which runs here (16 < s <= 4096, 4 | s, b·a/t a "
                "multiple of the kernel's rows a block; elsewhere Megatron's torch fallback is counted)"]
    why = ("switched off (--no-masked-softmax-fusion)" if not arch.masked_softmax_fusion else
           f"does not run here: {rules.fused_softmax_reason(values)}")
    return [f"attention core: eager (Megatron-Core's local DotProductAttention): its fused causal softmax {why}, "
            f"so Megatron runs torch's softmax (fused_softmax.py, FusedScaleMaskSoftmax.forward_torch_softmax), "
            f"which keeps {_torch_softmax_keeps(arch)}", _paper_rows_note(spec, rows)]


def _torch_softmax_keeps(arch: Architecture) -> str:
    """What forward_torch_softmax and the ops after it keep, in words."""
    if arch.softmax_in_fp32:
        kept = ("in fp32 (--attention-softmax-in-fp32): its fp32 output (softmax_output_fp32, 4as²b/t), "
                + ("and the dropout keeps only its mask of the 16-bit copy" if arch.attention_dropout else
                   "and its 16-bit copy, which ·V keeps (softmax_output, 2as²b/t)"))
    else:
        kept = "in 16 bits: its output (softmax_output, 2as²b/t), the fused kernel's bytes"
    mask = ("the dataloader's mask it fills, under every recompute mode (attention_mask: masked_fill_ keeps it)"
            if arch.attention_mask else
            "the causal mask it makes at each call and fills the scores with (softmax_causal_mask: "
            "get_default_causal_mask, s² bytes of bool a layer, whole on every rank, not cached)")
    return f"{kept}; and {mask}; its backward is not in place (a 'softmax' moment of the peak floor)"


def _paper_rows_note(spec: Spec, rows: tuple) -> str:
    """Each technique row on torch's softmax, beside the paper's value: the same row with the fused
    kernel's bytes (Table 2's closed form for the paper's layer)."""
    fused = replace(spec.architecture, masked_softmax_fusion=True)
    shown = []
    for row in rows:
        t = spec.technique_t(row.technique)
        if row.technique.partial or not torch_softmax(spec.architecture_at(t)):
            continue
        bindings = spec.bindings_at(t)
        paper = engine.exact(engine.per_layer_bytes(row.technique, fused), bindings)
        shown.append(f"{row.technique.name} {row.per_layer_bytes:,} B (paper {paper:,} B)")
    return ("per layer here on torch's softmax, and the paper's value beside (the same row with the fused "
            "kernel's bytes): " + "; ".join(shown))


def _layer_backward_note(arch: Architecture) -> str:
    """The moments of the last layer's backward the floor takes (actmem.memory.backward), as the verdict's note
    names them."""
    if "layer_backward" in arch.code.has:
        return ", or inside the last layer's backward its fc1's and its eager core's gradients (actmem.memory.backward)"
    if backward.modelled("swiglu", None, arch):
        return ", or inside the last layer's backward its SwiGLU product's gradients (actmem.memory.backward)"
    return ""


def _every_layer_moe(arch: Architecture) -> bool:
    """A mixture of experts in every layer (--moe-layer-freq 1, or a pattern of 1s)."""
    freq = arch.moe_layer_freq
    return bool(arch.moe) and (freq == 1 if isinstance(freq, int) else all(freq))


def _recompute_notes(spec: Spec) -> list:
    """What --recompute-modules other than Megatron's default does to the rows; transformers' checkpointing."""
    modules = spec.run.recompute_modules
    if spec.architecture.code.full_recompute_note and spec.run.recompute is Recompute.FULL:
        return [spec.architecture.code.full_recompute_note]
    if modules is None:
        return []
    notes = [f"selective recompute of {' and '.join(modules)} (Megatron's --recompute-modules)"
             + ("" if "core_attn" in modules else ": the attention core is not recomputed, its rows are kept")]
    if "mlp" in modules and _every_layer_moe(spec.architecture):
        notes.append("recompute module mlp changes no byte here: Megatron recomputes a dense layer's MLP only "
                     "(transformer_layer.py: recompute_mlp where not is_moe_layer), and every layer here has experts")
    elif "mlp" in modules:
        kept = ("Transformer Engine fuses its norm into linear_fc1, so the MLP keeps only the norm's input "
                "(mlp_layernorm_input, one storage with the checkpoint's)" if te_layer_spec(spec.architecture) else
                "the eager core runs in Megatron's local spec, whose norm is a module of its own before the MLP, "
                "so the MLP keeps the norm's output (fc1_input, the checkpoint's input) and the norm its input")
        notes.append("recompute module mlp: Megatron checkpoints the MLP (transformer_layer.py, _forward_mlp: "
                     f"tensor_parallel.checkpoint(self.mlp, ...)); {kept}; the mask of the bias-dropout-add "
                     "after it is kept")
    if "layernorm" in modules and not (latent(spec.architecture) or moe(spec.architecture)):
        notes.append("recompute module layernorm changes no byte here: Megatron recomputes only a norm of its "
                     "own, and Transformer Engine fuses both norms into the next linear (input_layernorm and "
                     "pre_mlp_layernorm are IdentityOps in its layer spec)")
    return notes


def _fsdp_notes(spec: Spec) -> list:
    from actmem.model.implementation import RESHARD_POLICIES

    if not spec.run.fsdp:
        return []
    n = spec.microbatches
    batch = (f"{n} microbatches a step: after the first, every group's sharded gradients are held" if n and n > 1 else
             "one microbatch a step" + ("" if n else " (no --global-batch: torchtitan's default, no gradient "
                                                     "accumulation)"))
    return [f"FSDP2 (torch 2.13's fully_shard) as torchtitan 018740b7 applies it (apply_fsdp): groups of the token "
            f"embedding, each block and (norm, output), bf16 compute and fp32 reduce; "
            f"{RESHARD_POLICIES[spec.run.fsdp_reshard]} (--fsdp-reshard-after-forward {spec.run.fsdp_reshard}); "
            f"{_fsdp_mesh(spec)}; "
            f"{batch}; rank 0, which keeps ceil(rows/d) of each parameter, is counted",
            "FSDP2's peak counts the gathered bf16 weights of the group computing and the one prefetched, the output "
            "layer's bf16 gradients and fp32 reduce-scatter input, and the sharded gradients where they are held; "
            "not the activation gradients, the last block's own gradients as its backward makes them, nor the "
            "allocator's separate pools for the all-gather and reduce-scatter streams (reserved memory above "
            "allocated)"]


def _megatron_fsdp_notes(spec: Spec, parameters: ParameterBytes) -> list:
    """Megatron-FSDP's model state (actmem.memory.megatron_fsdp), and what its peak leaves out."""
    from actmem.model.implementation import MEGATRON_FSDP_STRATEGIES

    strategy = spec.megatron_fsdp_strategy
    parts = zip(("16-bit weights", "main gradients", "fp32 main weights and Adam's moments"),
                MEGATRON_FSDP_STRATEGIES[strategy])
    sharded = [part for part, split in parts if split]
    over = f"d = {spec.data_parallel}" if spec.run.context_parallel == 1 else f"d·c = {spec.optimizer_shards}"
    pooled = bool(spec.run.fsdp_double_buffer and parameters.double_buffer_bytes)
    return [f"Megatron-FSDP (megatron-core's own FSDP, --use-megatron-fsdp), --data-parallel-sharding-strategy "
            f"{strategy}: " + (f"{', '.join(sharded)} sharded over {over}" if sharded else "nothing sharded")
            + ", each in a buffer allocated once and held at every moment (param_and_grad_buffer.py), each bucket "
            "padded as build_data_parallel_buffer_index lays it out (chunks of the lcm of its parameters' row sizes, "
            "d·c of them a multiple; a bucket a layer and the rest, under no_shard every parameter, in one bucket or, "
            "under --overlap-grad-reduce, in buckets of --ddp-bucket-size): "
            f"{parameters.buckets.padded:,} elements for {parameters.count:,} parameters "
            f"(+{100 * (parameters.buckets.padded - parameters.count) / parameters.count:.2f}%); its "
            "gradients in --megatron-fsdp-main-grads-dtype (auto: the weights' dtype; Megatron-LM d98e8a64), its main "
            "weights fp32; Megatron-FSDP v1 turns the distributed optimizer on (arguments.py), which builds nothing "
            "of its own here", _megatron_fsdp_transients(pooled, parameters.buckets.one_rank)] + (
        _idle_double_buffer(spec, parameters)) + (
        _megatron_fsdp_fp8(spec, parameters)) + (
        ["under optim_grads_params the weights outside its units (the embedding, the output layer, the final norm) "
         "are gathered in the forward and kept until the backward's end (megatron_fsdp.py, _root_pre_backward: "
         "only the units' buckets are released): their padded bucket counted whole beside their shards ('gathered "
         "weights')"]
        if parameters.buckets.sharded(strategy)[0] else [])


def _megatron_fsdp_transients(double_buffer: bool, one_rank: bool = False) -> str:
    """What of Megatron-FSDP's step the peak floor counts beside its buffers, and what it leaves out."""
    if one_rank:
        return ("over one data-parallel rank Megatron-FSDP distributes no buffer (param_and_grad_buffer.py: "
                "is_data_distributed needs a group of more than one): nothing is gathered and no bucket allocated, its "
                "buffers whole; not counted: under 16-bit main gradients the optimizer's fp32 copy of the gradients "
                "(update_main_grads, from the backward's end to the step)")
    units = ("under --fsdp-double-buffer the units' gathered weights (where sharded) and gradient buckets (where "
             "sharded) are in fixed pools of min(L, 2) buffers each (param_and_grad_buffer.py, FixedPoolAllocator: "
             "'double buffers'), held at every moment from the first backward on, its prefetch stopped at two units; "
             "in the last layer's backward moments beside them the no-unit group's gradient buckets that the final "
             "norm's and output layer's backward made (held in the reduce-scatter queue), its reduce-scatters in "
             "place; not counted: " if double_buffer else
             "Megatron-FSDP's transients in the last layer's backward moments: its unit all-gathered again, the units "
             "its prefetch window gathers ahead (half of max(10⁹ elements, two units)), its gradient bucket and the "
             "no-unit group's that the final norm's and output layer's backward made (held in the reduce-scatter "
             "queue), and before the layers' backward the first units the final norm's forward prefetch gathered "
             "again; not counted: the reduce-scatters' outputs, ")
    return (units + "the gradient buckets queued in the backward's later moments, and under 16-bit main gradients the "
            "optimizer's fp32 copy of the gradient shard (update_main_grads, from the backward's end to the step): the "
            "peak floor is below the run's by those")


def _megatron_fsdp_fp8(spec: Spec, parameters: ParameterBytes) -> list:
    """FP8 beside Megatron-FSDP: where its FP8 weights live, or TE's cached copies."""
    if not spec.architecture.fp8:
        return []
    if not parameters.buckets.fp8_shard:
        return ["FP8 without --fp8-param-gather beside Megatron-FSDP: its buckets hold bf16 weights, and TE caches "
                "each linear's FP8 weight (on Hopper with its transpose) for the iteration's microbatches, whole on "
                "every rank ('FP8 weight state': Megatron-FSDP shards the bf16 weights it casts, not the cache)"]
    return ["--fp8-param-gather beside Megatron-FSDP: each unit's TE linears' weights are a group of their own "
            "(param_and_grad_buffer.py, _get_parameter_groups: dtype float8), laid out and padded apart from its norms "
            "and biases, 1 B an element in the weights' buffer and gathered (and in the double buffers where they are) "
            f"({parameters.buckets.fp8_shard:,} elements of the shard); their gradients in the main gradients' dtype, "
            "their main weights fp32; their Hopper transposes made in each layer's forward (TE's quantize_weight) and "
            "after each unit's backward all-gather (megatron_fsdp.py: fp8_create_transpose_cache), dropped at each "
            "release, counted at the last layer's backward moments (the forward's one layer at a time, below the "
            "loss's moment); TE's FP8 scaling state kept"]


def _idle_double_buffer(spec: Spec, parameters: ParameterBytes) -> list:
    """A note where --fsdp-double-buffer is given and changes nothing: no pool is ever fetched into."""
    if not spec.run.fsdp_double_buffer or parameters.double_buffer_bytes:
        return []
    why = ("over one data-parallel rank no buffer is distributed" if parameters.buckets.one_rank else
           "it makes no units" if spec.megatron_fsdp_strategy == "no_shard" else
           "its units' weights and gradients are whole buffers, fetched as views")
    return [f"--fsdp-double-buffer changes nothing under {spec.megatron_fsdp_strategy}: {why} "
            "(param_and_grad_buffer.py: the fixed pools are allocated into only for sharded buckets of units)"]


def _zero_notes(spec: Spec) -> list:
    from actmem.model.deepspeed import DEEPSPEED_VERSION, TRAINER

    zero = spec.run.zero
    if not zero:
        return []
    n = spec.microbatches
    optimizer = ("the Trainer's fused torch AdamW in two groups, decayed and not (no optimizer section)"
                 if zero.optimizer == TRAINER else "DeepSpeed's FusedAdam over one group (the optimizer section)")
    auto = dict(zero.auto)

    def resolved(key: str) -> str:
        return f" (\"auto\": the Trainer's {'h²' if key == 'reduce_bucket_size' else '10·h'})" if key in auto else ""

    whole = (f"; parameters of at most {zero.persistence_threshold:,} elements kept whole on every rank "
             f"(stage3_param_persistence_threshold{resolved('param_persistence_threshold')})"
             if zero.stage == 3 else "")
    batch = (f"{n} microbatches a step (gradient accumulation)" if n and n > 1 else
             "one microbatch a step" + ("" if n else " (no --global-batch: no gradient accumulation)"))
    if zero.micro_batch is None and not zero.source.startswith("--zero-stage"):
        batch += (f"; the file gives no train_micro_batch_size_per_gpu (\"auto\": the Trainer's "
                  f"--per_device_train_batch_size, 8 by default): priced at b = {spec.run.micro_batch} (--micro-batch)")
    stage = {1: "every gradient and the reduce bucket from the earlier microbatches through the last one's, and "
                "at the reduce after the backward every gradient its first bucket did not take beside the bucket, "
                "then the all-reduce's flattened copy of that bucket or the gradient partition (under overlap_comm: "
                "its reduce in the backward, as stage 2's)",
             2: "the gradient partition from the earlier microbatches through the last one's, and at the backward's "
                "last reduce the bucket, the partition (twice with gradient accumulation) and the token embedding's "
                "gradient where it exceeds the bucket, with the all-reduce's copy of it",
             3: "the output layer's weight, gathered from its forward through the loss to its backward (tied to the "
                "embedding, to the embedding's backward where the whole model "
                f"{'three times' if spec.run.recompute is Recompute.FULL else 'twice'} over is short of "
                "stage3_max_reuse_distance), and the layers' it certainly keeps gathered too (where "
                f"{'three passes (forward, rerun, backward)' if spec.run.recompute is Recompute.FULL else 'two passes'}"
                " over the weights from that layer on are short of the distance)"}[zero.stage]
    return [f"DeepSpeed {DEEPSPEED_VERSION}'s {zero.label} as the Hugging Face Trainer runs it ({zero.source}): bf16 "
            f"weights, gradients and buckets, {optimizer}; a reduce bucket of {zero.reduce_bucket_size:,} elements"
            f"{resolved('reduce_bucket_size')}{whole}; {batch}; rank 0 of d = {spec.data_parallel} is counted (at "
            "stages 1 and 2 another rank's gradient partition can hold more, a straddling parameter at each end)",
            *zero.notes,
            f"{zero.label}'s peak counts {stage}, the gradient norm's fp64 copy of the largest piece, and the optimizer "
            "step's bf16 flatten and fp32 copy of the largest (sub-)group's gradient partition; not the reduce's "
            "other temporaries (" + ("the padded reduce-scatter copy" if zero.stage == 3 else
                                     "the flattened copies of the other buckets") + ")"
            + (", the weights ZeRO-3 prefetches or keeps gathered beyond those, its all-gather buffers"
               if zero.stage == 3 else "")
            + ", nor on a GPU the side streams' memory that the caching allocator holds for reuse"]


def _fsdp_mesh(spec: Spec) -> str:
    if spec.run.fsdp_replicate == 1:
        return f"sharded over all d = {spec.data_parallel} data-parallel ranks"
    return (f"HSDP: sharded over {spec.fsdp_shards} ranks, replicated {spec.run.fsdp_replicate} times (each gradient "
            f"reduce-scattered, then all-reduced in place over the replicas)")


def _offload_notes(spec: Spec) -> list:
    n, layers = spec.run.offload_layers, spec.model.layers
    if not n:
        return []
    freqs = (" and its copy of the fused rope's fp32 freqs (4s·d_rope bytes, shared by the layers on the GPU)"
             if spec.architecture.position_embedding == "rope" and spec.architecture.rope_fusion else "")
    return [f"CPU offloading of the first {n} of {layers} layers (--cpu-offloading-num-layers; Transformer Engine "
            f"v2.11's cpu_offload.py under megatron-core 0.16.1): every tensor an offloaded layer saves goes to the "
            f"host{freqs}; the GPU releases layer i's tensors only as layer i + {layers - n} begins, so it holds "
            f"{layers - n} layers' activations from the forward's end through the last layer's backward, and the "
            f"embedding's output (layer 0's input) until the forward returns (the forward_end moment); TE v2.11 frees "
            f"none of a layer's saved tensors inside its backward, so the last layer's backward moments keep all its rows. "
            f"The technique rows with recompute are without offloading (Megatron refuses the two together)",
            "not counted under CPU offloading: the cuDNN kernel's 16-byte RNG state and its cu_seqlens (4(b + 1) B) "
            "that each offloaded layer copies to the host too; the GPU copies of the shared rope freqs and cu_seqlens "
            "a reloaded layer makes, which put the backward of layer L - 2 a few MiB above the last layer's (below the "
            "loss's backward wherever v > h); the host's reserve rounding (PyTorch's pinned allocator rounds each "
            "block up to a power of two)"]


def _mask_notes(spec: Spec) -> list:
    """Whether the dataloader's attention mask is counted, under Megatron's code."""
    if "dataloader_mask" not in spec.architecture.code.has:
        return []
    if spec.architecture.attention_mask:
        return ["the dataloader's causal attention mask (Megatron's default, create_attention_mask_in_dataloader): "
                "b·s² bytes of bool a microbatch (under context parallelism a rank's s/c rows of it), whole on "
                "every tensor-parallel rank of the first and last stages; the recompute checkpoints (core_attn's, full recompute's) save it, so it is held while "
                "its microbatch is in flight (attention_mask); without recompute it lives only during the forward"]
    return ["no dataloader attention mask counted: Megatron makes one, b·s² bytes of bool a microbatch kept "
            "by the recompute checkpoints, unless --no-create-attention-mask-in-dataloader; --attention-mask "
            "counts it (a pasted argument list without that switch has it)"]


def _histogram_note(spec: Spec) -> str:
    """Where the load histogram puts the busiest rank (actmem.model.experts.busiest_rank)."""
    from actmem.model.experts import busiest_rank

    loads, ep = spec.run.expert_loads, spec.run.expert_parallel
    busiest = busiest_rank(loads, ep)
    first, last = busiest.experts
    where = (f"row {busiest.layer} (from 0) of the histogram's {len(loads)} (a layer a row; from Megatron's "
             "tokens_per_expert logs, an expert-parallel group's layer and microbatch)" if len(loads) > 1 else
             "the histogram")
    return (f"expert rows: from the load histogram (--moe-load-histogram): the busiest of the EP = {ep} ranks, rank "
            f"{busiest.rank} (experts {first}-{last}), receives {busiest.imbalance} (= {float(busiest.imbalance):.4g}) "
            f"x its balanced k·N·ETP rows in "
            f"{where}, and every layer is counted at that; rounded up; the router's and the permutation's rows are "
            "per token and do not scale")


def _moe_notes(spec: Spec) -> list:
    """What a mixture-of-experts layer is counted as, and what it leaves out."""
    arch, run = spec.architecture, spec.run
    if not megatron_moe(arch):          # transformers' experts: their model class's notes say what they keep
        return []
    imbalance = run.routing_imbalance
    return [
        f"mixture of experts: megatron-core 0.16.1's MoELayer (as the harness runs it on a CPU), "
        f"{arch.moe_dispatcher} dispatcher{' (Megatron default)' if arch.moe_dispatcher == 'allgather' else ''}, "
        f"{_capacity_text(arch)}, {arch.moe_score_function} top-{arch.moe_topk} of {arch.num_experts} experts"
        + ({"aux_loss": " with the aux loss", "seq_aux_loss": " with the sequence-wise aux loss"}.get(
            arch.moe_load_balancing, "") if arch.moe_aux_loss_coeff > 0 else "")
        + f", EP = {run.expert_parallel}, ETP = {run.etp}: {plural(arch.num_experts // run.expert_parallel, 'expert')} "
          f"a rank",
        *_permutation_notes(spec),
        _histogram_note(spec) if run.expert_loads is not None else "expert rows: "
        + (f"padded to capacity, each expert receives C = {spec.expert_capacity(run.tensor_parallel)} rows from each "
           f"of the EP·ETP ranks, whatever the routing (N = s·b/t a rank)" if arch.moe_pad_to_capacity else
           "balanced routing, each rank's experts receive k·N·ETP token rows (N = s·b/t a rank); the busiest "
           "rank of a real step receives more (give --moe-imbalance, e.g. 1.25 for 25% over its share)"
           if imbalance == 1 else
           f"the busiest rank's experts receive {spec.effective_imbalance} x the balanced k·N·ETP token rows "
           f"(--moe-imbalance {imbalance}"
           + (f", at most min(EP, E/k) = {spec.effective_imbalance} x: a token sends at most min(k, E/EP) of its "
              "copies to one rank" if spec.effective_imbalance != imbalance else "")
           + "), rounded up; the router's and the permutation's rows are per token and do not scale"),
        "the MoE layer's backward transients (the experts' gradients, the dispatcher's buffers, the "
        "router's weight gradient) are not in the peak floor yet: it is a floor; nor are the dispatcher's own "
        "references to its last microbatch's routing (token_dispatcher.py: alltoall's probs and routing_map, "
        "[N, E] 16-bit and bool, allgather's local_map), held once a layer until its next forward",
        *(["the expert bias's fp32 buffers (router.py: expert_bias and local_tokens_per_expert, 8E B a layer) are "
           "not counted"] if arch.moe_expert_bias else []),
        "TE's grouped GEMM (--moe-grouped-gemm) hands autograd one cached dummy weight gradient a shape from "
        "Transformer Engine 2.10 (grouped_linear.py: get_dummy_wgrad); 2.9, which megatron-core 0.16.1 allows, "
        "makes one for each expert's weight at its backward, a transient not modelled",
    ]


def _fp8_notes(spec) -> list:
    """What FP8 is counted as (actmem.model.fp8), and what it leaves out."""
    from actmem.model.fp8 import bf16_padding_multiple

    arch = spec.architecture
    if not arch.fp8:
        return []
    history = arch.fp8_amax_history_len
    scales = ("their block scales (MXFP8: E8M0 a 32 elements; blockwise: fp32 a 128)"
              if arch.fp8 in ("mxfp8", "blockwise") else "a 4-byte scale_inv")
    return [f"FP8 ({arch.fp8_format}, {arch.fp8} scaling, {spec.gpu_fp8}): Transformer Engine 2.11's linears keep "
            f"the QKV's and fc1's inputs and fc2's in one byte with {scales}"
            + (", and the projection its input quantized alone" if arch.fp8 == "delayed" else "")
            + "; the rest stays 16-bit; read off TE's source, checked in the harness against a CPU stand-in that "
            "keeps the same, not TE's own kernels",
            "FP8 not counted: the quantized gradients of the backward (its floor counts fc1's gathered input in one "
            "byte)" + (f"; under a recompute that reruns TE's linears (full, or the mlp, moe or shared_experts "
                       f"modules, the last two through TE's checkpoint), each rerun module's stash of its forward "
                       f"scales and amax history, 4·3·({history} + 1) B a module (a grouped GEMM's G times) a "
                       "microbatch in flight, and the clone it keeps after (quantization.py: "
                       "copy_forward_fp8_meta_tensors_for_recompute)" if arch.fp8 == "delayed" else "")] + (
        [f"--first-last-layers-bf16: the model's first {arch.fp8_bf16_start} and last {arch.fp8_bf16_end} layers run "
         f"outside FP8 (fp8_utils.py, is_first_last_bf16_layer: by global index), keeping 16-bit inputs and no FP8 "
         f"weight copies; on a stage of both kinds each layer is counted as its kind keeps, the stage's last "
         f"layer's kind deciding its backward's moments"
         + (f"; their experts' rows still padded, to a multiple of {bf16_padding_multiple(spec.gpu_fp8)} (TEGroupedMLP "
            f"pads whenever the run is FP8; TE's Fp8Padding outside an FP8 autocast takes the GPU's default "
            f"recipe's alignment), so kept in 16 bits over the padded rows" if arch.moe else "")
         + ("; the multi-token-prediction layers run in FP8 (Megatron's global FP8 context, no layer number)"
            if arch.mtp_layers else "")] if arch.fp8_first_last_bf16 else []) + _fp8_model_notes(spec)


def _fp8_model_notes(spec) -> list:
    """What FP8 changes in the experts, latent attention and prediction layers (actmem.model.fp8)."""
    from actmem.model.fp8 import BLOCK_RECIPES, expert_padding_rows, padding_multiple

    arch, notes = spec.architecture, []
    if arch.moe:
        align, ep = padding_multiple(arch.fp8), spec.run.expert_parallel
        notes.append(
            f"FP8 experts (TEGroupedMLP over TE's GroupedLinear): each expert's rows ({plural(arch.num_experts // ep, 'expert')} "
            f"a rank) padded to a multiple of {align}, "
            + (f"counted at their most, {expert_padding_rows(arch, ep):,} rows beside the T rows it receives (how the "
               f"rows split among the experts is not known)" if arch.num_experts // ep > 1 else
               "the T rows the rank receives rounded up")
            + f"; each expert's fc1 and fc2 "
            f"inputs kept in one byte (fc2's freed under --recompute-modules moe_act, its rerun remaking 16 bits)"
            + (", with block scales for each 128 of its rows, counted at their most too" if arch.fp8 in BLOCK_RECIPES
               else ", with a 4-byte scale_inv each")
            + "; the weighted SwiGLU's 16-bit input over the padded rows; the router 16-bit"
            + ("; the shared experts' fc2 input in one byte, fc1 its input quantized under delayed scaling, its "
               "original input (the router's) otherwise" if arch.moe_shared_ffn is not None else ""))
    if arch.multi_latent_attention:
        notes.append("FP8 multi-latent attention: the q and kv linears on the input norm's output keep a one-byte "
                     "copy each (its 16-bit output kept by neither); the up projections the latents quantized "
                     + ("(their fused norms' outputs; the norms keep their 16-bit inputs)" if arch.qk_norm
                        else "(the latents themselves)"))
    if arch.mtp_layers:
        notes.append("FP8 multi-token prediction: its layers run in FP8 whatever their number (Megatron asks its FP8 "
                     "context for none); eh_proj keeps its input in one byte")
    return notes


def _capacity_text(arch) -> str:
    if arch.moe_capacity_factor is None:
        return "dropless"
    return (f"capacity factor {arch.moe_capacity_factor:g} (C = ⌈k·N/E·factor⌉ rows an expert takes from a rank, "
            f"dropping by {arch.moe_drop_policy}" + (", padded to C" if arch.moe_pad_to_capacity else "") + ")")


def _permutation_notes(spec) -> list:
    """What the permutation keeps where it is not 0.16.1's unfused masked_select, and Megatron-LM main's."""
    arch = spec.architecture
    if arch.moe_permute_fusion:
        return ["--moe-permute-fusion: TE's fused permutation keeps an int32 row map (and, sorting by several local "
                "experts, an int32 [T] map each way), read off TE 2.9-2.11's permutation.py; the harness checks "
                "megatron-core keeps nothing beside it over a CPU stand-in, not TE's Triton kernels"]
    if arch.moe_pad_to_capacity and arch.moe_dispatcher == "alltoall":
        return []
    return ["Megatron-LM's main branch (d98e8a64, 2026-08) permutes with an argsort whose [E·N] int64 result stays "
            "pinned (8sbE/t a layer) in place of 0.16.1's bool map and 16-bit probabilities (3sbE/t)"]


def notes(spec: Spec, occupancy: StageOccupancy, rows: tuple, parameters: ParameterBytes) -> tuple:
    """What an estimate assumes and leaves out, in the order a reader meets it: widths, dropout, the
    attention core, recompute, the mask, the pipeline, the peak, parameters and model state."""
    arch = spec.architecture
    grad = spec.gradient_bytes
    grad_text = f"{grad} B {'fp32' if grad == GRADIENT_BYTES else '16-bit'} gradient"
    adam = spec.optimizer
    per_parameter = WEIGHT_BYTES + grad + adam.bytes_per_parameter
    notes = [
        f"activations 16-bit ({ACTIVATION_BYTES} B), dropout masks {MASK_BYTES} B, logits fp32 "
        f"({LOGITS_BYTES} B) (section 4); "
        + ("the norms' fp32 statistics counted"
           + (" (TE's fused norms keep them)" if "te_flash_core" in arch.code.has else "")
           if counts_norm_statistics(arch) else "layer-norm mean/variance left out, as in the paper")
        + "; small buffers left out",
        f"dropout: attention {arch.attention_dropout:g}, hidden {arch.hidden_dropout:g}"
        + ("" if arch.attention_dropout and arch.hidden_dropout else
           " (a dropout of 0 keeps no mask, and no attention dropout keeps no separate output)"),
        *_attention_notes(spec, rows),
        *_moe_notes(spec),
        *_fp8_notes(spec),
        *_mtp_notes(spec),
        *_recompute_notes(spec),
        *_offload_notes(spec),
        *_fsdp_notes(spec),
        *_zero_notes(spec),
        *_mask_notes(spec),
        ("every layer on one stage (p = 1)" if spec.run.pipeline_parallel == 1 else
         "first pipeline stage" if occupancy.stage == 0 else f"pipeline stage {occupancy.stage}")
        + f": {occupancy.explanation}"
        + ("" if occupancy.holds_output_layer else
           "; the output-layer terms of section 4.5 sit on the last stage (p > 1)")
        + ("" if occupancy.stage == 0 else "; the embedding sits on the first stage"),
        "the technique rows share this run's pipeline and microbatch and vary only t, SP and "
        "recompute; 'none' sets t = 1, so its parameters are not split either"
        + (f" (but over the run's {spec.fsdp_shards} FSDP2 shards)" if spec.run.fsdp else ""),
        *([f"embedding dropout masks of {plural(occupancy.microbatches, 'microbatch')}: p as "
           "section 4.5 counts under 1F1B, 2p at the peak of the interleaved schedule (the paper "
           "says p)"] if occupancy.stage == 0 and arch.hidden_dropout else []),
        "the verdict is the allocator's peak from below on the busiest pipeline stage: model state, "
        "activations in flight and, under recompute, what the first backward reruns, all live at "
        "one moment (actmem.memory.peak), or on the stage with the output layer the loss's backward "
        + ("and the fp32 logits gradients of PyTorch's cross entropy"
           if "cross_entropy_fp32_gradients" in arch.code.keeps_for(arch) else "and its 16-bit logits gradient")
        + _layer_backward_note(arch)
        + "; not counted yet: the other ops' backward transients "
        "(the flash core's, the QKV and projection linears', fc2's, a recomputed MLP's), allocator "
        "fragmentation, workspace and communication buffers",
        f"parameters: layers of {_layer_formula(arch)} each, word embedding split "
        "over the vocabulary on the first stage" + (
            ", tied with the output layer (the last stage keeps a copy when p > 1)" if arch.tied_output
            else "; the output layer's own weights on the last stage")
        + (_positions_note(arch, spec.model.seq_len) if arch.position_embedding == "learned" else
           "; rotary positions have no parameters"),
    ]
    if spec.run.megatron_fsdp:
        notes += _megatron_fsdp_notes(spec, parameters)
    elif spec.run.distributed_optimizer:
        notes.append(f"{WEIGHT_BYTES} B weight + {grad_text} + {adam.describe()} / "
                     + (f"d = {spec.data_parallel}" if spec.run.context_parallel == 1 else
                        f"d·c = {spec.optimizer_shards}")
                     + " (the distributed optimizer) a parameter"
                     + ("; over one data-parallel rank it shards nothing (Megatron allows it): the plain "
                        "optimizer's bytes" if spec.optimizer_shards == 1 else ""))
        if arch.moe:
            notes.append(f"the experts' optimizer state is sharded over the expert data-parallel ranks, "
                         f"gpus/(ETP·EP·p) = {spec.expert_optimizer_shards} (parallel_state.py: "
                         f"expert_data_parallel_size), the rest over d·c")
        notes.append("not counted: the distributed optimizer's buffer padding (optimizer/param_layout.py: each "
                     "parameter's start aligned to 64 elements, each bucket's end to lcm(d·c, 128)): at most 63 "
                     f"elements a parameter tensor and lcm(d·c, 128) a bucket, {WEIGHT_BYTES + grad} B each")
    elif not spec.run.fsdp and not spec.run.zero:      # FSDP2's and ZeRO's model state: their own notes
        notes.append(f"{per_parameter} B a parameter: {WEIGHT_BYTES} B weight + {grad_text} + "
                     f"{adam.describe()} (mixed-precision Adam)")
    sharded = spec.run.distributed_optimizer or spec.megatron_fsdp_strategy not in (None, "no_shard")
    shard = -(-parameters.count // (spec.optimizer_shards if sharded else 1))
    notes += adam.notes(shard)
    if grad != GRADIENT_BYTES and not adam.precision_aware:
        notes.append(f"16-bit main gradients ({'Megatron-FSDP' if spec.run.megatron_fsdp else 'DDP'}'s buffer in "
                     "the parameters' dtype): the optimizer step then "
                     "copies its gradients to fp32 (`.float()`, 4 B a parameter of its shard) after the last "
                     "backward has freed the activations; that moment is not counted in the peak floor")
    if unfused_weight_gradients(arch):
        notes.append("no gradient accumulation fusion (--no-gradient-accumulation-fusion): no dummy weight gradients; "
                     "each linear makes a 16-bit weight gradient at its backward (TE linear.py: the wgrad GEMM with no "
                     f"out), which {'Megatron-FSDP' if spec.run.megatron_fsdp else 'DDP'}'s hook adds to main_grad "
                     "and frees: fc1's is in its backward moment; the "
                     "others' (QKV, projection, fc2, the output layer's) at their own moments are not counted")
    elif "wgrad_fusion" in arch.code.has:
        notes.append("dummy weight gradients: under Megatron's DDP each linear that accumulates into main_grad "
                     "hands autograd an uncomputed 16-bit tensor of its weight's shape, and Transformer Engine "
                     "(get_dummy_wgrad, since its PR #1651, 2025) keeps one a shape for the process; older releases make one at "
                     "each weight gradient instead, a transient not modelled")
    if spec.run.gpus is None:
        notes.append("GPU count unknown: data parallel size taken as 1")
    if spec.padded_vocab != spec.model.vocab and arch.code.pads_vocab:
        notes.append(f"vocabulary {spec.model.vocab} padded to {spec.padded_vocab} "
                     f"(a multiple of {spec.vocab_divisible_by}·t, as Megatron does)")
    elif spec.padded_vocab != spec.model.vocab:
        notes.append(f"vocabulary {spec.model.vocab} sharded unevenly over t (DTensor pads none): "
                     f"rank 0 holds {spec.padded_vocab // spec.run.tensor_parallel:,} rows, counted as if "
                     f"v were {spec.padded_vocab:,}")
    return tuple(notes) + arch.code.notes_for(arch) + spec.notes
