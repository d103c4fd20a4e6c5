"""Megatron-Core's own multi-token prediction, measured: megatron-core 0.16.1's
MultiTokenPredictionBlock (transformer/multi_token_prediction.py) run forward on a CPU over real gloo
ranks, its layer around a real TransformerLayer (DeepSeek-V3's kind of attention, MLA, and a dense
SwiGLU MLP) in Transformer Engine's layer spec, its embedding Megatron's own LanguageModelEmbedding,
every tensor autograd saves recorded, and the rows of actmem's table it keeps (terms.py: MTP_TERMS and
the layer's rows) compared with them, rank by rank.

Transformer Engine's modules are the stand-ins of actmem_validate.megatron_mla, which keep what TE's
keep (TENorm for enorm, hnorm, the final norm and the layer's input norm; TEColumnParallelLinear for
eh_proj), with its shims (megatron_mla._cpu_shims: among them the CUDA RNG tracker Megatron forks
around the embedding's dropout and the layer under SP, and the RNG state full recompute's checkpoint
copies onto its context). The output layer and the losses are not run
here beyond the output layer's input (the chunks of the block's output it keeps): the losses are the main
model's code (the main harness measures them).

A saved tensor counts where its storage is alive when the forward ends, once a storage; the layer's
parameters and buffers are model state. Tensors are named by dtype and shape and, where rows share
both, by the order the layer saves them (``_order``); the hidden states handed in (the main model's
final norm's output) by their storage. A storage several rows share (the layer's input, a view of
the gathered projection output under SP) is named 'a+b' and checked against their sum.
"""

from dataclasses import dataclass

from actmem.memory.techniques import Technique, run_technique
from actmem.model.architecture import Architecture
from actmem.model.recompute import FULL, NONE, Recompute
from actmem.model.spec import Model, Run, Spec

MEGATRON_CORE = "0.16.1"


@dataclass(frozen=True)
class MTPConfig:
    """One multi-token-prediction block measured over ``world_size`` gloo ranks (t of them)."""

    spec: Spec
    technique: Technique

    @property
    def full(self) -> bool:
        return self.technique.recompute is Recompute.FULL

    @property
    def label(self) -> str:
        run = self.spec.run
        fp8 = self.spec.architecture.fp8
        return (f"mtp D={self.spec.architecture.mtp_layers} mla+dense{f' fp8 {fp8}' if fp8 else ''} "
                f"t={run.tensor_parallel}{' sp' if run.sequence_parallel else ''} b={run.micro_batch}"
                f"{' full' if self.full else ''}")

    @property
    def world_size(self) -> int:
        return self.spec.run.tensor_parallel


def mtp_spec(t: int = 1, depth: int = 1, b: int = 2, fp8: str | None = None) -> Spec:
    """One layer of MLA (q_r = 18, kv_r = 12, d_qk = 6, d_rope = 4, d_v = 10, latent norms) and a SwiGLU MLP
    of f = 14, h = 16, a = 4, s = 16, v = 64, and ``depth`` prediction layers of the same kind; ``fp8``: under
    that recipe on a Hopper, at the MLA harness's FP8 dims (megatron_mla.FP8_DIMS)."""
    from actmem_validate.megatron_mla import FP8_DIMS

    h, q_r, kv_r, d_qk, d_rope, d_v, f = (16, 18, 12, 6, 4, 10, 14) if fp8 is None else FP8_DIMS[None]
    arch = Architecture(multi_latent_attention=True, q_lora_rank=q_r, kv_lora_rank=kv_r, qk_head_dim=d_qk,
                        qk_pos_emb_head_dim=d_rope, v_head_dim=d_v, qk_norm=True, activation="swiglu", ffn_hidden=f,
                        bias=False, normalization="rmsnorm", attention_core="flash", position_embedding="rope",
                        attention_dropout=0.0, hidden_dropout=0.0, tied_output=False, mtp_layers=depth,
                        fp8_format=fp8 and "e4m3", fp8_recipe=fp8)
    run = Run(tensor_parallel=t, sequence_parallel=t > 1, micro_batch=b)
    gpu = {"gpu_name": "a Hopper GPU", "gpu_fp8": "hopper"} if fp8 else {}
    return Spec(Model(heads=4, hidden=h, layers=1, vocab=64, seq_len=16), run, name="mtp", architecture=arch, **gpu)


