"""Each private PyTorch API the harness uses still works on this torch; a failure names it."""

import pytest

pytest.importorskip("torch")

from actmem_validate.torch_compat import PROBES  # noqa: E402


@pytest.mark.parametrize("api", PROBES)
def test_private_torch_api_still_works(api):
    PROBES[api]()
