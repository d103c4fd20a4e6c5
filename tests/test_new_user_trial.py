"""Each defect the new-user trial found (issue 7), as a test that failed before its fix.

Sections follow the issue: wrong answers, tracebacks and runaway work, silent acceptance,
the planner, output polish. (The harness's gate is tested in tests/validate/test_gate.py.)
"""

import json
import subprocess
import sys

import pytest

from tests.conftest import assert_one_line_error

GPT3 = dict(s=2048, h=12288, a=96, t=8)


# -- 2. wrong answers ---------------------------------------------------------------------

def test_full_recompute_under_sp_has_its_own_row_and_the_run_marker(actmem):
    """530B with SP + full: the row is tp-sp-full, 2sbh/t = 2·2048·20480/8 = 10,485,760 B a
    layer (the old 'full' row showed 2sbh and no row was marked as the run)."""
    out = actmem.json("estimate", "--model", "530b", "--sp", "--recompute", "full")
    rows = {row["technique"]: row for row in out["techniques"]}
    assert rows["tp-sp-full"]["per_layer_bytes"] == 2 * 2048 * 20480 // 8 == 10_485_760
    assert rows["full"]["per_layer_bytes"] == 2 * 2048 * 20480
    assert [name for name, row in rows.items() if row["is_run"]] == ["tp-sp-full"]
    rich = actmem("estimate", "--model", "530b", "--sp", "--recompute", "full").stdout
    assert "tp-sp-full ◀" in rich


def test_the_none_row_counts_parameters_unsplit(actmem):
    """'none' sets t = 1, so its weights are not split either. 530B first stage (p = 35: 3
    layers) at t = 1: 3·(12h² + 13h) + vh + sh = 3·5,033,431,040 + 1,048,576,000 + 41,943,040
    = 16,190,812,160 parameters, 18 B each; the run's own t = 8 count is 2,060,874,240 (the
    README example). TE's 16-bit dummy weight gradients, one a linear weight shape, are
    unsplit too: 12h² elements at t = 1, 12h²/8 at t = 8."""
    h, v, s = 20480, 51200, 2048
    count_t1 = 3 * (12 * h * h + 13 * h) + v * h + s * h
    assert count_t1 == 16_190_812_160
    out = actmem.json("estimate", "--model", "530b")
    rows = {row["technique"]: row for row in out["techniques"]}
    assert rows["none"]["parameters_bytes"] == 18 * count_t1 + 2 * 12 * h * h
    assert rows["tp"]["parameters_bytes"] == 18 * 2_060_874_240 + 2 * 12 * h * h // 8
    assert rows["none"]["total_bytes"] == rows["none"]["first_stage_bytes"] + 18 * count_t1 + 2 * 12 * h * h


def test_no_dropout_drops_every_mask_and_the_dropout_output(actmem):
    """Eq 1's layer is sbh(34 + 5as/h): masks are sbh (attention dropout), sbh (MLP dropout)
    and as²b (softmax dropout); the softmax dropout output is 2as²b. Without dropout:
    sbh(32 + 2as/h). GPT-3, no parallelism, s = 2048, b = 1."""
    s, h, a = 2048, 12288, 96
    out = actmem.json("estimate", "--model", "gpt3", "--attention-dropout", "0", "--hidden-dropout", "0")
    none = {row["technique"]: row for row in out["techniques"]}["none"]
    assert none["per_layer_bytes"] == s * h * 32 + 2 * a * s * s
    assert not [t for t in out["run_terms"] if "dropout" in t["term"]]
    only_attention = actmem.json("estimate", "--model", "gpt3", "--attention-dropout", "0")
    none = {row["technique"]: row for row in only_attention["techniques"]}["none"]
    assert none["per_layer_bytes"] == s * h * 34 + 2 * a * s * s


# -- 3. tracebacks and runaway work --------------------------------------------------------

HUGE = str(10**30)


@pytest.mark.parametrize("flag", ["--gpus", "--global-batch", "--hidden", "--seq-len", "--vocab",
                                  "--max-micro-batch"])
def test_plan_refuses_huge_inputs_in_one_line(actmem, flag):
    assert_one_line_error(actmem("plan", "--model", "530b", flag, HUGE))


