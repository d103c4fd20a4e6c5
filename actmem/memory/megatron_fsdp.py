"""megatron-core's own FSDP (Megatron-FSDP: --use-megatron-fsdp): the model state a rank keeps, as its
--data-parallel-sharding-strategy shards it over the d·c data-parallel ranks (context parallelism holds the same
weights: mcore_fsdp_adapter.py, the data-parallel group with context parallelism).

megatron-core 0.16.1, distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py ("pgb"), and Megatron-LM
d98e8a64's arguments for the defaults:
- the 16-bit weights: the model-weight buffer, sharded under optim_grads_params (is_model_weight_buffer_distributed),
  whole under optim and optim_grads (the module's weights views into it); under no_shard no buffer, the module's own
  weights (pgb, _init_each_parameter_group_buffers);
- the main gradients: the gradient buffer, sharded under optim_grads and optim_grads_params, in
  --megatron-fsdp-main-grads-dtype (auto, the default: the parameters' dtype, 2 B under bf16; fp32: 4 B), as
  Megatron-LM d98e8a64 (core 0.20) makes it (_resolve_group_grad_dtype); megatron-core 0.16.1 had no such flag
  and made it fp32 unless --grad-reduce-in-bf16 (give --megatron-fsdp-main-grads-dtype fp32 to price that);
- the fp32 main weights (--megatron-fsdp-main-params-dtype fp32, the default: preserve_fp32_weights) and Adam's two
  moments, on the main weights' shard under every strategy but no_shard (the optimizer steps on that buffer's
  shards: 12 B a parameter, over d·c);
- the buffers are allocated once, at wrapping, and kept: every byte here is held at every moment of the step.
Under optim_grads_params the weights outside its units (TransformerLayer: the embedding, the output layer, the
final norm) are all-gathered into a bucket of their own in the forward (pgb, DataParallelBuffer.fetch_bucket: a new
unsharded tensor beside the shard) and kept: only the units' buckets are marked releasable (megatron_fsdp.py,
_root_pre_backward); 0.16.1 frees it at finish_grad_sync (synchronize_param_gather), d98e8a64 keeps it across steps.
Each bucket is padded as pgb's build_data_parallel_buffer_index lays it out (replayed here: bucket_layout): its
parameters' rows walked widest first, packed in chunks of the lcm of their row sizes, the bucket padded to a multiple
of d·c chunks; a rank's shard is a d·c-th of it, and Adam's moments cover only the parameters' elements inside it.
In the last layer's backward the transients it certainly holds are peak rows (backward_rows: the unit gathered, the
prefetched units, the gradient buckets), and before it the units the final norm's prefetch gathered again
(regathered_units). Under --fsdp-double-buffer (pools) the units' gathered weights and gradient buckets live in a
fixed pool of two buffers each, allocated once and held for the run, in place of those transients. Not counted
(named in the output): the reduce-scatters' outputs, and under 16-bit main gradients the optimizer's fp32 copy of
the gradient shard (update_main_grads: dist_main_grad, from the backward's end to the next zero_grad).
Arithmetic on ints: the planner does not sweep Megatron-FSDP.
"""

import math
from bisect import bisect_right
from dataclasses import dataclass

from actmem.model.implementation import MEGATRON_FSDP_STRATEGIES
from actmem.model.widths import FP8_BYTES, WEIGHT_BYTES

#: fp32 main weights, 4 B an element of the main-weight buffer's shard (preserve_fp32_weights)
MAIN_WEIGHT_BYTES = 4


def chunk_factor(shapes) -> int:
    """A bucket's chunk size factor (pgb, _get_parameter_groups, step 3): its parameters walked by row size
    (shape[1:].numel(), widest first), the factor the lcm of the row sizes met, but where a row divides it and
    the parameter is a whole number of chunks, or the parameter is smaller than one chunk."""
    factor = 0
    for shape in sorted(shapes, key=_row, reverse=True):
        row, numel = _row(shape), math.prod(shape)
        if factor == 0:
            factor = row
        elif not (row == factor or (factor % row == 0 and numel % factor == 0) or numel < factor):
            factor = math.lcm(factor, row)
    return factor


