"""Compose the term table into the paper's equations (symbolic, exact).

Every public function here returns a sympy expression in the symbols of
``actmem.model.symbols``; nothing is written out by hand twice. ``exact`` binds the
symbols to integers, ``numeric`` turns an expression into a vectorised function.
"""

from functools import cache

import sympy

from actmem.model.architecture import PAPER, Architecture, keeps_norm_input
from actmem.memory.pipeline import chunks_in_flight
from actmem.model.symbols import C, L, P, Q, a, b, c, e, ep, h, m, p, r, s, t, v
from actmem.memory.techniques import Technique
from actmem.memory.terms import RERUN_OUTPUT, STAGE_TERMS, TERMS, TRANSIENT_TERMS, Region, Scope, Term, layer_terms
from actmem.model.recompute import PARTS, Recompute, remakes, reruns

#: how many of each scope the first stage holds, as symbols for the vectorised form
layer_activations, microbatches_held, holds_output = sympy.symbols(
    "layer_activations microbatches_held holds_output", nonnegative=True, integer=True)

#: argument order of the functions ``numeric`` returns
NUMERIC_ARGS = (s, b, h, a, L, t, p, v, m, layer_activations, microbatches_held, holds_output, c, e, r, ep, C, P, Q)


def divisor(term: Term, technique: Technique, arch: Architecture = PAPER):
    """How many ways a tensor is split (Figures 4 and 5): by its region, unless the
    implementation keeps it all-gathered under sequence parallelism (placement belongs to the
    code, actmem.model.implementation: DTensor's ColwiseParallel keeps the gathered input)."""
    if term.region is Region.REPLICATED:
        split = False
    elif term.region is Region.BLOCK:
        split = technique.tensor_parallel
    else:
        split = technique.sequence_parallel and term.name not in arch.code.gathered_under_sp
    return t if split else sympy.Integer(1)


@cache
def term_bytes(term: Term, technique: Technique, arch: Architecture = PAPER) -> sympy.Expr:
    """Bytes of one instance of a term on one GPU; 0 where the technique recomputes it or
    the architecture has no such tensor."""
    if not _kept(term, technique, arch) or not term.present(arch) or technique.drops(term, arch) \
            or (term.only_under_sp and not technique.sequence_parallel):
        return sympy.Integer(0)
    return term.size(arch) / divisor(term, technique, arch) + term.fixed_bytes(arch)


def _kept(term: Term, technique: Technique, arch: Architecture) -> bool:
    """Whether the technique's forward keeps the row: by its recompute mode, or as an op output that torchtitan's
    per-op checkpointing caches (Term.op_saved)."""
    return technique.recompute in term.kept_under_for(arch) or (technique.policy.ops and term.op_saved)


@cache
def per_layer_bytes(technique: Technique, arch: Architecture = PAPER) -> sympy.Expr:
    """One layer, one microbatch: a row of Table 2 (Eqs 1, 2, 4 and the recompute rows)."""
    return sympy.Add(*(term_bytes(term, technique, arch) for term in layer_terms(arch)))


def stage_count(term: Term, layer_activations, microbatches, holds_output):
    """How many instances of a term the stage holds (sections 4.4 and 4.5): a batch's are the
    first stage's microbatches, or the last stage's one (the same one when p = 1)."""
    if term.scope is Scope.BATCH:
        if isinstance(microbatches, int) and isinstance(holds_output, int):
            return max(microbatches, holds_output)
        return (microbatches + holds_output + sympy.Abs(microbatches - holds_output)) / 2   # max, vectorised
    return {Scope.LAYER: layer_activations, Scope.EMBEDDING: microbatches,
            Scope.OUTPUT: holds_output}[term.scope]


@cache
def extra_bytes(technique: Technique, microbatches, holds_output, arch: Architecture = PAPER
                ) -> sympy.Expr:
    """Section 4.5: the embedding and output-layer terms of the first stage."""
    return sympy.Add(*(term_bytes(term, technique, arch) * stage_count(term, 0, microbatches, holds_output)
                       for term in STAGE_TERMS))


