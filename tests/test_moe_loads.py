"""A per-expert load histogram as the routing imbalance (--moe-load-histogram, issue 27): the busiest EP
rank's share of the tokens its experts received, in the histogram's busiest layer, sizes the expert rows;
the output names that rank. Numbers by hand.

The histogram below, 8 experts, 100 tokens, expert 6 taking 30: Megatron gives rank j the experts
j·E/EP .. (j+1)·E/EP - 1, so at EP = 2 rank 1 (experts 4-7) takes 60 against its share 50 (r = 6/5), at
EP = 4 rank 3 (experts 6-7) 40 against 25 (8/5), at EP = 8 rank 6 30 against 12.5 (12/5); at EP = 1 the
one rank takes everything: 1.
"""

from fractions import Fraction
from pathlib import Path

import pytest

from actmem.model.experts import busiest_rank
from actmem.sources.expert_loads import read_loads
from tests.conftest import assert_one_line_error

LOADS = (10, 10, 10, 10, 10, 10, 30, 10)


@pytest.mark.parametrize("ep, r, rank, experts", [(1, 1, 0, (0, 7)), (2, Fraction(6, 5), 1, (4, 7)),
                                                    (4, Fraction(8, 5), 3, (6, 7)), (8, Fraction(12, 5), 6, (6, 6))])
def test_the_busiest_rank_by_hand(ep, r, rank, experts):
    busiest = busiest_rank((LOADS,), ep)
    assert (busiest.imbalance, busiest.rank, busiest.experts) == (r, rank, experts)


def test_the_busiest_layer_decides():
    """Layer 1, 55 tokens, expert 4 taking 20: at EP = 4 rank 2 (experts 4-5) takes 25 against 13.75,
    20/11 > layer 0's 8/5."""
    busiest = busiest_rank((LOADS, (5, 5, 5, 5, 20, 5, 5, 5)), 4)
    assert (busiest.imbalance, busiest.rank, busiest.layer) == (Fraction(20, 11), 2, 1)


def test_large_counts_stay_exact_and_bad_nesting_is_one_line(actmem, tmp_path):
    (tmp_path / "big.json").write_text(f"[{2**60 + 1}, \"12.0\", 3]")
    assert read_loads(tmp_path / "big.json") == ((2**60 + 1, 12, 3),)
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    assert_one_line_error(actmem("estimate", "--model", "mixtral-8x7b", "--moe-load-histogram",
                                 str(tmp_path / "deep.json")), "not JSON")
    (tmp_path / "huge.json").write_text("[1e400, 1]")
    assert_one_line_error(actmem("estimate", "--model", "mixtral-8x7b", "--moe-load-histogram",
                                 str(tmp_path / "huge.json")), "is not a whole number of tokens")


def test_the_formats_read(tmp_path):
    (tmp_path / "one.json").write_text("[10, 10, 10, 10, 10, 10, 30, 10]")
    (tmp_path / "layers.json").write_text('{"tokens_per_expert": [[1, 2], [3.0, 4]]}')
    (tmp_path / "layers.csv").write_text("# layer 0\n1, 2\n\n3 4  # layer 1\n")
    assert read_loads(tmp_path / "one.json") == (LOADS,)
    assert read_loads(tmp_path / "layers.json") == read_loads(tmp_path / "layers.csv") == ((1, 2), (3, 4))


@pytest.mark.parametrize("text, suffix, fragment", [
    ("[1, -2]", ".json", "-2 is not a whole number of tokens"),
    ("[1, 2.5]", ".json", "2.5 is not a whole number of tokens"),
    ("1, x", ".csv", "'x' is not a whole number of tokens"),
    ("{", ".json", "not JSON"),
    ('{"counts": [1]}', ".json", "give a list of per-expert counts"),
    ("# nothing\n", ".txt", "holds no counts"),
])
def test_a_bad_histogram_is_one_line(actmem, tmp_path, text, suffix, fragment):
    path = tmp_path / f"loads{suffix}"
    path.write_text(text)
    assert_one_line_error(actmem("estimate", "--model", "mixtral-8x7b", "--moe-load-histogram", str(path)), fragment)


def _histogram(tmp_path, rows=(LOADS,)):
    path = tmp_path / "loads.csv"
    path.write_text("\n".join(", ".join(map(str, row)) for row in rows))
    return str(path)


