"""Megatron-Core's own multi-token prediction, measured: megatron-core 0.16.1's
MultiTokenPredictionBlock (transformer/multi_token_prediction.py) run forward on a CPU over real gloo
ranks, its layer around a real TransformerLayer (DeepSeek-V3's kind of attention, MLA, and a dense
SwiGLU MLP) in Transformer Engine's layer spec, its embedding Megatron's own LanguageModelEmbedding,
every tensor autograd saves recorded, and the rows of actmem's table it keeps (terms.py: MTP_TERMS and
the layer's rows) compared with them, rank by rank.

Transformer Engine's modules are the stand-ins of actmem_validate.megatron_mla, which keep what TE's
keep (TENorm for enorm, hnorm, the final norm and the layer's input norm; TEColumnParallelLinear for
eh_proj), with its shims; one more: Megatron forks its CUDA RNG tracker around the embedding's
dropout and the layer under SP, which on a CPU has no state: a tracker whose fork does nothing
(``_cpu_rng_tracker``), and under full recompute the checkpoint's CUDA RNG state, which it copies
onto its context (not a saved tensor) and a CPU has none of: neither makes or keeps a tensor. The output layer and the losses are not run
here beyond the output layer's input (the chunks of the block's output it keeps): the losses are the main
model's code (the main harness measures them).

A saved tensor counts where its storage is alive when the forward ends, once a storage; the layer's
parameters and buffers are model state. Tensors are named by dtype and shape and, where rows share
both, by the order the layer saves them (``_order``); the hidden states handed in (the main model's
final norm's output) by their storage. A storage several rows share (the layer's input, a view of
the gathered projection output under SP) is named 'a+b' and checked against their sum.
"""

import os
import socket
import weakref
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
        return (f"mtp D={self.spec.architecture.mtp_layers} mla+dense t={run.tensor_parallel}"
                f"{' sp' if run.sequence_parallel else ''} b={run.micro_batch}{' full' if self.full else ''}")

    @property
    def world_size(self) -> int:
        return self.spec.run.tensor_parallel


def mtp_spec(t: int = 1, depth: int = 1, b: int = 2) -> Spec:
    """One layer of MLA (q_r = 18, kv_r = 12, d_qk = 6, d_rope = 4, d_v = 10, latent norms) and a SwiGLU MLP
    of f = 14, h = 16, a = 4, s = 16, v = 64, and ``depth`` prediction layers of the same kind."""
    arch = Architecture(multi_latent_attention=True, q_lora_rank=18, kv_lora_rank=12, qk_head_dim=6,
                        qk_pos_emb_head_dim=4, v_head_dim=10, qk_norm=True, activation="swiglu", ffn_hidden=14,
                        bias=False, normalization="rmsnorm", attention_core="flash", position_embedding="rope",
                        attention_dropout=0.0, hidden_dropout=0.0, tied_output=False, mtp_layers=depth)
    run = Run(tensor_parallel=t, sequence_parallel=t > 1, micro_batch=b)
    return Spec(Model(heads=4, hidden=16, layers=1, vocab=64, seq_len=16), run, name="mtp", architecture=arch)


def mtp_grid() -> list:
    """One rank with one prediction layer (DeepSeek-V3's); two layers chained (the second's hidden states
    are the first's output); t = 2 with SP (the embedding's masked lookup, the gathered layer input); full
    recompute at t = 2 (Megatron checkpoints each prediction layer whole, uniform 1)."""
    specs = ((mtp_spec(), NONE), (mtp_spec(depth=2), NONE), (mtp_spec(t=2), NONE), (mtp_spec(t=2), FULL))
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


