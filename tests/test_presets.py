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
    assert [p.name for p in all_presets()] == ["qwen3-30b-a3b", "llama-3.1-8b", "mixtral-8x7b", "qwen3-8b",
                                               "qwen3-235b-a22b", "22b", "deepseek-v3", "llama-3.1-70b", "175b",
                                               "llama-3.1-405b", "llama-3.1-405b-128k", "530b", "1t"]


def test_the_moe_presets_count_their_published_parameters(actmem):
    """On one GPU (t = p = EP = 1) the first stage holds every parameter. Qwen3-235B-A22B: a layer's q
    4096·8192 = 33,554,432, k and v 2·4096·512 = 4,194,304, o 8192·4096 = 33,554,432, q and k norms 2·128, two
    norms 2·4096, the router 128·4096 = 524,288, 128 experts of 3·4096·1536 = 2,415,919,104: 2,487,755,008;
    x 94 = 233,848,970,752, with the embedding and the output layer 2·151,936·4096 = 1,244,659,712 and the
    final norm 4096: 235,093,634,560, the report's 235B. DeepSeek-V3 without its prediction layer:
    671,026,404,352, the report's 671B (its released config.json gives the same: tests/test_mla.py)."""
    qwen = actmem.json("estimate", "--model", "qwen3-235b-a22b")
    assert qwen["parameters"]["count"] == 235_093_634_560
    deepseek = actmem.json("estimate", "--model", "deepseek-v3", "--mtp-num-layers", "0")
    assert deepseek["parameters"]["count"] == 671_026_404_352


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
