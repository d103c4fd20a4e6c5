"""Megatron-Core's own MoE layer, measured: megatron-core's MoELayer (the PyPI release this
harness pins, 0.16.1) built from its local layer spec, run forward on a CPU over real gloo
ranks (expert and tensor parallelism), every tensor autograd saves recorded, and the MoE rows
of actmem's table (terms.py, router_input to experts_fc2_input) compared with them, rank by rank.

The rows the busiest rank's experts receive depend on the routing of the step; each rank's
formula is bound to the rows its experts did receive (the routing imbalance r at T/T_balanced,
so ⌈r·T_balanced⌉ = T), which checks every row's shape and what the layer keeps; the balance
itself is the user's input (--moe-imbalance).

Megatron-Core runs on a GPU; four shims let it run on a CPU, none of which makes or keeps a
tensor (``_cpu_shims``). A saved tensor counts where its storage is still alive when the forward ends (a
node autograd frees on the way, with what it saved, holds nothing), once a storage; it is named by its
dtype and shape, which the layer's dims make distinct (``_named``); any other is unnamed and fails the gate.
"""

import contextlib
from dataclasses import dataclass, replace
from fractions import Fraction

from actmem.memory.techniques import Technique, run_technique
from actmem.model.architecture import Architecture, moe_aux_loss, moe_group_mask
from actmem.model.fp8 import row_padding
from actmem.model.recompute import NONE, Recompute, RecomputePolicy
from actmem.model.spec import Model, Run, Spec

MEGATRON_CORE = "0.16.1"
"""The megatron-core release measured (pip install megatron-core==0.16.1)."""


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer measured over ``world_size`` gloo ranks."""

    spec: Spec
    technique: Technique
    ignored: tuple = ()
    """(TransformerConfig field, value): Megatron settings actmem reads as changing no saved byte
    (megatron_memory.toml, 'ignored'), set here so that the measurement shows they change none."""
    in_layer: bool = False
    """Run inside megatron-core's TransformerLayer, after its pre-MLP TENorm (the MLA harness's stand-in)
    and no attention: what --recompute-modules layernorm does to a MoE layer's norm and the router's input."""

    @property
    def label(self) -> str:
        run, arch = self.spec.run, self.spec.architecture
        return (f"moe E={arch.num_experts} k={arch.moe_topk} t={run.tensor_parallel} "
                + f"c={run.context_parallel} " * (run.context_parallel > 1) + f"EP={run.expert_parallel} "
                f"ETP={run.etp} {arch.moe_dispatcher} router {arch.moe_router_dtype or 'bf16'} "
                + "grouped " * arch.moe_grouped_gemm + f"fp8 {arch.fp8} " * bool(arch.fp8)
                + f"bf16 layer of an fp8 run (rows padded to {arch.moe_bf16_padding}) " * bool(arch.moe_bf16_padding)
                + "fused " * arch.moe_permute_fusion
                + (f"shared{' gated' if arch.moe_shared_gate else ''}{' overlap' if arch.moe_shared_overlap else ''} "
                   if arch.moe_shared_ffn else "") + ("pre-softmax " if arch.moe_pre_softmax else "")
                + (f"sigmoid{' bias' if arch.moe_expert_bias else ''} " if arch.moe_score_function == "sigmoid" else "")
                + (f"groups {arch.moe_router_groups}/{arch.moe_router_group_topk} " if arch.moe_router_groups else "")
                + "".join(f"{name.removeprefix('moe_router_')}={value} " for name, value in self.ignored)
                + (f"capacity {arch.moe_capacity_factor:g} by {arch.moe_drop_policy} "
                   + "padded " * arch.moe_pad_to_capacity if arch.moe_capacity_factor else "")
                + f"{'seq_aux' if arch.moe_load_balancing == 'seq_aux_loss' else 'aux'} {arch.moe_aux_loss_coeff:g}"
                + (f" selective:{'+'.join(self.technique.modules)}" if self.technique.recompute is Recompute.SELECTIVE
                   else "") + (" in a layer" if self.in_layer else ""))

    @property
    def world_size(self) -> int:
        run = self.spec.run
        return max(run.tensor_parallel * run.context_parallel, run.etp * run.expert_parallel)


def moe_spec(t: int = 1, ep: int = 1, etp: int | None = None, aux: bool = True, experts: int = 8,
             topk: int = 2, dispatcher: str = "alltoall", router_dtype: str | None = None, shared: bool = False,
             gate: bool = False, overlap: bool = False, pre_softmax: bool = False, sigmoid: bool = False,
             expert_bias: bool = False, groups: tuple | None = None, seq_aux: bool = False,
             capacity: float | None = None, drop_policy: str = "probs", pad: bool = False,
             grouped: bool = False, fused: bool = False, c: int = 1, fp8: str | None = None,
             bf16_padding: int | None = None) -> Spec:
    """A small MoE layer whose saved tensors' shapes are all distinct: h = 16, f_e = 10, s = 16, b = 2, and
    shared experts of f_s = 14 where asked. ``fp8``: the experts under that FP8 recipe, on a Hopper, at h = 32,
    f_e = 96 and f_s = 128, dims TE's FP8 GEMMs take (rules.py: the attention's a·d/t, f_e/ETP and f_s/t divisible
    by 16). ``bf16_padding``: the layer as a bf16 layer of an FP8 run runs it (--first-last-layers-bf16), its
    experts' rows padded to that multiple (Architecture.moe_bf16_padding)."""
    ffn = 96 if fp8 else 10
    arch = Architecture(num_experts=experts, moe_topk=topk, ffn_hidden=ffn, moe_ffn_hidden=ffn, activation="swiglu",
                        bias=False, normalization="rmsnorm", attention_core="flash", position_embedding="rope",
                        attention_dropout=0.0, hidden_dropout=0.0, moe_dispatcher=dispatcher,
                        moe_aux_loss_coeff=1e-2 if aux else 0.0, moe_router_dtype=router_dtype, tied_output=False,
                        moe_shared_ffn=(128 if fp8 else 14) if shared else None, moe_shared_gate=gate, moe_shared_overlap=overlap,
                        moe_pre_softmax=pre_softmax, moe_score_function="sigmoid" if sigmoid else "softmax",
                        moe_expert_bias=expert_bias, moe_router_groups=groups and groups[0],
                        moe_router_group_topk=groups and groups[1],
                        moe_load_balancing="seq_aux_loss" if seq_aux else "aux_loss", moe_capacity_factor=capacity,
                        moe_drop_policy=drop_policy, moe_pad_to_capacity=pad, moe_grouped_gemm=grouped,
                        moe_permute_fusion=fused, fp8_format=fp8 and "e4m3", fp8_recipe=fp8,
                        moe_bf16_padding=bf16_padding)
    run = Run(tensor_parallel=t, sequence_parallel=t > 1, micro_batch=2, expert_parallel=ep,
              expert_tensor_parallel=etp, context_parallel=c)
    generation = "blackwell" if fp8 == "mxfp8" else "hopper"          # MXFP8 runs on Blackwell alone
    gpu = {"gpu_name": f"a {generation.capitalize()} GPU", "gpu_fp8": generation} if fp8 else {}
    return Spec(Model(heads=4, hidden=32 if fp8 else 16, layers=1, vocab=64, seq_len=16), run, name="moe",
                architecture=arch, **gpu)


