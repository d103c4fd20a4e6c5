"""The planner against published runs: Megatron-LM's weak-scaling table on H100 (README.md and
images/model_table.png at NVIDIA/Megatron-LM@f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4, "New
scaling figures on H100 GPUs", 2024-07-15; unchanged at d98e8a64). The README: "All models use a
vocabulary size of 131,072 and a sequence length of 4096 ... We perform fine-grained overlapping of
data-parallel (--overlap-grad-reduce --overlap-param-gather), tensor-parallel (--tp-comm-overlap)
and pipeline-parallel communication ... The reported throughputs are measured for end-to-end
training". The table prints heads, hidden, layers, TP, PP, DP, GPUs, batch and MFU; it does not
print the MLP or attention, taken here as GPT's (f = 4h, one key and value a head) with TE's
cuDNN attention, bf16 (465.9 TFLOP/s is 47% of 989), the distributed optimizer (Megatron needs it
for --overlap-param-gather) and the H100's measured kernels (actmem.planner.kernels)."""

import pytest

from actmem.model.architecture import Architecture
from actmem.model.hardware import GPUS
from actmem.model.spec import Model
from actmem.planner.plan import PlanRequest, plan

#: name: (heads, hidden, layers, TP, PP, GPUs, global batch, published MFU)
WEAK_SCALING = {
    "1.7B": (16, 2048, 24, 1, 1, 48, 192, 0.41), "7.1B": (32, 4096, 30, 2, 1, 96, 192, 0.47),
    "16B": (48, 6144, 32, 4, 1, 192, 192, 0.49), "32B": (56, 7168, 48, 8, 1, 384, 192, 0.46),
    "70B": (64, 8192, 84, 8, 2, 768, 384, 0.42), "119B": (80, 10240, 92, 8, 4, 1536, 768, 0.43),
    "177B": (96, 12288, 96, 8, 6, 2304, 1152, 0.44), "314B": (128, 16384, 96, 8, 8, 3072, 1536, 0.48),
    "462B": (144, 18432, 112, 8, 16, 6144, 3072, 0.47),
}
#: where the published layout is not in the first three: the planner charges tensor-parallel
#: communication whole, where these runs overlapped it (--tp-comm-overlap, whose userbuffers actmem
#: does not model), so it prefers t = 4 with c = 2 (docs/usage.md, the planner's checks)
NOT_TOP_THREE = {"70B", "177B", "314B"}
#: runs the modelled MFU overshoots by more than the issue's 15%: the two smallest (h = 2048 and 4096),
#: where what is not charged (latencies, the optimizer step, data loading) weighs most against small
#: GEMMs, and 462B on 6,144 GPUs (p = 16), by 15.5%: the latencies of the most stages and nodes
OVER_15_PERCENT = {"1.7B", "7.1B", "462B"}


@pytest.fixture(scope="module")
def published():
    """name: (the published layout's fastest row, its rank among the fitting configurations, 1 first)."""
    rows = {}
    arch = Architecture(attention_core="flash", attention_dropout=0.0, hidden_dropout=0.0, position_embedding="rope",
                        bias=False)
    for name, (heads, hidden, layers, t, p, gpus, batch, _) in WEAK_SCALING.items():
        request = PlanRequest(model=Model(heads, hidden, layers, 131072, 4096), gpus=gpus, global_batch=batch,
                              gpu=GPUS["h100"], gpu_memory_bytes=GPUS["h100"].memory_bytes, architecture=arch,
                              overlap_grad_reduce=True, overlap_param_gather=True)
        fitting = plan(request).fitting.reset_index(drop=True)
        layout = fitting[(fitting.t == t) & (fitting.p == p) & (fitting.c == 1)]
        rows[name] = (layout.iloc[0], layout.index[0] + 1)
    return rows


@pytest.mark.parametrize("name", sorted(set(WEAK_SCALING) - NOT_TOP_THREE))
def test_the_published_layout_ranks_in_the_first_three(published, name):
    row, rank = published[name]
    assert rank <= 3, (name, rank, row.t, row.p)


def test_the_modelled_mfu_is_within_15_percent_above_but_for_three(published):
    """The time model charges the GEMMs, the attention core and the memory-bound kernels beside them
    (as measured), and the communication it does not take as overlapped; not latencies, the
    optimizer step or data loading. So each modelled MFU is above what the run measured, by at most
    15% (the issue's aim) but for OVER_15_PERCENT, the two smallest by the most. A modelled MFU under
    the published one would be charging something twice; one of the three coming within 15% is news
    for this test and the docs' table."""
    over = {name: row.mfu / WEAK_SCALING[name][-1] - 1 for name, (row, _) in published.items()}
    assert all(excess > 0 for excess in over.values()), over
    assert {name for name, excess in over.items() if excess > 0.15} == OVER_15_PERCENT, over
    assert sorted(over, key=over.get)[-2:] == ["7.1B", "1.7B"], over
