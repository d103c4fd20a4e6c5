"""SP + TP layers compute what a single-device layer computes (fp32, gloo, t = 2 and 4)."""

import pytest

pytest.importorskip("torch")

from actmem_validate.correctness import check_all  # noqa: E402


@pytest.mark.parametrize("t", [2, 4])
def test_layer_outputs_and_every_gradient_match_a_single_device_layer(t):
    worst = check_all(t)
    assert set(worst) == {f"{variant} sp={sp} recompute={r}" for variant in ("paper", "swiglu-rmsnorm", "gqa")
                          for sp in ("on", "off") for r in ("none", "selective", "full")}
    for case, difference in worst.items():
        assert difference < 1e-5, case
