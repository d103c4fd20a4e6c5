"""DeepSpeed ZeRO stages 1, 2 and 3 as the Hugging Face Trainer runs them: what data-parallel rank 0 keeps,
and what its gradients and optimizer step hold at the moments of a step.

Read at DeepSpeed 0.19.8 (runtime/zero/stage_1_and_2.py, stage3.py, partition_parameters.py) with bf16
(the gradients and their buckets bf16: grad_accum_dtype and communication_data_type default to the model's
dtype), and measured to the byte on CPU ranks (validate/actmem_validate/zero.py). N: the data-parallel ranks.

Stages 1 and 2 (DeepSpeedZeroOptimizer) flatten each optimizer group g of Ψ_g elements into one bf16
buffer padded to P_g = ceil(Ψ_g / 2N)·2N (alignment 2N: l.441-446), which the model's weights are views of,
whole on every rank; rank r's partition is S_g = P_g / N of it. It keeps an fp32 master copy of its
partition (l.560), and AdamW's two moments of it: 2·P_g + 12·S_g a group. Stage 3 partitions every
parameter alone, ceil(n/N) elements a rank (_padding_size), into one bf16 buffer (lp_param_buffer) and keeps
a bf16 gradient partition of the same size for the whole run (grad_partitions_flat_buffer, stage3.py:791)
and the reduce bucket (l.780), the fp32 master copy and the moments of each sub-group, and the parameters
of at most stage3_param_persistence_threshold elements whole (2·ceil(n/N)·N each, the padded gather).
"""

from dataclasses import dataclass

from actmem.memory.parameters import ParameterBytes
from actmem.memory.peak import PeakRow
from actmem.memory.stage_model import StageMoment, with_rows
from actmem.model.deepspeed import TRAINER, ZeroConfig

WEIGHT_BYTES = 2
"""bf16 weights, gradients and gradient buckets."""
MASTER_BYTES = 4
ADAM_BYTES = 8
STEP_BYTES = 4
"""The Trainer's fused torch AdamW: one 0-dim fp32 step a (sub-)group it steps, on the GPU (torch/optim/adam.py);
DeepSpeed's FusedAdam counts in a Python int."""
NORM_COPY_BYTES = 8
"""The gradient norm's fp64 copy of each gradient piece (get_norm_dtype: fp64 on CPU and CUDA)."""
NORM_BYTES = {1: 4, 2: 4, 3: 9}
"""_global_grad_norm, fp32 at stages 1 and 2 (stage_1_and_2.py); fp64 and a bool inf_or_nan_tracker at
stage 3 (stage3.py)."""

GRADIENTS_1 = ("autograd's bf16 gradients of every parameter: ZeRO-1 reduces them after the backward "
               "(engine.allreduce_gradients), so all are held at its end")
GRADIENTS_2 = ("the bf16 gradients of the parameters in rank 0's partition, whole where one straddles its end "
               "(grads_in_partition, stage_1_and_2.py: allocated at the first reduce of one, freed by the step)")
BUCKET = ("the bf16 reduce bucket, reduce_bucket_size elements, two with overlap_comm (ipg_buckets, setup_buckets: "
          "allocated at the backward's first gradient, released after its last reduce{kept})")
MASTER_GRADIENT = ("the optimizer step's gradient of the largest (sub-)group's partition: its bf16 flatten and the "
                   "fp32 copy made of it, both live at the cast ({where})")
KEPT_GATHERED = ("the weights ZeRO-3 keeps gathered from their forward into their backward: a layer's (or the embedding's) "
                 "whose backward comes within stage3_max_reuse_distance elements of the weights used in between, "
                 "counted at most (twice the model's from that layer on), so a floor (partitioned_param_coordinator.py, "
                 "__params_to_release)")
NORM_COPY = ("the gradient norm's fp64 copy of the largest parameter's piece of rank 0's partition (get_grad_norm_direct: "
             "vector_norm(g.to(float64)) a piece)")
GATHERED_OUTPUT = ("the output layer's weight gathered whole (bf16): ZeRO-3 keeps a weight gathered while its next "
                   "use is within stage3_max_reuse_distance, and the output layer's backward follows the loss (tied "
                   "to the embedding, whose backward uses it again, it may stay gathered until then) "
                   "(partitioned_param_coordinator.py, __params_to_release)")


