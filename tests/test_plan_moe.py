"""`actmem plan` over a mixture of experts (issues 27 and 28): EP and ETP swept beside t, c, p, m, b,
each row's memory the exact estimate's, the k experts' FLOPs and the token dispatcher in the time.

Mixtral 8x7B (Megatron-LM's examples/mixtral run: 32 H100s, global batch 256) by hand where a
number is asserted: h = 4096, a = 32, g = 8, d = 128, L = 32, E = 8, k = 2, f_e = 14,336, s = 4096.
"""

from fractions import Fraction

import pytest

from actmem.memory.estimate import estimate
from actmem.model.architecture import Architecture
from actmem.model.hardware import GPUS
from actmem.model.spec import Model, build_spec
from actmem.planner.explain import parse_config
from actmem.planner.flops import matmul_weights, model_flops
from actmem.planner.plan import PlanRequest, candidates, config_label, plan
from actmem.sources.presets import load_preset
from tests.conftest import assert_one_line_error

MIXTRAL = load_preset("mixtral-8x7b")


def _request(imbalance=1, **architecture):
    return PlanRequest(model=Model(**MIXTRAL.model), gpus=32, global_batch=256, gpu=GPUS["h100"],
                       gpu_memory_bytes=GPUS["h100"].memory_bytes, max_micro_batch=2,
                       architecture=Architecture(**MIXTRAL.architecture | architecture),
                       routing_imbalance=imbalance)


@pytest.fixture(scope="module")
def mixtral_plan():
    return plan(_request())


def test_the_sweep_spreads_the_experts_as_megatron_lays_them_out():
    """EP divides the 8 experts, ETP is 1 or t, ETP·EP·p divides the 32 GPUs, SP at t > 1, and the MLP's
    recompute is not swept (the mlp module leaves a MoE layer whole: its rows are recompute none's)."""
    frame = candidates(_request())
    assert set(frame.ep) == {1, 2, 4, 8}
    assert ((frame.etp == 1) | (frame.etp == frame.t)).all() and set(frame.etp[frame.t == 4]) == {1, 4}
    assert (32 % (frame.etp * frame.ep * frame.p) == 0).all()
    assert frame.sequence_parallel[frame.t > 1].all()
    assert not frame.recompute.isin(["mlp", "sel+mlp"]).any()
    # ETP below t only beside EP > 1: at EP = 1 Megatron reduces the experts' gradients over d·c alone
    assert not ((frame.etp < frame.t) & (frame.ep == 1)).any()


def test_a_moe_layer_s_routed_experts_run_no_tensor_parallel_collectives(mixtral_plan):
    """t=2 ep=4 p=4 m=1 b=1 sp: d = 4, n = 64, 8 layers a stage. Under SP a dense layer all-gathers and
    reduce-scatters 2sbh twice forward and twice backward (4); a MoE layer without shared experts only its
    attention's 2 (its experts' tokens travel by the dispatcher): 64 x 8 x 2 x 2(1/2) x 2·4096·4096 B at
    360 GB/s."""
    evaluated = mixtral_plan.evaluated
    row = evaluated[evaluated.apply(config_label, axis=1) == "t=2 ep=4 p=4 m=1 b=1 sp none dopt"].iloc[0]
    assert row.tensor_parallel_s == pytest.approx(64 * 8 * 2 * 2 * (1 / 2) * 2 * 4096 * 4096 / 360e9)


def _sampled(evaluated, per_group=3):
    """Rows of every (ep, etp at t or 1, recompute), fitting or not."""
    groups = evaluated.assign(etp_is_t=evaluated.etp == evaluated.t).groupby(["ep", "etp_is_t", "recompute"])
    return [row for _, rows in groups for row in rows.sample(min(len(rows), per_group), random_state=3).itertuples()]