def moe_grid() -> list:
    """The layouts the alltoall dispatcher takes different paths for: one rank; experts over two
    ranks (E/EP local experts sorted by chunk); the expert linears split over two (ETP = t = 2,
    the tokens all-gathered); experts over two beside t = 2 with ETP = 1; the aux loss at Megatron's
    default coefficient, 0, which computes none. The
    allgather dispatcher (Megatron's default) gathering over EP and over ETP; the router in fp32 and fp64
    (--moe-router-dtype) on two of them; shared experts on three (alone; gated and overlapping at t = 2;
    gated beside EP = 2); the softmax over every expert, top-1 (--moe-router-pre-softmax), on one; the
    sigmoid router on three (with the expert bias, DeepSeek-V3's group-limited routing, its scaling factor,
    which keeps nothing more, and its sequence-wise aux loss beside EP = 2; in fp32 without bias; in fp64 with
    bias at top-1); group-limited routing under the softmax too (its mask kept)."""
    scaling = (("moe_router_topk_scaling_factor", 2.5),)
    specs = ((moe_spec(shared=True), ()), (moe_spec(ep=2, sigmoid=True, expert_bias=True, groups=(4, 2), seq_aux=True), scaling),
             (moe_spec(t=2, shared=True, gate=True, overlap=True), ()),
             (moe_spec(t=2, ep=2, etp=1, router_dtype="fp32", shared=True, gate=True, sigmoid=True), ()),
             (moe_spec(aux=False, ep=2, groups=(4, 2)), ()),
             (moe_spec(ep=2, dispatcher="allgather", pre_softmax=True, topk=1), ()),
             (moe_spec(t=2, dispatcher="allgather", router_dtype="fp64", sigmoid=True, expert_bias=True, topk=1), ()))
    configs = [MoEConfig(spec, run_technique(spec.run.sequence_parallel, NONE), ignored) for spec, ignored in specs]
    # selective recompute of the whole MoE layer (its checkpoint keeps the router's input alone) and of the
    # shared experts (theirs the same input), beside t = 2
    for spec, modules in ((moe_spec(t=2, shared=True, gate=True), ("moe",)),
                          (moe_spec(t=2, ep=2, etp=1, shared=True, gate=True, sigmoid=True), ("shared_experts",)),
                          # ... under the allgather dispatcher, which keeps its indices and probabilities too
                          (moe_spec(t=2, dispatcher="allgather", shared=True), ("shared_experts",))):
        policy = RecomputePolicy(Recompute.SELECTIVE, frozenset(modules))
        configs.append(MoEConfig(spec, run_technique(spec.run.sequence_parallel, policy)))
    # a capacity factor that drops tokens (0.5: half of each expert's balanced share), by probability under
    # alltoall beside EP = 2, by position under allgather at t = 2; 1.5, where a rank's experts may receive more
    # than the balanced k·N (up to E·C), beside EP = 2; padded to capacity (every expert C·EP·ETP rows) under
    # alltoall beside EP = 2 and under allgather at t = 2
    configs += [MoEConfig(spec, run_technique(spec.run.sequence_parallel, NONE)) for spec in (
        moe_spec(ep=2, capacity=0.5), moe_spec(t=2, dispatcher="allgather", capacity=0.5, drop_policy="position"),
        moe_spec(ep=2, capacity=1.5), moe_spec(ep=2, capacity=1.5, pad=True),
        moe_spec(t=2, dispatcher="allgather", capacity=0.5, pad=True))]
    # the experts as TE's grouped GEMM (TEGroupedMLP over the GroupedLinear stand-in) beside EP = 2, and with their
    # activation recomputed (moe_act: fc2's input freed once fc2 has run) at t = ETP = 2 beside shared experts
    act = RecomputePolicy(Recompute.SELECTIVE, frozenset({"moe_act"}))
    configs += [MoEConfig(moe_spec(ep=2, grouped=True), run_technique(False, NONE)),
                MoEConfig(moe_spec(t=2, grouped=True, shared=True), run_technique(True, act)),
                # ... beside gated shared experts overlapping the dispatcher: their fc2 and gate run backward first
                MoEConfig(moe_spec(t=2, grouped=True, shared=True, gate=True, overlap=True), run_technique(True, act))]
    # FP8 experts (TE's GroupedLinear's FP8 stand-in, each expert's rows padded to 16): tensorwise beside EP = 2
    # (four local experts), delayed at t = ETP = 2 (eight), tensorwise with moe_act recomputed at t = 2, and under
    # the allgather dispatcher beside EP = 2
    configs += [MoEConfig(moe_spec(ep=2, grouped=True, fp8="tensorwise"), run_technique(False, NONE)),
                MoEConfig(moe_spec(t=2, grouped=True, fp8="delayed"), run_technique(True, NONE)),
                MoEConfig(moe_spec(t=2, grouped=True, fp8="tensorwise"), run_technique(True, act)),
                MoEConfig(moe_spec(ep=2, grouped=True, fp8="tensorwise", dispatcher="allgather"),
                          run_technique(False, NONE))]
    # ... beside shared experts (TE linears' FP8 stand-in): tensorwise at t = 2 (fc1 keeps the router's input),
    # delayed at t = 2, gated and overlapping the dispatcher (fc1 keeps the gathered input quantized), delayed
    # beside EP = 2 at t = 1 (the whole input quantized)
    configs += [MoEConfig(spec, run_technique(spec.run.sequence_parallel, NONE)) for spec in (
        moe_spec(t=2, grouped=True, shared=True, fp8="tensorwise"),
        moe_spec(t=2, grouped=True, shared=True, gate=True, overlap=True, fp8="delayed"),
        moe_spec(ep=2, grouped=True, shared=True, fp8="delayed"))]
    # ... under the block-scaled recipes (their bulk buffers, rows padded to 32 under MXFP8): MXFP8 and blockwise
    # beside EP = 2 with shared experts, blockwise with moe_act recomputed
    configs += [MoEConfig(moe_spec(ep=2, grouped=True, shared=True, fp8="mxfp8"), run_technique(False, NONE)),
                MoEConfig(moe_spec(ep=2, grouped=True, shared=True, fp8="blockwise"), run_technique(False, NONE)),
                MoEConfig(moe_spec(ep=2, grouped=True, fp8="blockwise"), run_technique(False, act))]
    # ... and delayed beside shared experts at t = 2, not overlapping: fc1 keeps the rank's shard quantized
    configs.append(MoEConfig(moe_spec(t=2, grouped=True, shared=True, fp8="delayed"), run_technique(True, NONE)))
    # ... recomputed through TE's checkpoint (its stand-in, _te_checkpoint): the whole layer at t = 2, the shared
    # experts beside EP = 2, tensorwise
    for spec, modules in ((moe_spec(t=2, grouped=True, shared=True, fp8="tensorwise"), ("moe",)),
                          (moe_spec(ep=2, grouped=True, shared=True, fp8="tensorwise"), ("shared_experts",))):
        configs.append(MoEConfig(spec, run_technique(spec.run.sequence_parallel,
                                                     RecomputePolicy(Recompute.SELECTIVE, frozenset(modules)))))
    # a bf16 layer of an FP8 run (--first-last-layers-bf16): its GEMMs in bf16, its experts' rows still padded, to
    # 16 (a Hopper's) beside EP = 2, and to 32 (a Blackwell's) at t = 2 with shared experts and moe_act recomputed
    configs += [MoEConfig(moe_spec(ep=2, grouped=True, bf16_padding=16), run_technique(False, NONE)),
                MoEConfig(moe_spec(t=2, grouped=True, shared=True, bf16_padding=32), run_technique(True, act))]
    # the permutation as TE's fused kernels (their CPU stand-in, te_permutation): under alltoall at EP = 1 (the
    # chunk sorts of 8 local experts), beside EP = 2 with the router in fp32, padded to capacity beside EP = 2;
    # under allgather beside EP = 2
    configs += [MoEConfig(spec, run_technique(spec.run.sequence_parallel, NONE)) for spec in (
        moe_spec(fused=True), moe_spec(ep=2, fused=True, router_dtype="fp32"),
        moe_spec(ep=2, fused=True, capacity=1.5, pad=True), moe_spec(ep=2, dispatcher="allgather", fused=True))]
    # beside context parallelism (c = 2: each rank routes its s/c tokens; the aux losses reduce their counts over
    # t·c, which keeps nothing): EP = 2 over the same two ranks under alltoall, the sequence-wise aux loss under
    # allgather
    configs += [MoEConfig(spec, run_technique(False, NONE)) for spec in (
        moe_spec(ep=2, c=2), moe_spec(ep=2, c=2, dispatcher="allgather", seq_aux=True))]
    # inside a TransformerLayer after its pre-MLP TENorm: as it is, and with layernorm recomputed (the norm's
    # output, the router's input, freed once the layer has run), at t = 2 with shared experts; and as TE's grouped
    # GEMM with moe_act recomputed beside it (the norm's rerun comes first and holds its output, twice, through
    # the experts' activation's rerun: the rerun rows)
    spec = moe_spec(t=2, shared=True)
    for policy in (NONE, RecomputePolicy(Recompute.SELECTIVE, frozenset({"layernorm"}))):
        configs.append(MoEConfig(spec, run_technique(True, policy), in_layer=True))
    configs.append(MoEConfig(moe_spec(t=2, grouped=True, shared=True),
                             run_technique(True, RecomputePolicy(Recompute.SELECTIVE, frozenset({"layernorm", "moe_act"}))),
                             in_layer=True))
    return configs