def layers_in_flight(interleaved: bool) -> sympy.Expr:
    """Layer activations the first stage holds, pipeline full: Eq 5's L, times the
    interleave factor 1 + (p-1)/(pm) under the interleaved schedule (section 4.4)."""
    if interleaved:
        return L / (p * m) * chunks_in_flight(p, m, True)
    return L / p * chunks_in_flight(p, 1, False)


@cache
def held_bytes(technique: Technique, arch: Architecture = PAPER) -> sympy.Expr:
    """The first stage's activations for any occupancy: per layer x layer activations held,
    plus the section 4.5 terms, with the counts left as symbols (for the planner's sweep)."""
    return (per_layer_bytes(technique, arch) * layer_activations
            + extra_bytes(technique, microbatches_held, holds_output, arch))


#: what a module's rerun makes again beyond the rows it dropped: the attention core's output,
#: which the projection kept as its input and freed before the rerun (freed_before_rerun).
#: The MLP's rerun makes its output again too, which nothing kept: not counted (a floor). The reruns of
#: CheckpointWithoutOutput (random.py, _recompute: the experts' activation, moe_act; multi-latent attention's
#: up projections, mla_up_proj; each norm of layernorm) copy what they made back into the freed outputs and
#: keep their own outputs too (ctx.outputs) until the checkpoint's backward: twice. A norm's output is the row
#: its linears keep (the down projections' input under multi-latent attention, the router's in a MoE layer);
#: the up projections' are q, k and v. Measured: tests/validate (--grid mla, --grid moe: the rerun rows)
_RERUN_OUTPUT = {"core_attn": ("projection_input",), "moe_act": ("experts_fc2_input",),
                 "mla_up_proj": ("mla_query", "mla_key", "mla_value"),
                 "input_layernorm": ("qkv_input",), "pre_mlp_layernorm": ("router_input",)}
#: the reruns whose outputs are kept twice at their end, where an output is itself a row the module dropped
_RERUN_KEEPS_TWICE = frozenset({"moe_act", "mla_up_proj", "input_layernorm", "pre_mlp_layernorm"})
#: the reruns through megatron-core's own checkpoint (tensor_parallel.checkpoint, CheckpointFunction) that hold the
#: block's 16-bit output they made again (random.py, CheckpointFunction.backward: outputs = ctx.run_function(...),
#: then torch.autograd.backward(outputs, args), which runs with them held), one [s, b, h] like full recompute's
#: (RERUN_OUTPUT): the MoE layer's (moe_layer.py: custom_forward) and the shared experts' (shared_experts_compute).
#: Measured: --grid moe. The dense MLP's, the same, is left out of the floor (it would move the dense peak gates)
_RERUN_HOLDS_BLOCK_OUTPUT = frozenset({"moe", "shared_experts"})
#: the first row a rerun hooked on a block's output gradient finds freed (discard_output_and_register_recompute):
#: a norm's once the bias-dropout-add after its block has run backward (and everything after it), before the
#: block's own backward; the up projections' (multi_latent_attention.py: hooked on core_attn_out) once the output
#: projection's backward has run, before the core's (_mla_core_output); the experts' activation's (experts.py:
#: hooked on fc2's output) before the shared experts' backward, which the MoE layer ran first (moe_layer.py,
#: shared_experts_compute before route; _OVERLAPPED_AFTER where they overlap the dispatch); the shared experts'
#: checkpoint's (tensor_parallel.checkpoint) after the routed experts' and the router's backward (_ROUTED)
_FREED_FROM = {"input_layernorm": "attention_dropout_mask", "pre_mlp_layernorm": "mlp_dropout_mask",
               "mla_up_proj": "projection_input_fp8", "moe_act": "mlp_dropout_mask",
               "shared_experts": "mlp_dropout_mask"}
