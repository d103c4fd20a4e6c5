"""A small, transparent model of the time per iteration, each part shown.

    time = (compute + tensor-parallel + context-parallel + expert-parallel + pipeline point-to-point
            communication) x pipeline bubble + data-parallel communication

Arithmetic on numpy arrays (one element per configuration). Only the data-parallel communication
is taken as overlapped, where Megatron's switches say so (exposed_data_parallel_seconds): a ranking
model, not a promise.
"""

import numpy as np

from actmem.model.architecture import flash_attn, te_flash_core
from actmem.planner.flops import hardware_parts
from actmem.memory.techniques import PLAN_CHOICES
from actmem.model.recompute import Recompute
from actmem.model.widths import ACTIVATION_BYTES, GRADIENT_BYTES, WEIGHT_BYTES


def compute_seconds(B, s, L, h, v, recompute, gpus, peak_flops, efficiency, arch, heads, share=1):
    """Hardware FLOPs (recompute included) shared by all GPUs, each part (the layers' matmuls, the
    attention scores, the logits: flops.hardware_parts) at its efficiency x peak (an even pipeline's
    stage; the planner scales an uneven one's by its slowest stage). efficiency: one share of the
    peak for every part, or a (layers, scores, logits) triple of them (kernel_efficiencies). share:
    of what the recompute choice reruns, the part run (Megatron's block method: N of a chunk's
    layers)."""
    plain = hardware_parts(B, s, L, h, v, Recompute.NONE, arch, heads)
    chosen = [hardware_parts(B, s, L, h, v, choice.granularity, arch, heads, choice.modules, choice.ops)
              for choice in PLAN_CHOICES.values()]
    parts = [base + share * (sum((recompute == name) * rerun[part] for name, rerun in zip(PLAN_CHOICES, chosen)) - base)
             for part, base in enumerate(plain)]
    if not isinstance(efficiency, tuple):
        return sum(parts) / (gpus * efficiency * peak_flops)
    return sum(part / eff for part, eff in zip(parts, efficiency)) / (gpus * peak_flops)


def other_seconds(table, arch, h, a, v, t, etp, ep, rows, sequence_parallel) -> dict:
    """The memory-bound kernels of a rank beside its GEMMs and attention core, forward and backward
    (kernels.elementwise_seconds): {'layer': kind -> a layer's seconds, 'loss': the loss's}. A layer's
    two norms and two residual adds (and their gradients' two adds) on its h-wide rows, the sequence
    shard under sequence parallelism (T/t) or all T without; rope over its q and k heads, (a + g)d/t
    wide, as a one-read-one-write op (Megatron's fused rope); the activation over the MLP's f/t (GeLU's
    table for squared ReLU), a MoE layer's over each local expert's rows. The loss: cross entropy over
    fp32 logits, v/t wide. Not counted: dropout (Megatron fuses it into the residual add), the MoE
    permutation's copies, the router's softmax and top-k, the optimizer step."""
    from actmem.planner import kernels

    norm = "rms_norm" if arch.normalization == "rmsnorm" else "layer_norm"
    boundary = np.where(sequence_parallel, rows / t, rows) * h
    rope = rows * _rotated_width(arch, h, a) / t if arch.position_embedding == "rope" else 0
    activation = arch.activation

    def layer(kind):
        if kind.moe:
            mlp = (kind.num_experts / ep) * kernels.activation_seconds(
                table, activation, _expert_rows(kind, rows, t, ep, etp) * kind.expert_ffn(h) / etp)
            if kind.moe_shared_ffn is not None:
                mlp = mlp + kernels.activation_seconds(table, "swiglu", rows * kind.moe_shared_ffn / t)
        else:
            mlp = kernels.activation_seconds(table, activation, rows * kind.ffn(h) / t)
        seconds = 2 * kernels.elementwise_seconds(table, norm, boundary) + 4 * kernels.elementwise_seconds(
            table, "add", boundary) + mlp
        return seconds + (kernels.elementwise_seconds(table, "scale", rope) if np.any(rope) else 0.0)

    return {"layer": layer, "loss": kernels.elementwise_seconds(table, "cross_entropy", rows * v / t)}


def _expert_rows(kind, rows, t, ep, etp):
    """The rows each of a rank's experts receives, balanced: k·(T/t)·EP·ETP/E (its share of the k
    copies of the T/t tokens each of the EP·ETP ranks routes)."""
    return kind.moe_topk * rows / t * ep * etp / kind.num_experts


