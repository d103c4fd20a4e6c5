"""Moments inside the backward of a stage's last layer, for the peak floor (actmem.memory.peak).

The first backward after the pipeline fills runs the stage's last layer backward with every
microbatch held. Three of its moments are modelled, op by op from the kernels' source:

- ``fc1``: the MLP's first linear, its gradients and gathered input all live once its input
  gradient's reduce-scatter has its shard (terms.MLP_BACKWARD_TERMS);
- ``core``: Megatron's eager attention core at its softmax's or dropout's backward
  (terms.CORE_BACKWARD_TERMS);
- ``softmax``: where that core runs torch's fallback softmax rather than its fused kernel,
  at that softmax's backward, not in place: in 16 bits at its masked_fill_'s (inside
  CopySlices), in fp32 at the softmax's own (terms.SOFTMAX_BACKWARD_TERMS);
- ``swiglu``: an unfused SwiGLU (transformers' LlamaMLP, torchtitan's FeedForward) at its
  product's backward, mul's two gradients made (terms.SWIGLU_BACKWARD_TERMS). Both codes
  checkpoint a layer with torch's non-reentrant checkpoint, which holds no rerun output through
  the backward: the rerun returns nothing, and with early stop (torch's default) ends at the last
  tensor the layer saves.

At each, the layer's rows after the op are freed (their backward has run), the rows before
it are still held, and the op's gradients are live. What the layer holds there is kept, or
rerun: full recompute reruns the whole layer first; selective recompute of the core reruns
it at the core's backward. Each moment is four sympy expressions (``Moment``); the planner
takes ``beyond_held``, the estimate binds the four and actmem.memory.peak names them as rows.
"""

from dataclasses import dataclass
from functools import cache

import sympy

from actmem.model.architecture import PAPER, Architecture, eager, swiglu_keeping_silu_output, torch_softmax
from actmem.memory.engine import output_rows, rematerialised_bytes, rows_after, term_bytes
from actmem.model.symbols import a, t
from actmem.memory.techniques import Technique
from actmem.memory.terms import CORE_BACKWARD_TERMS, MLP_BACKWARD_TERMS, RERUN_OUTPUT, SOFTMAX_BACKWARD_TERMS, SP_ONLY, \
    SWIGLU_BACKWARD_TERMS, TERMS, Term, layer_terms
from actmem.model.recompute import Recompute

MOMENTS = ("fc1", "core", "softmax", "swiglu")
_TRANSIENTS = {"fc1": MLP_BACKWARD_TERMS, "core": CORE_BACKWARD_TERMS, "softmax": SOFTMAX_BACKWARD_TERMS,
               "swiglu": SWIGLU_BACKWARD_TERMS}
#: SP gathers and scatters only across t > 1 ranks (TE: sequence_parallel = tp_size > 1 and ...):
#: the SP-only rows of a technique row shown at t = 1 are 0
_SPLIT = sympy.Piecewise((0, sympy.Eq(t, 1)), (1, True))

_AFTER_FC1 = TERMS[[term.name for term in TERMS].index("fc1_input") + 1:]


@dataclass(frozen=True)
class Moment:
    """What one moment of the last layer's backward holds beyond the activations in flight."""

    rerun: sympy.Expr
    """What the backward has rerun by then (the whole layer, or the attention core)."""
    freed_held: sympy.Expr
    """Saved rows already freed: the output layer's, and the layer's rows after the op."""
    freed_rerun: sympy.Expr
    """Rerun rows already freed (those after the op)."""
    transient: sympy.Expr
    """The op's gradients and gathered inputs, live at that moment."""

    @property
    def beyond_held(self) -> sympy.Expr:
        return self.rerun - self.freed_rerun + self.transient - self.freed_held