@pytest.mark.parametrize("imbalance, changes", [
    (1, {}), (Fraction(5, 4), {}), (1, {"moe_permute_fusion": True}),
    (Fraction(3, 2), {"moe_capacity_factor": 1.25}), (1, {"moe_capacity_factor": 1.5, "moe_pad_to_capacity": True}),
    (1, {"fp8_format": "e4m3", "fp8_recipe": "tensorwise"}), (Fraction(5, 4), {"fp8_format": "hybrid"}),
    (1, {"fp8_format": "e4m3", "fp8_recipe": "tensorwise", "fp8_param_gather": True}),
])
def test_every_row_is_the_estimate_s_verdict(imbalance, changes):
    """The sweep's peak of a row is the exact estimate's of the same run (its configuration read back
    from its label), balanced and with the busiest rank receiving 5/4 of its share; with TE's fused
    permutation (its maps depend on EP), a capacity that caps a 3/2 imbalance, padding to capacity, and FP8
    experts (their rows padded by up to E/EP·15, and their weight state, both depend on EP), under
    --fp8-param-gather too (the experts' weights one byte, E/EP of them): the stage model is one, evaluated twice."""
    req = _request(imbalance, **changes)
    evaluated = plan(req).evaluated
    for row in _sampled(evaluated):
        run = parse_config(config_label(row), layers=32) | {"gpus": 32, "global_batch": 256,
                                                            "routing_imbalance": imbalance}
        spec = build_spec(MIXTRAL.model, run, architecture=MIXTRAL.architecture | changes, gpu_name="h100",
                          gpu_fp8=GPUS["h100"].fp8)
        assert row.peak_bytes == estimate(spec).verdict_bytes, config_label(row)


def test_an_imbalance_adds_to_the_busiest_rank_s_memory_only_through_its_expert_rows():
    """Same configuration, r = 5/4: the experts' rows T = ⌈r·k·N·ETP⌉ grow by 1/4 (t = 1, N = 4096:
    8192 -> 10,240 rows); those rows keep 2h + 4f_e + 2f_e + 2 = 94,210 B each (input, fc1 output, fc2
    input, probabilities: tests/test_moe.py), so each layer held keeps 2048 x 94,210 B more."""
    label = "t=1 ep=8 p=4 m=1 b=1 nosp none dopt"
    rows = [plan(_request(r)).evaluated for r in (1, Fraction(5, 4))]
    balanced, busy = (frame[frame.apply(config_label, axis=1) == label].iloc[0] for frame in rows)
    assert busy.activations_bytes - balanced.activations_bytes == balanced.layer_activations * 2048 * (
        2 * 4096 + 6 * 14336 + 2)


def test_the_dispatcher_s_time_by_hand(mixtral_plan):
    """t=1 ep=8 p=4 m=1 b=1: d = 8, n = 256/8 = 32 microbatches, 8 layers a stage. The alltoall
    dispatcher sends 7/8 of each rank's k·N = 8192 routed copies away, 7168 rows of 2h = 8192 B, at
    dispatch and at combine, forward and backward: 4 x 32 x 8 x 7168 x 8192 B at NVLink's 360 GB/s
    (ETP·EP = 8 ranks, one node) = 0.16704 s."""
    evaluated = mixtral_plan.evaluated
    row = evaluated[evaluated.apply(config_label, axis=1) == "t=1 ep=8 p=4 m=1 b=1 nosp none dopt"].iloc[0]
    assert row.expert_parallel_s == pytest.approx(4 * 32 * 8 * 7168 * 8192 / 360e9)
    assert row.iteration_s == pytest.approx((row.compute_s + row.expert_parallel_s + row.pipeline_p2p_s)
                                            * row.bubble + row.data_parallel_s)


def test_a_token_multiplies_k_experts_not_all():
    """A MoE layer's weights a token multiplies: attention h·(ad + 2gd) + ad·h = 25,165,824 + 16,777,216,
    the router E·h = 32,768 and k = 2 experts of 3h·f_e = 176,160,768: 394,297,344 (Mixtral's ~12.9B
    active parameters over 32 layers, with the embedding). Model FLOPs 6·B·s·L·W + 12·B·s²·L·ad + 6·B·s·h·v."""
    arch = Architecture(**MIXTRAL.architecture)
    assert matmul_weights(4096, arch, 32) == 394_297_344
    B, s, L, h, v = 256, 4096, 32, 4096, 32000
    assert model_flops(B, s, L, h, v, arch, 32) == pytest.approx(
        6 * B * s * L * 394_297_344 + 12 * B * s * s * L * 4096 + 6 * B * s * h * v)