#: the rerun before it whose rows stay held through it, until that rerun's checkpoint's backward, which comes after:
#: a norm's (its outputs twice and its statistics) through the reruns of its block; the up projections' (q, k and
#: v twice, which the core's checkpoint then holds as its inputs) through the core's; the whole MoE layer's (moe)
#: through its experts' activation's, which runs inside moe's backward. Each chains on (the up projections' to the
#: input norm's, moe's to the pre-MLP norm's), and is 0 where that module is not recomputed
_HELD_THROUGH = {"core_attn": "mla_up_proj", "mla_up_proj": "input_layernorm", "mlp": "pre_mlp_layernorm",
                 "moe": "pre_mlp_layernorm", "moe_act": "moe", "shared_experts": "pre_mlp_layernorm"}
#: the routed experts' and the router's rows, between the router's input (which the shared experts' checkpoint
#: keeps too, one storage) and the shared experts' own
_ROUTED = ("router_topk_indices", "shared_experts_fc1_input_gathered")
#: what the token dispatcher keeps as an attribute of its own until the layer's next forward, beside the permutation
#: backward's saved copy: its sorted indices (token_dispatcher.py, both dispatchers: reversed_local_input_permutation_
#: mapping, the alltoall's permute_sorted_indices, the allgather's permute_local_indices; TE's row map where the
#: permutation is fused, source read only); and the allgather's probabilities (local_probs, the experts' [T] probs
#: before their unsqueeze: experts_probs where no FP8 padding copies them). A rerun after the permutation's backward
#: (the shared experts') finds them held where that microbatch's forward was the layer's last, one chunk in flight
#: (stage_model; the harness's one microbatch: measured, --grid moe), and freed where a later one's has replaced them
DISPATCHER_KEEPS = ("permute_sorted_indices", "permute_local_indices", "permute_row_id_map")
#: the shared experts' rows whose backward runs before the routed experts' where they overlap the dispatch: fc2's
#: and the gate's product's, made after the combine (moe_layer.py, combine_postprocess: linear_fc2_forward;
#: post_forward_comm sets its gradient's sequence number past every other), so they are freed when moe_act's rerun
#: runs; the gate's score, which its sigmoid made during the dispatch, stays (measured: --grid moe)
_OVERLAPPED_AFTER = ("shared_experts_fc2_input", "shared_experts_fc2_input_scales", "shared_experts_output")


@cache
def rematerialised_bytes(technique: Technique, arch: Architecture = PAPER, group: int = 1,
                         module: str | None = None) -> sympy.Expr:
    """What the backward of a stage's last layer reruns while everything else is held (the
    peak's rerun moment, actmem.memory.peak). Full recompute reruns ``group`` layers from their
    checkpoint: each as it is kept without recompute, less the group's input where its first
    norm keeps it, which is then the checkpoint's own storage (CheckpointFunction.backward
    detaches it: a view; transformers' LlamaRMSNorm keeps an fp32 copy instead, a row of its
    own), and their output again (RERUN_OUTPUT). Selective recompute reruns one ``module`` at a time: the rows
    it dropped, and for the attention core its output again; and what an earlier rerun of the layer still holds
    (_HELD_THROUGH: a norm's, the up projections', moe's). None reruns nothing."""
    if technique.recompute is Recompute.NONE:
        return sympy.Integer(0)
    if technique.recompute is Recompute.SELECTIVE:
        _one_unit(module)
        before = _HELD_THROUGH.get(module)
        held = rematerialised_bytes(technique, arch, module=before) if before else 0
        runs = module in _RERUN_HOLDS_BLOCK_OUTPUT and module in technique.modules    # not as a link of the chain
        output = term_bytes(RERUN_OUTPUT, technique, arch) if runs else 0
        return held + output + sympy.Add(*(_rerun_bytes(term, technique.whole(), arch, module) *
                                           _rerun_copies(term, technique, arch, module) for term in layer_terms(arch)))
    # under torchtitan's per-op checkpointing (torch-native, whose norm keeps its input) every row the checkpoint
    # keeps is one of the rerun's layer (the cached attention and gate outputs, handed back to it) or one the rerun
    # frees once it has used it (the other cached matmul outputs, the reduce-scatters'): the layer less all of them.
    # The rerun's own forward transients (rope's fp32 copies, w2's partial sums beside the last add) are not counted
    layer, kept = per_layer_bytes(technique.whole(), arch), per_layer_bytes(technique, arch)
    kept = kept if keeps_norm_input(arch) else 0
    output = term_bytes(RERUN_OUTPUT, technique, arch)
    return group * layer - kept + output if group else sympy.Integer(0)


