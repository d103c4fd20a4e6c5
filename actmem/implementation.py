"""Whose code runs the layer: the second axis of the term table, beside the architecture.

The same architecture keeps different tensors under different code. An implementation is
data read off its source: which of the term table's rows its code keeps beyond Megatron's
(``terms.py`` asks ``keeps``), which tensors it places differently (PyTorch-native DTensor
keeps a column-parallel linear's input all-gathered under sequence parallelism, where
Megatron keeps the local shard), and the architecture and run it is modelled for. Each
field cites the code it was read from; the harness runs that code and measures it.
"""

from dataclasses import dataclass

from actmem.errors import SpecError

MEGATRON = "megatron"


@dataclass(frozen=True)
class Implementation:
    name: str
    label: str
    """One line a person reads: the code, and where it was read."""
    gathered_under_sp: frozenset = frozenset()
    """Terms kept whole along the sequence under sequence parallelism (divided by nothing)
    where Megatron keeps the local shard (divided by t)."""
    keeps: frozenset = frozenset()
    """Behaviours that add rows of the term table, by name (terms.py's predicates ask)."""
    architecture: tuple = ()
    """(field, allowed values, why): the architecture the implementation is modelled for."""
    runs: frozenset = frozenset({"tensor", "pipeline", "context", "partial_recompute", "distributed_optimizer"})
    """Which of Megatron's run shapes it has: t > 1, p > 1, c > 1, --recompute-method, and the
    distributed optimizer (model state is counted as Megatron's mixed-precision Adam)."""
    selective_recompute: str | None = None
    """Why its selective recompute is not modelled; None where it is Megatron's."""
    full_recompute: str | None = None
    """Why its full recompute is not modelled; None where it is."""
    notes: tuple = ()
    """What an estimate under this code says about it (its assumptions)."""
    unpadded_vocab: str | None = None
    """Why the vocabulary is not padded (None: Megatron pads it to a multiple of 128·t,
    --make-vocab-size-divisible-by). DTensor shards it unevenly, rank 0 holding ceil(v/t)
    rows (as if padded to a multiple of t)."""

    @property
    def pads_vocab(self) -> bool:
        return self.unpadded_vocab is None

    def vocab_divisible_by(self, requested: int | None, default: int) -> int:
        """Megatron's padding multiple: the one asked for, or the default; 1 where the code pads
        none, and a request for padding there is refused."""
        if self.pads_vocab:
            return default if requested is None else requested
        if requested is not None and requested != 1:
            raise SpecError(f"--make-vocab-size-divisible-by is Megatron's vocabulary padding; "
                            f"--implementation {self.name} pads none ({self.unpadded_vocab})")
        return 1

    def stored_padding(self, value: int, default: int) -> int:
        """What a Spec or PlanRequest keeps as its padding multiple: the value given (the
        default read as not asked for), or 1 where the code pads none."""
        return self.vocab_divisible_by(None if value == default else value, default)

    def check(self, arch) -> None:
        """Refuse an architecture this implementation is not modelled for, with the reason."""
        for field, allowed, why in self.architecture:
            value = getattr(arch, field)
            if value not in allowed:
                shown = " or ".join(str(v) for v in allowed)
                raise SpecError(f"--implementation {self.name} is modelled for {why}: {field} must be "
                                f"{shown}, got {value} (--{field.replace('_', '-')})")


# torchtitan's Llama 3 block, parallelised by torchtitan's plan (torchtitan/models/llama3/
# infra/parallelize.py, apply_tp): SequenceParallel norms, PrepareModuleInput all-gathering
# Shard(1) -> Replicate() before the attention and the feed-forward, ColwiseParallel wq, wk,
# wv, w1, w3 and RowwiseParallel wo, w2 reduce-scattering to Shard(1).
_TORCHTITAN_LLAMA = (
    ("attention_core", ("flash",), "torchtitan's Llama layer, whose attention is "
                                  "F.scaled_dot_product_attention (a flash kernel)"),
    ("activation", ("swiglu",), "torchtitan's Llama layer (w2(silu(w1 x) * w3 x))"),
    ("normalization", ("rmsnorm",), "torchtitan's Llama layer (nn.RMSNorm)"),
    ("attention_dropout", (0,), "torchtitan's Llama layer, which has no dropout"),
    ("hidden_dropout", (0,), "torchtitan's Llama layer, which has no dropout"),
)