def formula(spec: Spec, technique: Technique, expert_rows: int, in_layer: bool = False,
            kept_copies: int | None = None, padding: tuple | None = None) -> dict:
    """{term: bytes} of one MoE layer on a rank whose experts received ``expert_rows`` rows, and under FP8
    ``padding``: (the rows they computed, each expert's padded to a multiple of 16 or 32, the 128-row scale blocks
    of those): P and Q bound to what padding and the blocks added, as r to the rows received; ``in_layer``: with
    its pre-MLP norm's rows. Under a capacity factor that drops (not padded), the alltoall permute keeps the
    indices of the ``kept_copies`` its rank kept, which the table bounds by min(k·N, E·C): the row is bound to
    them where they are within it (as T to the rows received), and stays the bound, to fail, where they are not."""
    from actmem.memory import engine

    arch, bindings = spec.architecture, _bindings(spec, expert_rows, padding)
    rows = {term.name: engine.exact(engine.term_bytes(term, technique, arch), bindings)
            for term in _layer_terms(arch, in_layer)}
    bound = rows.get("permute_sorted_indices")
    if bound and arch.moe_capacity_factor is not None and not arch.moe_pad_to_capacity and kept_copies is not None \
            and 8 * kept_copies <= bound:
        rows["permute_sorted_indices"] = 8 * kept_copies
    return rows


def _bindings(spec: Spec, expert_rows: int, padding: tuple | None) -> dict:
    """The spec's bindings with r bound to the rows the rank's experts received, and P and Q to what padding and
    the 128-row blocks added under FP8 (formula)."""
    from actmem.memory import engine
    from actmem.memory.terms_experts import expert_rows as balanced_rows
    from actmem.model import symbols

    arch, bindings = spec.architecture, spec.bindings_at(spec.run.tensor_parallel)
    # r against the balanced rows without a capacity: T = min(⌈r·k·N·ETP⌉, the capacity's) is then what was received
    balanced = engine.exact(balanced_rows(replace(arch, moe_capacity_factor=None, moe_drop_policy="probs",
                                                  moe_pad_to_capacity=False)),
                            bindings | {symbols.r: 1})
    bindings[symbols.r] = Fraction(expert_rows, balanced)
    if padding is not None:
        padded_rows, blocks = padding
        bindings[symbols.P] = padded_rows - expert_rows
        bindings[symbols.Q] = 128 * blocks - padded_rows
    return bindings


