"""The paper's variables (Table 1), as sympy symbols, plus the interleave m and the
context-parallel size c (the bindings give s as the s/c tokens a rank holds; c names the
whole sequence where a tensor spans it: the dataloader's attention mask).

All are positive integers; declaring them so lets sympy simplify the equations.
"""

import sympy

s, b, h, a, L, t, p, v, m, c = sympy.symbols("s b h a L t p v m c", positive=True, integer=True)

#: name in the spec -> symbol, in the order of Table 1
BY_NAME = {"s": s, "b": b, "h": h, "a": a, "L": L, "t": t, "p": p, "v": v, "m": m, "c": c}