def test_flops_prices_a_mixture_of_experts(actmem):
    out = actmem.json("flops", "--model", "mixtral-8x7b")
    assert out["model_flops_formula"]["formula"].startswith("6·B·s·L·W_e")
    assert "W_e = h·(a·d + 2·g·d) + a·d·h + E·h + k·3·h·f_e = 394,297,344" in out["model_flops_formula"]["where"]


def test_the_plan_cli_shows_ep_and_names_the_dispatcher(actmem):
    result = actmem("plan", "--model", "mixtral-8x7b", "--max-micro-batch", "2", "--top", "3")
    assert result.exit_code == 0, result.output
    assert " ep " in result.output.splitlines()[6] and "ep=8" in result.output
    assert "the alltoall dispatcher's dispatch and combine" in " ".join(result.output.split())
    explained = actmem("plan", "--model", "mixtral-8x7b", "--explain", "t=1 ep=8 p=4 b=1 nosp none dopt")
    assert explained.exit_code == 0 and "the MoE token dispatcher" in explained.output


@pytest.mark.parametrize("args, fragment", [
    (("--model", "mixtral-8x7b", "--moe-layer-freq", "([1]*2+[0]*30)"), "plan does not sweep this --moe-layer-freq "
                                                                         "pattern yet"),
    (("--model", "22b", "--moe-imbalance", "1.5"), "--moe-imbalance and --moe-load-histogram shape a mixture-of-experts"),
    (("--model", "mixtral-8x7b", "--moe-imbalance", "0.5"), "routing imbalance must be at least 1"),
])
def test_what_the_plan_does_not_sweep_is_refused(actmem, args, fragment):
    assert_one_line_error(actmem("plan", *args), fragment)


def test_an_imbalance_on_a_dense_estimate_is_refused(actmem):
    """It was silently accepted before: a dense model has no expert rows to scale."""
    assert_one_line_error(actmem("estimate", "--model", "22b", "--moe-imbalance", "1.5"),
                          "--moe-imbalance shape a mixture-of-experts layer")


DEEPSEEK = load_preset("tests/data/hf/deepseek-v3/config.json")


def _deepseek_request(**architecture):
    """DeepSeek-V3's config.json (MLA, 256 experts top-8 and a shared expert, its first 3 layers dense, one
    multi-token-prediction layer) at s = 4096 on 256 H100s."""
    arch = Architecture(**DEEPSEEK.architecture | architecture)
    return PlanRequest(model=Model(**DEEPSEEK.model | {"seq_len": 4096}), gpus=256, global_batch=512, gpu=GPUS["h100"],
                       gpu_memory_bytes=GPUS["h100"].memory_bytes, max_micro_batch=2, architecture=arch)


@pytest.mark.parametrize("pattern, mtp", [(None, 1), (2, 0), (None, 2)], ids=["v3", "every-other", "two-mtp"])
def test_deepseek_v3_rows_are_the_estimate_s_verdict(pattern, mtp):
    """Multi-latent attention, experts and dense layers among them (DeepSeek's first 3; and one MoE layer
    every 2): every stage's layers counted by kind, and of the stages between the first and the last the
    heaviest, which with a dense prefix is not stage 1 (in 2+4x14+3, stage 1 holds a dense layer, stage 2
    none); the last stage with its D prediction layers: the sweep's peak equals the exact estimate's on
    sampled rows of every EP, ETP and recompute."""
    change = ({} if pattern is None else {"moe_layer_freq": pattern}) | {"mtp_layers": mtp}
    req = _deepseek_request(**change)
    evaluated = plan(req).evaluated
    architecture = DEEPSEEK.architecture | change
    for row in _sampled(evaluated, per_group=1):
        run = parse_config(config_label(row), layers=61) | {"gpus": 256, "global_batch": 512}
        spec = build_spec(DEEPSEEK.model | {"seq_len": 4096}, run, architecture=architecture, gpu_name="h100")
        assert row.peak_bytes == estimate(spec).verdict_bytes, config_label(row)
    if pattern is None:
        assert {"stage 2", "last"} <= set(evaluated.peak_stage)