def test_plan_refuses_a_2_to_the_63_gpu_count_with_the_limit(actmem):
    assert_one_line_error(actmem("plan", "--model", "530b", "--gpus", "9223372036854775808"),
                          "gpus", "largest the planner sweeps")


def test_plan_refuses_a_billion_layers_at_once(actmem):
    """The model's own bound (rules.LARGEST) comes first; between it and the planner's, the
    planner's limit speaks."""
    assert_one_line_error(actmem("plan", "--model", "530b", "--layers", "1000000000"),
                          "layers (1,000,000,000) must be at most 100,000")
    assert_one_line_error(actmem("plan", "--model", "530b", "--layers", "20000"),
                          "layers (20,000)", "largest the planner sweeps (16,384)")


def test_a_closed_pipe_is_quiet_and_not_exit_1():
    """`actmem estimate | head -1`: 141 (128 + SIGPIPE, what a shell reports), no message;
    exit 1 means 'nothing fits' to the planner's users."""
    proc = subprocess.Popen([sys.executable, "-m", "actmem", "estimate", "--model", "530b"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()                    # the reader goes away after one line
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, stderr
    assert "Traceback" not in stderr and "Exception" not in stderr


# -- 4. silent acceptance ----------------------------------------------------------------

@pytest.mark.parametrize("args, fragments", [
    (["--tp", "4", "--tensor-model-parallel-size", "8"],
     ["--tp 4 and --tensor-model-parallel-size 8 disagree: two values of one setting (tensor parallel)"]),
    (["--tp", "4", "--tp", "2"], ["--tp 4 and --tp 2"]),
    (["--sp", "--no-sp"], ["--sp and --no-sp disagree", "(sequence parallel)"]),
    (["--sequence-parallel", "--no-sp"], ["--sequence-parallel", "--no-sp", "disagree"]),
    (["--use-distributed-optimizer", "--no-distributed-optimizer", "--gpus", "560"],
     ["--use-distributed-optimizer", "--no-distributed-optimizer", "disagree"]),
    (["--gpu-memory", "80"], ["memory size '80' is not a number with a unit"]),
    (["--tp", "1", "--sp"], ["sequence parallelism", "needs t > 1 (t = 1)"]),
    (["--gpus", "560", "--global-batch", "280", "--pp", "70"], ["p (70) must divide layers (105)"]),
    (["--attention-dropout", "1"], ["attention_dropout must be a probability in [0, 1)"]),
    (["--hidden-dropout", "-0.1"], ["hidden_dropout must be a probability in [0, 1)"]),
])
def test_conflicting_or_meaningless_settings_are_refused(actmem, args, fragments):
    assert_one_line_error(actmem("estimate", "--model", "530b", *args), *fragments)


def test_the_same_setting_twice_with_the_same_value_is_fine(actmem):
    out = actmem.json("estimate", "--model", "530b", "--tp", "8", "--tensor-model-parallel-size", "8")
    assert out["run"]["tensor_parallel"] == 8


@pytest.mark.parametrize("args, fragments", [
    (["--top", "-1"], ["-1 is not in the range x>=0"]),
    (["--explain", ""], ["--explain needs a configuration"]),
    (["--explain", "sel full"], ["recompute is given twice"]),
    (["--explain", "t=8 t=4"], ["tensor_parallel is given twice"]),
    (["--explain", "sp nosp"], ["sequence_parallel is given twice"]),
    (["--reserve", "8"], ["memory size '8' is not a number with a unit"]),
    (["--efficiency", "nan"], ["efficiency must be in (0, 1]"]),
])
def test_plan_flags_that_were_silently_accepted(actmem, args, fragments):
    assert_one_line_error(actmem("plan", "--model", "530b", *args), *fragments)


def test_plan_top_0_shows_every_fitting_configuration(actmem):
    everything = actmem.json("plan", "--model", "530b", "--top", "0")
    assert len(everything["best"]) == everything["fitting"] > 10


def test_explain_fills_what_it_leaves_out_from_the_preset(actmem):
    """530B's preset runs m = 3, SP and selective recompute: 't=8 p=35' means that run (139
    layer activations held, as the README example), not m = 1 with no SP or recompute."""
    result = actmem("plan", "--model", "530b", "--explain", "t=8 p=35")
    assert result.exit_code == 0, result.output
    assert "530b · t=8 p=35 m=3 b=1 sp sel" in result.stdout
    assert "139 layer activations held" in result.stdout
    assert "custom" not in result.stdout


@pytest.mark.parametrize("args, fragments", [
    (["--iteration-time", "inf"], ["--iteration-time must be a positive, finite number"]),
    (["--iteration-time", "nan"], ["--iteration-time must be a positive, finite number"]),
    (["--peak-tflops", "inf"], ["--peak-tflops must be positive and finite"]),
    (["--iteration-time", "10", "--global-batch", "8"], []),
])
def test_flops_refuses_non_finite_numbers(actmem, args, fragments):
    result = actmem("flops", "--model", "530b", *args)
    if fragments:
        assert_one_line_error(result, *fragments)
    else:
        assert result.exit_code == 0, result.output


def test_flops_names_the_missing_gpu_count(actmem):
    assert_one_line_error(actmem("flops", "--heads", "8", "--hidden", "64", "--layers", "2", "--vocab",
                                 "100", "--seq-len", "32", "--global-batch", "8", "--iteration-time", "1"),
                          "MFU needs --gpus")


# -- 5. the planner a user can trust ------------------------------------------------------

def test_plan_keeps_a_stated_reserve_by_default(actmem):
    """8 GiB a GPU by default: the budget is the preset's A100 at what its allocator reaches,
    85,056,798,720 B (79.21 GiB), less 8 GiB: 76,466,864,128 B; and it is in the assumptions."""
    out = actmem.json("plan", "--model", "530b")
    assert out["request"]["reserve_bytes"] == 8 * 2**30
    assert out["request"]["budget_bytes"] == 85_056_798_720 - 8 * 2**30 == 76_466_864_128
    assert all(row["total_bytes"] <= 76_466_864_128 for row in out["best"])
    assert "reserve 8.00 GiB a GPU" in actmem("plan", "--model", "530b").stdout


def test_nothing_fits_for_structural_reasons_says_why_and_where_to_go(actmem):
    """530B on 64 GPUs: p must divide 64/t (a power of 2) and split the 105 layers: 1, or
    unevenly (⌈105/p⌉ = k on each stage between, the rest r = 105 - (p-2)k >= 2 on the first
    and last) 4 (r = 51), 8 (r = 21), 16 (r = 7); not 2 (105 is odd), 32 or 64 (r < 0).
    With the batch of 280 = 8·35, d = 64/(t·p) must be 1, 2, 4 or 8. Every stage's parameters
    are too many: at the leanest, t = 8 p = 8, stage 1's 14 layers hold 14 x (12h² + 13h)/8
    = 8.81e9 of them, 18 B each (d = 1: no distributed optimizer), 147.7 GiB.
    The nearest count that fits is 144 = 8 x 18 (d = 1): p = 18 gives 4 + 6 x 16 + 5, and
    stage 1's 6 layers of 629,178,880 parameters at 18 B are 63.28 GiB, under the 72 GiB
    budget with the rest (the row's peak from the sweep); 128 = 8 x 16 (3 + 7 x 14 + 4)
    does not: 7 layers are 73.83 GiB of parameter bytes alone."""
    result = actmem("plan", "--model", "530b", "--gpus", "64")
    assert result.exit_code == 1
    out = " ".join(result.stdout.split())
    assert "leaves t in {1, 2, 4, 8} and p in {1, 4, 8, 16}" in out
    # p | 105, or a split with r = 105 - (p-2)·⌈105/p⌉ >= 2: the largest are 36 (⌈105/36⌉ = 3,
    # r = 3: 1 + 3 x 34 + 2) and 53 (2, r = 3: 1 + 2 x 51 + 2); 54 leaves r = 1, 4 gives r = 51
    assert "the model allows p in {1, 3, 4, 5," in out and ", 35, 36, 53, 105}" in out
    assert "144 GPUs: t=8 p=4+6x16+5" in out
    data = json.loads(actmem("plan", "--model", "530b", "--gpus", "64", "--format", "json").stdout)
    assert data["nothing_fits"]["usable_p"] == [1, 4, 8, 16]
    assert data["nothing_fits"]["nearest_fitting"][0]["gpus"] == 144
    h = 20480
    assert 7 * (12 * h * h + 13 * h) // 8 * 18 > 72 * 2**30 > 6 * (12 * h * h + 13 * h) // 8 * 18
    assert json.loads(actmem("plan", "--model", "530b", "--gpus", "128", "--format", "json").stdout)["fitting"] == 0


# -- 6. output polish ---------------------------------------------------------------------

def test_formulas_write_powers_as_powers(actmem):
    out = actmem("formulas").stdout
    assert "2·a·b·s²" in out and "s··2" not in out and "**" not in out


def test_formulas_latex_is_plain_lines_to_copy(actmem):
    out = actmem("formulas", "--latex").stdout
    assert r"\frac{5 a s}{h t}" in out
    assert not set("│┃─━┏┡└") & set(out)
    assert "% tp-sp-sel:" in out


def test_plan_table_fits_80_columns(actmem):
    """CliRunner renders at 80 columns, like CI and pipes: no cut numbers, no wrapped verdicts."""
    out = actmem("plan", "--model", "530b").stdout
    assert "…" not in out
    assert all(len(line) <= 80 for line in out.splitlines())
    fitting = [line for line in out.splitlines() if line.strip().startswith("t=8 p=35 m=3 b=1 sp sel ")]
    assert fitting and fitting[0].rstrip().endswith("%")


def test_one_unit_a_column_and_singular_words(actmem):
    out = actmem("estimate", "--heads", "8", "--hidden", "64", "--layers", "1", "--vocab", "512",
                 "--seq-len", "32", "--gpus", "1", "--global-batch", "1").stdout
    assert "1 microbatch per iteration" in out and "1 GPU," in out
    assert "1 layer activation held" in out
    estimate = actmem("estimate", "--model", "530b").stdout
    technique_lines = [line for line in estimate.splitlines() if "%" in line and "█" in line]
    assert technique_lines and not [line for line in technique_lines if "MiB" in line]


@pytest.mark.parametrize("args, fragment", [
    (("--moe-router-fusion",), "--moe-router-fusion is a Megatron-LM argument that actmem does not model yet"),
    (("--recompute-modules", "moe_act"), "--recompute-modules moe_act recomputes the experts' activation"),
])
def test_a_megatron_argument_actmem_does_not_model_says_so(actmem, args, fragment):
    result = actmem("estimate", "--model", "530b", *args)
    assert_one_line_error(result, fragment)
    assert "Did you mean" not in result.stderr


def test_actmem_alone_prints_its_help(actmem):
    result = actmem()
    assert result.exit_code == 0
    assert "Usage: actmem" in result.stdout and "estimate" in result.stdout
    assert "actmem: error" not in result.output


def test_csv_and_markdown_carry_the_settings_and_the_verdict(actmem):
    csv_out = actmem("estimate", "--model", "530b", "--format", "csv").stdout
    assert "settings,tensor_parallel,8" in csv_out and "settings,fits,true" in csv_out
    assert "settings,sequence_parallel,true" in csv_out
    markdown = actmem("estimate", "--model", "530b", "--gpu-memory", "40GiB", "--format", "markdown").stdout
    assert markdown.startswith("# actmem · 530b: does not fit")
    assert "| recompute" in markdown and "selective" in markdown


def test_the_distributed_optimizer_on_one_data_parallel_rank_is_allowed_and_shards_nothing(actmem):
    """Megatron-Core allows --use-distributed-optimizer at d = 1 (530B's preset: 280 GPUs =
    t·p): its state is one shard, 18 B a parameter as without it, and the output says so."""
    plain = actmem.json("estimate", "--model", "530b")
    dopt = actmem.json("estimate", "--model", "530b", "--distributed-optimizer")
    assert dopt["parameters"] == plain["parameters"] and dopt["verdict_bytes"] == plain["verdict_bytes"]
    assert any("shards nothing" in note for note in dopt["assumptions"])
