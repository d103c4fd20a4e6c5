"""The harness's tests start hundreds of rank processes: the fork server they are forked from imports, once, what
their ranks import (megatron-core's layers, transformers' models) beside torch and the harness
(actmem_validate.forkserver). Those not installed are left out; their tests skip."""

import pytest

pytest.importorskip("torch")

from actmem_validate import forkserver  # noqa: E402

forkserver.preload("megatron.core.models.gpt", "megatron.core.transformer.moe.moe_layer",
                   "megatron.core.transformer.moe.token_dispatcher", "megatron.core.transformer.multi_latent_attention",
                   "megatron.core.transformer.multi_token_prediction", "transformers.models.llama.modeling_llama",
                   "transformers.models.qwen3.modeling_qwen3", "transformers.models.gpt2.modeling_gpt2")