def test_deepseek_v3_s_weights_a_token_multiplies():
    """DeepSeek-V3's MoE layer: MLA's q down h·q_r = 7168·1536 and up q_r·a(d_qk + d_r) = 1536·128·192, kv down
    h·(kv_r + d_r) = 7168·576 and up kv_r·a(d_qk + d_v) = 512·128·256, the projection a·d_v·h = 128·128·7168:
    187,105,280; the router E·h = 256·7168, 8 experts and the shared one of 3h·f_e = 3·7168·2048: 398,196,736.
    585,302,016 in all (58 such layers, 3 dense of 3h·18432 = 396,361,728 MLP each: ~37B active with the
    embedding and the output layer, as the report says)."""
    arch = Architecture(**DEEPSEEK.architecture)
    assert matmul_weights(7168, arch, 128) == 585_302_016


@pytest.mark.parametrize("name, mtp", [("mixtral-8x7b", 2), ("llama-3.1-8b", 1)])
def test_prediction_layers_on_the_last_stage_are_the_estimate_s(name, mtp):
    """A model of one kind with D prediction layers: the last stage's rows (its D layers held unless full
    recompute, their norms, projection and the logits D more times) match the estimate's verdict."""
    preset = load_preset(name)
    architecture = preset.architecture | {"mtp_layers": mtp}
    req = PlanRequest(model=Model(**preset.model), gpus=32, global_batch=256, gpu=GPUS["h100"],
                      gpu_memory_bytes=GPUS["h100"].memory_bytes, max_micro_batch=2,
                      architecture=Architecture(**architecture))
    evaluated = plan(req).evaluated
    assert "last" in set(evaluated.peak_stage) and (evaluated.m == 1).all()
    for row in _sampled(evaluated, per_group=2):
        run = parse_config(config_label(row), layers=preset.model["layers"]) | {"gpus": 32, "global_batch": 256}
        spec = build_spec(preset.model, run, architecture=architecture, gpu_name="h100")
        assert row.peak_bytes == estimate(spec).verdict_bytes, config_label(row)


def test_every_n_th_layer_a_moe_layer_sizes_each_mix_of_stage(actmem):
    """Mixtral's dims at L = 38 with one MoE layer every 3 (layers 0, 3, ..., 36): in p = 8 (4 + 5 x 6 + 4) the
    stages between hold 1 or 2 MoE layers and end in either kind, and the rerun of full recompute depends on
    the last one's kind, so the heaviest is not always the earliest of a count: the sweep sizes the earliest
    of each (count, last kind) and every sampled row is the estimate's verdict (a review's counterexample:
    t=1 p=4+5x6+4 b=1 nosp full)."""
    preset = load_preset("mixtral-8x7b")
    model = preset.model | {"layers": 38}
    architecture = preset.architecture | {"moe_layer_freq": 3}
    req = PlanRequest(model=Model(**model), gpus=16, global_batch=8, gpu=GPUS["h100"],
                      gpu_memory_bytes=GPUS["h100"].memory_bytes, max_micro_batch=1,
                      architecture=Architecture(**architecture))
    evaluated = plan(req).evaluated
    rows = evaluated[evaluated.p == 8]
    assert len(rows) and "t=1 p=4+5x6+4 b=1 nosp full" in set(rows.apply(config_label, axis=1))
    for row in rows.itertuples():
        run = parse_config(config_label(row), layers=38) | {"gpus": 16, "global_batch": 8}
        spec = build_spec(model, run, architecture=architecture, gpu_name="h100")
        assert row.peak_bytes == estimate(spec).verdict_bytes, config_label(row)


def test_a_pattern_written_out_as_every_n_th_layer_is_swept(actmem):
    out = actmem("plan", "--model", "mixtral-8x7b", "--moe-layer-freq", "([1,0]*16)", "--top", "1")
    assert out.exit_code == 0, out.output


def test_explain_sizes_a_mixed_model_without_a_stage_between(actmem):
    """DeepSeek-V3 (3 dense layers, then MoE) at p = 1 and p = 2: no stage between the first and the last,
    so none is sized (it crashed on the middle stage before); its verdict is the first stage's (p = 1)."""
    for pipeline in ("p=1", "p=31+30"):
        result = actmem("plan", "--model", "deepseek-v3", "--gpu", "h100", "--gpus", "2048", "--global-batch", "8192",
                        "--explain", f"t=2 ep=64 {pipeline} b=1 sp none dopt")
        assert result.exit_code == 0, result.output
        assert "Time per iteration" in result.stdout
