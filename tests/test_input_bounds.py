"""Every input of a spec is bounded (rules.LARGEST): far above any published model, so a slip of
the keyboard is one line, exit 2, and never a 60-digit percentage."""

import json
from pathlib import Path

import pytest

from actmem.model import rules
from actmem.errors import SpecError
from actmem.planner.plan import LIMITS
from actmem.model.spec import build_spec
from tests.conftest import assert_one_line_error

LLAMA_8B = Path("tests/data/hf/llama-3.1-8b/config.json")


@pytest.mark.parametrize("flags, fragment", [
    (["--layers", "1000000000"], "layers (1,000,000,000) must be at most 100,000"),
    (["--seq-len", str(2**40)], "seq_len (1,099,511,627,776) must be at most 134,217,728"),
    # under the flash core too (the eager core's is torch's softmax past the fused kernel's 4096)
    (["--seq-len", str(2**40), "--attention-core", "flash"], "seq_len (1,099,511,627,776) must be at most"),
    (["--hidden", str(2**30), "--heads", "64"], "hidden (1,073,741,824) must be at most 1,048,576"),
    (["--vocab", "1000000000"], "vocab (1,000,000,000) must be at most 16,777,216"),
    (["--micro-batch", str(10**11)], "micro_batch (100,000,000,000) must be at most 16,777,216"),
    (["--global-batch", str(2**40)], "global_batch (1,099,511,627,776) must be at most 16,777,216"),
    (["--gpus", str(2**40), "--global-batch", str(2**22)], "gpus (1,099,511,627,776) must be at most 1,048,576"),
    (["--ffn-hidden-size", str(10**9)], "ffn_hidden (1,000,000,000) must be at most 4,194,304"),
    (["--kv-channels", str(10**9)], "head_dim (1,000,000,000) must be at most 1,048,576"),
    (["--make-vocab-size-divisible-by", str(2**40)], "vocab_divisible_by (1,099,511,627,776) must be at most"),
    (["--gpu-memory", "1000000TiB"], "gpu_memory_bytes (1,099,511,627,776,000,000) must be at most "
                                     "1,125,899,906,842,624"),
])
def test_absurd_flags_are_one_line(actmem, flags, fragment):
    assert_one_line_error(actmem("estimate", "--model", "22b", *flags), fragment)


@pytest.mark.parametrize("change, fragment", [
    # an integer in the JSON: read, then bounded by the rules as any spec is
    ({"hidden_size": 10**30}, "hidden (1,000,000,000,000,000,000,000,000,000,000) must be at most 1,048,576"),
    ({"num_hidden_layers": 10**9}, "layers (1,000,000,000) must be at most 100,000"),
    ({"max_position_embeddings": 2**40}, "seq_len (1,099,511,627,776) must be at most 134,217,728"),
    ({"intermediate_size": 10**12}, "ffn_hidden (1,000,000,000,000) must be at most 4,194,304"),
    # a float where an integer is required: refused as it is, never rounded
    ({"hidden_size": 1e30}, "hidden_size must be a positive integer, got 1e+30"),
    ({"hidden_size": 4096.5}, "hidden_size must be a positive integer, got 4096.5"),
    ({"hidden_size": 4096.0}, "hidden_size must be a positive integer, got 4096.0"),
    ({"num_hidden_layers": 1e9}, "num_hidden_layers must be a positive integer, got 1000000000.0"),
])
def test_absurd_hf_configs_are_one_line(actmem, tmp_path, change, fragment):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(json.loads(LLAMA_8B.read_text()) | change))
    assert_one_line_error(actmem("estimate", "--model", str(config)), fragment)


@pytest.mark.parametrize("args", [
    ["--model", "1t"],
    ["--model", "llama-3.1-405b", "--seq-len", "131072"],
    ["--model", "llama-3.1-405b-128k"],
    # DeepNet's 1,000 layers (Wang et al. 2022) at the paper's 22B width
    ["--model", "22b", "--layers", "1000"],
])
def test_large_real_models_still_estimate(actmem, args):
    result = actmem("estimate", *args)
    assert result.exit_code == 0, result.output


def _spec(**model):
    """The 22B's dims under the flash core."""
    return build_spec(dict(heads=64, hidden=6144, layers=48, vocab=51200, seq_len=2048) | model, {},
                      architecture={"attention_core": "flash"})


@pytest.mark.parametrize("name", ["hidden", "layers", "seq_len", "vocab"])
def test_a_bound_is_inclusive(name):
    """The bound itself is taken, one more is refused (with the numbers)."""
    largest = rules.LARGEST[name][1]
    fits = {"hidden": largest, "heads": 64} if name == "hidden" else {name: largest}
    assert getattr(_spec(**fits).model, name) == largest
    with pytest.raises(SpecError, match=f"{name} \\({largest + 64:,}\\) must be at most {largest:,}"):
        _spec(**{name: largest + 64})


def test_the_bounds_leave_the_planners_sweep_as_it_was():
    """The planner sweeps within plan.LIMITS; the rules it shares (rules.valid) must not refuse
    what it sweeps."""
    shared = {"hidden": "hidden", "heads": "heads", "layers": "layers", "seq_len": "seq_len", "vocab": "vocab",
              "gpus": "gpus", "global_batch": "global_batch", "b": "max_micro_batch",
              "vocab_divisible_by": "vocab_divisible_by", "gpu_memory_bytes": "gpu_memory_bytes"}
    for key, limit in shared.items():
        assert rules.LARGEST[key][1] >= LIMITS[limit], key