def test_the_estimate_sizes_the_busiest_rank_and_names_it(actmem, tmp_path):
    """Mixtral at EP = 8, t = 1, s = 4096 (k·N = 8192 rows balanced): r = 12/5, T = ⌈12/5·8192⌉ = 19,661 rows,
    the experts' input 2·4096·19,661 = 161,062,912 B; the router's rows are per token: unchanged."""
    out = actmem.json("estimate", "--model", "mixtral-8x7b", "--moe-load-histogram", _histogram(tmp_path))
    terms = {row["term"]: row["bytes_each"] for row in out["run_terms"]}
    assert terms["experts_input"] == 161_062_912 and terms["router_input"] == 2 * 4096 * 4096
    assert out["run"]["routing_imbalance"] == 2.4 and out["run"]["expert_load_layers"] == 1
    note = next(line for line in out["assumptions"] if line.startswith("expert rows: from the load histogram"))
    assert "rank 6 (experts 6-6), receives 12/5 (= 2.4)" in note


@pytest.mark.parametrize("args, fragment", [
    (("--moe-imbalance", "1.2"), "give --moe-imbalance or --moe-load-histogram, not both"),
    (("--num-experts", "16"), "the expert load histogram's layer 0 has 8 counts; the model has 16 experts"),
])
def test_what_does_not_fit_the_histogram_is_refused(actmem, tmp_path, args, fragment):
    assert_one_line_error(actmem("estimate", "--model", "mixtral-8x7b", "--moe-load-histogram", _histogram(tmp_path),
                                 *args), fragment)


def test_a_dense_model_with_a_histogram_is_refused(actmem, tmp_path):
    assert_one_line_error(actmem("estimate", "--model", "22b", "--moe-load-histogram", _histogram(tmp_path)),
                          "--moe-load-histogram shapes a mixture-of-experts layer")
    assert_one_line_error(actmem("plan", "--model", "22b", "--moe-load-histogram", _histogram(tmp_path)),
                          "--moe-imbalance and --moe-load-histogram shape a mixture-of-experts layer")


def test_the_plan_takes_each_ep_s_busiest_rank(actmem, tmp_path):
    """Each swept EP takes its own r from the histogram: a row's peak is the estimate's with the same
    histogram at its EP (1 at EP = 1, 12/5 at EP = 8)."""
    from actmem.memory.estimate import estimate
    from actmem.model.architecture import Architecture
    from actmem.model.hardware import GPUS
    from actmem.model.spec import Model, build_spec
    from actmem.planner.explain import parse_config
    from actmem.planner.plan import PlanRequest, config_label, plan
    from actmem.sources.presets import load_preset

    preset = load_preset("mixtral-8x7b")
    req = PlanRequest(model=Model(**preset.model), gpus=32, global_batch=256, gpu=GPUS["h100"],
                      gpu_memory_bytes=GPUS["h100"].memory_bytes, max_micro_batch=1,
                      architecture=Architecture(**preset.architecture), expert_loads=(LOADS,))
    evaluated = plan(req).evaluated
    for ep, rows in evaluated[evaluated.recompute == "none"].groupby("ep"):
        row = rows.iloc[0]
        run = parse_config(config_label(row), layers=32) | {"gpus": 32, "global_batch": 256, "expert_loads": (LOADS,)}
        spec = build_spec(preset.model, run, architecture=preset.architecture, gpu_name="h100")
        assert row.peak_bytes == estimate(spec).verdict_bytes, config_label(row)
    assert actmem("plan", "--model", "mixtral-8x7b", "--moe-load-histogram", _histogram(tmp_path), "--top",
                  "1").exit_code == 0


MEGATRON_LOGS = "tests/data/megatron_tokens_per_expert"


