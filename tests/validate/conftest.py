"""The harness's tests start hundreds of rank processes: the fork server they are forked from imports, once, what
their ranks import (megatron-core's layers, transformers' models, DeepSpeed) beside torch and the harness
(actmem_validate.forkserver), whichever test starts the first. Those not installed are left out; their tests skip."""

import pytest

pytest.importorskip("torch")

from actmem_validate import forkserver  # noqa: E402

forkserver.preload(*forkserver.MEGATRON, *forkserver.TRANSFORMERS, *forkserver.DEEPSPEED)
