"""megatron-core's own multi-token prediction measured against the MTP rows of actmem's table (issue 27):
`actmem validate --grid mtp` runs megatron-core 0.16.1's MultiTokenPredictionBlock (an MLA and SwiGLU
TransformerLayer inside, Transformer Engine's modules as stand-ins) over real gloo ranks."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from actmem_validate.compare import judge, term_rows  # noqa: E402
from actmem_validate.megatron_mtp import formula, measure, mtp_grid  # noqa: E402
from actmem.memory.terms import MTP_TERMS  # noqa: E402
from tests.conftest import assert_one_line_error  # noqa: E402
from tests.validate.cli_grid import validate_grid  # noqa: E402


@pytest.fixture(scope="module")
def grid_rows():
    return validate_grid("mtp")        # CI's run of `actmem validate --grid mtp` (tests/validate/cli_grid.py)


def test_every_row_of_megatrons_mtp_block_is_counted_to_the_byte(grid_rows):
    """Six layouts (one prediction layer; two chained; t = 2 with SP; the same under full recompute, where
    Megatron checkpoints each prediction layer whole; under FP8, tensorwise at t = 2, blockwise on one rank), every
    rank: each row equals its formula both ways, nothing unnamed; and every MTP row is measured, non-zero,
    somewhere."""
    assert judge(grid_rows, 0.0) == []
    assert len({row["config"] for row in grid_rows}) == 6
    measured = {name for row in grid_rows if row["measured_bytes"] > 0 for name in row["term"].split("+")}
    # the embedding's dropout mask: every layout runs at dropout 0 (a CPU's dropout keeps another tensor than a
    # GPU's bool mask), so that row rests on the source
    assert {term.name for term in MTP_TERMS} - {"mtp_embedding_dropout_mask"} <= measured


def test_the_layer_keeps_the_whole_gathered_input_under_sp(grid_rows):
    """At t = 2 with SP, s = 16, b = 2, h = 16: eh_proj's output is gathered whole and scattered as a view of
    it, so the layer's input norm keeps the whole 2·s·b·h = 1024 B storage, not its 2sbh/t = 512: the layer's
    own row and mtp_layer_input_gathered, 512 each, one storage."""
    joint = [row for row in grid_rows if row["config"] == "mtp D=1 mla+dense t=2 sp b=2"
             and row["term"] == "attention_layernorm_input+mtp_layer_input_gathered"]
    assert [row["measured_bytes"] for row in joint] == [1024, 1024]


def test_full_recompute_keeps_the_checkpoints_arguments_only(grid_rows):
    """Under full recompute the block keeps, a rank, the rolled tokens 8bs = 256 and at t = 2 their mask bs = 32,
    the embedding's output and the hidden states, 2sbh/t = 512 each: nothing of the transformer layer; the output
    layers keep the main and the prediction's hidden states, one storage of (1 + D)·2sbh/t = 1024."""
    full = {row["term"]: row["measured_bytes"] for row in grid_rows
            if row["config"].endswith("full") and row["rank"] == 0 and row["measured_bytes"]}
    assert full == {"mtp_token_ids": 256, "mtp_token_mask": 32, "mtp_embedding_output": 512,
                    "mtp_hidden_input": 512, "output_layer_input": 1024, "total": 2336}


def test_the_gate_fails_a_row_left_out_of_the_formula_or_a_tensor_no_row_names():
    """Inject the failures: the formula without the gathered input's rest, with a row the block does not keep,
    and a saved tensor named by no row."""
    config = mtp_grid()[2]
    rank, named = measure(config)[0]
    expected = formula(config.spec, config.technique)
    assert judge(term_rows(config, rank, expected, named), 0.0) == []
    missing = {name: n for name, n in expected.items() if name != "mtp_layer_input_gathered"}
    assert judge(term_rows(config, rank, missing, named), 0.0)
    extra = expected | {"mtp_eh_proj_input": expected["mtp_eh_proj_input"] + 2}
    assert judge(term_rows(config, rank, extra, named), 0.0)
    stray = named | {"unnamed bfloat16 [8, 2, 16]": 512}
    assert any("no term or named residual" in line for line in judge(term_rows(config, rank, expected, stray), 0.0))


def test_validate_refuses_an_mtp_run_it_cannot_measure(actmem):
    assert_one_line_error(actmem("validate", "--grid", "mtp", "--mode", "fake"),
                          "--grid mtp runs megatron-core's multi-token prediction on real CPU")


def test_eh_proj_keeps_its_input_quantized_under_fp8(grid_rows):
    """Under FP8 eh_proj (a TE column-parallel linear, always FP8 in the prediction layer) keeps its [s/t, b, 2h]
    input's one-byte copy: tensorwise at t = 2 (h = 32, s = 16, b = 2) 8·2·64 + 4 = 1028; blockwise on one rank
    16·2·64 = 2048 and fp32 scales a 128 rows, 4·1·64 = 256 (16 bits: 4096)."""
    def kept(config, term):
        return [row["measured_bytes"] for row in grid_rows if row["config"] == config and row["term"] == term]

    assert kept("mtp D=1 mla+dense fp8 tensorwise t=2 sp b=2", "mtp_eh_proj_input") == [1028] * 2
    assert kept("mtp D=1 mla+dense fp8 blockwise t=1 b=2", "mtp_eh_proj_input") == [2048]
    assert kept("mtp D=1 mla+dense fp8 blockwise t=1 b=2", "mtp_eh_proj_input_scales") == [256]