def modelled(moment: str, technique: Technique, arch: Architecture = PAPER) -> bool:
    """Megatron's layer, kept whole or rerun alone (not partial full recompute: callers
    pass the technique a chunk's last layer runs under, Technique.last_layer); an unfused
    SwiGLU's whatever the technique (None will do). fc1: not with
    the MLP recomputed (its own rerun is not modelled yet); core: the eager core; softmax: the
    eager core on torch's fallback softmax; swiglu: transformers' dense unfused SwiGLU."""
    if moment == "swiglu":      # Megatron's fused SwiGLU is fc1's moment; MoE experts are not a dense MLP
        return "layer_backward" not in arch.code.has and swiglu_keeping_silu_output(arch) and not arch.moe
    if "layer_backward" not in arch.code.has or technique.partial:
        return False
    if moment == "fc1":     # the dense MLP's (a MoE layer's backward is not modelled yet: its floor omits it)
        return not arch.moe and (technique.recompute is not Recompute.SELECTIVE or "mlp" not in technique.modules)
    return eager(arch) if moment == "core" else torch_softmax(arch)


def _freed(moment: str, term: Term, arch: Architecture):
    """How much of a layer row its backward has freed at the moment (1, 0, or a Piecewise of
    the heads). fc1: the MLP's rows after fc1's input (the activation's and fc2's inputs) and
    the mask after the MLP, not the norm's rows nor fc1's input, which are still needed. core:
    every row after the core (the projection's input on; not full recompute's checkpoint,
    held until its backward ends), the dropout output ·V kept, and with fewer query groups
    than heads v too: Megatron's repeat_interleave copy, which only ·V kept (without groups v
    is a view of the QKV output, which the q and k views keep)."""
    if moment == "fc1":
        return int(term in _AFTER_FC1 and (term.module_of(arch) == "mlp" or term.name == "mlp_dropout_mask"))
    if moment == "swiglu":
        return int(term.name == "fc2_input")
    if term.name == "value" and arch.query_groups is not None:
        return sympy.Piecewise((1, a > arch.query_groups), (0, True))
    after_core = TERMS.index(term) >= rows_after("core_attn", arch) and term.name != "layer_input_checkpoint"
    return int(after_core or term.name == "softmax_dropout_output"
               or (moment == "softmax" and _freed_before_softmax(term)))


def _freed_before_softmax(term: Term) -> bool:
    """At torch's softmax backward (terms.SOFTMAX_BACKWARD_TERMS), beyond the core moment's: the
    dropout's mask (its backward has run) and the 16-bit probabilities: in 16 bits the softmax's
    output, its backward done; in fp32 the copy only ·V kept."""
    return term.name in ("softmax_dropout_mask", "softmax_output")


def _rerun_scope(moment: str, technique: Technique, arch: Architecture):
    """(what the backward has rerun by then, which rows that rerun made)."""
    if technique.recompute is Recompute.FULL:
        output = term_bytes(RERUN_OUTPUT, technique, arch) if moment == "swiglu" else 0     # no output held
        return rematerialised_bytes(technique, arch) - output, lambda term: True
    if moment != "fc1" and technique.recompute is Recompute.SELECTIVE and "core_attn" in technique.modules:
        return (rematerialised_bytes(technique, arch, module="core_attn"),
                lambda term: term.module_of(arch) == "core_attn")
    return sympy.Integer(0), lambda term: False


@cache
def moment_bytes(moment: str, technique: Technique, arch: Architecture = PAPER) -> Moment:
    """One moment ('fc1', 'core' or 'softmax') of the stage's last layer's backward, for a technique row."""
    rerun, made_by_rerun = _rerun_scope(moment, technique, arch)
    freed = [(term, _freed(moment, term, arch)) for term in layer_terms(arch)]
    held = sympy.Add(*(share * term_bytes(term, technique, arch) for term, share in freed))
    rerun_freed = sympy.Add(*(share * (term_bytes(term, technique.whole(), arch) - term_bytes(term, technique, arch))
                              for term, share in freed if made_by_rerun(term)))
    transient = sympy.Add(*(term_bytes(term, technique, arch) * (_SPLIT if term.name in SP_ONLY else 1)
                            for term in _TRANSIENTS[moment] if technique.sequence_parallel or term.name not in SP_ONLY))
    return Moment(rerun, output_rows(technique, arch) + held, rerun_freed, transient)
