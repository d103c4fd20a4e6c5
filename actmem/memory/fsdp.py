"""PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard) as torchtitan applies it: the model state
a data-parallel rank keeps, and the weights and gradients its groups hold while they compute.

Read at torch 2.13 (torch/distributed/fsdp/_fully_shard/) and torchtitan 018740b7
(torchtitan/models/llama3/infra/parallelize.py, apply_fsdp), with torchtitan's defaults:
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), fully_shard over all d
data-parallel ranks (data_parallel_shard_degree -1), one group a module: the token embedding
(E), each transformer block, [the final norm, the output layer] (O), and the root, which holds
no parameter of its own. Rank 0 holds the most (torch.chunk's split), which is what is counted.

- A parameter is sharded along its first dim, on its tensor-parallel shard where DTensor TP
  splits it (_fsdp_param.py, _init_sharded_param: _chunk_with_empty on the local tensor): rank 0
  keeps ceil(n0/d) of its n0 rows, fp32 (the module's own dtype), and every rank pads its shard
  to that size. S: the elements rank 0 keeps, summed over the parameters.
- AdamW (torchtitan's default, fused) keeps exp_avg and exp_avg_sq of the shard, fp32, and a
  0-dim fp32 step tensor a parameter (torch/optim/adam.py, _init_group): 8S + 4 B a tensor.
- The gradients are sharded fp32 too, one flat buffer a group that its reduce-scatter makes in
  the group's post-backward (_fsdp_collectives.py, foreach_reduce); zero_grad(set_to_none) frees
  them at the next step's start (torchtitan's train_step): they are not held at every moment,
  so the peak counts them where they are (``GRADIENTS``).
"""

from dataclasses import dataclass

from actmem.memory import engine
from actmem.memory.parameters import ParameterBytes
from actmem.memory.peak import PeakRow
from actmem.memory.stage_model import StageMoment, held_rows as _rows, rematerialised_source, with_rows as _extend
from actmem.model.recompute import Recompute

PARAMETER_BYTES = 4
"""The sharded parameters' dtype: fp32, the module's (torchtitan builds the model in fp32)."""
COMPUTE_BYTES = 2
"""MixedPrecisionPolicy.param_dtype: bf16, the weights a group gathers to compute."""
REDUCE_BYTES = 4
"""MixedPrecisionPolicy.reduce_dtype: fp32, the gradients' reduce-scatter and the sharded gradients."""
ADAM_BYTES = 8
"""AdamW's exp_avg and exp_avg_sq, fp32 each, of the sharded parameter."""
STEP_BYTES = 4
"""AdamW's step, a 0-dim fp32 tensor a parameter (fused: on the GPU; a 512-B block of CUDA's caching
allocator, of which 4 B are counted, as every tensor is counted by its own bytes)."""

GRADIENTS = ("sharded fp32 gradients: one flat buffer a group, made by its reduce-scatter in its post-backward "
             "(torch 2.13, _fsdp_collectives.py, foreach_reduce) and freed by the next step's zero_grad")


