"""FSDP2 as torchtitan applies it, measured on real gloo ranks: a training step of the torch-native model
(torchtitan's Llama 3, torchtitan.py) under torch's own fully_shard, against actmem's estimate for --fsdp
(actmem.memory.fsdp).

Each rank runs two steps of AdamW (fused, torchtitan's default) over the spec's microbatches: the first makes
the optimizer's state, the second is measured. Its rows:
- the saved activations of its last microbatch by term (torch_native's ledger and rules), 0 B off as without
  FSDP: the unsharded weights autograd saves for the backward are model state, left out;
- on rank 0, the model state after the step (the sharded fp32 parameters, their gradients, AdamW's state: the
  storages themselves, padding included), each checked to the byte (kind 'state');
- on rank 0, the step's peak (torch_compat.LiveBytes: every live storage at its current size, less gloo's own
  copies, which NCCL does not make; on a GPU, torch.cuda's allocator, through which FSDP2's storage resizes go)
  against actmem's peak floor (kind 'floor'), less what the process held besides the model state (the rotary
  table, the token batches; on a GPU cuBLAS's workspaces, which the first step makes: 'kept_for_the_process').

Real tensors (gloo ranks, or rank 0 of the fake process group on a GPU, --mode rank0) are made as torchtitan makes
them (train.py): the model on the meta device, parallelized and sharded there, then each rank's shards made on its
device (to_empty) and initialised, so no rank ever holds the whole model. Fake runs make fake tensors instead.
"""

import torch

from actmem.memory.estimate import estimate
from actmem_validate.compare import _row
from actmem_validate.ledger import Ledger
from actmem_validate.naming import naming
from actmem_validate.torch_compat import LiveBytes, fake_tensor_mode, local_tensor, storage_key
from actmem_validate.torch_native import _compare, build_model, rules_for
from actmem_validate.torchtitan import cross_entropy_loss, parallelize_model


def apply_fsdp(model, mesh, policy: str = "default"):
    """torchtitan 018740b7's apply_fsdp (models/llama3/infra/parallelize.py) at its defaults: bf16 parameters
    for compute, fp32 reduce; the token embedding and each block, resharded after the forward unless the policy
    is 'never', and [norm, output] only under 'always' (by default not: "FSDP would prefetch them
    immediately"), then the root. A 2-D mesh is HSDP (replicate, shard)."""
    import warnings

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # under TP the embedding's output is a view (RowwiseParallel's); torchtitan's model writes it in place nowhere
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    config = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    reshard = policy != "never"            # torchtitan's "default" without pipeline parallelism: True
    fully_shard(model.tok_embeddings, **config, reshard_after_forward=reshard)
    for block in model.layers:
        fully_shard(block, **config, reshard_after_forward=reshard)
    fully_shard([model.norm, model.output], **config, reshard_after_forward=policy == "always")
    fully_shard(model, **config)
    return model


def measure(config, rank: int, device: str = "cpu", fake: bool = False) -> list[dict]:
    """This rank's rows; ``fake``: rank 0 of the fake process group, paper-scale shapes on fake tensors; on a
    GPU (``device`` cuda), rank 0 of the fake process group with real tensors (--mode rank0)."""
    from contextlib import nullcontext

    from torch.distributed.device_mesh import init_device_mesh

    spec, run = config.spec, config.spec.run
    t, cuda = run.tensor_parallel, device.startswith("cuda")
    torch.manual_seed(1234)
    # torchtitan's mesh: data-parallel outer (HSDP's replicas, then the shards), tensor-parallel inner; rank 0 is
    # the first of each; made outside the fake mode
    replicas = run.fsdp_replicate
    mesh = init_device_mesh("cuda" if cuda else "cpu", (replicas, spec.fsdp_shards, t),
                            mesh_dim_names=("replicate", "shard", "tp"))
    data_mesh, tensor_mesh = mesh["replicate", "shard"] if replicas > 1 else mesh["shard"], mesh["tp"]
    fake_mode = fake_tensor_mode() if fake else nullcontext()
    if fake:
        with fake_mode:
            model = _parallelized(spec, tensor_mesh)
        model = apply_fsdp(model, data_mesh, run.fsdp_reshard)     # outside the fake mode: under TP it joins the meshes, real tensors
    else:
        model = _materialised(spec, tensor_mesh, data_mesh, device)
    with fake_mode:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        batches = [tuple(torch.randint(0, spec.model.vocab, (run.micro_batch, spec.model.seq_len),
                                       device="cpu" if fake else device) for _ in "tl")
                   for _ in range(config.microbatches)]
        _step(model, optimizer, batches, parallel_loss=t > 1)              # AdamW makes its state
        state = _state_bytes(model, optimizer)
        _check_resharded(model)
        ledger = _ledger(model)
        with AllocatorPeak() if cuda else LiveBytes(fake_mode if fake else None) as live:
            _step(model, optimizer, batches, ledger, parallel_loss=t > 1, rules=rules_for(spec))
    est = estimate(spec)
    rows = _compare(config, rank, ledger.by_term(), device)
    if rank:
        return rows                      # rank 0 keeps the most (ceil(rows/d)); the others, their own share
    params = est.parameters
    for name, formula in (("weights", params.weights_bytes), ("gradients", params.gradients_bytes),
                          ("optimizer_state", params.optimizer_bytes)):
        rows.append(_row(config, rank, f"fsdp_{name}", formula, state[name], "state"))
    held = sum(state.values())
    if fake and live.below_peak:
        raise RuntimeError(f"{live.below_peak:,} B made below the dispatcher in a fake run, which has no gloo copies: "
                           "LiveBytes would miss them")
    rows.append(_row(config, rank, "peak", est.peak.total_bytes, live.peak - live.base + held, "floor"))
    if cuda:
        return rows + [_row(config, rank, "kept_for_the_process", 0, live.base - held, "reserve")]
    return rows + [_row(config, rank, "gloo_copies_at_most", 0, live.below_peak, "information")]