def _layer_terms(arch, in_layer: bool) -> tuple:
    """The rows of the harness's layer: the MoE layer's, and ``in_layer`` its pre-MLP norm's."""
    from actmem.memory.terms import MOE_TERMS, TERMS

    norm = tuple(term for term in TERMS if term.name in ("mlp_layernorm_input", "mlp_norm_statistics")) * in_layer
    return tuple(term for term in MOE_TERMS + norm if term.present(arch))


def _named(saved: list, spec: Spec, x_key, norm_input_key=None) -> dict:
    """{term: bytes} of the saved storages (key, dtype, shape, bytes) in the order saved; ``x_key`` the
    router's input, ``norm_input_key`` the pre-MLP norm's where the layer runs in a TransformerLayer."""
    arch, run = spec.architecture, spec.run
    s, b, h = spec.model.seq_len // run.context_parallel, run.micro_batch, spec.model.hidden
    n = s * b // (run.tensor_parallel if run.sequence_parallel else 1)
    k, e, f = arch.moe_topk, arch.num_experts, arch.expert_ffn(h) // run.etp
    # the permutation's map and probabilities: [E, N], or the allgather dispatcher's local experts'
    # columns of the tokens gathered over ETP·EP ranks, [E/EP, N·ETP·EP]
    columns = (e, n) if arch.moe_dispatcher == "alltoall" else (e // run.expert_parallel,
                                                                 n * run.etp * run.expert_parallel)
    probs = {None: "bfloat16", "fp32": "float32", "fp64": "float64"}[arch.moe_router_dtype]
    by_shape = {("bool", columns): "permute_routing_map"}
    if arch.moe_permute_fusion:       # TE's row map: [tokens, 2·experts + 1] of the tokens it permutes (te_permutation)
        by_shape[("int32", (columns[1], 2 * columns[0] + 1))] = "permute_row_id_map"
    router = _router_saves(arch, n, k, e, probs)
    by_width = {2 * f: "experts_fc1_output", f: "experts_fc2_input", 1: "experts_probs", h: "experts_input"}
    if len(by_width) != 4:   # (the probabilities: width 1, in the router's dtype)
        raise ValueError(f"h = {h} and f_e/ETP = {f} give two expert tensors one width: pick other dims")
    # the router's top-k indices; the aux loss's own are freed before the forward ends (terms.py): a second
    # [N, k] int64 storage held is no row's, and fails the gate
    topk_indices = iter(("router_topk_indices",))
    # int64 vectors in the order saved: the aux loss's tokens per expert, then the permutation's indices
    # (padded to capacity, the alltoall permute's probabilities' flat indices, selected first: moe_utils.py, permute)
    vectors = iter(("aux_loss_tokens_per_expert",) * moe_aux_loss(arch)
                   + ("permute_probs_indices",) * (arch.moe_pad_to_capacity and arch.moe_dispatcher == "alltoall")
                   + ("permute_sorted_indices" if arch.moe_dispatcher == "alltoall" else "permute_local_indices",))
    if arch.moe_shared_ffn is not None:        # the shared experts': 3-D, or 2-D over the whole sequence
        f_s, t = arch.moe_shared_ffn // run.tensor_parallel, run.tensor_parallel
        by_shape |= {("bfloat16", (s, b, f_s)): "shared_experts_fc2_input",
                     ("float8_e4m3fn", (s, b, f_s)): "shared_experts_fc2_input",
                     ("float8_e4m3fn", (s, b, h) if arch.moe_shared_overlap else (n // b, b, h)):
                         "shared_experts_fc1_input_gathered_fp8" if arch.moe_shared_overlap
                         else "shared_experts_fc1_input_fp8",
                     ("bfloat16", (n // b, b, 1)): "shared_experts_gate_score",
                     ("bfloat16", (n // b, b, h)): "shared_experts_output",
                     ("bfloat16", (s, b, h)): "shared_experts_fc1_input_gathered" if t > 1 else "shared_experts_output",
                     ("bfloat16", (s * b, 2 * f_s)): "shared_experts_swiglu_input"}
        if 2 * f_s in by_width:
            raise ValueError(f"f_s/t = {f_s} gives the shared experts' SwiGLU an expert tensor's width: pick other dims")
        if arch.fp8 and f_s == h:
            raise ValueError(f"f_s/t = h = {h} gives the shared experts' fc1 and fc2 FP8 copies one shape: pick other dims")
    named = {}
    for key, dtype, shape, n_bytes in saved:
        if key == x_key:
            name = "router_input"
        elif key == norm_input_key:
            name = "mlp_layernorm_input"
        elif norm_input_key is not None and (dtype, shape) == ("float32", (n // b, b, 1)):
            name = "mlp_norm_statistics"
        elif (dtype, shape) == ("int64", (n, k)):
            name = next(topk_indices, f"unnamed {dtype} {list(shape)}")
        elif (dtype, shape) in [(d, sh) for d, sh, _ in router]:      # the first not yet named, in order
            name = router.pop([(d, sh) for d, sh, _ in router].index((dtype, shape)))[2]
        elif (dtype, shape) == (probs, columns):
            name = "permute_probs"
        elif dtype == "int64" and len(shape) == 1:
            name = next(vectors, f"unnamed {dtype} {list(shape)}")
        elif dtype == "int32" and len(shape) == 1 and arch.moe_permute_fusion:
            name = "permute_chunk_maps"           # TE's chunk sorts' maps, [T] each
        elif (dtype, shape) in by_shape:
            name = by_shape[(dtype, shape)]
        elif arch.fp8 and key in _STAND_IN_TERMS:
            name = _STAND_IN_TERMS[key]         # a scale_inv or a bulk buffer, named by the stand-in that made it
        elif arch.fp8 and dtype == "float8_e4m3fn" and len(shape) == 2 and shape[1] in (h, f):
            name = "experts_input" if shape[1] == h else "experts_fc2_input"     # an expert's columnwise copy
        elif dtype == probs and len(shape) == 2 and shape[1] == 1:
            name = "experts_probs"
        elif dtype == "bfloat16" and len(shape) == 2 and shape[1] in by_width:
            name = by_width[shape[1]]
        else:
            name = f"unnamed {dtype} {list(shape)}"
        named[name] = named.get(name, 0) + n_bytes
    return named


def _router_saves(arch, n: int, k: int, e: int, logits: str) -> list:
    """(dtype, shape, term) of what the router and the aux loss save, in the order they save it: a
    storage takes the first entry of its dtype and shape not taken yet."""
    sigmoid = arch.moe_score_function == "sigmoid"
    pre_softmax = arch.moe_pre_softmax and not sigmoid               # the sigmoid router ignores it
    saves = []
    if pre_softmax:
        saves.append(("float32", (n, e), "router_softmax_probs"))
    if sigmoid:
        saves.append(("float32", (n, e), "router_sigmoid"))
        if arch.moe_expert_bias and logits != "float32":         # fp32: sigmoid's own output
            saves.append((logits, (n, e), "router_sigmoid_scores"))
        if k > 1:
            saves += [(logits, (n, 1), "router_score_sum"), (logits, (n, k), "router_topk_scores")]
    elif not pre_softmax:
        saves.append(("float32", (n, k), "router_topk_probs"))
    if moe_group_mask(arch):
        saves.append(("bool", (n, e), "router_group_mask"))
    if arch.moe_capacity_factor is not None:     # after the routing, before the aux loss (router.py, routing)
        saves.append(("bool", (n, e), "router_capacity_map"))
    if moe_aux_loss(arch):
        aux = logits if sigmoid else "float32"
        saves.append((aux, (n, e), "aux_loss_scores"))
        if sigmoid:
            saves.append((logits, (n, 1), "aux_loss_score_sum"))
        saves.append((aux, (), "aux_loss_value"))
    return saves


def _cpu_shims() -> None:
    """What lets megatron-core 0.16.1's MoE layer run on a CPU; none makes or keeps a tensor.
    - moe_utils.te_general_gemm: the wheel names it only where Transformer Engine imports, and
      RouterGatingLinearFunction reads it: None, its path without TE;
    - torch.cuda streams: the alltoall dispatcher copies its split sizes to the host on a side
      stream (token_dispatcher.py, cuda_dtoh_stream): on a CPU they are host tensors already;
    - torch.cuda.current_device: the router moves a weight made on the CPU to the GPU (router.py,
      gating): here it stays on the CPU;
    - token_dispatcher.maybe_move_tensor_to_cpu: on a GPU it turns the split sizes into numpy, which
      all_to_all_single takes as lists; a CPU tensor it leaves a tensor, which gloo refuses: converted
      as the GPU path converts it."""
    import contextlib

    import torch
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    class _HostStream:
        def __init__(self, *args, **kwargs):
            pass

        def wait_stream(self, *args):
            pass

        def synchronize(self):
            pass

        def record_event(self):
            return self

        def __eq__(self, other):
            return isinstance(other, _HostStream)

        __hash__ = object.__hash__

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    torch.cuda.Stream = _HostStream
    torch.cuda.current_stream = lambda *args, **kwargs: _HostStream()
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"

    def to_host(tensor, as_numpy=False, record_stream=False):
        return tensor.numpy() if torch.is_tensor(tensor) and as_numpy else tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host
    from actmem_validate.megatron_mla import rng_shims

    rng_shims()           # the moe and shared_experts recompute checkpoints' RNG state and FP8 check
    from megatron.core.transformer.moe import moe_layer

    moe_layer.te_checkpoint = _te_checkpoint


def _te_checkpoint(function, distribute_saved_activations, get_rng_state_tracker, tp_group, *args):
    """Transformer Engine's checkpoint, which Megatron's MoE layer takes for its moe and shared_experts recompute
    under FP8 (moe_layer.py: te_checkpoint), as it runs there (TE 2.11, distributed.py: checkpoint, the reentrant
    _CheckpointFunction, use_reentrant's default): the forward under no_grad, its tensor arguments saved by
    reference (save_for_backward), the RNG states on the host; under delayed scaling each module's amax history and
    scale cloned for the recompute (quantization.py: copy_forward_fp8_meta_tensors_for_recompute), which the
    harness's tensorwise layouts do not make. Megatron's own CheckpointFunction keeps the same, so it stands in."""
    from megatron.core import tensor_parallel

    return tensor_parallel.checkpoint(function, distribute_saved_activations, *args)

_STAND_IN_TERMS: dict = {}
"""{storage address: term} of the storages the FP8 stand-ins made, on this rank's run: the fp32 scale_inv [1] every
quantized input keeps (the same dtype and shape whoever made it) and the block recipes' bulk buffers; cleared at
each run (_rank)."""


def _scale_inv(term: str):
    """TE's fp32 scale_inv [1] of a tensor quantized for ``term`` (quantizer.cpp), named for _named."""
    import torch

    scale = torch.ones(1, dtype=torch.float32)
    _STAND_IN_TERMS[scale.untyped_storage().data_ptr()] = term
    return scale


def _bulk_columnwise(inputs, recipe: str, term: str) -> list:
    """Transformer Engine's split_quantize under a block-scaled recipe, its columnwise buffer (cast.cpp,
    bulk_allocate_mxfp8_tensors / bulk_allocate_fp8_blockwise_tensors, TE 2.11): one uint8 storage, each expert's
    data [M_i, K] (one byte an element) from a 256-byte boundary, then each expert's scales from a 16-byte one,
    MXFP8's E8M0 [roundup(M_i/32, 4), roundup(K, 128)], blockwise's fp32 GEMM_READY [ceil(M_i/128),
    roundup(K, 4)] (quantizer.cpp, get_scale_shape); the experts' views of it, which keep it alive. The rowwise
    buffer TE frees once the GEMM has run (update_usage) is not made."""
    import torch

    def up(x, n):
        return -(-x // n) * n

    cols = inputs[0].shape[-1]
    scales = [up(-(-len(x) // 32), 4) * up(cols, 128) if recipe == "mxfp8" else 4 * -(-len(x) // 128) * up(cols, 4)
              for x in inputs]
    offsets, end = [], 0
    for x in inputs:
        offsets.append(up(end, 256))
        end = offsets[-1] + len(x) * cols
    scale_offsets = []
    for size in scales:
        scale_offsets.append(up(end, 16))
        end = scale_offsets[-1] + size
    buffer = torch.zeros(end, dtype=torch.uint8)
    _STAND_IN_TERMS[buffer.untyped_storage().data_ptr()] = term
    kept = []
    for x, offset in zip(inputs, offsets):
        data = buffer[offset:offset + x.numel()].view(torch.float8_e4m3fn).view(x.shape)
        data.copy_(x.to(torch.float8_e4m3fn))
        kept.append(data)
    return kept + [buffer[offset:offset + size] for offset, size in zip(scale_offsets, scales)]


def _grouped_linear(fp8: str | None = None, fc2_original_input: bool = False):
    """(column, row): Transformer Engine's GroupedLinear as Megatron's TEColumn/TERowParallelGroupedLinear wrap
    it for the experts, keeping what TE's keeps in 16 bits (module/grouped_linear.py, _GroupedLinear.forward:
    the input split into views of its one storage, torch.split(inp, m_splits), and the weights, saved with
    prepare_for_saving; the output one storage the grouped GEMM writes). No communication: with ETP or EP > 1
    Megatron's expert linears leave it to the dispatcher (explicit_expert_comm). TE needs a GPU; this stand-in
    runs its arithmetic on a CPU, so that megatron-core's own TEGroupedMLP (its moe_act checkpoint too) runs.
    Under ``fp8`` (TE 2.11, actmem.model.fp8) each expert's input is quantized on its own (split_quantize, a
    quantizer an expert) and only its columnwise copy is kept, one byte an element (float8_e4m3fn [M_i, K]:
    Blackwell's layout; Hopper's transpose [K, M_i] holds the same bytes), with its own fp32 scale_inv [1];
    ``fc2_original_input``: fc2 saves its 16-bit input instead (Megatron's set_save_original_input under moe_act
    recompute), which the checkpoint frees. The FP8 weight copies TE caches are model state, not stood in for."""
    import torch

    class _GroupedGemm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, inp, m_splits, quantize, term, *weights):
            inputs = torch.split(inp, m_splits)
            out = torch.empty(inp.shape[0], weights[0].shape[0], dtype=inp.dtype)
            for x, weight, y in zip(inputs, weights, torch.split(out, m_splits)):
                torch.matmul(x, weight.t(), out=y)
            if quantize and fp8 in ("mxfp8", "blockwise"):   # every expert's copy and scales in one buffer
                kept = _bulk_columnwise(inputs, fp8, term)
            elif quantize:     # an expert's columnwise copy and its scale_inv, a storage each
                kept = [x.to(torch.float8_e4m3fn) for x in inputs]
                kept += [_scale_inv(term) for _ in inputs]
            else:
                kept = list(inputs)
            ctx.save_for_backward(*kept, *weights)
            ctx.m_splits, ctx.quantize = m_splits, quantize
            return out

        @staticmethod
        def backward(ctx, grad):
            saved, n = ctx.saved_tensors, len(ctx.m_splits)
            inputs, weights = saved[:n], saved[-n:]
            if ctx.quantize:
                inputs = [x.to(grad.dtype) for x in inputs]
            grads = torch.split(grad, ctx.m_splits)
            grad_input = torch.cat([g @ w for g, w in zip(grads, weights)])
            return grad_input, None, None, None, *(g.t() @ x for g, x in zip(grads, inputs))

    class _GroupedLinear(torch.nn.Module):
        column = True

        def __init__(self, num_gemms, input_size, output_size, *, pg_collection, **kwargs):
            super().__init__()
            etp = pg_collection.expt_tp.size()
            rows, cols = (output_size // etp, input_size) if self.column else (output_size, input_size // etp)
            self.weights = torch.nn.ParameterList(
                torch.nn.Parameter(torch.randn(rows, cols, dtype=torch.bfloat16) * 0.02) for _ in range(num_gemms))
            self.quantize = fp8 is not None and (self.column or not fc2_original_input)

        def forward(self, x, m_splits):
            term = "experts_input" if self.column else "experts_fc2_input"
            return _GroupedGemm.apply(x, list(m_splits), self.quantize, term, *self.weights), None

    class _RowGroupedLinear(_GroupedLinear):
        column = False

    return _GroupedLinear, _RowGroupedLinear


def _te_linears(fp8: str):
    """(column, row): Transformer Engine's Linear as Megatron's TEColumnParallelLinear and TERowParallelLinear
    build the shared experts' fc1 and fc2 (moe_module_specs.py), under FP8, on a CPU (TE 2.11, linear.py;
    actmem.model.fp8): fc1 under sequence parallelism all-gathers the rank's shard itself and keeps, under delayed
    scaling, that shard quantized (one byte, its scale_inv), under the other recipes the shard itself (Megatron's
    set_save_original_input: the router's input); fc2 keeps its input's columnwise copy and scale_inv (under a block
    recipe its block scales) and reduce-scatters its output. Under --recompute-modules shared_experts Megatron
    hands fc1 no save_original_input: it keeps its shard quantized under every recipe. Overlapping the dispatcher Megatron sets parallel_mode None on both: no
    communication of their own, fc1 handed the input gathered ahead."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import _gather_along_first_dim, _reduce_scatter_along_first_dim, \
        reduce_from_tensor_model_parallel_region, reduce_scatter_to_sequence_parallel_region

    def _scales(x, term):
        """The copy's fp32 scale_inv [1], or under a block recipe its GEMM_READY block scales (layers.block_scales)."""
        if fp8 not in ("mxfp8", "blockwise"):
            return _scale_inv(term)
        from actmem_validate.layers import block_scales

        scales = block_scales(x.numel() // x.shape[-1], x.shape[-1], fp8, compact=False, device=x.device)
        _STAND_IN_TERMS[scales.untyped_storage().data_ptr()] = term + "_scales"
        return scales

    class _Gemm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, quantize, term, group):
            total = x if group is None else _gather_along_first_dim(x, group)
            kept = (x.to(torch.float8_e4m3fn), _scales(x, term)) if quantize else (x,)
            ctx.save_for_backward(*kept, weight)
            ctx.quantize, ctx.group = quantize, group
            return torch.matmul(total, weight.t())

        @staticmethod
        def backward(ctx, grad):
            saved = ctx.saved_tensors
            x, weight = (saved[0].to(grad.dtype) if ctx.quantize else saved[0]), saved[-1]
            total = x if ctx.group is None else _gather_along_first_dim(x, ctx.group)
            grad_total = torch.matmul(grad, weight)
            grad_x = grad_total if ctx.group is None else _reduce_scatter_along_first_dim(grad_total, ctx.group)
            grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ total.reshape(-1, total.shape[-1])
            return grad_x, grad_weight, None, None, None

    class _Linear(torch.nn.Module):
        column = True

        def __init__(self, input_size, output_size, *, config, **kwargs):
            super().__init__()
            self.t, self.sequence_parallel = config.tensor_model_parallel_size, config.sequence_parallel
            rows, cols = (output_size // self.t, input_size) if self.column else (output_size, input_size // self.t)
            self.weight = torch.nn.Parameter(torch.randn(rows, cols, dtype=torch.bfloat16) * 0.02)
            self.parallel_mode = "column" if self.column else "row"
            # fc1 keeps its input quantized under delayed scaling, and where Megatron does not hand it
            # save_original_input: under --recompute-modules shared_experts (shared_experts.py, __init__)
            self.quantize_input = fp8 == "delayed" or (config.recompute_granularity == "selective"
                                                       and "shared_experts" in config.recompute_modules)

        def forward(self, x):
            group = parallel_state.get_tensor_model_parallel_group()
            communicate = self.parallel_mode is not None and self.t > 1
            if self.column:
                gather = group if communicate and self.sequence_parallel else None
                return _Gemm.apply(x, self.weight, self.quantize_input, "shared_experts_fc1_input_fp8"
                                   if self.parallel_mode else "shared_experts_fc1_input_gathered_fp8", gather), None
            partial = _Gemm.apply(x, self.weight, True, "shared_experts_fc2_input", None)
            if not communicate:
                return partial, None
            reduce = reduce_scatter_to_sequence_parallel_region if self.sequence_parallel else \
                reduce_from_tensor_model_parallel_region
            return reduce(partial), None

    class _RowLinear(_Linear):
        column = False

    return _Linear, _RowLinear


def _fp8_padding(align: int):
    """(padding, unpadding): Transformer Engine's Fp8Padding and Fp8Unpadding (module/fp8_padding.py, TE 2.11)
    as TEGroupedMLP calls them: each expert's rows padded to a multiple of ``align`` into a new 16-bit tensor
    (the input itself where none needs it), saving nothing but the split lists, and the output unpadded."""
    import torch

    def padded(m_splits):
        return [(m + align - 1) // align * align for m in m_splits]

    class _Pad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, inp, m_splits, to):
            out = torch.zeros(sum(to), inp.shape[-1], dtype=inp.dtype)
            for x, y, m in zip(torch.split(inp.view(-1, inp.shape[-1]), m_splits), torch.split(out, to), m_splits):
                y[:m] = x
            ctx.m_splits, ctx.to = m_splits, to
            return out

        @staticmethod
        def backward(ctx, grad):
            return torch.cat([g[:m] for g, m in zip(torch.split(grad, ctx.to), ctx.m_splits)]), None, None

    class _Unpad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, inp, m_splits, of):
            ctx.m_splits, ctx.of = m_splits, of
            return torch.cat([x[:m] for x, m in zip(torch.split(inp, of), m_splits)])

        @staticmethod
        def backward(ctx, grad):
            return _Pad.forward(ctx, grad, ctx.m_splits, ctx.of), None, None

    class Padding(torch.nn.Module):
        def forward(self, inp, m_splits):
            to = padded(m_splits)
            return (inp, m_splits) if to == m_splits else (_Pad.apply(inp, m_splits, to), to)

    class Unpadding(torch.nn.Module):
        def forward(self, inp, m_splits):
            of = padded(m_splits)
            return inp if of == m_splits else _Unpad.apply(inp, m_splits, of)

    return Padding(), Unpadding()


def _layer(spec: Spec, ignored: tuple = (), technique: Technique | None = None, in_layer: bool = False):
    """megatron-core's MoELayer of this spec, from its local layer spec (SequentialMLP experts), or with
    --moe-grouped-gemm its TEGroupedMLP over TE's GroupedLinear's stand-in (_grouped_linear); under FP8 with TE's
    padding's stand-in (_fp8_padding) and config.fp8 set once built, where TEGroupedMLP reads it at each call
    (built with it, it would import TE's own modules)."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    from actmem_validate.gloo import recompute_settings

    arch, run, model = spec.architecture, spec.run, spec.model
    config = TransformerConfig(
        num_layers=1, hidden_size=model.hidden, num_attention_heads=model.heads, ffn_hidden_size=arch.ffn(model.hidden),
        num_moe_experts=arch.num_experts, moe_router_topk=arch.moe_topk, moe_ffn_hidden_size=arch.expert_ffn(model.hidden),
        moe_token_dispatcher_type=arch.moe_dispatcher, moe_router_load_balancing_type=arch.moe_load_balancing,
        moe_aux_loss_coeff=arch.moe_aux_loss_coeff, moe_router_dtype=arch.moe_router_dtype, add_bias_linear=False,
        moe_shared_expert_intermediate_size=arch.moe_shared_ffn, moe_shared_expert_gate=arch.moe_shared_gate,
        moe_shared_expert_overlap=arch.moe_shared_overlap, moe_router_pre_softmax=arch.moe_pre_softmax,
        moe_router_score_function=arch.moe_score_function, moe_router_enable_expert_bias=arch.moe_expert_bias,
        moe_router_num_groups=arch.moe_router_groups, moe_router_group_topk=arch.moe_router_group_topk,
        moe_expert_capacity_factor=arch.moe_capacity_factor, moe_token_drop_policy=arch.moe_drop_policy,
        moe_pad_expert_input_to_capacity=arch.moe_pad_to_capacity,
        # built unfused: the alltoall dispatcher makes its chunk indices on "cuda" under fusion (token_dispatcher.py,
        # __init__: permute_idx_device); turned on below, where the dispatchers read it at each call
        moe_permute_fusion=False,
        **dict(ignored), **recompute_settings(technique),
        normalization="RMSNorm", hidden_dropout=arch.hidden_dropout, attention_dropout=arch.attention_dropout,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, bias_activation_fusion=True, bf16=True,
        params_dtype=torch.bfloat16, use_cpu_initialization=True, tensor_model_parallel_size=run.tensor_parallel,
        sequence_parallel=run.sequence_parallel, expert_model_parallel_size=run.expert_parallel,
        expert_tensor_parallel_size=run.etp, context_parallel_size=run.context_parallel,
        moe_grouped_gemm=arch.moe_grouped_gemm)
    submodules = get_gpt_layer_local_spec(num_experts=arch.num_experts, moe_grouped_gemm=False).submodules.mlp.submodules
    if arch.moe_grouped_gemm:
        from megatron.core.transformer.mlp import MLPSubmodules
        from megatron.core.transformer.moe.experts import TEGroupedMLP
        from megatron.core.transformer.spec_utils import ModuleSpec

        moe_act = technique is not None and "moe_act" in technique.modules
        column, row = _grouped_linear(arch.fp8, fc2_original_input=moe_act)
        submodules = replace(submodules, experts=ModuleSpec(module=TEGroupedMLP, submodules=MLPSubmodules(
            linear_fc1=column, linear_fc2=row)))
        if arch.fp8:        # the shared experts' TE linears' FP8 stand-ins
            column, row = _te_linears(arch.fp8)
            submodules = replace(submodules, shared_experts=replace(submodules.shared_experts, submodules=replace(
                submodules.shared_experts.submodules, linear_fc1=column, linear_fc2=row)))
    if arch.moe_permute_fusion:
        from actmem_validate import te_permutation

        te_permutation.install()
    if not in_layer:
        layer = MoELayer(config, submodules)
        config.moe_permute_fusion = arch.moe_permute_fusion
        if row_padding(arch):       # under FP8, or a bf16 layer of an FP8 run: its GEMMs in bf16, config.fp8 set
            layer.experts.quantization_padding, layer.experts.quantization_unpadding = _fp8_padding(row_padding(arch))
            config.fp8, config.fp8_recipe = arch.fp8_format or "e4m3", arch.fp8 or _RUN_RECIPE[row_padding(arch)]
        return layer
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from actmem_validate.megatron_mla import _stand_ins

    # TE's layer spec for a MoE layer: its pre-MLP norm a TENorm of its own; no attention here (IdentityOp)
    spec_ = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=_stand_ins()["norm"], mlp=ModuleSpec(module=MoELayer, submodules=submodules),
        mlp_bda=get_bias_dropout_add))
    layer = build_module(spec_, config=config, layer_number=1)
    config.moe_permute_fusion = arch.moe_permute_fusion
    return layer


#: the FP8 run a bf16 layer is one of, by the rows it pads to (fp8.bf16_padding_multiple): blockwise on a Hopper,
#: MXFP8 on a Blackwell (a recipe whose FP8 layers pad as its bf16 ones do: fp8.check_gpu)
_RUN_RECIPE = {16: "blockwise", 32: "mxfp8"}


def _rank(rank: int, world: int, port: int, config: MoEConfig, results) -> None:
    """One rank: build the layer, run it forward recording what autograd saves, then backward."""
    import torch

    from actmem_validate import te_permutation
    from actmem_validate.gloo import held_storages, rank_group, recorder, rerun_moments

    spec, run = config.spec, config.spec.run
    with rank_group(rank, world, port, _cpu_shims, run.tensor_parallel, expert_model_parallel_size=run.expert_parallel,
                    expert_tensor_parallel_size=run.etp, context_parallel_size=run.context_parallel), \
            contextlib.ExitStack() as stack:
        stack.callback(te_permutation.uninstall)      # the next configuration in this process starts unfused
        torch.manual_seed(0)                      # the same weights on every rank of a group
        layer = _layer(spec, config.ignored, config.technique, config.in_layer)
        norm_output = []                   # the pre-MLP norm's output: the router's input, in a layer
        if config.in_layer:
            layer.pre_mlp_layernorm.register_forward_hook(
                lambda module, args, out: norm_output.append(out.untyped_storage().data_ptr()))
        torch.manual_seed(1 + rank)               # each rank's own tokens: routing differs by rank
        rows = spec.model.seq_len // run.context_parallel // (run.tensor_parallel if run.sequence_parallel else 1)
        x = torch.randn(rows, run.micro_batch, spec.model.hidden, dtype=torch.bfloat16, requires_grad=True)
        received, kept, padded = [], [], []
        _STAND_IN_TERMS.clear()
        moe = layer.mlp if config.in_layer else layer
        experts_forward = moe.experts.forward
        align = row_padding(spec.architecture)     # the rows each expert's are padded to, under FP8 (or None)
        moe.experts.forward = lambda tokens, tokens_per_expert, *args, **kwargs: (
            received.append(int(sum(tokens_per_expert))),
            padded.append(align and _padding(tokens_per_expert, align)),
            experts_forward(tokens, tokens_per_expert, *args, **kwargs))[2]
        preprocess = moe.token_dispatcher.dispatch_preprocess     # the routed copies this rank keeps, after capacity
        moe.token_dispatcher.dispatch_preprocess = lambda tokens, routing_map, probs: (
            kept.append(int(routing_map.sum())), preprocess(tokens, routing_map, probs))[1]
        # an expert that receives no token saves empty tensors: they hold nothing (recorder skips them); a
        # storage saved by a node autograd has already freed may lend its address to a later one (the later
        # one recorded); the layer's parameters and buffers are model state
        saved, pack = recorder()
        with rerun_moments(layer, saved, {}) as moments:     # (entered before the forward registers the reruns)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                out, _ = layer(hidden_states=x, attention_mask=None) if config.in_layer else layer(x)
            held = held_storages(saved, layer)
            x_key = x.untyped_storage().data_ptr()
            named = (_named(held, spec, norm_output[0], x_key) if config.in_layer else _named(held, spec, x_key))
            out.float().sum().backward()
        results.put((rank, received[0], kept[0], padded[0], named, moments))


def _padding(tokens_per_expert, align: int) -> tuple:
    """(Σ roundup(n_i, align), Σ ceil(roundup(n_i, align)/128)): the rows the experts computed under FP8, each
    expert's padded (TEGroupedMLP: quantization_padding), and their 128-row scale blocks."""
    rows = [-(-int(n) // align) * align for n in tokens_per_expert]
    return sum(rows), sum(-(-n // 128) for n in rows)


def measure(config: MoEConfig, timeout: int = 300) -> list[tuple]:
    """(rank, expert rows received, routed copies kept, under FP8 (the rows its experts computed padded, their
    128-row blocks), else None, {term: bytes saved}, {rerun: bytes held as it ends}) of every rank of one
    configuration."""
    from actmem_validate.gloo import spawn

    return spawn(_rank, config)


def rows(configs, timeout: int = 300) -> list[dict]:
    """The error table's rows of every rank of every configuration: compare.term_rows, then compare.rerun_rows."""
    from actmem_validate.compare import rerun_rows, term_rows
    from actmem_validate.gloo import spawn_each

    table, measured = [], spawn_each(_rank, configs)
    for config in configs:
        spec, technique = config.spec, config.technique
        for rank, received, kept, padded, named, moments in measured[config]:
            expected = formula(spec, technique, received, config.in_layer, kept, padded)
            table += term_rows(config, rank, expected, named)
            table += rerun_rows(config, rank, technique, spec.architecture, expected,
                                _layer_terms(spec.architecture, config.in_layer),
                                _bindings(spec, received, padded), moments)
    return table