@dataclass(frozen=True)
class ZeroModel:
    """Rank 0 of N under ZeRO: the config, the optimizer groups (each a tuple of parameter sizes in order),
    the parameters' sizes in the model's order and the output layer's, n microbatches a step."""

    config: ZeroConfig
    d: int
    groups: tuple
    output_numel: int
    microbatches: int = 1
    kept_numel: int = 0
    """Elements of the weights besides the output layer's that ZeRO-3 certainly keeps gathered from the forward
    into the backward (``kept_through_the_turn``)."""
    output_kept: bool = False
    """Whether ZeRO-3 certainly keeps the output layer's weight gathered after its backward too: tied to the
    embedding, whose backward uses it again, within stage3_max_reuse_distance (``tied_output_kept``)."""

    @property
    def stage(self) -> int:
        return self.config.stage

    @property
    def bucket_bytes(self) -> int:
        """The reduce bucket's bf16 buffers: two at stages 1 and 2 under overlap_comm (double buffers), one at
        stage 3 whatever it says (stage3.py)."""
        return WEIGHT_BYTES * self.config.reduce_bucket_size * (1 + (self.config.overlap_comm and self.stage < 3))

    @property
    def count(self) -> int:
        return sum(sum(group) for group in self.groups)

    @property
    def _steps(self) -> int:
        """Bytes of step counters a (sub-)group."""
        return STEP_BYTES if self.config.optimizer == TRAINER else 0

    # stages 1 and 2
    def padded(self, group: tuple) -> int:
        """P_g: the group's flat buffer, padded to a multiple of 2N."""
        return -(-sum(group) // (2 * self.d)) * 2 * self.d

    def partition(self, group: tuple) -> int:
        """S_g = P_g / N: rank 0's partition of the group."""
        return self.padded(group) // self.d

    def layout(self, group: tuple) -> list:
        """(index in the group, elements, offset) of each parameter in the flat buffer's order: the group's, or
        under round_robin_gradients every N-th parameter from the first, then from the second, ...
        (_round_robin_reorder)."""
        n = len(group)
        order = ([i for start in range(self.d) for i in range(start, n, self.d)] if self.config.round_robin
                 else range(n))
        placed, offset = [], 0
        for i in order:
            placed.append((i, group[i], offset))
            offset += group[i]
        return placed

    def owned(self, group: tuple) -> list:
        """(index, elements, offset) of the parameters that begin inside rank 0's partition [0, S_g)."""
        end = self.partition(group)
        return [placed for placed in self.layout(group) if placed[2] < end]

    def largest_piece(self) -> int:
        """The most elements of one parameter inside rank 0's partition (the gradient norm's largest copy)."""
        if self.stage == 3:
            return max(self.shard(numel) for group in self.groups for numel in group)
        return max(min(numel, self.partition(group) - offset) for group in self.groups
                   for _, numel, offset in self.owned(group))

    def in_partition(self) -> int:
        """Elements of grads_in_partition on rank 0: every parameter that begins inside its partition, whole
        (get_partition_info: a parameter straddling the end counts in full)."""
        return sum(numel for group in self.groups for _, numel, _ in self.owned(group))

    # stage 3
    def shard(self, numel: int) -> int:
        return -(-numel // self.d)

    def sub_group_shards(self) -> list:
        """Rank 0's partitions of each sub-group's parameters: a group is cut where its running sum reaches
        sub_group_size (stage3.py, _create_fp16_sub_groups)."""
        subs = []
        for group in self.groups:
            shards = [self.shard(numel) for numel in group]
            if sum(shards) <= self.config.sub_group_size:
                subs.append(shards)
                continue
            current = []
            for shard in shards:
                current.append(shard)
                if sum(current) >= self.config.sub_group_size:
                    subs.append(current)
                    current = []
            if current:
                subs.append(current)
        return subs

    def sub_groups(self) -> list:
        """Rank 0's partition of each sub-group, in elements."""
        return [sum(shards) for shards in self.sub_group_shards()]

    def step_gradient_bytes(self) -> int:
        """The step's cast of the largest (sub-)group's gradient partition: its bf16 flatten and fp32 copy, or the
        fp32 copy alone where rank 0's partition is one parameter's piece (flattening one tensor returns a view)."""
        if self.stage == 3:
            return max((MASTER_BYTES + WEIGHT_BYTES * (len(shards) > 1)) * sum(shards)
                       for shards in self.sub_group_shards())
        return max((MASTER_BYTES + WEIGHT_BYTES * (self.layout(group)[0][1] < self.partition(group)))
                   * self.partition(group) for group in self.groups)

    def first_bucket(self) -> tuple:
        """(elements, whether rank 0 owns one of them, its flattened copy's elements) of stage 1's first reduce,
        walking the groups in the
        model's order (reduce_gradients): the parameters that fit in reduce_bucket_size, whose gradients it moved
        into the bucket, or the first alone where it does not fit (reduced in place, its gradient still held:
        reduce_independent_p_g_buckets_and_remove_grads)."""
        moved, taken = 0, []
        for g, group in enumerate(self.groups):           # one bucket across the groups, walked in order
            for i, numel in enumerate(group):
                if moved + numel > self.config.reduce_bucket_size:
                    break
                moved += numel
                taken.append((g, i))
            else:
                continue
            break
        owned = {(g, i) for g, group in enumerate(self.groups) for i, _, _ in self.owned(group)}
        return moved, bool(owned & set(taken or [(0, 0)])), self.reduce_copy(taken or [(0, 0)])

    def reduce_copy(self, taken: list) -> int:
        """Elements of the largest flattened copy a reduce of these parameters (group, index) makes: average_tensor
        cuts the bucket into slices, one a destination rank's partition (consecutive ones merged), and
        allreduce_and_scatter all-reduces them in runs that stop once past reduce_bucket_size, each flattened
        into a new tensor (allreduce_bucket: flattening one slice returns a view)."""
        offsets = {(g, i): offset for g, group in enumerate(self.groups) for i, _, offset in self.layout(group)}
        slices = []
        for g, i in taken:
            size, start = self.partition(self.groups[g]), offsets[g, i]
            position, end = start, start + self.groups[g][i]
            while position < end:
                rank, stop = position // size, min(end, (position // size + 1) * size)
                if slices and slices[-1][0] == rank:
                    slices[-1][1] += stop - position
                else:
                    slices.append([rank, stop - position])
                position = stop
        largest, run = 0, []
        for _, numel in slices:
            run.append(numel)
            if sum(run) > self.config.reduce_bucket_size:
                largest, run = max(largest, sum(run) * (len(run) > 1)), []
        return max(largest, sum(run) * (len(run) > 1))

    @property
    def last_gradient_oversized(self) -> int:
        """The first parameter's elements (the token embedding's, whose gradient the backward makes last) where
        they exceed the bucket: stage 2 holds that gradient whole until its reduce, at the backward's end."""
        first = self.groups[0][0]
        return first * (first > self.config.reduce_bucket_size)

    def persistent_bytes(self) -> int:
        """The parameters ZeRO-3 keeps whole on every rank, each in its padded gather (2·ceil(n/N)·N)."""
        return sum(WEIGHT_BYTES * self.shard(numel) * self.d for group in self.groups for numel in group
                   if numel <= self.config.persistence_threshold)

    @property
    def output_persists(self) -> bool:
        return self.output_numel <= self.config.persistence_threshold


def model_state(model: ZeroModel) -> ParameterBytes:
    """Rank 0's model state after a step (stages 1 and 2: the gradients, which the moments hold where they
    are live, as ``gradients_bytes``; stage 3 keeps its gradient buffers for the whole run)."""
    if model.stage < 3:
        partitions = [model.partition(group) for group in model.groups]
        gradients = WEIGHT_BYTES * (model.count if model.stage == 1 else model.in_partition())
        return ParameterBytes(model.count, WEIGHT_BYTES * sum(model.padded(group) for group in model.groups),
                              gradients, sum((MASTER_BYTES + ADAM_BYTES) * s + model._steps for s in partitions)
                              + NORM_BYTES[model.stage], zero=model.stage)
    subs = model.sub_groups()
    shard = sum(subs)
    return ParameterBytes(model.count, WEIGHT_BYTES * shard + model.persistent_bytes(),
                          WEIGHT_BYTES * (shard + model.config.reduce_bucket_size),
                          sum((MASTER_BYTES + ADAM_BYTES) * s + model._steps for s in subs) + NORM_BYTES[3], zero=3)


def stage_moments(moments: tuple, model: ZeroModel) -> tuple:
    """The stage's moments (stage_model.StageMoment, one device's: every layer on it) with what ZeRO holds at
    each beside the model state, and its own: the backward's end and the optimizer's step, the activations
    freed. The last microbatch's moments hold what the earlier ones left: at stage 1 every gradient and the
    bucket (no reduce before the step's boundary), at stage 2 the gradient partition (measured)."""
    return tuple(with_rows(moment, _during(model, moment.name)) for moment in moments) + _after_backward(model)


#: the stage model's moments before the output layer's backward: ZeRO-3 still holds its weight gathered there;
#: later (a rerun, the last layer's backward) an untied weight's next use is the next step's forward, and its
#: post-backward hook has released it (a tied one's is the embedding's backward: ZeroModel.output_kept)
BEFORE_OUTPUT_BACKWARD = frozenset({"start", "loss", "forward_end"})


def _during(model: ZeroModel, moment: str) -> tuple:
    rows = ()
    earlier = model.microbatches > 1
    if model.stage == 1 and earlier:
        rows = (PeakRow("gradients", WEIGHT_BYTES * model.count, GRADIENTS_1 + ": the earlier microbatches'"),
                PeakRow("gradient_bucket", model.bucket_bytes, BUCKET.format(kept="; kept between microbatches")))
    elif model.stage == 2 and earlier:
        rows = (PeakRow("gradient_partition", WEIGHT_BYTES * model.in_partition(), GRADIENTS_2
                        + ": the earlier microbatches'"),)
    elif model.stage == 3 and model.config.reuse_distance > 0:
        gathered = not model.output_persists and (moment in BEFORE_OUTPUT_BACKWARD or model.output_kept)
        rows = ((PeakRow("gathered_weights", WEIGHT_BYTES * model.output_numel, GATHERED_OUTPUT),) if gathered else ()) \
            + ((PeakRow("gathered_weights_kept", WEIGHT_BYTES * model.kept_numel, KEPT_GATHERED),)
               if model.kept_numel else ())
    return rows


def _after_backward(model: ZeroModel) -> tuple:
    bucket = PeakRow("gradient_bucket", model.bucket_bytes, BUCKET.format(kept=""))
    norm = PeakRow("norm_copy", NORM_COPY_BYTES * model.largest_piece(), NORM_COPY)
    step = PeakRow("step_gradient", model.step_gradient_bytes(), MASTER_GRADIENT.format(
        where="stage3.py, _prepare_fp32_grad_for_sub_group" if model.stage == 3 else
        "stage_1_and_2.py, step: flatten, then .to(fp32)"))
    if model.stage == 3:
        released = PeakRow("persistent_weights_released", -model.persistent_bytes(),
                           "the whole persistent weights, which the step releases first (stage3.py, step: "
                           "_partition_all_parameters)")
        return (StageMoment("gradient_norm", "the optimizer step's gradient norm, at its largest fp64 copy",
                            (norm, released)),
                StageMoment("optimizer_step", "the optimizer's step, at the cast of the largest sub-group's gradient",
                            (step, released)))
    partition = PeakRow("gradient_partition", WEIGHT_BYTES * model.in_partition(), GRADIENTS_2)
    return (*_reduce_moments(model, partition, bucket),
            StageMoment("gradient_norm", "the optimizer step's gradient norm, at its largest fp64 copy",
                        (partition, norm)),
            StageMoment("optimizer_step", "the optimizer's step, at the cast of the largest group's gradient",
                        (partition, step)))


def _reduce_moments(model: ZeroModel, partition: PeakRow, bucket: PeakRow) -> tuple:
    """Stage 1 reduces after the backward, in the groups' order: at its first reduce every gradient is held but
    those its first bucket took (their storage freed into it), beside the bucket and the all-reduce's flattened
    copy; then the copy freed, the partition is made (reduce_ipg_grads: copy_grads_in_partition, after
    average_tensor). Stage 2 (and stage 1 under overlap_comm, which reduces in the last microbatch's backward) at
    its last reduce: the bucket, the partition (at stage 2 with gradient accumulation the earlier microbatches' too:
    all_grad_tensors), and the token embedding's gradient where it is too large for the bucket (held whole until
    reduced) with the all-reduce's copy of it, where an earlier reduce made the partition."""
    if model.stage == 1 and not model.config.overlap_comm:
        moved, owns, copy = model.first_bucket()
        held = PeakRow("gradients", WEIGHT_BYTES * (model.count - moved), GRADIENTS_1 + ", but those its first "
                       "bucket took")
        return (StageMoment("backward_end", "the reduce after the backward, its first all-reduce",
                            (held, bucket, *_reduce_copy(copy))),
                StageMoment("first_partition", "the reduce after the backward, the gradient partition made",
                            (held, bucket, partition), owns))
    # stage 2 keeps the earlier microbatches' partition (all_grad_tensors); stage 1 never reduces before the step's
    # boundary, so its earlier gradients are in param.grad, which the last microbatch's hooks move into the bucket
    earlier = (PeakRow("gradient_partition_accumulated", WEIGHT_BYTES * model.in_partition(),
                       GRADIENTS_2 + ": the earlier microbatches' (all_grad_tensors)"),) \
        if model.microbatches > 1 and model.stage == 2 else ()
    made_before = any((g, i) != (0, 0) for g, group in enumerate(model.groups) for i, _, _ in model.owned(group))
    oversized = (PeakRow("oversized_gradient", WEIGHT_BYTES * model.last_gradient_oversized,
                         "the token embedding's gradient, larger than the bucket, reduced alone in place at the "
                         "backward's end (extra_large_param_to_reduce)"),
                 *(_reduce_copy(model.reduce_copy([(0, 0)])) if made_before else ())
                 ) if model.last_gradient_oversized else ()
    return (StageMoment("backward_end", "the backward's last reduce", (bucket, partition, *earlier, *oversized)),)


def _reduce_copy(elements: int) -> tuple:
    return (PeakRow("reduce_copy", WEIGHT_BYTES * elements, "the all-reduce's flattened copy of the bucket's slices "
                    "(allreduce_bucket), where they go to more than one rank"),) if elements else ()


def kept_through_the_turn(config: ZeroConfig, parameters: tuple, output_numel: int, passes: int = 2) -> int:
    """Elements of the weights, not persistent, that ZeRO-3 releases after their forward only where their next use
    is further than stage3_max_reuse_distance elements of traced weights away (its coordinator scans the module
    trace ahead from the next module, counting each module's weights, and keeps the weights of a module met
    before the count reaches it). Between a layer's forward and its backward run at most the weights of that
    layer and those after it ``passes`` times over (forward and backward; with activation checkpointing each
    later layer's rerun too: 3), the output layer's among them: where that bound is short of the distance, the
    layer's weights are certainly kept; the embedding's likewise, beyond it the whole model. The output layer is
    its own row (GATHERED_OUTPUT)."""
    if config.stage < 3 or config.reuse_distance == 0:
        return 0
    embeddings = ("model.embed_tokens.weight", "transformer.wte.weight", "transformer.wpe.weight")
    names = {p.name for p in parameters}
    output = "lm_head.weight" if "lm_head.weight" in names else next(name for name in embeddings if name in names)
    layers = {}
    for p in parameters:
        index = next((int(part) for part in p.name.split(".") if part.isdigit()), None)
        if index is not None:
            layers.setdefault(index, []).append(p)
    whole = sum(p.numel for p in parameters)
    # from layer 0 on: every weight but the embeddings', and the output layer's where it is the embedding (tied)
    tail = whole - sum(p.numel for p in parameters if p.name in embeddings) + output_numel * (output != "lm_head.weight")
    kept = 0
    for index in sorted(layers):
        if passes * tail < config.reuse_distance:
            kept += sum(p.numel for p in layers[index] if p.numel > config.persistence_threshold)
        tail -= sum(p.numel for p in layers[index])
    if passes * (whole + output_numel) < config.reuse_distance:      # the embedding's backward comes last
        kept += sum(p.numel for p in parameters if p.name in embeddings and p.name != output
                    and p.numel > config.persistence_threshold)
    return kept


def tied_output_kept(config: ZeroConfig, parameters: tuple, output_numel: int, passes: int = 2) -> bool:
    """Whether ZeRO-3 certainly keeps a tied output layer's weight (the embedding's) gathered from its backward to
    the embedding's, where it is used again: between them run at most the whole model ``passes`` times over (as
    ``kept_through_the_turn`` bounds the embedding's)."""
    names = {p.name for p in parameters}
    whole = sum(p.numel for p in parameters)
    return (config.stage == 3 and config.reuse_distance > 0 and "lm_head.weight" not in names
            and passes * (whole + output_numel) < config.reuse_distance)


def zero_model(config: ZeroConfig, parameters: tuple, d: int, microbatches: int, output_numel: int,
               checkpointed: bool = False) -> ZeroModel:
    """The ZeroModel of transformers' parameters (actmem.model.hf_parameters) in the optimizer's groups: the
    Trainer's two, decayed then not (trainer.py, create_optimizer), or FusedAdam's one. ``checkpointed``: under
    activation checkpointing, whose reruns traverse the layers' weights a third time."""
    if config.optimizer == TRAINER:
        groups = tuple(tuple(p.numel for p in parameters if p.decays == decays) for decays in (True, False))
        groups = tuple(group for group in groups if group)
    else:
        groups = (tuple(p.numel for p in parameters),)
    passes = 3 if checkpointed else 2
    return ZeroModel(config, d, groups, output_numel, microbatches,
                     kept_through_the_turn(config, parameters, output_numel, passes),
                     tied_output_kept(config, parameters, output_numel, passes))
