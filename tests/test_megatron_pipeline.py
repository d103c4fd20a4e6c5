"""Megatron's other ways of laying layers over the pipeline, read as actmem's uneven pipeline.
Expected counts from Megatron's own rules (transformer_block.py, get_num_layers_to_build:
N = L + e + l layers, N/p a stage, the first building e fewer and the last l fewer;
pipeline_parallel_layer_layout.py: stage i is rank i mod p's virtual stage i div p)."""

import pytest

from actmem.errors import SpecError
from actmem.sources.megatron_pipeline import account_counts, layout_counts
from tests.conftest import assert_one_line_error

BASE = ("--num-layers 30 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --vocab-size 32000 "
        "--micro-batch-size 1 --global-batch-size 64 --bf16 --attention-backend local "
        "--no-create-attention-mask-in-dataloader --pipeline-model-parallel-size 4")


@pytest.mark.parametrize("layers, p, e, l, counts", [
    (30, 4, 1, 1, [7, 8, 8, 7]),            # N = 32: 8 a stage, one fewer at each end
    (62, 8, 1, 1, [7] + [8] * 6 + [7]),     # N = 64
    (31, 4, 1, 0, [7, 8, 8, 8]),            # N = 32: the embedding's stage alone is short
    (31, 4, 0, 1, [8, 8, 8, 7]),
    (32, 4, 0, 0, [8, 8, 8, 8]),
])
def test_account_counts(layers, p, e, l, counts):
    assert account_counts(layers, p, e, l) == counts
    assert sum(counts) == layers


def test_account_counts_refuse_what_megatron_refuses():
    with pytest.raises(SpecError, match="num_layers 31 after the account-for"):
        account_counts(30, 4, 1, 0)          # N = 31: 4 does not divide it


def test_layout_counts():
    """'Et*7|(t*8|)*2,t*7L': 7 + 8 + 8 + 7 over p = 4; over p = 2 the same four stages are two
    virtual stages a rank (rank 0: stages 0 and 2, 7 + 8; rank 1: 8 + 7)."""
    assert layout_counts("Et*7|(t*8|)*2,t*7L", 30, 4) == ([7, 8, 8, 7], 1)
    assert layout_counts("Et*7|(t*8|)*2,t*7L", 30, 2) == ([15, 15], 2)
    # a multi-token-prediction layer on the last stage, as Megatron's DeepSeek-V3 recipe lays it out
    assert layout_counts("Et*7|(t*8|)*2,t*7mL", 30, 4, mtp=1) == ([7, 8, 8, 7], 1)


@pytest.mark.parametrize("layout, message", [
    ("Et*7|(t*8|)*2,t*7mL", "its 1 'm' (multi-token prediction) layers must be --mtp-num-layers (0)"),
    ("Etm*7|(t*8|)*2,t*7L", "its 7 'm' (multi-token prediction) layers must be --mtp-num-layers (0)"),
    ("Et*7|(t*8|)*2,t*7xL", "only E, L, t and m"),
    ("t*7|(t*8|)*2,t*7EL", "one E, first, and one L, last"),
    ("Et*7|(t*8|)*2,t*6L", "it has 29 layers (t), and --num-layers is 30"),
    ("Et*7|t*8|t*15L", "a multiple of the pipeline size 4"),
])
def test_layout_counts_refuse_what_megatron_refuses(layout, message):
    with pytest.raises(SpecError) as error:
        layout_counts(layout, 30, 4)
    assert message in str(error.value)


def _stages(out):
    return [stage["layers"] for stage in out["stages"]]


@pytest.mark.parametrize("extra", ["--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split",
                                   "--pipeline-model-parallel-layout Et*7|(t*8|)*2,t*7L"])