def _rotated_width(arch, h, a):
    """The q and k widths rope runs over: a·d + g·d, or under multi-latent attention q's and k's
    a·(d_qk + d_r) each (Megatron rotates their rope parts in place in the whole tensors)."""
    if arch.multi_latent_attention:
        from actmem.model.latent import query_width

        return 2 * query_width(arch, a)
    return arch.attention_width(h, a) + arch.kv_width(h, a)


def kernel_efficiencies(table, arch, s, h, a, v, L, t, c, b, ep, etp, peak_flops, sequence_parallel=True):
    """(layers, scores, logits): the share of the peak each part of compute_seconds runs at on one
    rank, from the kernels measured on its GPU (kernels.py) at the shapes the rank runs; t, c, b,
    ep, etp arrays (one a configuration).

    The layers' matmuls: the FLOPs over the measured seconds of the linears (flops.attention_linears,
    mlp_linears) of a layer of each kind, weighted by the number of such layers (a MoE model's
    dense layers at its dense twin's). A linear runs on T = s·b/c rows (its sequence shard, gathered
    over t under sequence parallelism), its outputs split by t ('column') or its inputs ('row'); a
    'whole' one on the rank's T/t tokens; a routed expert's on k·(T/t)·EP·ETP/E rows (its share of
    the routed tokens, balanced) split by ETP, E/EP of them. The scores: the attention core
    (kernels.attention_seconds: TE's cuDNN attention under Megatron's flash core, flash-attn's or torch's
    flash otherwise), b·a/t heads,
    against their counted FLOPs (the full s², as MFU counts them); an eager core at
    DEFAULT_EFFICIENCY (no table of its softmax). The logits: the output layer's linear, v/t columns.
    Multi-token-prediction layers are not in the weighting (their FLOPs go at the layers').
    The memory-bound kernels around them (other_seconds) are charged into the layers' and the
    logits' time: their efficiency is their FLOPs over the GEMMs' and those kernels' seconds."""
    from actmem.model.experts import dense_twin
    from actmem.model.hardware import DEFAULT_EFFICIENCY
    from actmem.planner import kernels
    from actmem.planner.flops import _layer_counts, attention_linears, mlp_linears, score_width

    t, c, b, ep, etp = (np.asarray(x, dtype=float) for x in (t, c, b, ep, etp))
    rows = s * b / c
    other = other_seconds(table, arch, h, a, v, t, etp, ep, rows, sequence_parallel)

    def layer(kind):
        flops = seconds = 0.0
        for inputs, outputs, split, expert in attention_linears(h, kind, a) + mlp_linears(h, kind):
            if expert:
                count, tokens = kind.num_experts / ep, _expert_rows(kind, rows, t, ep, etp)
                inputs, outputs = (inputs, outputs / etp) if split == "column" else (inputs / etp, outputs)
            else:
                count, tokens = 1.0, rows / t if split == "whole" else rows
                inputs, outputs = ((inputs, outputs / t) if split == "column" else
                                   (inputs / t, outputs) if split == "row" else (inputs, outputs))
            flops = flops + count * 6.0 * tokens * inputs * outputs
            seconds = seconds + count * kernels.linear_seconds(table, tokens, inputs, outputs)
        return flops, seconds + other["layer"](kind)

    own, dense = _layer_counts(L, arch)
    kinds = [(arch, own)] + ([(dense_twin(arch), dense)] if dense else [])
    flops, seconds = (sum(n * part for n, part in zip((n for _, n in kinds), parts))
                      for parts in zip(*(layer(kind) for kind, _ in kinds)))
    layers = flops / seconds / peak_flops
    logits = 6.0 * rows * h * v / t / (kernels.linear_seconds(table, rows, h, v / t) + other["loss"]) / peak_flops
    if arch.attention_core == "eager":
        return layers, np.full_like(layers, DEFAULT_EFFICIENCY), logits
    width = score_width(h, arch, a)
    # TE's own attention runs cuDNN's fused kernel; its flash-attn core (--attention-core flash-attn), flash-attn's
    backend = "cudnn" if te_flash_core(arch) and not flash_attn(arch) else "flash"
    attention = kernels.attention_seconds(table, backend, b * a / t, s, c, head_dim=width / (2 * a))
    return layers, 3 * 2.0 * b * s * s * width / (t * c) / attention / peak_flops, logits


