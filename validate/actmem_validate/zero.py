"""DeepSpeed's ZeRO as the Hugging Face Trainer runs it, measured on real gloo ranks: transformers' own model
class (hf.py) under deepspeed.initialize, with the optimizer the Trainer makes, against actmem's estimate for
--zero-stage (actmem.memory.zero).

DeepSpeed runs on a CPU with its CPU accelerator (DS_ACCELERATOR=cpu) over the harness's gloo group. Each
rank runs three steps of the spec's microbatches (the first makes the optimizer's state, the second completes
ZeRO-3's trace of the modules, after which it keeps gathered what it will reuse soon); the third is measured.
Rank 0's rows:
- the model state after the step, every live storage the garbage collector reaches (deduplicated, the model's
  own buffers and the token batches left out), split by dtype: the bf16 state (weights; at stage 3 the gradient
  partition and the bucket too) and the rest (fp32 master weights, AdamW's moments and steps, the gradient
  norm), each checked to the byte (kind 'state');
- the step's peak (torch_compat.LiveBytes: every live storage, less what gloo's collectives copy below the
  dispatcher) against actmem's peak floor (kind 'floor').
The saved activations by term are the hf harness's (hf.py), which ZeRO does not change; they are not measured
again here.

What a CPU run cannot show: CUDA's streams (ZeRO-3 overlaps its gathers and reduces on side streams, whose
freed blocks the caching allocator keeps until the stream passes them) and the allocator's rounding.
"""

import os

import torch

from actmem.memory.estimate import estimate
from actmem.model.deepspeed import DEEPSPEED_VERSION, TRAINER
from actmem_validate.compare import _row
from actmem_validate.hf import CPU_WIDTHS, _dropout_as_on_a_gpu, _is_gpt2, build_model
from actmem_validate.torch_compat import LiveBytes, live_tensors

STEPS = 3


def deepspeed_config(spec, microbatches: int) -> dict:
    """The config the ZeroConfig stands for, as the Trainer would finalise it (gradient_clipping its default
    max_grad_norm 1.0; an optimizer section only where the config had one)."""
    zero = spec.run.zero
    config = {"train_micro_batch_size_per_gpu": spec.run.micro_batch, "gradient_accumulation_steps": microbatches,
              "gradient_clipping": 1.0, "bf16": {"enabled": True}, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": zero.stage, "reduce_bucket_size": zero.reduce_bucket_size,
                                    "stage3_param_persistence_threshold": zero.persistence_threshold,
                                    "stage3_max_reuse_distance": zero.reuse_distance,
                                    "sub_group_size": zero.sub_group_size, "overlap_comm": zero.overlap_comm,
                                    "round_robin_gradients": zero.round_robin},
              "steps_per_print": 10 ** 9}
    if zero.optimizer != TRAINER:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4}}
    return config


def trainer_optimizer(model):
    """The Trainer's optimizer (trainer.py, create_optimizer): fused torch AdamW over two groups, the
    parameters get_decay_parameter_names names, then the rest."""
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))
    groups = [{"params": [p for n, p in model.named_parameters() if (n in decay) == decays], "weight_decay": w}
              for decays, w in ((True, 0.0), (False, 0.0))]
    return torch.optim.AdamW([group for group in groups if group["params"]], lr=1e-4, fused=True)


def measure(config, rank: int, device: str = "cpu", fake: bool = False) -> list[dict]:
    """This rank's rows (rank 0's; the others take part)."""
    if fake or device != "cpu":
        raise ValueError("the ZeRO harness runs DeepSpeed's CPU accelerator on gloo ranks (--mode real)")
    import torch.distributed as dist

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # what a launcher sets, which DeepSpeed reads beside the group the harness made
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(dist.get_world_size()))
    try:
        import deepspeed
    except ImportError:
        raise ImportError("the ZeRO harness runs DeepSpeed: pip install 'actmem[deepspeed]' "
                          f"(deepspeed=={DEEPSPEED_VERSION})") from None
    spec = config.spec
    imported = {_key(tensor) for tensor in _live_tensors()}    # what the process's imports made (its fork server's)
    torch.manual_seed(1234)
    model = build_model(spec)
    optimizer = trainer_optimizer(model) if spec.run.zero.optimizer == TRAINER else None
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      model_parameters=None if optimizer else model.parameters(),
                                      config=deepspeed_config(spec, config.microbatches), dist_init_required=False)
    batches = [torch.randint(0, spec.model.vocab, (spec.run.micro_batch, spec.model.seq_len))
               for _ in range(config.microbatches)]
    with _dropout_as_on_a_gpu():
        for _ in range(STEPS - 1):
            _step(engine, batches)
    left_out = imported | {_key(t) for t in (*batches, *model.buffers())}
    with _dropout_as_on_a_gpu(), LiveBytes() as live:
        _step(engine, batches)
    state = _state_bytes(left_out)
    if rank:
        return []
    est = estimate(spec)
    params = est.parameters
    bf16 = params.weights_bytes + (params.gradients_bytes if spec.run.zero.stage == 3 else 0)
    rows = [_row(config, rank, "zero_bf16_state", bf16, state["bf16"], "state"),
            _row(config, rank, "zero_optimizer_state", params.optimizer_bytes, state["other"], "state")]
    held = state["bf16"] + state["other"]        # the model state, as at the step's start
    rows.append(_row(config, rank, "peak", est.peak.total_bytes - _statistics_on_a_cpu(est),
                     live.peak - live.base + held, "floor"))
    return rows + [_row(config, rank, "gloo_copies_at_most", 0, live.below_peak, "information")]


def _statistics_on_a_cpu(est) -> int:
    """What a CPU keeps less than the floor counts: GPT-2's LayerNorm statistics, fp32 on a GPU, are 16-bit on a
    CPU (hf.CPU_WIDTHS), half their bytes, where the peak's moment holds the activations."""
    if not _is_gpt2(est.spec) or not est.peak.bytes_of("activations_in_flight"):
        return 0
    return sum(row.total_bytes for row in est.run_terms if row.term.name in CPU_WIDTHS) // 2


def _step(engine, batches) -> None:
    for tokens in batches:
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        del loss


def _key(tensor) -> int:
    return tensor.untyped_storage()._cdata


def _live_tensors() -> list:
    """The strided tensors with storage alive once the garbage collector has run."""
    import gc

    gc.collect()
    return live_tensors()


def _bytes_of(tensor) -> int:
    return tensor.untyped_storage().nbytes()


def _state_bytes(left_out: set) -> dict:
    """Every live storage the garbage collector reaches, once, by dtype: bf16, and the rest (fp32, fp64, bool)."""
    seen, sums = set(), {"bf16": 0, "other": 0}
    for tensor in _live_tensors():
        key = _key(tensor)
        if key in seen or key in left_out:
            continue
        seen.add(key)
        sums["bf16" if tensor.dtype == torch.bfloat16 else "other"] += _bytes_of(tensor)
    return sums
