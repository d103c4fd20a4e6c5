"""One recompute value (actmem.model.recompute): Megatron's four recompute arguments at once, with
one label that every output writes and one parser that reads it back."""

import pytest

from actmem.errors import SpecError
from actmem.model.recompute import FULL, NONE, SELECTIVE, RecomputePolicy
from actmem.model.recompute import Recompute

MLP = RecomputePolicy(Recompute.SELECTIVE, frozenset({"mlp", "core_attn"}))
BLOCK_2 = RecomputePolicy(Recompute.FULL, method="block", layers=2)


@pytest.mark.parametrize("policy, label, word, flags", [
    (NONE, "none", "none", ""),
    (SELECTIVE, "selective", "sel", ""),
    (MLP, "selective:core_attn+mlp", "sel+mlp", "--recompute-modules core_attn mlp"),
    (RecomputePolicy(Recompute.SELECTIVE, frozenset({"mlp"})), "selective:mlp", "mlp", "--recompute-modules mlp"),
    (RecomputePolicy(Recompute.SELECTIVE, frozenset({"layernorm", "core_attn"})), "selective:core_attn+layernorm",
     "sel:core_attn+layernorm", "--recompute-modules core_attn layernorm"),
    (FULL, "full", "full", ""),
    (BLOCK_2, "full:block=2", "block=2", "--recompute-method block --recompute-num-layers 2"),
    (RecomputePolicy(Recompute.FULL, method="uniform", layers=3), "full:uniform=3", "uniform=3",
     "--recompute-method uniform --recompute-num-layers 3"),
])
def test_one_label_read_back(policy, label, word, flags):
    assert (policy.label, policy.word, policy.megatron_flags) == (label, word, flags)
    assert RecomputePolicy.parse(label) == policy


def test_megatron_s_four_settings_and_back():
    """Megatron's defaults (None) are the paper's: core_attn; every layer alone."""
    assert RecomputePolicy.of_run("selective", None, None, ("core_attn", "mlp")) == MLP
    assert RecomputePolicy.of_run(Recompute.FULL, "block", 2) == BLOCK_2
    assert RecomputePolicy.of_run("full", "uniform", 1) == FULL and not FULL.partial and BLOCK_2.partial
    assert BLOCK_2.run_values == {"recompute": "full", "recompute_modules": None, "recompute_method": "block",
                                  "recompute_layers": 2}
    assert MLP.run_values["recompute_modules"] == ("core_attn", "mlp")


@pytest.mark.parametrize("make, message", [
    (lambda: RecomputePolicy.parse("partial"), "give none, selective"),
    (lambda: RecomputePolicy.parse("full:block"), "give none, selective"),
    (lambda: RecomputePolicy.parse("selective:attention"), "some of core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts"),
    (lambda: RecomputePolicy(Recompute.NONE, frozenset({"mlp"})), "choose what selective recompute reruns"),
    (lambda: RecomputePolicy(Recompute.SELECTIVE, method="block", layers=2), "groups full recompute"),
    (lambda: RecomputePolicy(Recompute.FULL, method="block", layers=0), "N >= 1"),
])
def test_what_is_not_a_recompute_is_refused(make, message):
    with pytest.raises(SpecError, match=message):
        make()