def _row(shape) -> int:
    return math.prod(shape[1:])


def bucket_layout(shapes, world: int, sharded: bool) -> tuple:
    """(padded size, [(offset, numel)] of each parameter) of one bucket, as build_data_parallel_buffer_index
    lays it out (pgb; megatron-core 0.16.1): its parameters in row-size order (widest first, as the bucket holds
    them), each not a whole number of chunks ending on a chunk boundary, the next such parameter whose remnant fits
    sharing that chunk, parameters smaller than a chunk filling the gap or packed at the end (in their order: the
    code's sort of them is discarded); the size padded to world·factor chunks under every strategy but no_shard."""
    ordered = sorted(shapes, key=_row, reverse=True)
    factor = chunk_factor(ordered)
    sizes = [math.prod(shape) for shape in ordered]
    regular = [n for n in sizes if n >= factor]
    fragments = [n for n in sizes if n < factor]
    items, index = [], 0
    while regular:
        numel = regular.pop(0)
        items.append((index, numel))
        if numel % factor == 0:
            index += numel
            continue
        gap, remain = index + numel, numel % factor
        index += (numel // factor + 1) * factor
        space = factor - remain
        partner = next((n for n in regular if n % factor and remain + n % factor <= factor), None)
        if partner is not None:
            regular.remove(partner)
            items.append((index - partner % factor, partner))
            space -= partner % factor
            index += partner // factor * factor
        for fragment in list(fragments):
            if fragment <= space:
                items.append((gap, fragment))
                space -= fragment
                gap += fragment
                fragments.remove(fragment)
    for fragment in fragments:
        items.append((index, fragment))
        index += fragment
    return (-(-index // (world * factor)) * world * factor if sharded else index), items


@dataclass(frozen=True)
class Buckets:
    """A rank's view of Megatron-FSDP's buckets: the parameters N, the padded buckets' sum P, a shard's sum S (P/d·c
    each), the most parameter elements any rank's shards hold (Adam's moments are made for those alone), and the
    padded bucket of the weights outside the units; a unit's (a layer's) bucket, padded, and its parameters; and the
    padded buckets of the no-unit group that hold a parameter after the layers (the final norm, an untied output
    layer), whose gradient buckets are made before the layers' backward."""
    count: int
    padded: int
    shard: int
    local: int
    outside_padded: int
    unit_padded: int = 0
    unit_count: int = 0
    after_layers_padded: int = 0
    fp8_shard: int = 0
    """Under --fp8-param-gather, the elements of a shard in the units' FP8 groups (1 B each in the weights' buffer)."""
    unit_fp8_padded: int = 0
    """... a unit's FP8 group, padded (1 B an element gathered)."""
    unit_fp8_count: int = 0
    """... its parameters: the TE linears' weights, whose Hopper transposes TE makes at the unit's backward."""
    one_rank: bool = False
    """d·c = 1: no buffer is distributed (pgb: is_data_distributed needs a group of more than one rank), so nothing
    is gathered, no bucket allocated, no pool fetched into: only the buffers, whole."""

    def sharded(self, strategy: str) -> tuple:
        """(weights, gradients, optimizer state): which of the strategy's buffers are distributed over the ranks."""
        return tuple(bool(flag) and not self.one_rank for flag in MEGATRON_FSDP_STRATEGIES[strategy])

    def unit_weight_bytes(self) -> int:
        """A unit's gathered 16-bit weights: its padded groups, 2 B an element, 1 B in an FP8 group."""
        return WEIGHT_BYTES * self.unit_padded - (WEIGHT_BYTES - FP8_BYTES) * self.unit_fp8_padded


def buckets(layer, layers: int, outside_first, outside_last, shards: int, strategy: str, rank=None,
            bucket_size=None, output_into_embedding=False, fp8_weights=False) -> Buckets:
    """Megatron-FSDP's buckets for a model of ``layers`` layers of parameter shapes ``layer``, between the
    parameters before them (the embedding's) and after them (the final norm's, the output layer's), over ``shards``
    ranks. Under every strategy but no_shard each TransformerLayer is a unit and a bucket of its own, the rest one
    group (Megatron-LM d98e8a64's mcore_fsdp_adapter.py: fsdp_unit_modules; megatron-core 0.16.1 made units under
    optim_grads_params alone); under no_shard one group of every parameter (pgb, _get_parameter_groups: grouped by
    dtype, expert or not, and unit). A group outside the units splits into buckets at ``bucket_size`` elements
    (split_at; None or 0: whole). ``rank``: that rank's shards (the harness checks each), else the rank whose shards
    hold the most. ``output_into_embedding``: a tied output layer whose fused weight gradient goes into the
    embedding's main_grad at its backward (tensor_parallel/layers.py: weight.get_main_grad()), making the embedding's
    gradient bucket then. ``fp8_weights`` (--fp8-param-gather): a unit's TE linears' weights (its 2-D parameters) are
    FP8, a group of their own (pgb, _get_parameter_groups: dtype "float8"), laid out and padded apart from its norms
    and biases (the rules refuse it under no_shard)."""
    sharded = strategy != "no_shard"
    if sharded:
        outside = split_at([*outside_first, *outside_last], bucket_size)
        units = [[shape for shape in layer if len(shape) == 2], [shape for shape in layer if len(shape) < 2]]
        units = units if fp8_weights else [layer]
        groups = [*((unit, layers) for unit in units), *((bucket, 1) for bucket in outside)]
    else:
        every = [*outside_first, *(shape for _ in range(layers) for shape in layer), *outside_last]
        groups = [(bucket, 1) for bucket in split_at(every, bucket_size)]
    laid = [(bucket_layout(shapes, shards, sharded), copies) for shapes, copies in groups]
    shard = sum((size // shards) * copies for (size, _), copies in laid)
    padded = sum(size * copies for (size, _), copies in laid)
    count = sum(math.prod(shape) * copies for shapes, copies in groups for shape in shapes)
    local = _largest_local(laid, shards, shard, rank)
    if not sharded:
        return Buckets(count, padded, shard, local, 0, one_rank=shards == 1)
    unit, rest = laid[:len(units)], laid[len(units):]
    fp8 = laid[0][0][0] if fp8_weights else 0
    return Buckets(count, padded, shard, local, sum(size for (size, _), _ in rest), sum(size for (size, _), _ in unit),
                   sum(map(math.prod, layer)), _made_before_the_layers(rest, outside, len(outside_first),
                                                                       output_into_embedding),
                   layers * fp8 // shards, fp8, sum(map(math.prod, units[0])) if fp8_weights else 0,
                   one_rank=shards == 1)


def _made_before_the_layers(laid, outside, before: int, output_into_embedding: bool) -> int:
    """The padded buckets of the no-unit group whose gradient buckets the backward makes before the layers': those
    holding a parameter after the layers (the final norm, an untied output layer), and the embedding's where the
    output layer's gradient goes into it."""
    made, seen = 0, 0
    for ((size, _), _), bucket in zip(laid, outside):
        holds_embedding = seen == 0
        seen += len(bucket)
        if seen > before or (holds_embedding and output_into_embedding):
            made += size
    return made


def _largest_local(laid, shards: int, shard: int, rank) -> int:
    """The parameter elements of ``rank``'s shards (Adam's moments are made for them), else of the rank whose shards
    hold the most: rank 0's where its shards have no gap nor padding (the usual case, checked), else every rank's."""
    below = [(_covered_below(items), size // shards, copies) for (size, items), copies in laid]

    def held(r):
        return sum(copies * (covered((r + 1) * width) - covered(r * width)) for covered, width, copies in below)

    if rank is not None:
        return held(rank)
    first = held(0)
    return first if first == shard else max(held(r) for r in range(shards))


def split_at(shapes, size) -> list:
    """A group's parameters (in named order) as its buckets: each closed where its elements reach ``size``, the
    parameter that reaches it included (pgb, _get_parameter_groups, step 2); one bucket where ``size`` is None."""
    if not size:                # Megatron's `suggested_bucket_size and ...`: None or 0 splits nothing
        return [list(shapes)]
    done, bucket, elements = [], [], 0
    for shape in shapes:
        bucket.append(shape)
        elements += math.prod(shape)
        if elements >= size:
            done.append(bucket)
            bucket, elements = [], 0
    return done + ([bucket] if bucket else [])


def bucket_size(spec):
    """The size Megatron-LM hands Megatron-FSDP for its buckets outside the units (training.py,
    resolve_ddp_bucket_size): --ddp-bucket-size, else max(4·10⁷, 10⁶·d·c); None without --overlap-grad-reduce."""
    run = spec.run
    if not run.overlap_grad_reduce:
        return None
    if run.ddp_bucket_size is not None:
        return run.ddp_bucket_size
    return max(40_000_000, 1_000_000 * spec.optimizer_shards)


def _covered_below(items):
    """A function of x: the parameter elements of a bucket laid out as ``items`` that lie below offset x (Adam's
    moments on a rank's shard [r·S, (r+1)·S) are the difference at its ends)."""
    starts = sorted(items)
    offsets = [offset for offset, _ in starts]
    before = [0]
    for _, numel in starts:
        before.append(before[-1] + numel)

    def covered(x):
        i = bisect_right(offsets, x)
        if i == 0:
            return 0
        offset, numel = starts[i - 1]
        return before[i - 1] + min(numel, x - offset)
    return covered


#: the buffers of each fixed pool under --fsdp-double-buffer (pgb, UB_BUFFER_NUM)
POOL_BUFFERS = 2


def pools(laid: Buckets, strategy: str, gradient_bytes, layers: int) -> tuple:
    """(weights, gradients): bytes of Megatron-FSDP's fixed pools under --fsdp-double-buffer (pgb, FixedPoolAllocator:
    built where units exist). The units' buckets of one dtype and size (here every layer's) are fetched into a pool
    of two buffers a bucket offset, each a GlobalMemoryBuffer tensor sized to the bucket's padded request (utils.py,
    get_tensor) and never freed (free() only returns the slot): the 16-bit weights' where they are sharded (the first
    at wrapping, the second at the first forward's prefetch), the gradients' where they are (the second once a unit's
    gradient bucket is needed while the one after it still waits in the reduce-scatter queue). min(L, 2) buffers
    each: a prefetch stops at two units (need_skip_prefetch) and the queue keeps two (_enforce_double_buffer_limit).
    Held at every moment from the first backward on."""
    weights, gradients, _ = laid.sharded(strategy)
    buffers = min(layers, POOL_BUFFERS)
    return buffers * laid.unit_weight_bytes() * weights, gradient_bytes * buffers * laid.unit_padded * gradients


def backward_rows(laid: Buckets, strategy: str, gradient_bytes, layers: int, prefetched: bool = True,
                  unit_gradients: bool = True, communication_unit=None, double_buffer: bool = False) -> tuple:
    """What Megatron-FSDP certainly holds beside the model state in the last layer's backward, as peak rows (each
    allocated in the host's order, whatever the streams): under optim_grads_params the layer's unit all-gathered
    again (its padded bucket, 16-bit) and, its pre-backward done (``prefetched``; not at full recompute's rerun,
    which gathers the unit alone), the units its prefetch window gathers ahead (prefetched_units); under optim_grads
    and optim_grads_params, once its first weight gradient is made (fc2's: ``unit_gradients``; not at a rerun), the
    layer's unsharded gradient bucket, and the gradient buckets of the no-unit group made before the layers'
    backward (Buckets.after_layers_padded: reduced only once complete, and then held in the reduce-scatter queue,
    the suggested communication unit, max(10⁹, two units) elements under optim_grads_params unless given, until
    the backward's end: megatron_fsdp.py, _root_post_backward; a queue smaller than those buckets is not modelled).
    Under --fsdp-double-buffer (``double_buffer``) the unit's, the prefetched units' and the unit's gradient bucket
    are in the pools (pools), 0 here; the no-unit group's stay (its buckets are allocated as without it).
    Not counted: the reduce-scatters' outputs (megatron-core 0.16.1 makes one a reduction, freed as it completes)."""
    from actmem.memory.peak import PeakRow

    weights, gradients, _ = laid.sharded(strategy)
    weights, unit_gradients = weights * (not double_buffer), unit_gradients * (not double_buffer)
    ahead = prefetched_units(laid, layers, communication_unit) * prefetched
    return (PeakRow("gathered_unit_weights", laid.unit_weight_bytes() * weights, UNIT_SOURCE),
            PeakRow("prefetched_unit_weights", laid.unit_weight_bytes() * ahead * weights,
                    PREFETCH_SOURCE.format(units=ahead)),
            PeakRow("unit_fp8_transposes", FP8_BYTES * laid.unit_fp8_count, TRANSPOSE_SOURCE),
            PeakRow("unit_gradient_bucket", gradient_bytes * laid.unit_padded * gradients * unit_gradients,
                    UNIT_GRADIENT_SOURCE),
            PeakRow("outside_gradient_buckets", gradient_bytes * laid.after_layers_padded * gradients, BUCKET_SOURCE))


def window_units(laid: Buckets, layers: int, communication_unit=None) -> int:
    """Units a prefetch adds after the buckets it gathers: while what it has added is below half the suggested
    communication unit (Megatron-LM's --suggested-communication-unit-size; unset, max(10⁹, twice a unit's
    parameters) elements: megatron_fsdp.py), the next unit, by its padded bucket (pgb, AllGatherPipeline.
    all_gather_params); at most ``layers``."""
    window = (communication_unit if communication_unit is not None else
              max(1_000_000_000, 2 * laid.unit_count)) // 2
    added = 0
    while added < layers and added * laid.unit_padded < window:
        added += 1
    return added


def regathered_units(laid: Buckets, layers: int, communication_unit=None) -> int:
    """Units held gathered from the forward's end through the loss: the final norm's pre-forward (a module of no
    unit) prefetches in forward order from the bucket after its own, the first units, each released after its
    forward and gathered again (megatron_fsdp.py, _pre_forward_param_unshard; pgb, next_bucket_id), k of them;
    _root_pre_backward only marks them releasable, freed at the backward's next gather (recycle_unused_buckets)."""
    return window_units(laid, layers, communication_unit)


def prefetched_units(laid: Buckets, layers: int, communication_unit=None) -> int:
    """Units held gathered beside the last one in its backward: its pre-backward prefetch adds the k before it;
    where the k units the forward's end gathered again (regathered_units) hold every unit, nothing is gathered and
    all stay; else the gather recycles those, and of the window only the units not among them were gathered
    (L - 1 - k where fewer than k: the window and the first k overlap)."""
    k = window_units(laid, layers, communication_unit)
    return layers - 1 if k >= layers else min(k, layers - 1 - k)


#: the moments before the last layer's backward (stage_model.stage_activations)
BEFORE_THE_LAYERS = ("start", "loss", "forward_end")


def stage_moments(moments: tuple, laid: Buckets, strategy: str, gradient_bytes, layers: int,
                  full_recompute: bool, communication_unit=None, double_buffer: bool = False) -> tuple:
    """The stage's moments (stage_model.StageMoment) with backward_rows beside those of the last layer's backward:
    at a rerun without the unit's gradient bucket (a selective rerun may come before fc2's weight gradient), and at
    full recompute's, which comes before the layer's pre-backward, without the prefetched units either; and before
    the layers' backward (the forward's end, the loss) the units the final norm's prefetch gathered again; under
    --fsdp-double-buffer those in its pools (pools) not."""
    from actmem.memory.stage_model import with_rows

    def rows(moment):
        rerun = moment.name == "rerun"
        return backward_rows(laid, strategy, gradient_bytes, layers, prefetched=not (rerun and full_recompute),
                             unit_gradients=not rerun, communication_unit=communication_unit,
                             double_buffer=double_buffer)

    before = forward_end_rows(laid, strategy, layers, communication_unit, double_buffer)
    return tuple(with_rows(moment, before) if moment.name in BEFORE_THE_LAYERS else with_rows(moment, rows(moment))
                 for moment in moments)


def forward_end_rows(laid: Buckets, strategy: str, layers: int, communication_unit=None,
                     double_buffer: bool = False) -> tuple:
    """What Megatron-FSDP holds beside the model state from the forward's end through the loss, as peak rows: under
    optim_grads_params the units the final norm's forward prefetch gathered again (regathered_units); 0 under
    --fsdp-double-buffer, where they are in the weights' pool (pools)."""
    from actmem.memory.peak import PeakRow

    gathered = (laid.sharded(strategy)[0] * (not double_buffer)
                * regathered_units(laid, layers, communication_unit))
    return (PeakRow("regathered_unit_weights", laid.unit_weight_bytes() * gathered, REGATHER_SOURCE),)


REGATHER_SOURCE = ("weights (16-bit; 1 B in FP8 groups) of the first units, all-gathered again by the final norm's "
                   "forward prefetch and held until the backward's first gather (Megatron-FSDP, optim_grads_params)")
UNIT_SOURCE = ("weights (16-bit; 1 B in FP8 groups) of the last layer's unit, all-gathered again for its backward "
               "(Megatron-FSDP, optim_grads_params: its padded bucket, a temporary beside the shard)")
PREFETCH_SOURCE = ("weights (16-bit; 1 B in FP8 groups) of the {units} unit(s) before it, all-gathered ahead by its "
                   "pre-backward's prefetch (Megatron-FSDP: half of max(10⁹ elements, two units))")
TRANSPOSE_SOURCE = ("Hopper transposes of the last layer's FP8 weights (--fp8-param-gather), made again after its "
                    "backward all-gather (TE makes them in each forward too) and dropped at its release "
                    "(megatron_fsdp.py: fp8_create_transpose_cache, fp8_discard_transpose_cache), 1 B an element")
UNIT_GRADIENT_SOURCE = ("the last layer's unsharded gradient bucket, made at its first weight gradient (fc2's) and "
                        "reduce-scattered once the layer's backward completes it (Megatron-FSDP)")
BUCKET_SOURCE = ("the unsharded gradient buckets of the no-unit group that the final norm's and output layer's "
                 "backward made, held until the backward's end (Megatron-FSDP's reduce-scatter queue)")


def gathered_outside_units(laid: Buckets, strategy: str):
    """The 16-bit weights outside the units held gathered through the first backward: under optim_grads_params,
    their whole padded bucket beside their shards (DataParallelBuffer.fetch_bucket allocates bucket_index.size);
    else 0, the weights whole already."""
    return WEIGHT_BYTES * laid.outside_padded if laid.sharded(strategy)[0] else 0


def state_bytes(laid: Buckets, strategy: str, gradient_bytes, optimizer_bytes) -> tuple:
    """(weights, main gradients, optimizer state) a rank keeps under ``strategy`` (the largest rank's: the most
    parameter elements in its shards). A sharded buffer is the rank's shards, an unsharded one the buckets whole
    (padded; under no_shard unpadded, gaps included); the 16-bit weights under no_shard are the module's own, unpadded.
    The optimizer state: the fp32 main weights' buffer, and the rest of Adam's bytes on the parameter elements that
    buffer's shard holds (under no_shard all of them). Under --fp8-param-gather the FP8 groups' weights 1 B an
    element."""
    weights, gradients, optimizer = MEGATRON_FSDP_STRATEGIES[strategy]

    def buffer(sharded):
        return laid.shard if sharded else laid.padded

    own = laid.count if strategy == "no_shard" else buffer(weights)
    fp8 = laid.fp8_shard          # FP8 weights: under optim_grads_params alone (rules.py), a rank's shards
    moments = laid.local if optimizer else laid.count
    return (WEIGHT_BYTES * own - (WEIGHT_BYTES - FP8_BYTES) * fp8, gradient_bytes * buffer(gradients),
            MAIN_WEIGHT_BYTES * buffer(optimizer) + (optimizer_bytes - MAIN_WEIGHT_BYTES) * moments)
