"""The paper's equations as composed by the engine, factored the way the paper writes them."""

from dataclasses import dataclass

import sympy

from actmem.memory import engine
from actmem.model.symbols import L, b, h, m, p, s, t
from actmem.memory.techniques import BY_NAME, TABLE_2, Technique

_SBH = sympy.Symbol("sbh", positive=True)
_SBHL = sympy.Symbol("sbhL", positive=True)


@dataclass(frozen=True)
class Equation:
    label: str
    meaning: str
    expr: sympy.Expr
    """The engine's expression, in bytes."""
    display: sympy.Expr
    """The same, factored as the paper prints it (sbh·(...))."""


def _per_sbh(expr):
    return _SBH * sympy.expand(sympy.simplify(expr / (s * b * h)))


def table_2() -> list[Equation]:
    """Per-layer activation bytes of the six techniques (Table 2)."""
    return [Equation(tech.name, tech.label, engine.per_layer_bytes(tech),
                     _per_sbh(engine.per_layer_bytes(tech))) for tech in TABLE_2]


def _first_stage(tech: Technique, interleaved: bool) -> sympy.Expr:
    return engine.per_layer_bytes(tech) * engine.layers_in_flight(interleaved)


def equations() -> list[Equation]:
    """Eqs 5 and 6, the interleave factor and the section 4.5 terms (Eqs 1, 2 and 4 are
    rows of Table 2; Eq 3 is the algebra of the sequence-parallel MLP, not a byte count)."""
    tp_sp, tp_sp_sel = BY_NAME["tp-sp"], BY_NAME["tp-sp-sel"]
    eq5 = _first_stage(tp_sp, interleaved=False)
    factor = sympy.simplify(engine.layers_in_flight(True) / L)
    extra_p1 = engine.extra_bytes(tp_sp, 1, 1)
    extra = engine.extra_bytes(tp_sp, p, 0)
    per_sbhl_t = s * b * h * L / t
    return [
        Equation("Eq 5", "first stage, 1F1B, tensor + sequence parallel: L layers in flight", eq5,
                 _SBHL / t * sympy.expand(sympy.simplify(eq5 / per_sbhl_t))),
        Equation("4.4", "interleaved schedule (m chunks a rank) multiplies Eq 5 by", factor,
                 sympy.apart(factor, m)),
        Equation("Eq 6", "Eq 5 with selective recompute", _first_stage(tp_sp_sel, False),
                 _SBHL / t * sympy.simplify(_first_stage(tp_sp_sel, False) / per_sbhl_t)),
        Equation("4.5", "first stage, p > 1: embedding dropout masks of p microbatches", extra,
                 _per_sbh(extra)),
        Equation("4.5", "first stage, p = 1: embedding mask + final layer norm + output layer "
                 "+ fp32 logits", extra_p1, _per_sbh(extra_p1)),
    ]