def mtp_grid() -> list:
    """One rank with one prediction layer (DeepSeek-V3's); two layers chained (the second's hidden states
    are the first's output); t = 2 with SP (the embedding's masked lookup, the gathered layer input); full
    recompute at t = 2 (Megatron checkpoints each prediction layer whole, uniform 1); under FP8 (eh_proj and the
    layer's TE linears keeping their inputs' one-byte copies): tensorwise at t = 2, blockwise on one rank."""
    specs = ((mtp_spec(), NONE), (mtp_spec(depth=2), NONE), (mtp_spec(t=2), NONE), (mtp_spec(t=2), FULL),
             (mtp_spec(t=2, fp8="tensorwise"), NONE), (mtp_spec(fp8="blockwise"), NONE))
    return [MTPConfig(spec, run_technique(spec.run.sequence_parallel, policy)) for spec, policy in specs]


def formula(spec: Spec, technique: Technique) -> dict:
    """{term: bytes} of the block on a rank: the MTP rows (D of each), D layers' rows and the output layer's
    input, (1 + D)·2Nh; not the losses' (not run here: the main model's code)."""
    from actmem.memory import engine
    from actmem.memory.terms import MTP_TERMS, TERMS, layer_terms

    arch = spec.architecture
    bindings = spec.bindings_at(spec.run.tensor_parallel)
    rows = {term.name: engine.exact(engine.term_bytes(term, technique, arch), bindings) for term in MTP_TERMS
            + tuple(term for term in TERMS if term.name == "output_layer_input")}
    # under full recompute the prediction layers are not layers of the stage: their checkpoints keep the
    # MTP rows' arguments, nothing of the transformer layer (stages.mtp_layers_held)
    for term in layer_terms(arch) if technique.recompute is not Recompute.FULL else ():
        rows[term.name] = arch.mtp_layers * engine.exact(engine.term_bytes(term, technique, arch), bindings)
    return {name: n for name, n in rows.items() if n}


def _order(spec: Spec, technique: Technique) -> dict:
    """(dtype, shape) -> the rows that save it, in the order the prediction layers save them: each its
    tokens, enorm's input and statistics, hnorm's (the first's input is the hidden states handed in, named
    by their storage; a later one's is the output of the one before), eh_proj's input, the layer's rows
    (megatron_mla.layer_saves, its input the gathered view under SP), the final norm's; only the rows the
    technique keeps (under full recompute the checkpoint's arguments)."""
    from actmem_validate.megatron_mla import layer_saves

    arch, run = spec.architecture, spec.run
    t, s, b, h = run.tensor_parallel, spec.model.seq_len, run.micro_batch, spec.model.hidden
    n = s // t
    kept = {part for name in formula(spec, technique) for part in name.split("+")}
    layer_input = "attention_layernorm_input+mtp_layer_input_gathered" if t > 1 else "attention_layernorm_input"
    order = {}
    for depth in range(arch.mtp_layers):
        saves = ([("int64", (b, s), "mtp_token_ids"), ("bool", (b, s), "mtp_token_mask"),
                  ("bfloat16", (n, b, h), "mtp_embedding_output"), ("float32", (n, b, 1), "mtp_embedding_norm_statistics")]
                 + [("bfloat16", (n, b, h), "mtp_hidden_input")] * (depth > 0)
                 + [("float32", (n, b, 1), "mtp_hidden_norm_statistics"), *_eh_proj_saves(spec, n, b, h),
                    ("bfloat16", (n, b, h), layer_input)] + layer_saves(spec)
                 + [("bfloat16", (n, b, h), "mtp_final_norm_input"), ("float32", (n, b, 1), "mtp_final_norm_statistics")])
        for dtype, shape, name in saves:
            if all(part in kept for part in name.split("+")):
                order.setdefault((dtype, shape), []).append(name)
    return order