# transformers 5.23.0's LlamaDecoderLayer (models/llama/modeling_llama.py), as LlamaModel runs
# it in training with no padding: RMSNorm in Python, the MLP unfused, eager or SDPA attention.
_HF_LLAMA = (
    ("activation", ("swiglu",), "transformers' Llama layer (GPT2Block is not modelled yet)"),
    ("normalization", ("rmsnorm",), "transformers' Llama layer (LlamaRMSNorm)"),
    ("position_embedding", ("rope",), "transformers' Llama layer (rotary)"),
    ("attention_dropout", (0,), "transformers' Llama layer at its default attention_dropout 0 (with "
                                "dropout SDPA falls back to its math kernel on a CPU, unmeasured here)"),
    ("hidden_dropout", (0,), "transformers' Llama layer, which has no hidden dropout"),
)
_HF = dict(runs=frozenset(), unpadded_vocab="transformers keeps the config's vocabulary",
           selective_recompute="transformers has no selective recompute: choose none",
           full_recompute="transformers' activation checkpointing also keeps the rotary tables, the "
                          "position ids and (eager) the causal mask bound to each layer's call, which actmem "
                          "does not count yet: choose none",
           notes=("hf: transformers 5.23 LlamaForCausalLM on one device, as measured by the harness: "
                  "LlamaRMSNorm keeps an fp32 copy of its input and its 16-bit normalized tensor, not "
                  "its input; eager attention keeps q and k, v repeated to a heads and the softmax in "
                  "fp32 beside its 16-bit copy; sdpa (is_causal, enable_gqa) keeps k and v in their "
                  "groups; the unfused SwiGLU keeps four f-wide tensors; cos and sin once a forward; "
                  "int64 token ids and shifted labels (8 B a token each) are not counted; model state is "
                  "counted as mixed-precision Adam on one GPU (DDP), not as DeepSpeed or FSDP shard it",
                  "hf: the loss's backward holds up to 12sbv bytes at once (fp32 log-softmax, its "
                  "gradient and the loss's), above this peak floor's loss moment"))

IMPLEMENTATIONS = {
    MEGATRON: Implementation(
        MEGATRON, "Megatron-Core with Transformer Engine (the paper's code; the default)"),
    "torch-native": Implementation(
        "torch-native",
        "PyTorch-native DTensor tensor + sequence parallelism, torchtitan's Llama 3 plan "
        "(parallelize_module with ColwiseParallel, RowwiseParallel, SequenceParallel)",
        gathered_under_sp=frozenset({"qkv_input", "fc1_input", "output_layer_input"}),
        keeps=frozenset({"repeated_key_value", "silu_output"}),
        architecture=_TORCHTITAN_LLAMA,
        runs=frozenset({"tensor"}),
        unpadded_vocab="DTensor shards the vocabulary unevenly",
        notes=("torch-native: torchtitan's Llama 3 block (commit 018740b7) under parallelize_module with "
               "its plan: PrepareModuleInput all-gathers each norm's output, and wq, wk, wv (and w1, w3) "
               "keep that gathered (s, b, h) input, not the shard Megatron keeps; repeat_kv copies k and v "
               "to a/t heads unless g = t; the unfused SwiGLU keeps silu's output; the rotation keeps only "
               "the model's table; the norms are counted as the GPU's fused RMSNorm keeps them (16-bit "
               "input, fp32 rstd), not as torch's CPU decomposition (fp32 copies)",
               "torch-native: with --sp, torchtitan's plan; without, plain DTensor TP (ColwiseParallel and "
               "RowwiseParallel, the norms replicated), which torchtitan does not use; model state is "
               "counted as Megatron's mixed-precision Adam split over t, not as FSDP2 shards it",
               "torch-native: the output layer keeps its all-gathered input too, and the loss (under "
               "loss_parallel) the fp32 log-softmax of its vocabulary shard; int64 token ids and targets "
               "(8 B a token each, whole on every rank) are not counted; the loss_parallel backward holds "
               "up to 16sbv/t bytes at once, above this peak floor's loss moment"),
        selective_recompute="torchtitan's selective activation checkpointing (op-level: it keeps the "
                            "outputs of chosen ops; or every n-th layer) is not Megatron's core_attn "
                            "recompute, and actmem does not model it yet: choose none or full"),
    "hf": Implementation(
        "hf", "Hugging Face transformers 5.23 LlamaDecoderLayer (attn_implementation eager for the "
              "eager core, sdpa with is_causal and enable_gqa for flash; one device: no tensor, "
              "pipeline or context parallelism)",
        keeps=frozenset({"silu_output", "norm_fp32_copy", "softmax_fp32", "rotary_tables"}),
        architecture=(("attention_core", ("eager", "flash"), "transformers' eager and sdpa attention"),)
        + _HF_LLAMA, **_HF),
}


def implementation(name: str) -> Implementation:
    """The implementation of this name, or SpecError naming the known ones."""
    try:
        return IMPLEMENTATIONS[name]
    except (KeyError, TypeError):
        raise SpecError(f"implementation must be one of {', '.join(IMPLEMENTATIONS)}; got {name!r}") from None