def test_megatrons_tokens_per_expert_logs_are_read_as_they_are_written(actmem):
    """tests/data/megatron_tokens_per_expert: what Megatron-LM's --save-tokens-per-expert-interval writes
    (its ActivationLogger.save_tpe made them: tools/megatron_tokens_per_expert.py), 4 ranks of EP = 4, each
    logging the rows its 2 experts received in 2 layers x 2 microbatches. Joined in EP order, layer 1's first
    microbatch is (1500, 1300, 1000, 1000, 1000, 900, 800, 692), 8192 rows: at EP = 4 rank 0 takes 2800
    against 2048, r = 175/128; at EP = 2 rank 0 (experts 0-3) 4800 against 4096, 75/64; layer 0's first,
    (1400, 600, 1000, 1048, 1100, 900, 1200, 944), gives no more (2144/2048 at EP = 4)."""
    from actmem.sources.expert_loads import loads_for

    rows = loads_for(read_loads(MEGATRON_LOGS), 8)
    assert rows[2] == (1500, 1300, 1000, 1000, 1000, 900, 800, 692) and len(rows) == 4
    assert busiest_rank(rows, 4).imbalance == Fraction(175, 128)
    assert busiest_rank(rows, 2).imbalance == Fraction(75, 64)
    out = actmem.json("estimate", "--model", "mixtral-8x7b", "--ep", "4", "--gpus", "32",
                      "--moe-load-histogram", MEGATRON_LOGS)
    assert out["run"]["routing_imbalance"] == 175 / 128            # a number in the JSON (exact: 128 is 2^7)


def test_the_expert_tensor_parallel_ranks_are_read_once(tmp_path):
    """At ETP = 2 each pair of neighbouring ranks receives the same gathered rows and logs the same: the files
    doubled (rank 2j and 2j+1 as rank j wrote) join to the same rows."""
    from actmem.sources.expert_loads import loads_for

    for rank in range(8):
        (tmp_path / f"rank{rank}.jsonl").write_text(
            (Path(MEGATRON_LOGS) / f"rank{rank // 2}.jsonl").read_text())
    assert loads_for(read_loads(tmp_path), 8) == loads_for(read_loads(MEGATRON_LOGS), 8)


def test_a_stage_of_dense_layers_writes_no_files_and_alike_ranks_stay_one_group(tmp_path):
    """A pipeline stage whose layers are all dense (DeepSeek-V3's first) logs nothing: ranks 0-3 have no file, ranks
    4-7 (the next stage's EP group of 4) are read. Ranks that log alike (a forced or padded routing) are not taken
    for one ETP group of the whole world: 4 files alike at EP = 4 are one EP group, ETP = 1."""
    from actmem.sources.expert_loads import loads_for

    for rank in range(4, 8):
        (tmp_path / f"rank{rank}.jsonl").write_text((Path(MEGATRON_LOGS) / f"rank{rank - 4}.jsonl").read_text())
    assert loads_for(read_loads(tmp_path), 8) == loads_for(read_loads(MEGATRON_LOGS), 8)
    alike = tmp_path / "alike"
    alike.mkdir()
    for rank in range(4):
        (alike / f"rank{rank}.jsonl").write_text('{"iter": 1, "block": "decoder", "layer": 0, "tpe": [[512, 512]]}\n')
    assert loads_for(read_loads(alike), 8) == ((512,) * 8,)


@pytest.mark.parametrize("files, experts, fragment", [
    ({"rank0.jsonl": '{"iter": 1, "block": "decoder", "layer": 0, "tpe": [[1, 2]]}'}, 8,
     "rank files missing from expert-parallel group 0 (EP·ETP = 4·1): rank1.jsonl, rank2.jsonl, rank3.jsonl"),
    ({"rank1.jsonl": '{"iter": 1, "block": "decoder", "layer": 0, "tpe": [[1, 2]]}'}, 8,
     "rank files missing from expert-parallel group 0 (EP·ETP = 4·1): rank0.jsonl"),
    ({"rank0.jsonl": '{"iter": 1, "layer": 0, "tpe": [[1, 2]]}'}, 8, "not a tokens-per-expert record"),
    ({"rank0.jsonl": '{"iter": 1, "block": "decoder", "layer": 0, "tpe": [[1, 2, 3]]}'}, 8,
     "each rank logs 3 experts' rows; with 8 experts each must log the same E/EP"),
    ({"notes.txt": "x"}, 8, "no rank<R>.jsonl files"),
])
def test_bad_logs_are_one_line(actmem, tmp_path, files, experts, fragment):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert_one_line_error(actmem("estimate", "--model", "mixtral-8x7b", "--moe-load-histogram", str(tmp_path)),
                          fragment)