def _eh_proj_saves(spec: Spec, n: int, b: int, h: int) -> list:
    """What eh_proj keeps of its [n, b, 2h] input: itself, or under FP8 its one-byte copy and its scale_inv (or
    block scales, COMPACT: its gathered input's)."""
    arch = spec.architecture
    if not arch.fp8:
        return [("bfloat16", (n, b, 2 * h), "mtp_eh_proj_input")]
    rows = n * b
    scale = {"mxfp8": ("uint8", (-(-(rows // 32) // 4) * 4, -(-2 * h // 128) * 128), "mtp_eh_proj_input_scales"),
             "blockwise": ("float32", (-(-rows // 128), 2 * h), "mtp_eh_proj_input_scales")}.get(
        arch.fp8, ("float32", (1,), "mtp_eh_proj_input"))
    return [("float8_e4m3fn", (n, b, 2 * h), "mtp_eh_proj_input"), scale]


def _named(saved: list, spec: Spec, technique: Technique, hidden_key) -> dict:
    """{term: bytes} of the saved storages (key, dtype, shape, bytes) in the order saved."""
    order, named = _order(spec, technique), {}
    for key, dtype, shape, n_bytes in saved:
        rows = order.get((dtype, shape))
        name = "mtp_hidden_input" if key == hidden_key else rows.pop(0) if rows else f"unnamed {dtype} {list(shape)}"
        if name.startswith("unnamed") and dtype == "bfloat16" and shape == (shape[0], spec.run.micro_batch,
                                                                             spec.model.hidden):
            name = "output_layer_input"   # a chunk of the block's output: the whole (1 + D)-long storage
        named[name] = named.get(name, 0) + n_bytes
    return named


def _block(spec: Spec, technique: Technique, stand_ins: dict):
    """megatron-core's MultiTokenPredictionBlock of this spec (its layer: megatron_mla.layer_spec) and the
    embedding it looks tokens up in."""
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.transformer.multi_token_prediction import (MultiTokenPredictionBlock,
                                                                  MultiTokenPredictionBlockSubmodules,
                                                                  MultiTokenPredictionLayer,
                                                                  MultiTokenPredictionLayerSubmodules)
    from megatron.core.transformer.spec_utils import ModuleSpec

    from actmem_validate.megatron_mla import config_for, layer_spec

    arch, model = spec.architecture, spec.model
    config = config_for(spec, technique, mtp_num_layers=arch.mtp_layers)
    mtp_layer = ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=stand_ins["norm"], hnorm=stand_ins["norm"], eh_proj=stand_ins["column"],
        transformer_layer=layer_spec(arch, stand_ins), layer_norm=stand_ins["norm"]))
    block = MultiTokenPredictionBlock(config, MultiTokenPredictionBlockSubmodules(
        layer_specs=[mtp_layer] * arch.mtp_layers))
    embedding = LanguageModelEmbedding(config, vocab_size=model.vocab, max_sequence_length=model.seq_len,
                                       position_embedding_type="rope")
    return block, embedding


def _rank(rank: int, world: int, port: int, config: MTPConfig, results) -> None:
    """One rank: build the block, run it forward recording what autograd saves, then backward."""
    import torch

    from actmem_validate.gloo import held_storages, rank_group, recorder
    from actmem_validate.megatron_mla import _cpu_shims, _stand_ins

    spec, run = config.spec, config.spec.run
    stand_ins = _stand_ins(spec.architecture.fp8)
    with rank_group(rank, world, port, lambda: _cpu_shims(stand_ins), run.tensor_parallel):
        torch.manual_seed(0)
        block, embedding = _block(spec, config.technique, stand_ins)
        for layer in block.layers:        # Megatron's set_save_original_input, as megatron_mla._rank does
            layer.transformer_layer.self_attention.linear_proj.save_original_input = \
                spec.architecture.fp8 not in (None, "delayed")
        s, b = spec.model.seq_len, run.micro_batch
        tokens = torch.randint(0, spec.model.vocab, (b, s))          # the same on every rank of the group
        positions = torch.arange(s).expand(b, s)
        torch.manual_seed(1 + rank)
        rows = s // (run.tensor_parallel if run.sequence_parallel else 1)
        hidden = torch.randn(rows, b, spec.model.hidden, dtype=torch.bfloat16, requires_grad=True)
        # the output layer is Megatron's own ColumnParallelLinear, never FP8: the 16-bit stand-in
        output_layer = _stand_ins()["column"](spec.model.hidden, spec.model.vocab, config=block.config)
        saved, pack = recorder()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = block(input_ids=tokens, position_ids=positions, hidden_states=hidden, attention_mask=None,
                        embedding=embedding)
            # gpt_model.py, _postprocess: the main and each prediction's hidden states, chunks of the block's
            # one output, each through the output layer (its column-parallel linear keeps its input)
            logits = [output_layer(chunk)[0] for chunk in torch.chunk(out, 1 + spec.architecture.mtp_layers, dim=0)]
        held = held_storages(saved, block, embedding, output_layer)
        named = _named(held, spec, config.technique, hidden.untyped_storage().data_ptr())
        sum(part.float().sum() for part in logits).backward()
        results.put((rank, named))


def measure(config: MTPConfig) -> list[tuple]:
    """(rank, {term: bytes saved}) of every rank of one configuration."""
    from actmem_validate.gloo import spawn

    return spawn(_rank, config)


def rows(configs) -> list[dict]:
    """The error table's rows (compare.term_rows) of every rank of every configuration, those of a world size
    measured in one set of processes."""
    from actmem_validate.gloo import spawn_each, term_table

    return term_table(configs, spawn_each(_rank, configs).__getitem__, formula)
