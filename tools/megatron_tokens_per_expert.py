"""Regenerate tests/data/megatron_tokens_per_expert/: the files Megatron-LM's --save-tokens-per-expert-interval
writes (tokens_per_expert/rank<R>.jsonl), made by Megatron-LM's own ActivationLogger (megatron/training/
activation_logging.py: its tokens-per-expert hook and save_tpe), fed the m_splits a TEGroupedMLP's fc1 receives.

    python tools/megatron_tokens_per_expert.py /path/to/Megatron-LM

The run it stands for: 8 experts, top-2, EP = 4 (2 experts a rank), ETP = 1, one pipeline stage, 4 ranks,
N = 1024 tokens a rank, so 2·1024·4 = 8192 routed rows a microbatch over the EP group; two MoE layers, two
microbatches, iteration 100. Each rank logs the rows its 2 experts received; the per-expert loads are
written below (tests/test_moe_loads.py derives the busiest rank from them by hand).
"""

import importlib.util
import sys
import types
from pathlib import Path
from unittest import mock

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "megatron_tokens_per_expert"
#: per layer, per microbatch: the rows each of the 8 experts received (each sums to 8192)
LOADS = {0: ([1400, 600, 1000, 1048, 1100, 900, 1200, 944], [1024] * 8),
         1: ([1500, 1300, 1000, 1000, 1000, 900, 800, 692], [1024] * 8)}
EP, LOCAL = 4, 2


def _logger_class(megatron_lm: Path):
    """ActivationLogger from Megatron-LM's source, its heavy imports (TE, checkpointing) stood in: the
    tokens-per-expert hook and save_tpe use none of them."""
    stubs = {"megatron.training": types.ModuleType("megatron.training"),
             "megatron.training.checkpointing": types.SimpleNamespace(save_grads=None)}
    sys.path.insert(0, str(megatron_lm))
    with mock.patch.dict(sys.modules, stubs):
        spec = importlib.util.spec_from_file_location(
            "megatron.training.activation_logging", megatron_lm / "megatron/training/activation_logging.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module.ActivationLogger


def main() -> None:
    import torch

    ActivationLogger = _logger_class(Path(sys.argv[1]))
    OUT.mkdir(parents=True, exist_ok=True)
    for rank in range(EP):
        logger = ActivationLogger(str(OUT.parent / "_save"))
        for layer, microbatches in LOADS.items():
            hook = logger._make_tpe_hook("model0", f"decoder.layers.{layer}.mlp.experts.linear_fc1")
            for loads in microbatches:
                m_splits = loads[rank * LOCAL:(rank + 1) * LOCAL]
                hook(None, (torch.empty(sum(m_splits), 1), m_splits), {}, None)
        with mock.patch.object(torch.distributed, "is_initialized", return_value=True), \
                mock.patch.object(torch.distributed, "get_rank", return_value=rank):
            logger.save_tpe(100)
    written = OUT.parent / "_save" / "tokens_per_expert"
    for path in written.glob("rank*.jsonl"):
        path.replace(OUT / path.name)
    written.rmdir()
    written.parent.rmdir()


if __name__ == "__main__":
    main()
