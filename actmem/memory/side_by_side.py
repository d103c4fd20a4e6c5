"""The same model and run under each implementation (--compare-implementations): what a
change of framework costs before it is made.

Each row is a whole estimate with only the code changed: Megatron's, PyTorch-native DTensor,
and transformers' model class (Llama, Qwen3 or GPT-2) with its eager and its sdpa attention
(attn_implementation is the attention core there; beside a transformers spec, Megatron and
torchtitan run flash; Megatron's unfused rope and its dataloader's attention mask stay
Megatron's). Where an implementation is not modelled for this model or run, the row says why
instead of showing a number.
"""

from dataclasses import dataclass, replace

from actmem.model import defaults
from actmem.errors import SpecError
from actmem.memory.estimate import Estimate, estimate
from actmem.model.implementation import IMPLEMENTATIONS
from actmem.model.spec import Spec


@dataclass(frozen=True)
class CodeRow:
    implementation: str
    attention_core: str
    estimate: Estimate | None
    not_modelled: str | None = None
    """Why this implementation is not modelled here (the refusal's line); None where it is."""

    @property
    def name(self) -> str:
        """'megatron', 'torch-native' ('torch-native + FSDP2' over d > 1 ranks), 'hf · sdpa', 'hf · eager'."""
        core = IMPLEMENTATIONS[self.implementation].attention_label(self.attention_core)
        sharded = " + FSDP2" if self.estimate and self.estimate.spec.run.fsdp else ""
        return (f"{self.implementation} · {core}" if core else self.implementation) + sharded


def side_by_side(spec: Spec, stage: int = 0) -> tuple[CodeRow, ...]:
    """One row an implementation (two for transformers: eager and sdpa), the spec's own first;
    each an estimate of the same pipeline stage (the verdict is always the busiest's)."""
    rows = [_row(spec, name, core, stage) for name in IMPLEMENTATIONS for core in _cores(name, spec)]
    own = (spec.architecture.implementation, spec.architecture.attention_core)
    return tuple(sorted(rows, key=lambda row: (row.implementation, row.attention_core) != own))


def _cores(name: str, spec: Spec) -> tuple:
    """transformers: both its attentions. The others: the spec's core, or flash when the spec
    is transformers' (its eager is an attn_implementation, and Megatron and torchtitan run
    flash attention: the column says which core each row ran)."""
    names = IMPLEMENTATIONS[name].attention_names
    if names:
        return tuple(names)
    return ("flash",) if spec.architecture.code.attention_names else (spec.architecture.attention_core,)


def _row(spec: Spec, name: str, core: str, stage: int) -> CodeRow:
    try:
        dropped = dict(IMPLEMENTATIONS[name].dropped_settings)
        arch = replace(spec.architecture, implementation=name, attention_core=core, **dropped)
        own = spec.vocab_divisible_by if spec.architecture.code.pads_vocab else defaults.VOCAB_DIVISIBLE_BY
        padding = own if arch.code.pads_vocab else defaults.VOCAB_DIVISIBLE_BY   # default: none asked
        run = spec.run
        if "fsdp" in arch.code.runs and spec.data_parallel > 1 and not run.fsdp:
            run = replace(run, fsdp=True)      # torchtitan shards data parallelism with FSDP2 (rules.FSDP_RULES)
        return CodeRow(name, core, estimate(replace(spec, architecture=arch, run=run, vocab_divisible_by=padding),
                                            stage))
    except SpecError as error:
        return CodeRow(name, core, None, str(error))


def records(rows) -> list[dict]:
    """Plain values for JSON, CSV and markdown; byte counts are integers, blank where the
    implementation is not modelled."""
    return [{"implementation": row.name, "attention_core": row.attention_core,
             "per_layer_bytes": row.estimate.run_row.per_layer_bytes if row.estimate else None,
             "activations_bytes": row.estimate.activations_bytes if row.estimate else None,
             "verdict_bytes": row.estimate.verdict_bytes if row.estimate else None,
             "fits": row.estimate.fits if row.estimate else None,
             "not_modelled": row.not_modelled} for row in rows]