def bubble_factor(p, m, n):
    """Pipeline flush: 1 + (p-1)/(m·n) for n microbatches and m chunks a rank."""
    return 1 + (p - 1) / (m * n)


def tensor_parallel_seconds(s, b, h, stage_layers, t, n, recompute, bandwidth, share=1, mlp_share=1):
    """Each layer of a stage (stage_layers: the slowest's, L/p when even) all-reduces its
    2sbh-byte output twice forward and twice backward, and again what recompute reruns: both
    forward ones with full recompute, the MLP's with the MLP recomputed (the attention core
    has none); sequence parallelism moves the same bytes as an all-gather plus a
    reduce-scatter. A ring moves 2(t-1)/t of the buffer a GPU. share: of the rerun, the part
    run (compute_seconds). mlp_share: the layers whose MLP has these collectives, a dense MLP's or
    a MoE layer's shared experts (a MoE layer's routed experts exchange their tokens through the
    dispatcher instead: expert_parallel_seconds)."""
    per_layer = 2 + 2 * mlp_share + share * sum((recompute == name) * _rerun_collectives(choice, mlp_share)
                                                for name, choice in PLAN_CHOICES.items())
    volume = n * stage_layers * per_layer * 2 * (t - 1) / t * ACTIVATION_BYTES * s * b * h
    return volume / bandwidth


def _rerun_collectives(choice, mlp_share=1):
    """Forward collectives of a layer that recompute runs again: torchtitan's per-op checkpointing caches the
    reduce-scatters and reruns the all-gathers, half of each (sequence parallelism's, which torchtitan's plan
    always has; under plain TP it would rerun the all-reduces whole)."""
    if choice.ops:
        return (1 + mlp_share) / 2
    if choice.granularity is Recompute.FULL:
        return 1 + mlp_share
    return mlp_share * int(choice.granularity is Recompute.SELECTIVE and "mlp" in choice.modules)


def context_parallel_seconds(s, b, stage_layers, t, c, n, recompute, kv_width, bandwidth, share=1):
    """The p2p ring sends each rank's k and v (2 x 2·s·b·gd/t bytes, s here the rank's own
    tokens) round the c ranks: c - 1 hops forward, and in backward k, v and their gradients
    again, 3 x (c - 1) in all (4 with full recompute's second forward). Not overlapped with
    the attention here, though TE overlaps it."""
    passes = 3 + share * sum(recompute == name for name, choice in PLAN_CHOICES.items()
                             if choice.granularity is Recompute.FULL and not choice.ops)
    volume = n * stage_layers * passes * (c - 1) * 2 * ACTIVATION_BYTES * s * b * kv_width / t
    return volume / bandwidth


def data_parallel_seconds(parameters, d, distributed_optimizer, bandwidth, gradient_bytes=GRADIENT_BYTES):
    """Once an iteration: all-reduce the gradients (2(d-1)/d x 4 B a parameter in fp32, 2 B in
    16 bits); the distributed optimizer reduce-scatters them and all-gathers 16-bit weights
    instead ((d-1)/d x (4 + 2) B). (reduce, gather) seconds."""
    reduce = parameters * gradient_bytes * (2 - distributed_optimizer) * (d - 1) / d / bandwidth
    return reduce, parameters * WEIGHT_BYTES * distributed_optimizer * (d - 1) / d / bandwidth


#: the parameters of a gradient bucket under Megatron's training script: max(40M, 1M·d·c)
#: (training.py, ddp_bucket_size; distributed_data_parallel.py takes 1M·d alone)
BUCKET_PARAMETERS, BUCKET_PER_RANK = 40_000_000, 1_000_000