def test_a_paste_becomes_actmem_s_uneven_pipeline(actmem, extra):
    """30 layers on 4 stages, which p alone does not divide: 7 + 8 + 8 + 7, as Megatron's first and
    last stage layers give it."""
    out = actmem.json("estimate", "--megatron-args", f"{BASE} {extra}", "--gpus", "4")
    same = actmem.json("estimate", "--megatron-args", BASE + " --decoder-first-pipeline-num-layers 7 "
                       "--decoder-last-pipeline-num-layers 7", "--gpus", "4")
    assert _stages(out) == [7, 8, 8, 7]
    assert out["verdict_bytes"] == same["verdict_bytes"]
    assert any(" read: " in note and ("7+8+8+7" in note or "the first building 7" in note)
               for note in out["assumptions"])


@pytest.mark.parametrize("extra, message", [
    ("--account-for-embedding-in-pipeline-split --decoder-first-pipeline-num-layers 7",
     "Megatron refuses --account-for-embedding-in-pipeline-split beside --decoder-first-pipeline-num-layers"),
    ("--pipeline-model-parallel-layout Et*7|t*8|t*7|t*8L", "stages between the first and last with different layers"),
    ("--account-for-loss-in-pipeline-split --num-virtual-stages-per-pipeline-rank 2",
     "with interleaving is not modelled"),
    ("--defer-embedding-wgrad-compute", "--defer-embedding-wgrad-compute is not modelled"),
])
def test_what_is_not_modelled_is_refused_in_one_line(actmem, extra, message):
    assert_one_line_error(actmem("estimate", "--megatron-args", f"{BASE} {extra}", "--gpus", "4"), message)


def test_the_microbatch_group_is_read_at_megatron_s_default_only(actmem):
    """Interleaved, 32 layers, p = 4, m = 2: the first stage's warm-up is 2(p-1) + (m-1)·g
    chunk forwards (schedules.py), 6 + 4 = 10 at g = p = 4, 6 + 8 = 14 at g = 8."""
    interleaved = BASE.replace("--num-layers 30", "--num-layers 32") + " --num-virtual-stages-per-pipeline-rank 2"
    default = actmem.json("estimate", "--megatron-args", interleaved, "--gpus", "4")
    given = actmem.json("estimate", "--megatron-args",
                        f"{interleaved} --microbatch-group-size-per-virtual-pipeline-stage 4", "--gpus", "4")
    assert given["verdict_bytes"] == default["verdict_bytes"]
    assert_one_line_error(actmem("estimate", "--megatron-args",
                                 f"{interleaved} --microbatch-group-size-per-virtual-pipeline-stage 8", "--gpus", "4"),
                          "= 14 warm-up chunk forwards", "= 10 (schedules.py)")


def test_a_layout_of_equal_virtual_stages_is_megatron_s_interleaving(actmem):
    """'Et*4|(t*4|)*6,t*4L' over p = 4 is 8 stages of 4 layers: 2 virtual stages a rank, as
    --num-virtual-stages-per-pipeline-rank 2 lays 32 layers (rank i: stages i and i + 4)."""
    interleaved = BASE.replace("--num-layers 30", "--num-layers 32")
    layout = actmem.json("estimate", "--megatron-args",
                         f"{interleaved} --pipeline-model-parallel-layout Et*4|(t*4|)*6,t*4L", "--gpus", "4")
    chunks = actmem.json("estimate", "--megatron-args", f"{interleaved} --num-virtual-stages-per-pipeline-rank 2",
                         "--gpus", "4")
    assert layout["run"]["interleave"] == 2 and layout["verdict_bytes"] == chunks["verdict_bytes"]
    assert_one_line_error(actmem("estimate", "--megatron-args", f"{interleaved} --pipeline-model-parallel-layout "
                                 "Et*3|t*5|(t*4|)*5,t*4L", "--gpus", "4"), "of different layers is not modelled")
    assert_one_line_error(actmem("estimate", "--megatron-args", f"{interleaved} --pipeline-model-parallel-layout "
                                 "Et*4|(t*4|)*6,t*4L --num-virtual-stages-per-pipeline-rank 2", "--gpus", "4"),
                          "Megatron refuses --pipeline-model-parallel-layout beside")
