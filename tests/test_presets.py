"""The presets carry Table 3 of the paper."""

import pytest

from actmem.errors import SpecError
from actmem.sources.presets import all_presets, load_preset

# Table 3: heads, hidden, layers, t, p, GPUs, global batch, microbatch; plus m from section 6
TABLE_3 = {
    "22b": (64, 6144, 48, 8, 1, 8, 4, 4, 1),
    "175b": (96, 12288, 96, 8, 8, 64, 64, 1, 3),
    "530b": (128, 20480, 105, 8, 35, 280, 280, 1, 3),
    "1t": (160, 25600, 128, 8, 64, 512, 512, 1, 1),
}


@pytest.mark.parametrize("name", TABLE_3)
def test_preset_matches_table_3(name):
    preset = load_preset(name)
    model, run = preset.model, preset.run
    assert (model["heads"], model["hidden"], model["layers"], run["tensor_parallel"],
            run["pipeline_parallel"], run["gpus"], run["global_batch"], run["micro_batch"],
            run["interleave"]) == TABLE_3[name]
    assert (model["vocab"], model["seq_len"]) == (51200, 2048)
    assert (run["sequence_parallel"], run["recompute"]) == (True, "selective")


def test_aliases():
    assert load_preset("gpt3").name == "175b"
    assert load_preset("GPT-3").name == "175b"
    assert load_preset("mt-nlg").name == "530b"


def test_all_presets_smallest_first():
    assert [p.name for p in all_presets()] == ["qwen3-30b-a3b", "llama-3.1-8b", "mixtral-8x7b", "qwen3-8b", "22b", "llama-3.1-70b", "175b",
                                               "llama-3.1-405b", "llama-3.1-405b-128k", "530b", "1t"]


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(SpecError, match="unknown preset 'gpt5'.*175b"):
        load_preset("gpt5")


def test_preset_file_by_path(tmp_path, actmem):
    path = tmp_path / "tiny.toml"
    path.write_text('name = "tiny"\n[model]\nheads = 16\nhidden = 256\nlayers = 4\n'
                    'vocab = 1000\nseq_len = 128\n[run]\ntensor_parallel = 2\n')
    out = actmem.json("estimate", "--model", str(path))
    assert out["model"]["name"] == "tiny"
    assert out["model"]["padded_vocab"] == 1024   # 1000 up to a multiple of 128·t = 256
    tp = {r["technique"]: r for r in out["techniques"]}["tp"]
    # sbh(10 + 24/t + 5as/(ht)) with s=128, b=1, h=256, a=16, t=2 (b·a/t = 8: the fused softmax's
    # 8 rows a block at s <= 128)
    assert tp["per_layer_bytes"] == 128 * 256 * (10 + 12) + 5 * 16 * 128 * 128 // 2