def exposed_data_parallel_seconds(reduce, gather, parameters, d, m, forward, backward, overlap_grad_reduce,
                                  overlap_param_gather, embedding=0):
    """What of the data-parallel communication (data_parallel_seconds) the iteration waits for.
    Without overlap, all of it: one reduction after the last backward, the gather in the optimizer
    step. --overlap-grad-reduce: the stage's buckets reduce as their gradients are complete in the
    last microbatch's backward (param_and_grad_buffer.py, register_grad_ready; no_sync before), and
    stages past the first reduce theirs as the pipeline drains, so what exceeds one microbatch's
    backward (``backward`` seconds: 2/3 of its compute, more where the backward reruns a forward) waits, and
    at least the last bucket's (the first layers',
    BUCKET_PARAMETERS of the stage's; a bucket closes on a whole parameter, so the first stage's last
    holds at least the word embedding, `embedding` parameters: param_and_grad_buffer.py builds them
    in reverse order) or, interleaved (m > 1), the first chunk's whole reduction, 1/m
    (each chunk reduces once its last backward is done). --overlap-param-gather (the distributed
    optimizer's rows): the all-gather runs ahead of the next iteration's forward, bucket by bucket
    (the forward pre-hook's finish_param_sync), so what exceeds a microbatch's ``forward`` waits,
    and at least the first bucket's (or chunk's)."""
    bucket = np.minimum(1.0, np.maximum(np.maximum(BUCKET_PARAMETERS, BUCKET_PER_RANK * d), embedding) / parameters)
    first = np.where(m > 1, np.maximum(bucket, 1 / m), bucket)
    if overlap_grad_reduce:
        reduce = np.maximum(first * reduce, reduce - backward)
    if overlap_param_gather:
        gather = np.maximum(first * gather, gather - forward)
    return reduce + gather


def fsdp_seconds(shard, embedding_shard, d, n, forward, backward, bandwidth):
    """What of FSDP2's collectives (torchtitan's, actmem.memory.fsdp) the iteration waits for. Every microbatch
    all-gathers each group's bf16 weights for its forward and, resharded after it, again for its backward, and
    reduce-scatters its fp32 gradients: (d - 1)·S elements a collective on rank 0 (d padded shards of S),
    2 + 2 + 4 B each, n times a step. Each overlaps the compute beside it (the forward's
    all-gathers one group ahead, the backward's prefetch and the reduce-scatters behind it), so what exceeds a
    microbatch's ``forward`` and ``backward`` seconds waits, and at least the token embedding's: its all-gather
    opens the forward (the root's pre-forward) and its reduce-scatter closes the backward (the root's final
    callback). The output group, which the default policy leaves gathered from its forward to its backward, is
    counted as gathered twice too (a few percent of S): a ranking model."""
    per_byte = (d - 1) / bandwidth
    gather, reduce = 2 * shard * per_byte, 4 * shard * per_byte
    first_gather, last_reduce = 2 * embedding_shard * per_byte, 4 * embedding_shard * per_byte
    return n * (np.maximum(first_gather, gather - forward) + np.maximum(last_reduce, gather + reduce - backward))


def pipeline_p2p_seconds(s, b, h, t, p, m, n, bandwidth):
    """Each microbatch crosses each of the rank's m chunk boundaries forward (activations)
    and backward (gradients): 2·m sends of 2sbh/t bytes (Megatron scatters them over the t
    tensor-parallel ranks). None with p = 1."""
    return (p > 1) * n * 2 * m * ACTIVATION_BYTES * s * b * h / t / bandwidth


def expert_parallel_seconds(s, b, h, stage_layers, t, ep, etp, n, k, dispatcher, recompute, bandwidth, share=1):
    """A MoE layer's token dispatcher (token_dispatcher.py), per microbatch, each rank's N = s·b/t tokens
    (SP): the alltoall dispatcher sends each of its k·N routed copies to its expert's rank, (EP-1)/EP of
    them away, then all-gathers the received rows over ETP ((ETP-1)·k·N rows); the combine returns them
    (reduce-scatter, all-to-all). The allgather dispatcher gathers every token of the ETP·EP ranks
    ((ETP·EP-1)·N rows, h wide) and reduce-scatters the result back. Each moves 2h bytes a row forward
    (dispatch and combine) and again backward (their gradients), and once more forward under full recompute
    (its second forward). Not overlapped here, though Megatron can overlap it (--overlap-moe-expert-parallel-comm)."""
    passes = 4 + 2 * share * sum(recompute == name for name, choice in PLAN_CHOICES.items()
                                 if choice.granularity is Recompute.FULL and not choice.ops)
    tokens = s * b / t
    rows = (k * tokens * ((ep - 1) / ep + (etp - 1)) if dispatcher == "alltoall"
            else tokens * (etp * ep - 1))
    return n * stage_layers * passes * rows * ACTIVATION_BYTES * h / bandwidth