def _order(spec: Spec, full: bool = False) -> dict:
    """(dtype, shape) -> the rows that save it, in the order the prediction layers save them: each its
    tokens, enorm's input and statistics, hnorm's (the first's input is the hidden states handed in, named
    by their storage; a later one's is the output of the one before), eh_proj's input, the layer's rows,
    the final norm's; under full recompute (``full``) the checkpoint's arguments only."""
    arch, run = spec.architecture, spec.run
    t, s, b, h = run.tensor_parallel, spec.model.seq_len, run.micro_batch, spec.model.hidden
    n, heads, f = s // t, spec.model.heads // t, arch.ffn(h) // t
    qk = arch.qk_head_dim + arch.qk_pos_emb_head_dim
    layer_input = "attention_layernorm_input+mtp_layer_input_gathered" if t > 1 else "attention_layernorm_input"
    layer = [
        ("bfloat16", (n, b, 2 * h), "mtp_eh_proj_input"),
        ("bfloat16", (n, b, h), layer_input), ("float32", (n, b, 1), "attention_norm_statistics"),
        ("bfloat16", (n, b, h), "qkv_input"),
        ("bfloat16", (n, b, arch.q_lora_rank), "mla_q_latent"), ("float32", (n, b, 1), "mla_q_latent_statistics"),
        ("bfloat16", (n, b, arch.q_lora_rank), "mla_q_latent_normed"),
        ("bfloat16", (n, b, arch.kv_lora_rank), "mla_kv_latent"), ("float32", (n, b, 1), "mla_kv_latent_statistics"),
        ("bfloat16", (n, b, arch.kv_lora_rank), "mla_kv_latent_normed"),
        ("bfloat16", (s, b, heads, qk), "mla_query"), ("bfloat16", (s, b, heads, qk), "mla_key"),
        ("bfloat16", (s, b, heads, arch.v_head_dim), "mla_value"), ("float32", (b, heads, s), "softmax_lse"),
        ("bfloat16", (s, b, heads * arch.v_head_dim), "projection_input"),
        ("bfloat16", (n, b, h), "mlp_layernorm_input"), ("float32", (n, b, 1), "mlp_norm_statistics"),
        ("bfloat16", (n, b, h), "fc1_input"), ("bfloat16", (s * b, 2 * f), "swiglu_input"),
        ("bfloat16", (s, b, f), "fc2_input"),
        ("bfloat16", (n, b, h), "mtp_final_norm_input"), ("float32", (n, b, 1), "mtp_final_norm_statistics")]
    order = {}
    for depth in range(arch.mtp_layers):
        saves = ([("int64", (b, s), "mtp_token_ids")] + [("bool", (b, s), "mtp_token_mask")] * (t > 1)
                 + [("bfloat16", (n, b, h), "mtp_embedding_output"),
                    ("float32", (n, b, 1), "mtp_embedding_norm_statistics")]
                 + [("bfloat16", (n, b, h), "mtp_hidden_input")] * (depth > 0)
                 + [("float32", (n, b, 1), "mtp_hidden_norm_statistics")] + layer)
        if full:
            saves = [save for save in saves if save[2] in ("mtp_token_ids", "mtp_token_mask", "mtp_embedding_output",
                                                           "mtp_hidden_input")]
        for dtype, shape, name in saves:
            order.setdefault((dtype, shape), []).append(name)
    return order


def _named(saved: list, spec: Spec, hidden_key, full: bool = False) -> dict:
    """{term: bytes} of the saved storages (key, dtype, shape, bytes) in the order saved."""
    order, named = _order(spec, full), {}
    for key, dtype, shape, n_bytes in saved:
        rows = order.get((dtype, shape))
        name = "mtp_hidden_input" if key == hidden_key else rows.pop(0) if rows else f"unnamed {dtype} {list(shape)}"
        if name.startswith("unnamed") and dtype == "bfloat16" and shape == (shape[0], spec.run.micro_batch,
                                                                             spec.model.hidden):
            name = "output_layer_input"   # a chunk of the block's output: the whole (1 + D)-long storage
        named[name] = named.get(name, 0) + n_bytes
    return named


def _cpu_rng_tracker():
    """A CUDA RNG tracker whose fork does nothing: Megatron forks it around the embedding's dropout and
    the prediction layer under SP (language_model_embedding.py; multi_token_prediction.py,
    _proj_and_transformer_layer); with every dropout 0 no random number is drawn."""
    import contextlib

    class _Tracker:
        def fork(self, *args, **kwargs):
            return contextlib.nullcontext()

        def get_states(self):
            return {}

        def set_states(self, states):
            pass

    tracker = _Tracker()
    return lambda *args, **kwargs: tracker


