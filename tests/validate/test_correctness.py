"""SP + TP layers compute what a single-device layer computes (fp32, gloo, t = 2 and 4), and
the flash core and rope compute what the textbook formulas compute."""

import pytest

torch = pytest.importorskip("torch")

from actmem_validate.correctness import check_all  # noqa: E402
from actmem_validate.fused import rotary_frequencies, rotate  # noqa: E402
from actmem_validate.gpt import flash_core  # noqa: E402


@pytest.mark.parametrize("t", [2, 4])
def test_layer_outputs_and_every_gradient_match_a_single_device_layer(t):
    worst = check_all(t)
    expected = {f"{variant} sp={sp} recompute={r}" for variant in ("paper", "swiglu-rmsnorm", "gqa", "torch-softmax")
                for sp in ("on", "off") for r in ("none", "selective", "selective:core_attn+mlp", "full")}
    flash = ("flash-rope-gqa", "flash-attn", "flash-unfused-rope", "flash-qk-norm", "flash-qk-norm-learned")
    expected |= {f"{variant} sp={sp} recompute={r}" for variant in flash for sp in ("on", "off")
                 for r in ("none", "selective", "selective:core_attn+mlp", "selective:mlp", "full")}
    assert set(worst) == expected
    for case, difference in worst.items():
        assert difference < 1e-5, case


def test_flash_core_with_query_groups_is_causal_attention_over_expanded_keys():
    """softmax(QKᵀ/√d + causal mask)·V with each group's K and V repeated for its a/g heads,
    written out by hand in fp64: the batch folded into the heads must pair head j of
    sequence i with group j/(a/g) of the same sequence."""
    s, b, a, g, d = 6, 3, 4, 2, 8
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, b, n, d, generator=gen) for n in (a, g, g))
    out = flash_core(q, k, v).view(s, b, a, d)
    assert torch.allclose(flash_core(q, k, v, copies_output=True).view(s, b, a, d), out, atol=1e-6)  # flash-attn layout
    kk, vv = (x.double().repeat_interleave(a // g, dim=2) for x in (k, v))
    scores = torch.einsum("ibhd,jbhd->bhij", q.double(), kk) / d ** 0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.einsum("bhij,jbhd->ibhd", scores.softmax(-1), vv)
    assert (out.double() - expected).abs().max() < 1e-5


def test_rope_rotates_pairs_by_position_and_its_backward_is_the_transpose():
    """Position 0 is unrotated; x·cos + rotate_half(x)·sin keeps each pair's norm; and the
    hand-written backward agrees with autograd's gradcheck in fp64."""
    s, d = 5, 8
    freqs = rotary_frequencies(s, d).double()
    x = torch.randn(s, 2, 3, d, dtype=torch.float64, requires_grad=True)
    y = rotate(x, freqs)
    assert torch.allclose(y[0], x[0])
    pairs = lambda t: t[..., : d // 2] ** 2 + t[..., d // 2:] ** 2     # (x_i, x_{i+d/2}) rotate together
    assert torch.allclose(pairs(y), pairs(x))
    assert torch.autograd.gradcheck(lambda t: rotate(t, freqs), (x,))


@pytest.mark.parametrize("t, c", [(1, 2), (2, 2)])
def test_context_parallel_layer_matches_a_single_device_layer(t, c):
    """c ranks each holding s/c of the sequence (with t-way TP and SP beside them): the output,
    the input gradient and every weight gradient (summed over the c ranks) equal the
    single-device layer's."""
    from actmem_validate.correctness import check_context

    worst = check_context(t, c)
    assert set(worst) == {f"flash-rope-gqa c={c} sp={sp} recompute={r}" for sp in (("off", "on") if t > 1 else ("off",))
                          for r in ("none", "selective", "selective:core_attn+mlp", "selective:mlp", "full")}
    for case, difference in worst.items():
        assert difference < 1e-5, case


def _rank_without_head_grad_allreduce(rank: int, folder: str, port: int) -> None:
    """One of t = 2 ranks running the Qwen3-like layer with the q and k norms' grads left
    unsummed (the all-reduce Megatron's finalize_model_grads does skipped)."""
    import json
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from actmem_validate import correctness, layers
    from actmem_validate.parallel import TensorParallel

    def sequence_parallel_only(module, tp):
        for param in module.parameters():
            param.summed_over_heads = False
        layers.allreduce_layernorm_grads(module, tp)

    correctness.allreduce_layernorm_grads = sequence_parallel_only
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    diffs = {sp: correctness.layer_differences(TensorParallel(2, rank, None, sp), "none", "flash-qk-norm")
             for sp in (False, True)}
    with open(os.path.join(folder, f"{rank}.json"), "w") as file:
        json.dump({str(sp): {"q_norm": d["attention.q_norm.weight"], "k_norm": d["attention.k_norm.weight"],
                             "worst": max(d.values())} for sp, d in diffs.items()}, file)
    dist.destroy_process_group()


def test_q_and_k_norm_grads_unsummed_over_t_fail_the_check(tmp_path):
    """Each rank's q and k norm grads cover its own heads: without the all-reduce over t that
    Megatron does by their names (finalize_model_grads) the check sees them off under plain
    TP. Under SP the norms' sequence_parallel mark sums them anyway (TENorm is built with
    sequence_parallel=config.sequence_parallel), and the layer stays right."""
    import json

    from actmem_validate import forkserver
    from actmem_validate.gloo import free_port

    forkserver.start(_rank_without_head_grad_allreduce, (str(tmp_path), free_port()), 2)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"{rank}.json").read_text())
        assert result["False"]["q_norm"] > 1e-3 and result["False"]["k_norm"] > 1e-3, (rank, result)
        assert result["True"]["worst"] < 1e-5, (rank, result)