@dataclass(frozen=True)
class Group:
    """One fully_shard group: its parameters' (rows, columns) on one tensor-parallel rank."""

    name: str
    shapes: tuple

    def sharded(self, d: int) -> int:
        """Elements rank 0 keeps: ceil(rows/d)·columns a parameter (every rank pads to that)."""
        return sum(-(-rows // d) * cols for rows, cols in self.shapes)

    def unsharded(self) -> int:
        """Elements a gathered copy of the group holds (the tensor-parallel rank's own)."""
        return sum(rows * cols for rows, cols in self.shapes)

    def gathered(self, d: int) -> int:
        """Elements of the group's all-gather output: d padded shards."""
        return d * self.sharded(d)


def groups(h: int, t: int, v: int, arch, heads: int) -> tuple:
    """(E, one block, O) of torchtitan's Llama 3 (model.py) on one of t ranks: wq, wk, wv, w1 and w3
    split by rows (ColwiseParallel), wo and w2 by columns (RowwiseParallel), the embedding's and the
    output layer's vocabulary rows (v padded to a multiple of t: DTensor's uneven split gives rank 0
    ceil(v/t)), the RMSNorm weights whole."""
    d_h, g, f = arch.head_dim_or(h, heads), arch.query_groups_or(heads), arch.ffn(h)
    block = ((heads * d_h // t, h), (g * d_h // t, h), (g * d_h // t, h), (h, heads * d_h // t),
             (f // t, h), (h, f // t), (f // t, h), (h, 1), (h, 1))
    return Group("tok_embeddings", ((v // t, h),)), Group("block", block), Group("norm, output", ((h, 1), (v // t, h)))


def model_state(model: "ShardedModel") -> ParameterBytes:
    """Rank 0's model state under FSDP2: fp32 sharded parameters, their fp32 gradients (held from
    each group's reduce-scatter to the next zero_grad: ``GRADIENTS``) and AdamW's state."""
    shard = model.shard
    return ParameterBytes(shard, PARAMETER_BYTES * shard, REDUCE_BYTES * shard,
                          ADAM_BYTES * shard + STEP_BYTES * model.parameter_tensors, fsdp=True)


# What FSDP2 holds beside the activations at each moment of a microbatch's step (torch 2.13):
#  - a group computing holds its unsharded bf16 weights: one buffer a parameter of d padded shards
#    (_fsdp_param.py, init_all_gather_outputs / alloc_all_gather_outputs), 2·d·P_g;
#  - (norm, output) is not resharded after the forward (torchtitan's default), so they stay from the
#    forward through the loss until its own post-backward;
#  - the backward prefetches the group before the one computing (_fsdp_param_group.py,
#    _backward_prefetch): its flat bf16 all-gather output, 2·d·P_g, freed at its copy-out;
#  - a group's post-backward reshards, then copies its bf16 gradients (2·N_g, unpadded) into one flat
#    fp32 reduce-scatter input (4·d·P_g) and frees them; that input stays referenced until the next
#    group's post-backward (reduce_scatter_states), its output is the group's sharded gradient; the
#    embedding's runs last, in the root's final callback (_fsdp_state.py, _root_post_backward_final_callback);
#  - the sharded gradients (4·P_g a group) stay to the step; with gradient accumulation every
#    microbatch after the first adds to them in place, so its moments hold all of them (4S).
# Not counted (a floor): the activation gradients between groups, the gradients of the group computing,
# the transient reduce-scatter output of an accumulating microbatch.

GATHERED = ("unsharded bf16 weights of {group}, d padded shards a parameter (torch 2.13, _fsdp_param.py: "
            "alloc_all_gather_outputs){why}")
PREFETCHED = ("the flat bf16 all-gather output of {group}, prefetched by the backward (_fsdp_param_group.py, "
              "_backward_prefetch; freed at its copy-out)")
UNSHARDED_GRADIENTS = ("the bf16 gradients of {group}, autograd's, before the post-backward frees them "
                       "(_fsdp_collectives.py, foreach_reduce)")
EMBEDDING_GRADIENT = ("the token embedding's bf16 gradient, which its post-backward, run from the root's final "
                      "callback, has not freed when the reduce-scatter output is made (foreach_reduce's "
                      "unsharded_grads.clear() drops the list's reference, not the last: measured to the byte)")
REDUCE_INPUT = ("the flat fp32 reduce-scatter input of {group}, d padded shards (foreach_reduce), held until "
                "the next group's post-backward (_fsdp_param_group.py, reduce_scatter_states)")


@dataclass(frozen=True)
class ShardedModel:
    """torchtitan's Llama under FSDP2 on rank 0: its groups (``groups``), d shards, L blocks, n microbatches a
    step, the resharding policy. d, n and the groups' shapes (through t) are ints for one run, numpy arrays
    over the planner's sweep (every count below is arithmetic, no branch on them)."""

    d: int
    layers: int
    microbatches: int
    embedding: Group
    block: Group
    output: Group
    reshard: str = "default"
    """torchtitan's fsdp_reshard_after_forward (actmem.model.implementation.RESHARD_POLICIES)."""

    @property
    def shard(self) -> int:
        """S: the elements rank 0 keeps."""
        return self.embedding.sharded(self.d) + self.layers * self.block.sharded(self.d) + self.output.sharded(self.d)

    @property
    def parameter_tensors(self) -> int:
        return len(self.embedding.shapes) + self.layers * len(self.block.shapes) + len(self.output.shapes)

    def gathered_bytes(self, group: Group) -> int:
        return COMPUTE_BYTES * group.gathered(self.d)

    def reduce_input_bytes(self, group: Group) -> int:
        return REDUCE_BYTES * group.gathered(self.d)

    def gradients_before_bytes(self) -> int:
        """Sharded gradients held before the last microbatch's backward: every group's after a first."""
        return REDUCE_BYTES * self.shard * (self.microbatches > 1)

    def gradients_after_output_bytes(self) -> int:
        """... and once (norm, output) has reduced: its own too, on a first microbatch."""
        before = self.gradients_before_bytes()
        return before + (before == 0) * REDUCE_BYTES * self.output.sharded(self.d)

    def gradients_but_embedding_bytes(self) -> int:
        """... and at the embedding's post-backward, every group's but its own (being made) on a first microbatch."""
        before = self.gradients_before_bytes()
        return before + (before == 0) * REDUCE_BYTES * (self.shard - self.embedding.sharded(self.d))

    def unresharded_bytes(self) -> int:
        """The embedding's and the blocks' gathered weights where the forward leaves them gathered ('never'):
        they stay until each group's post-backward, so every one is held from the forward to the last block's."""
        if self.reshard != "never":
            return 0
        return self.gathered_bytes(self.embedding) + self.layers * self.gathered_bytes(self.block)

    @property
    def before_last_block(self) -> Group:
        """The group the last block's backward prefetches: the block before it, or the embedding."""
        return self.block if self.layers > 1 else self.embedding


def sharded_model(h: int, t: int, v: int, arch, heads: int, layers: int, d: int, microbatches: int = 1,
                  reshard: str = "default") -> ShardedModel:
    return ShardedModel(d, layers, microbatches, *groups(h, t, v, arch, heads), reshard)


def stage_moments(stage, technique, arch, value, model: ShardedModel) -> tuple:
    """A stage's moments (stage_model.stage_activations) under FSDP2 (``with_fsdp``), the engine's expressions
    evaluated by ``value``: exactly for one run (estimate), over arrays for the planner's sweep. Under full
    recompute the last block's backward holds the layer its rerun makes."""
    last = stage.last_checkpointed             # False: a partial recompute kept the last block whole (no rerun)
    rerun = (PeakRow("rematerialised", value(engine.rematerialised_bytes(technique, arch)) * last,
                     rematerialised_source(technique)) if technique.recompute is Recompute.FULL and last is not False
             else None)
    return with_fsdp(stage.moments, model, stage.held_bytes, value(engine.output_rows(technique, arch)), rerun)


def with_fsdp(moments: tuple, model: ShardedModel, held, output_rows, rerun: PeakRow | None = None) -> tuple:
    """The stage's moments (stage_model.StageMoment) with what FSDP2 holds at each, and four of its own: the
    output group's post-backward, the last block's backward (with, under full recompute, the layer its rerun
    makes: the ``rerun`` row), the embedding's post-backward at the backward's end, and the optimizer's step (fused AdamW
    makes no temporaries: torch/optim/adam.py, _fused_adamw). ``held``: the saved activations in flight;
    ``output_rows``: the output layer's, which its backward frees first."""
    after_forward, in_block = _after_forward(model), _in_last_block(model)
    extra = {"start": after_forward, "loss": after_forward, "rerun": in_block, "swiglu": in_block}
    after_output = PeakRow("activations_in_flight", held - output_rows,
                           "the saved activations in flight, less the output layer's (its backward is done)")
    return tuple(_extend(moment, extra.get(moment.name, ())) for moment in moments) + (
        StageMoment("output_reduce", "(norm, output)'s post-backward, its gradients copied to fp32",
                    _rows(after_output, *_output_reduce(model))),
        StageMoment("last_block", "the last block's backward begun" + (", its rerun done" if rerun else ""),
                    _rows(after_output, *((rerun,) if rerun else ()), *in_block)),
        StageMoment("embedding_reduce", "the embedding's post-backward, at the backward's end, its reduce-scatter "
                    "output made", _rows(
            PeakRow("unsharded_gradients", COMPUTE_BYTES * model.embedding.unsharded(), EMBEDDING_GRADIENT),
            PeakRow("reduce_scatter_input", model.reduce_input_bytes(model.embedding),
                    REDUCE_INPUT.format(group="the token embedding")),
            PeakRow("sharded_gradients", model.gradients_but_embedding_bytes(), GRADIENTS + ": every other group's"),
            PeakRow("reduce_scatter_output", REDUCE_BYTES * model.embedding.sharded(model.d),
                    "the embedding's reduce-scatter output, fp32, its shard (foreach_reduce: its sharded gradient, or "
                    "added to it with gradient accumulation)"))),
        StageMoment("optimizer_step", "the optimizer's step, every gradient held, the activations freed", (
            PeakRow("sharded_gradients", REDUCE_BYTES * model.shard, GRADIENTS + ": every group's"),)))


def _after_forward(model: ShardedModel) -> tuple:
    """What the forward leaves gathered through the loss (the output group but under 'always'; every group
    under 'never') and, with gradient accumulation, the earlier microbatches' gradients."""
    gathered = model.gathered_bytes(model.output) * (model.reshard != "always") + model.unresharded_bytes()
    return (PeakRow("gathered_weights", gathered, GATHERED.format(
                group="(norm, output)" + (" and every other group" if model.reshard == "never" else ""),
                why=": the forward leaves them gathered until their post-backward")),
            PeakRow("sharded_gradients", model.gradients_before_bytes(),
                    GRADIENTS + ": every group's, from the step's earlier microbatches"))


def _still_gathered(model: ShardedModel) -> PeakRow:
    return PeakRow("gathered_weights", model.unresharded_bytes(), GATHERED.format(
        group="the embedding and every block", why=": the forward left them gathered (reshard_after_forward never)"))


def _in_last_block(model: ShardedModel) -> tuple:
    """When the last block's backward begins: it gathered again and the group before it prefetched (under
    'never' every group but the output's still gathered, nothing prefetched), the output group's reduce-scatter
    input and its sharded gradient."""
    if model.reshard == "never":
        weights = (_still_gathered(model),)
    else:
        weights = (PeakRow("gathered_weights", model.gathered_bytes(model.block),
                           GATHERED.format(group="the last block", why=", gathered again for its backward")),
                   PeakRow("prefetched_weights", model.gathered_bytes(model.before_last_block),
                           PREFETCHED.format(group="the group before it")))
    return weights + (
        PeakRow("reduce_scatter_input", model.reduce_input_bytes(model.output),
                REDUCE_INPUT.format(group="(norm, output)")),
        PeakRow("sharded_gradients", model.gradients_after_output_bytes(),
                GRADIENTS + ": (norm, output)'s and, with gradient accumulation, every group's"))


def _output_reduce(model: ShardedModel) -> tuple:
    """The output group's post-backward: the last block prefetched (under 'never' every other group still
    gathered), the group's bf16 gradients and fp32 reduce-scatter input, the earlier microbatches' gradients."""
    weights = _still_gathered(model) if model.reshard == "never" else PeakRow(
        "prefetched_weights", model.gathered_bytes(model.block), PREFETCHED.format(group="the last block"))
    return (weights,
            PeakRow("unsharded_gradients", COMPUTE_BYTES * model.output.unsharded(),
                    UNSHARDED_GRADIENTS.format(group="the output layer and final norm")),
            PeakRow("reduce_scatter_input", model.reduce_input_bytes(model.output),
                    REDUCE_INPUT.format(group="(norm, output)")),
            PeakRow("sharded_gradients", model.gradients_before_bytes(),
                    GRADIENTS + ": every group's, from the step's earlier microbatches"))
