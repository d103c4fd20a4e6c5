"""The paper's variables (Table 1), as sympy symbols, plus the interleave m and the
context-parallel size c (the bindings give s as the s/c tokens a rank holds; c names the
whole sequence where a tensor spans it: the dataloader's attention mask).

All are positive integers; declaring them so lets sympy simplify the equations.
"""

import sympy

s, b, h, a, L, t, p, v, m, c = sympy.symbols("s b h a L t p v m c", positive=True, integer=True)
#: mixture of experts: e, the expert-tensor-parallel size (ETP); r >= 1, the routing imbalance (the
#: busiest rank's expert rows over the balanced count: a rational); the expert-parallel size EP, where a
#: row's shape has the E/EP local experts in it (TE's fused permutation maps)
e = sympy.Symbol("e", positive=True, integer=True)
r = sympy.Symbol("r", positive=True, rational=True)
ep = sympy.Symbol("EP", positive=True, integer=True)
#: C, an expert's capacity under --moe-expert-capacity-factor: bound to the integer Megatron computes in floating
#: point (actmem.model.experts.capacity), not a ceiling sympy would take exactly
C = sympy.Symbol("C", positive=True, integer=True)
#: P, the rows FP8's per-expert padding may add to a rank's expert rows (actmem.model.fp8.expert_padding_rows): an
#: estimate binds its most, the harness what its rank's experts did receive
P = sympy.Symbol("P", nonnegative=True, integer=True)
#: Q, the rows the experts' 128-row scale blocks may add under a block-scaled FP8 recipe
#: (actmem.model.fp8.expert_block_rows): bound as P is
Q = sympy.Symbol("Q", nonnegative=True, integer=True)

#: name in the spec -> symbol, in the order of Table 1
BY_NAME = {"s": s, "b": b, "h": h, "a": a, "L": L, "t": t, "p": p, "v": v, "m": m, "c": c, "e": e, "r": r,
           "ep": ep, "C": C, "P": P, "Q": Q}

#: a mixture-of-experts layer's own sizes, as the formulas view shows its rows (an estimate binds
#: the architecture's integers in their place): E experts, top-k, an expert's hidden size f_e, the
#: shared experts' f_s
E, k, f_e, f_s = sympy.symbols("E k f_e f_s", positive=True, integer=True)
#: multi-latent attention's own widths, as the formulas view shows its rows: the q and kv latents'
#: ranks, each head's q and k width without rope, its rope part, its v width
q_r, kv_r, d_qk, d_rope, d_v = sympy.symbols("q_r kv_r d_qk d_rope d_v", positive=True, integer=True)
