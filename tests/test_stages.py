"""Every pipeline stage's load and peak floor (actmem.memory.stages, --stage), derived by hand.

The 530B run: a=128, h=20480, s=2048, b=1, t=8, p=35, m=3 (3 layers a stage, 1 a chunk),
v=51200, SP and selective recompute; sbh/t = 5,242,880.
The tiny run: a=8, h=1024, L=2, s=2048, v=256000, t=1, p=2, b=1, no recompute, the paper's
eager layer with dropout; sbh = 2,097,152.
"""

import csv
import io
import re

from actmem.memory.estimate import estimate
from actmem.model.hardware import GPUS
from actmem.planner.plan import PlanRequest, plan
from actmem.sources.presets import load_preset
from actmem.model.spec import Model, build_spec
from tests.conftest import assert_one_line_error, plan_row_run
from tests.test_plan import row_of

TINY = ["--heads", "8", "--hidden", "1024", "--layers", "2", "--vocab", "256000", "--seq-len", "2048",
        "--tp", "1", "--pp", "2", "--micro-batch", "1", "--recompute", "none"]
TINY_LAYER = 2_097_152 * (34 + 5 * 8 * 2048 // 1024)   # sbh(34 + 5as/h) = 239,075,328 B, Table 2 with t = 1
TINY_LAYER_PARAMETERS = 12 * 1024**2 + 13 * 1024       # 12h² + 13h = 12,596,224
TINY_EMBEDDING = 256_000 * 1024                        # v·h, tied: the last stage keeps a copy
TINY_LOSS_GRADIENT = 2 * 2048 * 256_000                 # the loss's 16-bit logits gradient 2sbv/t
# TE's dummy weight gradients, 16-bit, one a weight shape: QKV [3h, h], projection [h, h],
# fc1 [4h, h], fc2 [h, 4h] = 12h² = 12,582,912 elements; the last stage adds the output
# layer's [v, h] = 262,144,000
TINY_DUMMIES = 2 * 12 * 1024**2, 2 * (12 * 1024**2 + 256_000 * 1024)


def test_530b_last_stage_by_hand(actmem):
    """Stage 34 of 35, interleaved: pm + p - 1 - 2(p - 1) = 105 - 34 = 71 chunk forwards of
    one layer in flight at its first backward (schedules.py's warm-up for the last rank, plus
    one). Activations: 71 x 34sbh/t (178,257,920) = 12,656,312,320, and the output layer's rows
    of one microbatch: final norm input and output-layer input 2sbh/t each (10,485,760) and
    fp32 logits 4sbv/t = 4·2048·51200/8 = 52,428,800: 12,729,712,640 B. Parameters: 3 layers
    of (12h² + 7h)/t + 6h = 629,286,400, the final norm 2h and the tied copy of the embedding
    v·h/t = 131,072,000: 2,018,972,160. Rerun: the core, 5as²b/t = 335,544,320, and its output
    again, 2sbh/t = 10,485,760; freed first, the output layer's rows (73,400,320) and the last
    layer's after its core, 24 sbh/t (125,829,120): 146,800,640 B above the total. At the core's
    backward (tests/test_peak.py) the rerun's dropout output 2as²b/t = 134,217,728 is freed and
    2 x 134,217,728 + 3 x 2sbh/t = 299,892,736 made: 165,675,008 more. TE's dummy weight
    gradients: 12h²/t for the layer's four linears and v·h/t for the output layer, 16-bit:
    2 x (629,145,600 + 131,072,000) = 1,520,435,200."""
    out = actmem.json("estimate", "--model", "530b", "--stage", "last")
    assert out["stage"]["index"] == 34 and out["stage"]["layer_activations"] == 71
    assert out["stage"]["holds_output_layer"] and out["stage"]["embedding_microbatches"] == 0
    assert out["activations_bytes"] == 71 * 178_257_920 + 2 * 10_485_760 + 52_428_800 == 12_729_712_640
    assert out["parameters"]["count"] == 3 * 629_286_400 + 2 * 20480 + 131_072_000 == 2_018_972_160
    total = 12_729_712_640 + 18 * 2_018_972_160 + 1_520_435_200
    assert out["peak_floor"]["total_bytes"] == (total + 335_544_320 + 10_485_760 - 73_400_320 - 125_829_120
                                                + 299_892_736 - 134_217_728)
    assert out["busiest_stage"] == 0 and out["verdict_bytes"] == out["stages"][0]["peak_floor"]["total_bytes"]
    assert [stage["layer_activations"] for stage in out["stages"][:3]] == [139, 137, 135]


def _tiny_loads():
    """Peak floors. First stage: 2 microbatches x 1 layer, the embedding's masks sbh x 2, and
    the layer, the embedding v·h and the learned positions s·h; at its last layer's core
    backward the rows after the core freed (24sbh, and the dropout output 2as²b = 32sbh) and
    the probabilities' and softmax output's gradients (2 x 32sbh), v's and the residual
    stream's (2sbh each) made: 12sbh more. Last: 1 microbatch x 1 layer,
    the final norm's and output layer's inputs 2sbh each and the fp32 logits 4sbv =
    2,097,152,000; the layer, the final norm 2h and the embedding's copy; and at the loss's
    backward, with all of it held, the 16-bit logits gradient 2sbv = 1,048,576,000. 18 B a
    parameter, and TE's dummy weight gradients (TINY_DUMMIES)."""
    first = (2 * TINY_LAYER + 2 * 2_097_152
             + 18 * (TINY_LAYER_PARAMETERS + TINY_EMBEDDING + 2048 * 1024) + 12 * 2_097_152 + TINY_DUMMIES[0])
    last = (TINY_LAYER + 2 * 4_194_304 + 4 * 2048 * 256_000
            + 18 * (TINY_LAYER_PARAMETERS + 2 * 1024 + TINY_EMBEDDING) + TINY_LOSS_GRADIENT + TINY_DUMMIES[1])
    return first, last


def test_the_last_stage_can_be_the_busiest(actmem):
    """A huge vocabulary on a short model: the last stage's logits outweigh the first stage's
    second microbatch, and the verdict is the last stage's."""
    first, last = _tiny_loads()
    assert (first, last) == (5_465_417_728 + 25_165_824 + 25_165_824,
                             7_289_976_832 + 549_453_824 + 1_048_576_000)
    out = actmem.json("estimate", *TINY)
    assert [stage["peak_floor"]["total_bytes"] for stage in out["stages"]] == [first, last]
    assert out["stages"][1]["total_bytes"] == 7_289_976_832 + 549_453_824
    assert out["stages"][1]["peak_floor"]["moment"] == "the loss's backward, every microbatch held"
    assert out["busiest_stage"] == 1 and out["verdict_bytes"] == last
    assert out["peak_floor"]["total_bytes"] == first           # the detail shown: the first stage
    assert out["stages"][0]["total_bytes"] == 5_465_417_728 + 25_165_824
    small = actmem.json("estimate", *TINY, "--gpu-memory", "6GiB", "--reserve", "0GiB")
    assert not small["fits"]                                     # the first stage fits, the last not
    run_row = next(row for row in small["techniques"] if row["is_run"])
    assert run_row["peak_bytes"] == first and run_row["busiest_peak_bytes"] == last
    assert not run_row["fits"]                                   # the row agrees with the verdict
    text = actmem("estimate", *TINY, "--gpu-memory", "6GiB", "--reserve", "0GiB").output
    assert "The last stage holds the most" in text and "on the last stage" in text


def test_the_planner_fits_on_the_busier_of_first_and_last(actmem):
    """The same tiny run swept: its row carries both stages' floors, and fits on the larger."""
    req = PlanRequest(model=Model(heads=8, hidden=1024, layers=2, seq_len=2048, vocab=256000),
                      gpus=2, global_batch=4, gpu=GPUS["a100"], gpu_memory_bytes=8 * 2**30,
                      reserve_bytes=2 * 2**30)          # budget 6 GiB = 6,442,450,944 B
    row = row_of(plan(req).evaluated, 1, 2, 1, 1, False, "none")
    first, last = _tiny_loads()
    # n = 4 microbatches: the first stage still holds min(p, n) = 2
    assert (row.first_peak_bytes, row.last_peak_bytes, row.peak_bytes) == (first, last, last)
    assert first < req.budget_bytes < last and not row.fits     # the first stage alone would fit


def test_a_technique_row_fits_on_its_peak_not_its_total(actmem):
    """530B tp-sp-sel: total 57.97 GiB + 1.17 GiB of dummy weight gradients = 59.14 GiB
    (63,498,880,000 B), peak floor 59.50 GiB (63,884,755,968 B). Between them the run's row and
    the verdict agree at 63.7 GB: neither fits (before, the row said ✓ on its total)."""
    out = actmem.json("estimate", "--model", "530b", "--gpu-memory", "63.7GB")
    row = next(r for r in out["techniques"] if r["is_run"])
    assert row["total_bytes"] < 63_700_000_000 < row["peak_bytes"] == out["verdict_bytes"]
    assert not row["fits"] and not out["fits"]


def test_stage_all_lists_every_stage_and_marks_the_busiest(actmem):
    text = actmem("estimate", *TINY, "--stage", "all").output
    assert "Peak per GPU, every pipeline stage" in text and "1 ◀" in text


def test_a_stage_outside_the_pipeline_is_one_line(actmem):
    assert_one_line_error(actmem("estimate", "--model", "530b", "--stage", "35"), "0 to 34")
    assert_one_line_error(actmem("estimate", "--model", "530b", "--stage", "middle"), "first, last, all")
    assert_one_line_error(actmem("estimate", "--model", "530b", "--stage", "all", "--format", "json"),
                          "lists every stage always")


def test_interleaved_later_ranks_hold_their_warm_up_plus_one_even_when_n_is_p(actmem):
    """Llama 3.1 8B, t = 1, p = 4, m = 2 (4 layers a chunk), n = 4 = p. Megatron-Core's
    get_pp_rank_microbatches: rank i warms up with 2(p - i - 1) + (m - 1)p chunk forwards and
    runs one more, capped at n·m = 8: 11, 9, 7, 5 -> 8, 8, 7, 5 chunks, 32, 32, 28, 20 layers.
    (Older Megatron ran all 8 on every rank when n = p.)"""
    out = actmem.json("estimate", "--model", "llama-3.1-8b", "--tp", "1", "--no-sp", "--pp", "4",
                      "--interleave", "2", "--micro-batch", "1", "--gpus", "4", "--global-batch", "4",
                      "--recompute", "none")
    assert [stage["layer_activations"] for stage in out["stages"]] == [32, 32, 28, 20]


def test_the_planner_s_peak_is_the_estimate_s_verdict_where_the_last_stage_or_n_equal_to_p_decide():
    """Llama 3.1 8B on 8 GPUs, global batch 8: a 128K vocabulary puts some configurations'
    peak on the last stage, and n = p under interleaving occurs; for those rows the sweep's
    peak is the exact estimate's verdict, every stage sized."""
    preset = load_preset("llama-3.1-8b")
    spec = build_spec(preset.model, preset.run, architecture=preset.architecture)
    req = PlanRequest(model=spec.model, gpus=8, global_batch=8, gpu=GPUS["h100"],
                      gpu_memory_bytes=80 * 2**30, architecture=spec.architecture)
    evaluated = plan(req).evaluated
    last = evaluated[evaluated.peak_stage == "last"].head(8)
    all_warm = evaluated[(evaluated.m > 1) & (evaluated.n == evaluated.p)].head(8)
    assert len(last) == 8 and len(all_warm) == 8
    for row in [*last.itertuples(), *all_warm.itertuples()]:
        run = plan_row_run(row, gpus=8, global_batch=8)
        est = estimate(build_spec(preset.model, preset.run | run, architecture=preset.architecture))
        assert row.peak_bytes == est.verdict_bytes, row
        assert (row.peak_stage == "last") == (est.busiest_stage.stage == row.p - 1 > 0), row


def test_every_format_shows_each_stage_s_peak_by_term(actmem):
    """The tiny run's two stages, by term, in CSV and markdown as in JSON: the last stage's
    loss-backward moment carries the 16-bit logits gradient 2sbv = 1,048,576,000 B, and each
    stage's rows add up to its peak floor derived by hand above."""
    first, last = _tiny_loads()
    rows = list(csv.DictReader(io.StringIO(actmem("estimate", *TINY, "--format", "csv").stdout)))
    peaks = [row for row in rows if row["section"] == "stage_peaks"]
    by_stage = {stage: sum(int(row["bytes"]) for row in peaks if row["stage"] == stage) for stage in ("0", "1")}
    assert by_stage == {"0": first, "1": last}
    gradient = next(row for row in peaks if row["term"] == "logits_gradient_16bit")
    assert gradient["stage"] == "1" and int(gradient["bytes"]) == TINY_LOSS_GRADIENT == 1_048_576_000
    assert gradient["moment"] == "the loss's backward, every microbatch held"
    markdown = actmem("estimate", *TINY, "--format", "markdown").stdout
    section = markdown.split("## The peak floor of every stage, by term")[1].split("##")[0]
    assert re.search(r"\| logits_gradient_16bit +\| +1048576000 \|", section)


def test_block_recompute_on_an_uneven_pipeline_counts_each_stage_s_own_chunk():
    """Llama 3.1 405B's 7 + 8 x 14 + 7 with --recompute-method block --recompute-num-layers 2
    (Megatron checkpoints the first N layers of each stage's own chunk). At t = 8 with SP,
    s = 8192, b = 1, in sbh/t = 16,777,216 B: a layer kept whole is 2 x 6 (both norms' and
    the linears' inputs, q) + k and v 2sb·gd/t = 2 x 2,097,152 + the fp32 log-sum-exp
    4·(a/t)·s = 524,288 + SwiGLU's input 4sbf/t = 218,103,808 and fc2's 2sbf/t = 109,051,904
    + two RMSNorm rsigma 4·s/t = 4,096 each: 533,209,088 B; its checkpoint 2sbh/t =
    33,554,432. Stage 0: 16 microbatches x (2 checkpoints + 5 whole); stage 1: 15 x (2 + 6);
    the last: 1 x (2 + 5)."""
    preset = load_preset("llama-3.1-405b")
    run = preset.run | dict(recompute="full", recompute_method="block", recompute_layers=2)
    est = estimate(build_spec(preset.model, run, architecture=preset.architecture))
    whole, checkpoint = 2 * 6 * 16_777_216 + 2 * 2_097_152 + 524_288 + 218_103_808 + 109_051_904 + 2 * 4_096, 33_554_432
    assert whole == 533_209_088
    layers = {stage.stage: stage.row.layers_bytes for stage in est.stages}
    assert layers[0] == 16 * (2 * checkpoint + 5 * whole)
    assert layers[1] == 15 * (2 * checkpoint + 6 * whole)
    assert layers[15] == 1 * (2 * checkpoint + 5 * whole)
    assert est.busiest_stage.stage == 1