def _one_unit(module) -> None:
    """A selective rerun is one module's, or one part's of a module rerun in parts (recompute.PARTS)."""
    if module is None or module in PARTS:
        raise ValueError(f"selective recompute reruns one module at a time, a module in parts one part at a time: "
                         f"name it, not {module}")


def _rerun_bytes(term, whole: Technique, arch, module: str) -> sympy.Expr:
    """Bytes of one instance of a row as a selective rerun of ``module`` remakes it: the row's (``whole``: the
    technique keeping every module), or where the rerun is the row's own module's, what Term.remade says it
    remakes where that differs (a rerun of a module around it, moe's, keeps the row as the forward would)."""
    own = module == term.module_of(arch)
    remade = None if term.remade is None or not term.present(arch) or not own else term.remade(arch)
    if remade is None:
        return term_bytes(term, whole, arch)
    return remade / divisor(term, whole, arch) + term.fixed_bytes(arch, remade=True)


def _rerun_copies(term, technique, arch, module) -> int:
    """How many copies of a row a selective rerun of ``module`` holds at its end: the rows it dropped, once; its
    output, once more where no dropped row is it (core_attn's, which the projection kept), twice where
    the rerun keeps its own beside the one it restores (random.py, CheckpointWithoutOutput: _RERUN_KEEPS_TWICE),
    none where such a rerun does not run (its module not recomputed)."""
    dropped = remakes(module, term.module_of(arch), technique.modules) and technique.drops(term, arch)
    if term.name not in _RERUN_OUTPUT.get(module, ()):
        return int(dropped)
    return 2 * dropped if module in _RERUN_KEEPS_TWICE else 1


@cache
def freed_before_rerun(technique: Technique, arch: Architecture = PAPER, module: str | None = None
                       ) -> sympy.Expr:
    """What the stage's first backward frees before it reruns anything: the output layer's
    rows where the stage holds them (the loss runs backward first; ``holds_output``), and
    under selective recompute the last layer's rows after the rerun ``module``'s own (the
    layer's backward runs in reverse: the MLP's bias-dropout-add before the MLP is rerun, the
    MLP and the attention projection before the attention core is; a norm's rows from the bias-dropout-add after
    its block on, _FREED_FROM)."""
    freed = output_rows(technique, arch)
    if technique.recompute is Recompute.SELECTIVE:
        freed += sympy.Add(*(term_bytes(term, technique, arch) for term in freed_layer_rows(technique, arch, module)))
    return freed


def freed_layer_rows(technique: Technique, arch: Architecture, module: str) -> tuple:
    """The last layer's rows a selective rerun of ``module`` finds freed (freed_before_rerun)."""
    _one_unit(module)
    start = _TERM_INDEX[_FREED_FROM[module]] if module in _FREED_FROM else rows_after(module, arch)
    rows = tuple(term for term in TERMS[start:] if term.scope is Scope.LAYER)
    if module == "mla_up_proj":
        return _mla_core_output(technique) + rows
    if module == "shared_experts":
        return TERMS[_TERM_INDEX[_ROUTED[0]]:_TERM_INDEX[_ROUTED[1]]] + rows
    if module == "moe_act" and arch.moe_shared_overlap:
        return tuple(TERMS[_TERM_INDEX[name]] for name in _OVERLAPPED_AFTER) + rows
    return rows


