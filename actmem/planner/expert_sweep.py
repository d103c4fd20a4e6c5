"""The planner's sweep over a mixture of experts (actmem.planner.plan calls these): the expert-parallel
sizes it tries, what the rules read of them, the routing imbalance each row takes, and, where dense layers
sit among the MoE layers, how many of each kind a stage holds and which stages between the first and the
last may hold the most. Arithmetic on the sweep's columns; ``req`` is a plan.PlanRequest.
"""

import numpy as np
import pandas as pd

from actmem.model.experts import busiest_rank, capped_imbalance, moe_layers


def prefix_or_periodic(freq) -> bool:
    """--moe-layer-freq N (or its pattern written out, ([1,0]*16)), or a pattern of dense layers then MoE
    layers ([0]*3+[1]*58): the stages between the first and the last then hold at most three counts of
    MoE layers (middle_stages)."""
    if isinstance(freq, int):
        return True
    moe = list(freq)
    ones = [i for i, kind in enumerate(moe) if kind]
    steps = {b - a for a, b in zip(ones, ones[1:])}
    periodic = bool(ones) and ones[0] == 0 and len(steps) <= 1 and len(moe) - ones[-1] <= (steps or {1}).pop()
    return moe == sorted(moe) or periodic


def expert_sizes(req) -> pd.DataFrame:
    """(ep, etp) a mixture of experts is swept over: EP dividing the experts, ETP 1 or t (Megatron's
    default); (1, t) for a dense model. A column etp_is_t: the grid's own t stands for it."""
    if not req.architecture.moe:
        return pd.DataFrame({"ep": [1], "etp_is_t": [True]})
    experts = req.architecture.num_experts
    eps = [ep for ep in range(1, experts + 1) if experts % ep == 0 and ep <= req.gpus]
    return pd.DataFrame({"ep": eps}).merge(pd.DataFrame({"etp_is_t": [True, False]}), how="cross")


def expert_values(req, grid: pd.DataFrame) -> dict:
    """The rules' names of a mixture of experts (Spec.rule_values'), for rows of the sweep."""
    arch = req.architecture
    mtp = {"mtp": True} if arch.mtp_layers else {}
    if not arch.moe:
        return dict(dense=True, ep=grid.ep, etp=grid.etp, imbalance=req.routing_imbalance, **mtp)
    return dict(experts=arch.num_experts, ep=grid.ep, etp=grid.etp, imbalance=req.routing_imbalance,
                load_histogram=req.expert_loads is not None,
                expert_ffn=arch.expert_ffn(req.model.hidden), shared_ffn=arch.moe_shared_ffn,
                moe_freq=arch.moe_layer_freq, mixed_layers=mixed(req), **mtp)


def mixed(req) -> bool:
    """Dense layers among the MoE layers (--moe-layer-freq)."""
    return req.architecture.moe and 0 in moe_layers(req.architecture, req.model.layers)


def stage_kinds(req, grid: pd.DataFrame, name: str, layers: pd.Series, stage) -> tuple:
    """(MoE layers of the stage, whether its last layer is one), by row: the first stage holds layers
    [0, first), a stage j between [first + (j - 1)·between, first + j·between), the last [L - last, L)
    (m = 1: a rule); None, None for a model whose layers are all of one kind."""
    if not mixed(req):
        return None, None
    L = req.model.layers
    start = {"first": 0, "last": L - layers}.get(name, grid.first_stage_layers + (stage - 1) * grid.stage_layers)
    end = np.minimum(start + layers, L).to_numpy()            # a stage between where p < 3: none (zeroed)
    start = np.minimum(np.broadcast_to(start, len(grid)), end - 1)
    moe = moe_before(req)
    return moe[end] - moe[start], moe[end] - moe[end - 1] == 1


def moe_before(req) -> np.ndarray:
    """The MoE layers among the first i, for i = 0..L."""
    return np.concatenate([[0], np.cumsum(moe_layers(req.architecture, req.model.layers))])


def middle_stages(req, grid: pd.DataFrame) -> tuple:
    """The stages between the first and the last that may hold the most, by row, where the model mixes
    dense and MoE layers: for each mix, the fewest MoE layers, the most or some other count, and each kind
    of last layer (which sets the rerun's and the last layer's backward moments), the earliest stage of it
    (the most microbatches in flight, the same layers). A dense-first pattern or one MoE layer every N gives
    at most three counts (prefix_or_periodic): at most six stages a row, fewer sized where fewer occur."""
    moe, L = moe_before(req), req.model.layers
    first, between, p = (grid[name].to_numpy() for name in ("first_stage_layers", "stage_layers", "p"))

    def mix(j):
        """(MoE layers, whether the last is one) of stage j."""
        start = np.minimum(first + (j - 1) * between, L)
        end = np.minimum(start + between, L)
        return moe[end] - moe[start], moe[end] - moe[np.maximum(end - 1, 0)] == 1

    stages = range(1, max(p.max() - 1, 2))
    least, most = mix(1)[0], mix(1)[0]
    for j in stages:
        here, count = j <= p - 2, mix(j)[0]
        least, most = np.where(here, np.minimum(least, count), least), np.where(here, np.maximum(most, count), most)
    found = {}
    for j in stages:
        here, (count, last_moe) = j <= p - 2, mix(j)
        for kind, match in (("least", count == least), ("most", count == most),
                            ("other", (count > least) & (count < most))):
            for last in (True, False):
                slot = found.setdefault((kind, last), np.zeros(len(grid), dtype="int64"))
                found[(kind, last)] = np.where(here & match & (last_moe == last) & (slot == 0), j, slot)
    # rows that all have p < 3 have no stage between (an --explain at p = 1 or 2): stage 1, sized as 0 bytes
    return tuple(np.where(slot == 0, 1, slot) for slot in found.values() if slot.any()) or (np.ones(len(grid), "int64"),)


def imbalance(req, ep: np.ndarray) -> np.ndarray:
    """r by row: the load histogram's busiest rank at each row's EP, or the given r capped at EP."""
    arch = req.architecture
    if not arch.moe:                    # no expert rows: r unread
        return np.ones(len(ep))
    if req.expert_loads is None:
        return capped_imbalance(float(req.routing_imbalance), ep, arch.num_experts, arch.moe_topk)
    by_ep = {int(value): float(busiest_rank(req.expert_loads, int(value)).imbalance) for value in np.unique(ep)}
    return np.vectorize(by_ep.get)(ep.astype("int64"))
