"""The paper's variables (Table 1), as sympy symbols, plus the interleave m.

All are positive integers; declaring them so lets sympy simplify the equations.
"""

import sympy

s, b, h, a, L, t, p, v, m = sympy.symbols("s b h a L t p v m", positive=True, integer=True)

#: name in the spec -> symbol, in the order of Table 1
BY_NAME = {"s": s, "b": b, "h": h, "a": a, "L": L, "t": t, "p": p, "v": v, "m": m}
