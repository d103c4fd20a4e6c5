"""The command line through click's CliRunner: formats, aliases, and every bad input."""

import csv
import io

import pytest

from actmem.errors import SpecError
from tests.conftest import assert_one_line_error


def test_json_carries_the_table_2_rows_as_integers(actmem):
    out = actmem.json("estimate", "--model", "1t")
    names = [row["technique"] for row in out["techniques"]]
    assert names == ["none", "tp", "tp-sp", "tp-sel", "tp-sp-sel", "full", "tp-sp-full"]
    assert [row["technique"] for row in out["techniques"] if row["is_run"]] == ["tp-sp-sel"]
    for row in out["techniques"]:
        for key in ("per_layer_bytes", "layers_bytes", "extra_bytes", "first_stage_bytes"):
            assert isinstance(row[key], int)
        assert row["first_stage_bytes"] == row["layers_bytes"] + row["extra_bytes"]
    assert sum(term["bytes"] for term in out["run_terms"]) == out["activations_bytes"]
    assert out["total_bytes"] == out["activations_bytes"] + out["parameters"]["total_bytes"]


def test_megatron_argument_names_are_aliases(actmem):
    ours = actmem.json("estimate", "--heads", "32", "--hidden", "4096", "--layers", "32",
                       "--vocab", "50257", "--seq-len", "4096", "--tp", "4", "--pp", "2",
                       "--micro-batch", "2", "--sp", "--recompute", "selective")
    megatron = actmem.json("estimate", "--num-attention-heads", "32", "--hidden-size", "4096",
                           "--num-layers", "32", "--vocab-size", "50257", "--seq-length", "4096",
                           "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2",
                           "--micro-batch-size", "2", "--sequence-parallel",
                           "--recompute-granularity", "selective")
    assert ours == megatron
    assert ours["model"]["padded_vocab"] == 50688   # next multiple of 128·4 above 50257


def test_layers_per_virtual_stage_gives_the_interleave(actmem):
    """530B with p = 5: L/p = 21 layers a stage, 7 a virtual stage, so m = 3; d = 280/40 = 7,
    n = 280/7 = 40 microbatches; held: 105·(1 + 4/15) = 133 layers."""
    out = actmem.json("estimate", "--model", "530b", "--pp", "5",
                      "--num-layers-per-virtual-pipeline-stage", "7")
    assert out["run"]["interleave"] == 3
    assert out["stage"]["layer_activations"] == 133
    both = actmem("estimate", "--model", "530b", "--interleave", "3",
                  "--num-layers-per-virtual-pipeline-stage", "1")
    assert both.exit_code == 2 and "give the interleave once" in both.stderr


def test_recompute_activations_flag_means_selective(actmem):
    out = actmem.json("estimate", "--model", "gpt3", "--recompute-activations")
    assert out["run"]["recompute"] == "selective"


def test_full_recompute_with_sp_keeps_the_split_layer_input(actmem):
    """2sbh/t per layer: 2·2048·12288/8 = 6,291,456 bytes for GPT-3."""
    out = actmem.json("estimate", "--model", "gpt3", "--recompute", "full", "--sp")
    layer_terms = [t for t in out["run_terms"] if t["scope"] == "layer"]
    assert [t["term"] for t in layer_terms] == ["layer_input_checkpoint"]
    assert layer_terms[0]["bytes_each"] == 2 * 2048 * 12288 // 8


def test_flags_override_the_preset(actmem):
    out = actmem.json("estimate", "--model", "530b", "--tp", "4", "--gpu-memory", "40GB")
    assert out["run"]["tensor_parallel"] == 4
    assert out["run"]["data_parallel"] == 2           # 280 GPUs / (4·35)
    assert out["gpu_memory_bytes"] == 40 * 10**9
    assert out["fits"] is False


