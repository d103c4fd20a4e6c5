"""Moments inside the backward of a stage's last layer, for the peak floor (actmem.peak).

The first backward after the pipeline fills runs the stage's last layer backward with every
microbatch held. Two of its moments are modelled, op by op from the kernels' source:

- ``fc1``: the MLP's first linear at its weight gradient (terms.MLP_BACKWARD_TERMS);
- ``core``: Megatron's eager attention core at its softmax's or dropout's backward
  (terms.CORE_BACKWARD_TERMS).

At each, the layer's rows after the op are freed (their backward has run), the rows before
it are still held, and the op's gradients are live. What the layer holds there is kept, or
rerun: full recompute reruns the whole layer first; selective recompute of the core reruns
it at the core's backward. Each moment is four sympy expressions (``Moment``); the planner
takes ``beyond_held``, the estimate binds the four and actmem.peak names them as rows.
"""

from dataclasses import dataclass
from functools import cache

import sympy

from actmem.architecture import PAPER, Architecture, eager
from actmem.engine import output_rows, rematerialised_bytes, term_bytes
from actmem.symbols import t
from actmem.techniques import Technique
from actmem.terms import CORE_BACKWARD_TERMS, MLP_BACKWARD_TERMS, SP_ONLY, TERMS, Recompute, Term, layer_terms

MOMENTS = ("fc1", "core")
#: SP gathers and scatters only across t > 1 ranks (TE: sequence_parallel = tp_size > 1 and ...):
#: the SP-only rows of a technique row shown at t = 1 are 0
_SPLIT = sympy.Piecewise((0, sympy.Eq(t, 1)), (1, True))

_NAMES = [term.name for term in TERMS]
_AFTER_FC1 = TERMS[_NAMES.index("fc1_input") + 1:]
_AFTER_CORE = TERMS[max(i for i, term in enumerate(TERMS) if term.module == "core_attn") + 1:]


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
    """Megatron's layer only, kept whole or rerun alone (not partial full recompute). fc1:
    not with the MLP recomputed (its own rerun is not modelled yet); core: the eager core."""
    if arch.code.name != "megatron" or technique.partial:
        return False
    if moment == "fc1":
        return technique.recompute is not Recompute.SELECTIVE or "mlp" not in technique.modules
    return eager(arch)


def _freed(moment: str, term: Term, arch: Architecture) -> bool:
    """The layer's rows its backward has freed at the moment. fc1: the MLP's rows after fc1's
    input (the activation's and fc2's inputs) and the mask after the MLP, not the norm's rows
    nor fc1's input, which are still needed. core: every row after the core (the projection's
    input on; not full recompute's checkpoint, held until its backward ends), and the dropout
    output ·V kept."""
    if moment == "fc1":
        return term in _AFTER_FC1 and (term.module_of(arch) == "mlp" or term.name == "mlp_dropout_mask")
    return (term in _AFTER_CORE and term.name != "layer_input_checkpoint") or term.name == "softmax_dropout_output"


def _rerun_scope(moment: str, technique: Technique, arch: Architecture):
    """(what the backward has rerun by then, which rows that rerun made)."""
    if technique.recompute is Recompute.FULL:
        return rematerialised_bytes(technique, arch), lambda term: True
    if moment == "core" and technique.recompute is Recompute.SELECTIVE and "core_attn" in technique.modules:
        return (rematerialised_bytes(technique, arch, module="core_attn"),
                lambda term: term.module_of(arch) == "core_attn")
    return sympy.Integer(0), lambda term: False


@cache
def moment_bytes(moment: str, technique: Technique, arch: Architecture = PAPER) -> Moment:
    rerun, made_by_rerun = _rerun_scope(moment, technique, arch)
    freed = [term for term in layer_terms(arch) if _freed(moment, term, arch)]
    held = sympy.Add(*(term_bytes(term, technique, arch) for term in freed))
    rerun_freed = sympy.Add(*(term_bytes(term, technique.whole(), arch) - term_bytes(term, technique, arch)
                              for term in freed if made_by_rerun(term)))
    terms = MLP_BACKWARD_TERMS if moment == "fc1" else CORE_BACKWARD_TERMS
    transient = sympy.Add(*(term_bytes(term, technique, arch) * (_SPLIT if term.name in SP_ONLY else 1)
                            for term in terms if technique.sequence_parallel or term.name not in SP_ONLY))
    return Moment(rerun, output_rows(technique, arch) + held, rerun_freed, transient)
