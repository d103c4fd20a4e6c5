"""The lambdified form for sweeps agrees with the exact form."""

import numpy as np

from actmem.memory import engine
from actmem.model.architecture import Architecture
from actmem.model.spec import Model, Run, Spec
from actmem.memory.techniques import TABLE_2, TECHNIQUES


FLASH = Architecture(attention_core="flash")


def test_numeric_matches_exact_on_a_grid():
    grid = [(s, b, t) for s in (512, 2048, 8192) for b in (1, 2, 4) for t in (1, 2, 4, 8)]
    s, b, t = (np.array(column) for column in zip(*grid))
    h, a, L, p, v, m = 12288, 96, 96, 8, 51200, 3
    # GPT-3's interleaved first stage: 96·(1 + 7/24) = 124 layers, 2p = 16 embedding masks
    counts = {engine.layer_activations: 124, engine.microbatches_held: 16, engine.holds_output: 0}
    for technique in TABLE_2:
        expr = engine.held_bytes(technique)
        fast = engine.numeric(expr)(s, b, h, a, L, t, p, v, m, *counts.values(), 1, 1, 1, 1, 1, 0, 0)   # c, e, r, EP, C, P, Q
        for i, (si, bi, ti) in enumerate(grid):
            # the bindings only: the flash core's, since Megatron's eager core refuses s = 8192
            spec = Spec(Model(a, h, L, v, si), Run(tensor_parallel=ti, pipeline_parallel=p,
                                                   interleave=m, micro_batch=bi), architecture=FLASH)
            assert fast[i] == engine.exact(expr, spec.bindings() | counts)


def test_held_bytes_matches_the_estimate(actmem):
    """The planner's vectorised form gives the estimate's bytes for the same run."""
    out = actmem.json("estimate", "--model", "gpt3", "--global-batch", "4", "--interleave", "1")
    held = out["stage"]
    spec_args = (2048, 1, 12288, 96, 96, 8, 8, 51200, 1)
    for row in out["techniques"]:
        technique = next(t for t in TECHNIQUES if t.name == row["technique"])
        f = engine.numeric(engine.held_bytes(technique))
        assert f(*spec_args, held["layer_activations"], held["embedding_microbatches"],
                 int(held["holds_output_layer"]), 1, 1, 1, 1, 1, 0, 0) == row["first_stage_bytes"]     # c, e, r, EP, C, P, Q