def test_csv_is_one_table_with_a_section_column(actmem):
    result = actmem("estimate", "--model", "gpt3", "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    sections = {row["section"] for row in rows}
    assert sections == {"settings", "techniques", "run_terms", "memory", "stages", "stage_peaks"}
    sel = next(r for r in rows if r["technique"] == "tp-sp-sel")
    assert sel["per_layer_bytes"] == str(34 * 2048 * 12288 // 8)
    stages = [r for r in rows if r["section"] == "stages"]
    assert [r["stage"] for r in stages] == [str(i) for i in range(8)]     # 175B: p = 8
    memory = {r["item"]: r["bytes"] for r in rows if r["section"] == "memory"}
    assert stages[0]["peak_bytes"] == memory["peak_floor"] == memory["verdict"]


def test_markdown_has_the_three_tables(actmem):
    result = actmem("estimate", "--model", "22b", "--format", "markdown")
    assert result.exit_code == 0
    assert result.stdout.count("## ") == 7        # and the assumptions
    assert "| tp-sp-sel" in result.stdout


def test_formulas_pretty_and_latex(actmem):
    pretty = actmem("formulas")
    assert pretty.exit_code == 0 and "sbh" in pretty.stdout and "softmax_output" in pretty.stdout
    latex = actmem("formulas", "--latex")
    assert latex.exit_code == 0 and r"\frac{5 a s}{h t}" in latex.stdout


def test_presets_command(actmem):
    result = actmem("presets")
    assert result.exit_code == 0
    for name in ("22b", "175b", "530b", "1t", "gpt3", "mt-nlg"):
        assert name in result.stdout


BAD_INPUTS = [
    (["--model", "530b", "--hidden", "0"], ["hidden must be a positive integer, got 0"]),
    (["--model", "530b", "--heads", "-4"], ["heads must be a positive integer, got -4"]),
    (["--model", "530b", "--hidden", "12.5"], ["'12.5' is not a valid integer"]),
    (["--model", "530b", "--tp", "3"], ["t (3) must divide hidden (20480)"]),
    (["--model", "gpt3", "--tp", "64", "--gpus", "512"], ["t (64) must divide heads (96)"]),
    (["--model", "530b", "--heads", "100"], ["heads (100) must divide hidden (20480)"]),
    (["--model", "530b", "--seq-len", "2047"], ["t (8) must divide seq_len (2047)"]),
    (["--model", "530b", "--pp", "4"], ["p (4) must divide layers (105)"]),
    (["--model", "530b", "--interleave", "2"], ["interleave m (2) must divide", "105/35 = 3"]),
    (["--model", "22b", "--interleave", "2"], ["needs pipeline parallelism"]),
    (["--model", "530b", "--gpus", "100"], ["t·p (8·35 = 280) must divide gpus (100)"]),
    (["--model", "530b", "--global-batch", "101", "--gpus", "560"],
     ["micro_batch·data_parallel (1·2 = 2) must divide global_batch (101)"]),
    (["--model", "gpt3", "--global-batch", "4"], ["microbatches per iteration (4)", "multiple of p (8)"]),
    (["--model", "nope"], ["unknown preset 'nope'", "530b"]),
    (["--model", "530b", "--gpu-memory", "80G"], ["memory size '80G'"]),
    (["--model", "530b", "--recompute", "sometimes"], ["'sometimes' is not one of"]),
    (["--model", "530b", "--recompute", "full", "--recompute-granularity", "selective"],
     ["disagree: two values of one setting (recompute)", "--recompute full",
      "--recompute-granularity selective"]),
    (["--model", "530b", "--make-vocab-size-divisible-by", "0"], ["vocab_divisible_by must be"]),
    (["--model", "530b", "--num-layers-per-virtual-pipeline-stage", "2"],
     ["layers per virtual pipeline stage (2) must divide", "105/35"]),
    (["--hidden", "4096"], ["[model] is missing heads, layers, vocab, seq_len"]),
    ([], ["give a preset with --model"]),
    (["--model", "530b", "--no-such-flag"], ["No such option", "--no-such-flag"]),
]


@pytest.mark.parametrize("args, fragments", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(actmem, args, fragments):
    assert_one_line_error(actmem("estimate", *args), *fragments)


@pytest.mark.parametrize("content, fragment", [
    ("heads = [", "not valid TOML"),
    ("[model]\nheads = 4\nhidden = 256\n", "[model] is missing layers, vocab, seq_len"),
    ("[model]\nheads = 4\nhidden = 256\nlayers = 2\nvocab = 10\nseq_len = 8\nlayer = 3\n",
     "[model] has unknown keys: layer"),
    ("[model]\nheads = 4\nhidden = 256.0\nlayers = 2\nvocab = 10\nseq_len = 8\n",
     "hidden must be a positive integer, got 256.0"),
    ("[model]\nheads = 4\nhidden = 256\nlayers = 2\nvocab = 10\nseq_len = 8\n[run]\nrecompute = 'all'\n",
     "recompute must be one of none, selective, full; got 'all'"),
    ("name = 'x'\n", "needs a [model] table"),
    ("[model]\nheads = 4\nhidden = 256\nlayers = 2\nvocab = 10\nseq_len = 8\n"
     "[run]\nsequence_parallel = 'yes'\n", "sequence_parallel must be true or false"),
])
def test_bad_preset_file(tmp_path, actmem, content, fragment):
    path = tmp_path / "bad.toml"
    path.write_text(content)
    assert_one_line_error(actmem("estimate", "--model", str(path)), fragment)


def test_missing_preset_file(actmem):
    assert_one_line_error(actmem("estimate", "--model", "/no/such/model.toml"), "cannot read it")


def test_debug_shows_the_traceback(actmem):
    for result in (actmem("estimate", "--model", "530b", "--tp", "3", env={"ACTMEM_DEBUG": "1"}),
                   actmem("--debug", "estimate", "--model", "530b", "--tp", "3", env={"ACTMEM_DEBUG": ""})):
        assert isinstance(result.exception, SpecError)
        assert "t (3) must divide hidden" in str(result.exception)


def test_help_explains_every_flag(actmem):
    result = actmem("estimate", "--help")
    assert result.exit_code == 0
    for flag in ("--tensor-model-parallel-size", "--sequence-parallel", "--recompute-granularity",
                 "--gpu-memory", "--format", "--seq-length", "--num-layers"):
        assert flag in result.stdout