def dispatcher_kept(technique: Technique, arch: Architecture, module: str) -> sympy.Expr:
    """Of the rows a selective rerun of ``module`` finds freed, what the token dispatcher still holds where that
    microbatch's forward was the layer's last (DISPATCHER_KEEPS): the stage model adds it back with one chunk in
    flight."""
    return sympy.Add(*(term_bytes(term, technique, arch) for term in freed_layer_rows(technique, arch, module)
                       if term.name in dispatcher_keeps(arch)))


def dispatcher_keeps(arch: Architecture) -> tuple:
    """The rows the token dispatcher of ``arch`` still holds after the layer's backward (DISPATCHER_KEEPS)."""
    unpadded = arch.moe_dispatcher == "allgather" and not arch.fp8 and not arch.moe_bf16_padding
    return DISPATCHER_KEEPS + ("experts_probs",) * unpadded


def _mla_core_output(technique: Technique) -> tuple:
    """Of the attention output the projection kept, what the up projections' rerun finds freed: the projection's
    copy where one is its own, flash-attn's at b > 1 (flash_output's size; the kernel keeps its own output);
    where the projection's input is the core's output (TE's sbhd layout, a view), none while the core keeps
    it, and all of it where the core is recomputed (its checkpoint keeps only q, k and v)."""
    rows = (TERMS[_TERM_INDEX["flash_output"]],)
    return rows + (TERMS[_TERM_INDEX["projection_input"]],) if "core_attn" in technique.modules else rows


_TERM_INDEX = {term.name: i for i, term in enumerate(TERMS)}


@cache
def rows_after(module: str, arch: Architecture) -> int:
    """Where the term table's rows after a recompute module's own begin (cached: asked for each moment of each
    stage)."""
    return max((i + 1 for i, term in enumerate(TERMS) if reruns(module, term.module_of(arch))), default=len(TERMS))


def output_rows(technique: Technique, arch: Architecture) -> sympy.Expr:
    """The output layer's rows, where the stage holds them: the loss's backward frees them first."""
    return sympy.Add(*(term_bytes(term, technique, arch) * holds_output for term in STAGE_TERMS
                       if term.scope is Scope.OUTPUT))


@cache
def loss_backward_bytes(technique: Technique, arch: Architecture = PAPER) -> sympy.Expr:
    """What the loss's backward allocates while every saved activation is still held, on the
    stage that holds the output layer (``holds_output``): the 16-bit logits gradient."""
    return sympy.Add(*(term_bytes(term, technique, arch) * holds_output for term in TRANSIENT_TERMS))


def exact(expr, bindings: dict) -> int:
    """Bind the symbols to integers and return the whole number of bytes."""
    return _exact(sympy.sympify(expr), tuple(bindings.items()))


@cache
def _exact(expr, bindings: tuple) -> int:
    """Cached: every stage of a pipeline binds the same expressions to the same values.
    xreplace swaps every symbol for its integer and lets sympy fold the numbers as it builds
    (some 30x faster than subs); subs where something is left unfolded."""
    value = expr.xreplace({symbol: _number(number) for symbol, number in bindings})
    if not value.is_Number:
        value = expr.subs(dict(bindings))
    if not value.is_Integer:
        raise ArithmeticError(f"{expr} is not a whole number of bytes at {dict(bindings)}: {value}")
    return int(value)


def _number(number):
    """A bound value as sympy's exact number: an int, or a Fraction (the routing imbalance)."""
    if isinstance(number, int):
        return sympy.Integer(number)
    return sympy.Rational(number.numerator, number.denominator)


@cache
def numeric(expr):
    """A numpy function of NUMERIC_ARGS for sweeps (the planner), from the same expression.

    numpy's printer with its functions imported one by one: lambdify's modules="numpy" runs
    `from numpy import *`, which loads numpy's lazy submodules (f2py, testing, ...), a tenth of
    a second of every `actmem plan`."""
    from sympy.printing.numpy import NumPyPrinter

    printer = NumPyPrinter({"fully_qualified_modules": False, "inline": True, "allow_unknown_functions": True})
    return sympy.lambdify(NUMERIC_ARGS, expr, modules={}, printer=printer)