def _block(spec: Spec, stand_ins: dict, full: bool = False):
    """megatron-core's MultiTokenPredictionBlock of this spec and the embedding it looks tokens up in."""
    import torch
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
    from megatron.core.transformer.multi_token_prediction import (MultiTokenPredictionBlock,
                                                                  MultiTokenPredictionBlockSubmodules,
                                                                  MultiTokenPredictionLayer,
                                                                  MultiTokenPredictionLayerSubmodules)
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    arch, run, model = spec.architecture, spec.run, spec.model
    config = MLATransformerConfig(
        num_layers=1, hidden_size=model.hidden, num_attention_heads=model.heads, ffn_hidden_size=arch.ffn(model.hidden),
        multi_latent_attention=True, q_lora_rank=arch.q_lora_rank, kv_lora_rank=arch.kv_lora_rank,
        qk_head_dim=arch.qk_head_dim, qk_pos_emb_head_dim=arch.qk_pos_emb_head_dim, v_head_dim=arch.v_head_dim,
        rope_type="yarn", rotary_scaling_factor=40, qk_layernorm=True, normalization="RMSNorm", add_bias_linear=False,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, bias_activation_fusion=True,
        attention_dropout=0.0, hidden_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        use_cpu_initialization=True, tensor_model_parallel_size=run.tensor_parallel,
        sequence_parallel=run.sequence_parallel, apply_rope_fusion=True, mtp_num_layers=arch.mtp_layers,
        **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if full else {}))
    up = stand_ins["layernorm_column"]
    attention = ModuleSpec(module=MLASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                           submodules=MLASelfAttentionSubmodules(
                               linear_q_proj=stand_ins["column"], linear_q_down_proj=stand_ins["linear"],
                               linear_q_up_proj=up, linear_kv_down_proj=stand_ins["linear"], linear_kv_up_proj=up,
                               core_attention=stand_ins["core"], linear_proj=stand_ins["row"],
                               q_layernorm=IdentityOp, kv_layernorm=IdentityOp))
    layer = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=stand_ins["norm"], self_attention=attention, self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=IdentityOp, mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(
            linear_fc1=stand_ins["layernorm_column"], linear_fc2=stand_ins["row"])), mlp_bda=get_bias_dropout_add))
    mtp_layer = ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=stand_ins["norm"], hnorm=stand_ins["norm"], eh_proj=stand_ins["column"], transformer_layer=layer,
        layer_norm=stand_ins["norm"]))
    block = MultiTokenPredictionBlock(config, MultiTokenPredictionBlockSubmodules(
        layer_specs=[mtp_layer] * arch.mtp_layers))
    embedding = LanguageModelEmbedding(config, vocab_size=model.vocab, max_sequence_length=model.seq_len,
                                       position_embedding_type="rope")
    return block, embedding


def _rank(rank: int, world: int, port: int, config: MTPConfig, results) -> None:
    """One rank: build the block, run it forward recording what autograd saves, then backward."""
    import torch
    import torch.distributed as dist

    from actmem_validate.megatron_mla import _cpu_shims, _stand_ins

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        stand_ins = _stand_ins()
        _cpu_shims(stand_ins)
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.tensor_parallel import random

        tensor_parallel.get_cuda_rng_tracker = random.get_cuda_rng_tracker = _cpu_rng_tracker()
        random._get_cuda_rng_state = random._set_cuda_rng_state = lambda *args, **kwargs: None
        spec, run = config.spec, config.spec.run
        parallel_state.initialize_model_parallel(run.tensor_parallel, 1)
        torch.manual_seed(0)
        block, embedding = _block(spec, stand_ins, config.full)
        s, b = spec.model.seq_len, run.micro_batch
        tokens = torch.randint(0, spec.model.vocab, (b, s))          # the same on every rank of the group
        positions = torch.arange(s).expand(b, s)
        torch.manual_seed(1 + rank)
        rows = s // (run.tensor_parallel if run.sequence_parallel else 1)
        hidden = torch.randn(rows, b, spec.model.hidden, dtype=torch.bfloat16, requires_grad=True)
        saved = {}

        def pack(tensor):
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            held = saved.get(key)
            if storage.nbytes() and (held is None or held[0]() is None):
                saved.pop(key, None)
                saved[key] = (weakref.ref(storage), str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape),
                              storage.nbytes())
            return tensor

        output_layer = stand_ins["column"](spec.model.hidden, spec.model.vocab, config=block.config)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = block(input_ids=tokens, position_ids=positions, hidden_states=hidden, attention_mask=None,
                        embedding=embedding)
            # gpt_model.py, _postprocess: the main and each prediction's hidden states, chunks of the block's
            # one output, each through the output layer (its column-parallel linear keeps its input)
            logits = [output_layer(chunk)[0] for chunk in torch.chunk(out, 1 + spec.architecture.mtp_layers, dim=0)]
        state = {tensor.untyped_storage().data_ptr() for module in (block, embedding, output_layer)
                 for tensor in (*module.parameters(), *module.buffers())}
        held = [(key, *rest) for key, (alive, *rest) in saved.items() if alive() is not None and key not in state]
        named = _named(held, spec, hidden.untyped_storage().data_ptr(), config.full)
        sum(part.float().sum() for part in logits).backward()
        results.put((rank, named))
        parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def measure(config: MTPConfig) -> list[tuple]:
    """(rank, {term: bytes saved}) of every rank of one configuration."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.start_processes(_rank, args=(config.world_size, port, config, results), nprocs=config.world_size,
                       start_method="spawn")
    return sorted(results.get() for _ in range(config.world_size))


def rows(configs) -> list[dict]:
    """The error table's rows (compare.term_rows) of every rank of every configuration."""
    from actmem_validate.compare import term_rows

    table = []
    for config in configs:
        expected = formula(config.spec, config.technique)
        for rank, named in measure(config):
            table += term_rows(config, rank, expected, named)
    return table
