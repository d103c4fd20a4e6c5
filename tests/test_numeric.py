"""The lambdified form for sweeps agrees with the exact form."""

import numpy as np

from actmem import engine
from actmem.spec import Model, Run, Spec
from actmem.techniques import TABLE_2


def test_numeric_matches_exact_on_a_grid():
    grid = [(s, b, t) for s in (512, 2048, 8192) for b in (1, 2, 4) for t in (1, 2, 4, 8)]
    s, b, t = (np.array(column) for column in zip(*grid))
    h, a, L, p, v, m = 12288, 96, 96, 8, 51200, 3
    for technique in TABLE_2:
        expr = engine.first_stage_bytes(technique, interleaved=True, holds_output=False)
        fast = engine.numeric(expr)(s, b, h, a, L, t, p, v, m)
        for i, (si, bi, ti) in enumerate(grid):
            spec = Spec(Model(a, h, L, v, si), Run(tensor_parallel=ti, pipeline_parallel=p,
                                                   interleave=m, micro_batch=bi))
            assert fast[i] == engine.exact(expr, spec.bindings())
