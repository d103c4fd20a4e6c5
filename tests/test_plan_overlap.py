"""Megatron's data-parallel overlap in the planner's time model (iteration.exposed_data_parallel_seconds),
derived by hand, and the switches as a user gives them."""

import numpy as np
import pytest

from actmem.planner.iteration import exposed_data_parallel_seconds
from tests.conftest import assert_one_line_error

#: a stage of 400M parameters reduced over d = 8: a bucket is max(40M, 1M·8) = 40M, a tenth of it
PARAMETERS, D = 400e6, 8


def exposed(reduce, gather, m, microbatch, grad, param):
    """A microbatch of ``microbatch`` seconds without recompute: a third forward, two thirds backward."""
    return float(exposed_data_parallel_seconds(reduce, gather, PARAMETERS, D, np.array(m), microbatch / 3,
                                               2 * microbatch / 3, grad, param))


def test_without_overlap_the_iteration_waits_for_all_of_it():
    assert exposed(1.0, 0.5, 1, 10.0, False, False) == 1.5


def test_a_long_backward_hides_all_but_the_last_bucket():
    """A microbatch of 10 s computes 6.67 s backward: the 1 s reduction hides but its last bucket, 0.1 s."""
    assert exposed(1.0, 0.0, 1, 10.0, True, False) == pytest.approx(0.1)


def test_interleaved_the_first_chunk_s_reduction_waits_whole():
    """m = 4: the first chunk reduces after its last backward, a quarter of the 1 s (above the bucket's tenth)."""
    assert exposed(1.0, 0.0, 4, 10.0, True, False) == pytest.approx(0.25)


def test_a_short_backward_leaves_the_rest_waiting():
    """A 0.3 s microbatch: 0.2 s backward hides 0.2 s of the 1 s reduction; 0.8 s waits."""
    assert exposed(1.0, 0.0, 1, 0.3, True, False) == pytest.approx(0.8)


def test_the_first_stage_s_last_bucket_holds_the_embedding():
    """A 128K x 2048 embedding, 268M parameters, closes the last bucket: 0.67 of the 400M stage waits."""
    assert float(exposed_data_parallel_seconds(1.0, 0.0, PARAMETERS, D, np.array(1), 10 / 3, 20 / 3, True, False,
                                               embedding=131072 * 2048)) == pytest.approx(131072 * 2048 / 400e6)


def test_the_gather_hides_behind_the_next_forward():
    """0.5 s of all-gather against a 0.3 s microbatch's 0.1 s forward: 0.4 s waits; without the switch, all
    of it (the reduction, 1 s against 0.2 s of backward, leaves 0.8 s either way)."""
    assert exposed(1.0, 0.5, 1, 0.3, True, True) == pytest.approx(0.8 + 0.4)
    assert exposed(1.0, 0.5, 1, 0.3, True, False) == pytest.approx(0.8 + 0.5)


def test_a_recomputed_forward_lengthens_the_backward_window():
    """Full recompute reruns the forward inside the backward: a 0.4 s microbatch of 0.1 s forward has 0.3 s of
    backward (not 2/3 of 0.4), so 0.3 s of the 1 s reduction hides, 0.7 s waits."""
    assert float(exposed_data_parallel_seconds(1.0, 0.0, PARAMETERS, D, np.array(1), 0.1, 0.3, True, False)) \
        == pytest.approx(0.7)


def _plan_json(actmem, *args):
    return actmem.json("plan", "--model", "gpt3", "--gpus", "512", "--global-batch", "512", "--top", "1", *args)


def test_the_switches_and_a_paste_turn_the_overlap_on(actmem):
    assert _plan_json(actmem)["request"]["overlap_grad_reduce"] is False
    flagged = _plan_json(actmem, "--overlap-grad-reduce", "--overlap-param-gather")["request"]
    assert flagged["overlap_grad_reduce"] and flagged["overlap_param_gather"]
    pasted = _plan_json(actmem, "--megatron-args", "--overlap-grad-reduce --bf16")["request"]
    assert pasted["overlap_grad_reduce"] and not pasted["overlap_param_gather"]


def test_the_gather_without_the_reduction_is_refused(actmem):
    result = actmem("plan", "--model", "gpt3", "--gpus", "512", "--global-batch", "512", "--overlap-param-gather")
    assert_one_line_error(result, "--overlap-param-gather needs --overlap-grad-reduce")
    pasted = actmem("plan", "--model", "gpt3", "--gpus", "512", "--global-batch", "512", "--megatron-args",
                    "--overlap-param-gather --bf16")
    assert_one_line_error(pasted, "--overlap-param-gather needs --overlap-grad-reduce")


def test_the_gather_keeps_one_data_parallel_rank(actmem):
    """On 8 GPUs with t·p = 8 (d = 1) the distributed optimizer shards nothing, and Megatron's gather
    over one rank moves nothing: those configurations stay, with or without the switches."""
    def layouts(*switches):
        rows = actmem.json("plan", "--model", "gpt3", "--layers", "8", "--gpus", "8", "--global-batch", "8",
                           "--top", "0", *switches)["best"]
        return {(row["t"], row["p"]) for row in rows if row["d"] == 1}
    plain = layouts()
    assert plain and plain == layouts("--overlap-grad-reduce", "--overlap-param-gather")


def test_explain_sets_a_configuration_beside_the_first_pick(actmem):
    """--explain ranks the configuration in the plan's sweep and, where it is not the first pick, sets the
    first pick's time beside it part by part: the iteration's difference is the two plans' times apart."""
    plan = actmem.json("plan", "--model", "gpt3", "--top", "0")
    first, other = plan["best"][0], plan["best"][5]
    out = actmem("plan", "--model", "gpt3", "--explain", other["config"], env={"COLUMNS": "200"}).stdout
    words = " ".join(out.split())                                  # the caption wraps with the table
    assert f"ranks 6 of {plan['fitting']:,} that fit" in words
    assert f"first pick (beside it): {first['config']}" in words
    (iteration,) = [line.split() for line in out.splitlines() if line.strip().startswith("iteration ")]
    mine, theirs, difference = map(float, iteration[1:])
    assert (mine, theirs) == (round(other["iteration_s"], 3), round(first["iteration_s"], 3))
    assert difference == round(other["iteration_s"] - first["iteration_s"], 3) > 0
    alone = " ".join(actmem("plan", "--model", "gpt3", "--explain", first["config"]).stdout.split())
    assert "the plan's first pick of" in alone and "first pick (beside it)" not in alone