def _parallelized(spec, tensor_mesh, building=None):
    """The spec's model in fp32 (FSDP2 keeps fp32 shards and casts them to bf16 for compute), tensor-parallel as
    torchtitan plans it when t > 1; ``building``: a context the model is made in (the meta device), parallelized
    outside it."""
    from contextlib import nullcontext

    run = spec.run
    with building or nullcontext():
        model = build_model(spec, dtype=torch.float32)
    if run.tensor_parallel > 1:
        parallelize_model(model, tensor_mesh, run.sequence_parallel)
    return model


def _materialised(spec, tensor_mesh, data_mesh, device: str):
    """torchtitan's order (train.py): the model on the meta device, parallelized and fully_shard-ed there, then
    its shards made on the device (to_empty: FSDP2 swaps in each padded shard) and initialised, the rotary table
    made anew (a buffer, emptied too)."""
    from actmem_validate.torchtitan import precompute_freqs_cis

    model = apply_fsdp(_parallelized(spec, tensor_mesh, torch.device("meta")), data_mesh, spec.run.fsdp_reshard)
    model.to_empty(device=device)
    arch = spec.architecture
    with torch.no_grad():
        for param in model.parameters():           # each rank's own shard (DTensor's random ops would sync them)
            local_tensor(param).normal_(std=0.02)
        head_dim = arch.head_dim_or(spec.model.hidden, spec.model.heads)
        model.freqs_cis.copy_(precompute_freqs_cis(head_dim, spec.model.seq_len))
    return model


class AllocatorPeak:
    """On a GPU: torch.cuda's caching allocator's live bytes at the start and its peak through the step (FSDP2
    resizes its unsharded weights' storages through it, so it sees them, unlike torch's memory tracker)."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.base = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.peak = torch.cuda.max_memory_allocated()
        return False


def _step(model, optimizer, batches, ledger=None, parallel_loss: bool = False, rules=()) -> None:
    """torchtitan's train_step: zero_grad, each microbatch's forward, loss and backward (every one
    reduce-scatters), the optimizer's step; the ledger records the last microbatch's forward and loss, the
    naming ``rules`` (torch_native.rules_for) naming what torch's own code keeps.
    ``parallel_loss``: the loss under loss_parallel (the output layer vocabulary-parallel, t > 1)."""
    from contextlib import nullcontext

    from torch.distributed.tensor.parallel import loss_parallel

    optimizer.zero_grad()
    for i, (tokens, labels) in enumerate(batches):
        recording = ledger is not None and i == len(batches) - 1
        with loss_parallel() if parallel_loss else nullcontext():
            if recording:
                with ledger.recording(), naming(model, rules):
                    loss = cross_entropy_loss(model(tokens), labels)
                ledger.drop_freed()
            else:
                loss = cross_entropy_loss(model(tokens), labels)
            (loss / len(batches)).backward()
    optimizer.step()


def _ledger(model) -> Ledger:
    """A ledger that leaves out the weights: FSDP2 swaps each module's parameters for their unsharded bf16
    copies before its forward (_fsdp_param.py, to_unsharded), which autograd saves; a forward pre-hook on each
    module, after FSDP2's own, files their storages as model state."""
    ledger = Ledger([*model.parameters(), *model.buffers()])
    for module in model.modules():
        module.register_forward_pre_hook(
            lambda module, args: ledger.excluded.update(storage_key(p) for p in module.parameters(recurse=False)))
    return ledger


def _check_resharded(model) -> None:
    """Every unsharded weight's storage empty between steps, as LiveBytes takes the storages it resizes to be
    (each group reshards in its post-backward). Private: FSDPModule._get_fsdp_state, FSDPParam.all_gather_outputs."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()          # torch 2.13: _fsdp_param_groups; 2.11: one, or None
            groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
            for group in filter(None, groups):
                for param in group.fsdp_params:
                    if any(output.untyped_storage().nbytes() for output in param.all_gather_outputs):
                        raise RuntimeError(f"{param._module_info.param_name} is still gathered between steps")


def _state_bytes(model, optimizer) -> dict:
    """The model state this rank holds after a step, by storage (each counted once, at its size)."""
    def total(tensors):
        storages = {storage_key(tensor): local_tensor(tensor).untyped_storage().nbytes() for tensor in tensors}
        return sum(storages.values())

    params = list(model.parameters())
    return {"weights": total(params), "gradients": total(p.grad for p in params if p.grad is not None),
            "optimizer_state": total(value for state in optimizer.state.values() for value in state.values()
                                     if isinstance(value, torch.Tensor))}
