"""The first pipeline stage, run in the real order of its forwards and backwards.

Rank 0 of a p-stage pipeline holds m model chunks of L/(p·m) layers (chunk 0 starts with
the embedding; with p = 1 the stage ends with the output layer and loss). The schedules
are Megatron's: 1F1B, and the interleaved one. Each chunk forward runs under its own
ledger; its saved bytes stay live until its backward frees the graph, so the peak of
the live sum is what the stage really holds, not an assumption.
"""

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from actmem_validate.gpt import Embedding, LayerSpec, OutputHead, TransformerLayer, run_layers
from actmem_validate.ledger import Ledger, label
from actmem_validate.parallel import TensorParallel
from actmem_validate.torch_compat import pipeline_backward


def first_stage_order(p: int, m: int, n: int, rank: int = 0) -> list[tuple[str, int, int]]:
    """('F' or 'B', microbatch, chunk) in the order pipeline rank 0 (or ``rank``) runs them:
    Megatron-Core's schedules.py, whose warm-up alone depends on the rank
    (get_pp_rank_microbatches, microbatch groups of p: the default group size)."""
    total = n * m
    if m == 1:
        warmup = min(p - rank - 1, n)
    else:
        warmup = min(2 * (p - rank - 1) + (m - 1) * p, total)

    def step(kind, k):
        chunk = (k % (p * m)) // p
        return kind, (k // (p * m)) * p + k % p, chunk if kind == "F" else m - 1 - chunk

    order = [step("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [step("F", warmup + k), step("B", k)]
    return order + [step("B", k) for k in range(total - warmup, total)]


class FirstStage(nn.Module):
    def __init__(self, spec: LayerSpec, vocab: int, tp: TensorParallel, p: int, m: int,
                 stage_layers: int | None = None):
        """stage_layers: the first stage's layers in an uneven pipeline (m = 1); L/p if None."""
        super().__init__()
        per_chunk = (spec.layers // p if stage_layers is None else stage_layers) // m
        self.tp, self.spec = tp, spec
        self.embedding = Embedding(vocab, spec, tp)
        # the first stage's layers are the model's first; under --first-last-layers-bf16 some run in bf16 (m = 1)
        self.chunks = nn.ModuleList(nn.ModuleList(
            TransformerLayer(replace(spec, fp8=None) if chunk * per_chunk + i in spec.bf16_layers else spec, tp)
            for i in range(per_chunk)) for chunk in range(m))
        self.head = OutputHead(self.embedding, spec, tp) if p == 1 else None
        self.offload = None
        """CPU offloading (actmem_validate.offload.CpuOffload) where the run has it."""

    def forward_chunk(self, chunk: int, x, tokens, targets):
        # the chunk the batch arrives with carries the dataloader's mask (get_batch: first and last stages)
        mask = causal_mask(tokens) if chunk == 0 and self.spec.attention_mask else None
        context = self.tp.context
        if context is not None and context.size > 1:          # this rank's s/c of each sequence
            local = tokens.shape[1] // context.size
            rows = slice(context.offset(local), context.offset(local) + local)
            tokens, targets = (ids[:, rows] for ids in (tokens, targets))
            if mask is not None:   # get_batch_on_this_cp_rank: its rows of every column, a copy
                mask = label(mask[:, :, rows].clone(), "attention_mask")
        if chunk == 0:
            x = self.embedding(tokens)
        decoder_input = x         # GPTModel.forward keeps it to its end (gpt_model.py): a freed layer 0 does not free it
        x = run_layers(self.chunks[chunk], decoder_input, mask, self.offload)
        if self.head is not None and chunk == len(self.chunks) - 1:
            return self.head(x, targets)
        return x


def causal_mask(tokens):
    """Megatron's dataloader mask for a microbatch (gpt_dataset.py,
    _get_ltor_masks_and_position_ids: tril(ones(s, s)) < 0.5, batched to [b, 1, s, s] bool):
    True where a position may not attend. Made with the batch and handed to every layer."""
    b, s = tokens.shape
    ones = torch.ones(b, 1, s, s, dtype=torch.bool, device=tokens.device)
    return label(torch.tril(ones).logical_not(), "attention_mask")


@dataclass
class StageRun:
    """What the stage held: saved bytes by term at the peak of the live sum."""

    peak_saved_bytes: int = 0
    terms_at_peak: dict = field(default_factory=dict)
    allocated_at_peak: int = 0
    """Bytes allocated above the parameters right after the forward that made the peak."""
    host_bytes: int = 0
    """What CPU offloading's host copies held at their most (actmem_validate.offload)."""


def run_first_stage(stage: FirstStage, spec: LayerSpec, p: int, m: int, n: int, micro_batch: int,
                    vocab: int, tp: TensorParallel, allocated=lambda: 0) -> StageRun:
    s_local = spec.seq_len // tp.context_size // (tp.size if tp.sequence_parallel else 1)
    model_state = [*stage.parameters(), *stage.buffers()]
    in_flight: dict = {}
    result = StageRun()
    for kind, microbatch, chunk in first_stage_order(p, m, n):
        if kind == "F":
            gen = torch.Generator(device="cpu").manual_seed(1000 * microbatch + chunk)
            tokens = torch.randint(0, vocab, (micro_batch, spec.seq_len), generator=gen).to(spec.device)
            received = None if chunk == 0 else torch.randn(
                s_local, micro_batch, spec.hidden, generator=gen).to(spec.device, spec.dtype).requires_grad_()
            ledger = Ledger(model_state)
            with ledger.recording():
                out = stage.forward_chunk(chunk, received, tokens, tokens)
            ledger.drop_freed()
            shape = deallocate_output_tensor(out)
            in_flight[(microbatch, chunk)] = (out, shape, ledger)
            if _track_peak(result, in_flight):
                result.allocated_at_peak = allocated()
        else:
            out, shape, _ = in_flight.pop((microbatch, chunk))
            if out.dim() == 0:                                 # the loss (p = 1)
                out.backward()
            else:                                              # the gradient the next stage sends
                pipeline_backward(out, torch.ones(shape, dtype=out.dtype, device=out.device))
    if stage.offload is not None:
        result.host_bytes = stage.offload.host_bytes
    return result


def deallocate_output_tensor(out: torch.Tensor):
    """Megatron frees a chunk's output once it is sent (schedules.py, deallocate_output_tensor:
    out.data = torch.empty((1,)); on in the training path, deallocate_pipeline_outputs): only
    its autograd node stays for the backward. Returns its shape (None for the loss)."""
    if out.dim() == 0:
        return None
    shape = out.shape
    out.data = torch.empty((1,), dtype=out.dtype, device=out.device)
    return shape


def _track_peak(result: StageRun, in_flight: dict) -> bool:
    """Record the live saved bytes by term if they are a new peak; say whether they were."""
    live = sum(n_bytes for *_, ledger in in_flight.values() for _, n_bytes in ledger.saved.values())
    if live <= result.peak_saved_bytes:
        return False
    terms: dict = {}
    for *_, ledger in in_flight.values():
        for term, n_bytes in ledger.by_term().items():
            terms[term] = terms.get(term, 0) + n_bytes
    result.peak_saved_bytes, result.terms_at_peak = live, terms
    return True
