"""The gate fails in every direction: each failure is injected into the real layer code and
must turn it red; the healthy run must stay green."""

import pytest

torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from actmem.cli.main import cli  # noqa: E402
from actmem_validate import gpt, layers  # noqa: E402
from actmem_validate.compare import judge, worst_error  # noqa: E402
from actmem_validate.grid import configs_for, small_spec  # noqa: E402
from actmem_validate.launch import run_fake  # noqa: E402
from actmem_validate.ledger import label  # noqa: E402


def measured(technique="tp-sp-sel", dropout=0.1, layers_=2):
    """Rank 0 of t = 2 at small shapes, fake tensors: quick, and in this process, so the
    monkeypatches below reach the layer code."""
    rows = run_fake(configs_for(small_spec(layers_, 2, dropout=dropout), [technique], 1))
    return rows, judge(rows, 0.0)


def row(rows, term):
    return next(r for r in rows if r["term"] == term)


def test_a_healthy_run_passes():
    rows, failures = measured()
    assert failures == []
    assert {r["gate"] for r in rows if r["kind"] in ("paper", "total")} == {"pass"}


def test_recompute_disabled_at_run_time_fails(monkeypatch):
    """Selective recompute silently broken: the attention core is saved after all. The formula
    has 0 bytes for softmax_output; the gate must not skip it."""
    monkeypatch.setattr(gpt, "checkpoint", lambda fn, *args, use_reentrant: fn(*args))
    rows, failures = measured("tp-sp-sel")
    softmax = row(rows, "softmax_output")
    assert softmax["formula_bytes"] == 0 and softmax["measured_bytes"] > 0
    assert softmax["gate"] == "fail"
    assert any("softmax_output measured" in line and "where the formula has none" in line for line in failures)
    assert worst_error(rows) == float("inf")


def test_a_tensor_the_formula_counts_but_nothing_saves_fails(monkeypatch):
    """Dropout that keeps no mask: the formula's masks are missing from the measurement."""
    monkeypatch.setattr(layers.Dropout, "forward", lambda self, x: x)
    rows, failures = measured("tp")
    mask = row(rows, "mlp_dropout_mask")
    assert mask["measured_bytes"] == 0 and mask["formula_bytes"] > 0 and mask["gate"] == "fail"
    assert failures


def test_an_extra_unlabelled_tensor_fails(monkeypatch):
    """A saved tensor no layer names lands in 'unattributed': unnamed, so red whatever its size."""
    forward = gpt.MLP.forward
    monkeypatch.setattr(gpt.MLP, "forward", lambda self, x: torch.sin(forward(self, x)))  # sin saves its input
    rows, failures = measured("tp")
    unnamed = [r for r in rows if r["kind"] == "unnamed"]
    assert [r["term"] for r in unnamed] == ["unattributed"] and unnamed[0]["gate"] == "fail"
    assert any("no term or named residual accounts for" in line for line in failures)


def test_an_extra_tensor_under_a_paper_name_fails(monkeypatch):
    """Something saved twice under a term's name: the term reads more than the formula."""
    forward = gpt.MLP.forward
    monkeypatch.setattr(gpt.MLP, "forward",
                        lambda self, x: torch.sin(label(forward(self, x) * 1, "fc1_input")))
    rows, failures = measured("tp")
    fc1 = row(rows, "fc1_input")
    assert fc1["measured_bytes"] > fc1["formula_bytes"] and fc1["gate"] == "fail"
    assert failures


def test_a_tensor_hidden_inside_a_residual_scope_fails(monkeypatch):
    """A fresh activation saved inside the norm's scope would be filed under the norm's
    statistics; the residual's size is checked, so it is red."""
    from actmem_validate.ledger import scope

    norm = gpt.Norm.forward

    def norm_and_more(self, x):
        out = norm(self, x)
        with scope("mlp_norm_statistics"):
            return torch.sin(out * 1)              # sin saves a fresh (s, b, h) tensor
    monkeypatch.setattr(gpt.Norm, "forward", norm_and_more)
    rows, failures = measured("tp")
    stats = row(rows, "mlp_norm_statistics")
    assert stats["measured_bytes"] > stats["formula_bytes"] and stats["gate"] == "fail"
    assert any("(residual) measured" in line for line in failures)


def test_a_second_logits_copy_in_the_loss_fails(monkeypatch):
    """The cross entropy keeping a second fp32 copy of the logits under its targets' scope."""
    from actmem_validate.ledger import scope

    head = gpt.OutputHead.forward

    def head_and_copy(self, x, targets):
        loss = head(self, x, targets)
        with scope("cross_entropy_targets"):
            return loss + torch.sin(torch.zeros(64, 128, requires_grad=True) * 1).sum() * 0
    monkeypatch.setattr(gpt.OutputHead, "forward", head_and_copy)
    rows, failures = measured("tp")
    assert row(rows, "cross_entropy_targets")["gate"] == "fail"


def test_the_embedding_view_held_whole_fails(monkeypatch):
    """Without Megatron's clone after the SP scatter, dropout 0 makes the first layer save a
    view of the whole embedding output: its norm input reads t = 2 times the formula."""
    monkeypatch.setattr(gpt, "clone_scatter_output_in_embedding", lambda x: x)
    rows, failures = measured("tp-sp", dropout=0.0, layers_=1)
    norm = row(rows, "attention_layernorm_input")
    assert norm["measured_bytes"] == 2 * norm["formula_bytes"] and norm["gate"] == "fail"


def test_judge_on_hand_made_rows():
    """The gate's rules without running anything: both directions, unnamed, the total."""
    def r(kind, formula, measured_, term="x"):
        return {"config": "c", "technique": "tp", "rank": 0, "term": term, "kind": kind,
                "formula_bytes": formula, "measured_bytes": measured_,
                "error_percent": 100 * (measured_ - formula) / formula if formula else None}

    assert judge([r("paper", 100, 100), r("residual", 7, 7), r("total", 107, 107)], 0) == []
    assert len(judge([r("paper", 0, 1)], 0)) == 1                 # measured, not in the formula
    assert len(judge([r("paper", 100, 0)], 0)) == 1               # in the formula, not measured
    assert len(judge([r("paper", 100, 0)], 1e6)) == 1             # missing fails at any tolerance
    assert len(judge([r("residual", 7, 8)], 0)) == 1              # a residual larger than its code saves
    assert len(judge([r("residual", 0, 8)], 50)) == 1             # a residual that should not exist
    assert len(judge([r("unnamed", 0, 1)], 50)) == 1              # never allowed, any tolerance
    assert len(judge([r("total", 107, 108)], 0)) == 1             # a byte unaccounted for
    assert judge([r("paper", 100, 101)], 1.0) == []               # within --max-error 1%
    assert len(judge([r("paper", 100, 102)], 1.0)) == 1
    rows = [r("allocated", 100, 300), r("pytorch_choice", 0, 9)]
    assert judge(rows, 0) == [] and {x["gate"] for x in rows} == {"info"}
    assert judge([r("floor", 100, 500)], 0) == []                  # the peak above its floor
    assert len(judge([r("floor", 100, 99)], 50)) == 1              # below it, at any tolerance
    assert worst_error([r("floor", 100, 500)]) == 0.0              # the gap is not an error
    assert judge([r("floor", 100, 104)], 0, max_peak_gap=4.0) == []   # within --max-peak-gap
    too_far = judge([r("floor", 100, 105)], 0, max_peak_gap=4.0)      # above it by more
    assert len(too_far) == 1 and "more than --max-peak-gap" in too_far[0]
    assert judge([r("floor_cp", 100, 500)], 0, max_peak_gap=4.0) == []  # the harness's own CP attention
    assert len(judge([r("floor_cp", 100, 99)], 0, max_peak_gap=4.0)) == 1   # still a floor


def test_a_peak_below_the_floor_fails(monkeypatch):
    """Megatron's fp32 main-gradient buffer left unallocated: the allocator's peak drops under
    actmem's floor (main gradients, activations, the rerun layer), and the gate says so."""
    from actmem_validate import measure

    monkeypatch.setattr(measure, "attach_main_grads", lambda module: None)
    rows, failures = measured("tp-sp-full")
    peak = row(rows, "peak")
    assert peak["measured_bytes"] < peak["formula_bytes"] and peak["gate"] == "fail"
    assert any("is below actmem's floor" in line for line in failures)


def test_the_floor_holds_under_each_recompute_mode():
    for technique in ("tp-sp", "tp-sp-sel", "tp-sp-full"):
        rows, failures = measured(technique)
        assert failures == [], failures
        peak = row(rows, "peak")
        assert peak["gate"] == "pass" and peak["measured_bytes"] >= peak["formula_bytes"]


def test_the_weight_gradient_accumulated_into_main_grad_is_autograd_s():
    """Megatron's gradient accumulation fusion puts the same gradient in fp32 main_grad that
    autograd would return (the harness's linear, with and without a main_grad)."""
    from actmem_validate.parallel import TensorParallel

    torch.manual_seed(0)
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.float64))
    grad = torch.randn(6, 3, dtype=torch.float64)
    layers.linear(x, weight, None, TensorParallel()).backward(grad)
    returned = weight.grad.clone()
    weight.grad = None
    layers.attach_main_grads(torch.nn.ParameterList([weight]))
    layers.linear(x, weight, None, TensorParallel()).backward(grad)
    assert weight.grad is None
    assert torch.allclose(weight.main_grad.double(), returned, atol=1e-5)


def test_validate_command_exits_1_when_the_gate_fails(monkeypatch):
    monkeypatch.setattr(gpt, "checkpoint", lambda fn, *args, use_reentrant: fn(*args))
    result = CliRunner().invoke(cli, ["validate", "--heads", "8", "--hidden", "64", "--layers", "2",
                                      "--vocab", "512", "--seq-len", "32", "--tp", "2", "--micro-batch", "2",
                                      "--techniques", "tp-sp-sel",
                                      "--mode", "fake", "--format", "json"])
    assert result.exit_code == 1, result.output
    assert "gate failed" in result.stderr
    assert "softmax_output measured" in result.stderr


def measured_flash(technique="tp-sp"):
    """The flash layer with rope and 4 query groups (grid.FLASH), rank 0 of t = 2, fake."""
    from actmem_validate.grid import FLASH

    rows = run_fake(configs_for(small_spec(2, 2, name="small-flash", **FLASH), [technique], 1))
    return rows, judge(rows, 0.0)


def test_a_healthy_flash_run_passes_with_the_log_sum_exp_and_statistics_counted():
    rows, failures = measured_flash()
    assert failures == []
    assert row(rows, "softmax_lse")["kind"] == row(rows, "attention_norm_statistics")["kind"] == "paper"
    assert row(rows, "mlp_norm_statistics")["kind"] == "paper"


def test_flash_output_kept_twice_fails(monkeypatch):
    """TE's flash backend at b > 1 copies its output into the projection's layout, so both are
    kept: the projection input must then read twice the formula."""
    core = gpt.flash_core
    monkeypatch.setattr(gpt, "flash_core", lambda q, k, v, **kw: label(core(q, k, v, **kw).clone(), "projection_input"))
    rows, failures = measured_flash()
    projection = row(rows, "projection_input")
    assert projection["measured_bytes"] == 2 * projection["formula_bytes"] and projection["gate"] == "fail"
    assert failures


def test_keys_expanded_to_every_head_under_flash_fails(monkeypatch):
    """k and v repeated to a heads before the kernel (what the eager core does) keep a/g
    times the bytes flash keeps."""
    core = gpt.flash_core

    def expanded(q, k, v, **kw):
        repeat = q.shape[2] // k.shape[2]
        k, v = (label(x.repeat_interleave(repeat, dim=2), name) for x, name in ((k, "key"), (v, "value")))
        return core(q, k, v, **kw)

    monkeypatch.setattr(gpt, "flash_core", expanded)
    rows, failures = measured_flash()
    for name in ("key", "value"):
        kept = row(rows, name)
        assert kept["measured_bytes"] > kept["formula_bytes"] and kept["gate"] == "fail"
    assert failures


def test_context_parallel_keys_received_and_kept_fail(monkeypatch):
    """Ring attention must not keep the keys it received from the other c - 1 ranks: a layer
    that does keeps c times the keys, and key reads more than the formula."""
    from actmem_validate.grid import FLASH

    attention = gpt.context_parallel_attention

    def keeps_received(q, k, v, cp):
        received = label(torch.cat([k] * cp.size), "key")       # stands in for the ring's keys
        return attention(q, k, v, cp) + 0 * torch.sin(received).sum()  # sin saves them

    monkeypatch.setattr(gpt, "context_parallel_attention", keeps_received)
    rows = run_fake(configs_for(small_spec(2, 2, name="small-flash", c=2, **FLASH), ["tp-sp"], 1))
    failures = judge(rows, 0.0)
    keys = row(rows, "key")
    assert keys["measured_bytes"] > keys["formula_bytes"] and keys["gate"] == "fail" and failures


def test_a_peak_held_too_long_fails_the_gap_gate(monkeypatch):
    """The failure MemTracker had, counting tensors after they were freed, turned into a real
    one: every backward keeps its graph, so no saved tensor is freed and the peak climbs far
    above actmem's floor. This small run's healthy peak is 11.6% over its floor (its backward
    transients at h = 64); at --max-peak-gap 30 it is green, and red once the graphs are kept."""
    from torch.autograd import Variable

    from actmem_validate import schedule

    def rows_at_gap():
        rows = run_fake(configs_for(small_spec(2, 2, p=2), ["tp-sp"], 4))
        return rows, judge(rows, 0.0, max_peak_gap=30.0)

    rows, failures = rows_at_gap()
    assert failures == [], failures
    monkeypatch.setattr(schedule, "pipeline_backward", lambda out, grad: Variable._execution_engine.run_backward(
        tensors=(out,), grad_tensors=(grad,), keep_graph=True, create_graph=False, inputs=tuple(),
        allow_unreachable=True, accumulate_grad=True))
    rows, failures = rows_at_gap()
    peak = row(rows, "peak")
    assert peak["gate"] == "fail" and any("more than --max-peak-gap" in line for line in failures), peak


def test_the_fp32_accumulating_gemm_is_decided_once_and_real_errors_surface(monkeypatch):
    """Where addmm.dtype_out is missing (a CPU), the first weight gradient finds out and every
    later one adds a 16-bit product instead; where it once ran, a later error is raised, not
    hidden behind the fallback."""
    weight = torch.nn.Parameter(torch.zeros(3, 4))
    weight.main_grad = torch.zeros(3, 4)
    grad, inp = torch.ones(5, 3), torch.ones(5, 4)
    monkeypatch.setattr(layers, "_FP32_ACCUMULATING_GEMM", {})
    calls = []

    def missing(*args, **kwargs):
        calls.append(1)
        raise NotImplementedError("addmm.dtype_out: no CPU kernel")

    monkeypatch.setattr(torch, "addmm", missing)
    layers.accumulate_weight_gradient(weight, grad, inp)
    layers.accumulate_weight_gradient(weight, grad, inp)
    assert calls == [1] and weight.main_grad.eq(10).all()          # tried once; 5 + 5 added
    layers._FP32_ACCUMULATING_GEMM[(torch.Tensor, "cpu", torch.float32)] = True   # as if it had run
    with pytest.raises(NotImplementedError):
        layers.accumulate_weight_gradient(weight, grad, inp)


def measured_with_modules(modules, **architecture):
    """Rank 0 of t = 2, SP and selective recompute of ``modules`` (--recompute-modules), fake."""
    rows = run_fake(configs_for(small_spec(2, 2, modules=modules, **architecture), ["tp-sp-sel"], 1))
    return rows, judge(rows, 0.0)


def test_mlp_recompute_passes_and_keeps_the_checkpoint_input_only():
    """core_attn and mlp under the eager core (Megatron's local spec, the norm outside the MLP):
    the MLP keeps only its input, the norm's output (fc1_input, 2sbh/t = 2·16·2·64 B a layer);
    nothing of GeLU or fc2 is measured or counted."""
    rows, failures = measured_with_modules(("core_attn", "mlp"))
    assert failures == []
    assert row(rows, "fc1_input")["measured_bytes"] == 2 * 2 * 16 * 2 * 64     # two layers
    assert not {"gelu_input", "fc2_input"} & {r["term"] for r in rows}
    assert {r["config"] for r in rows} == {"small t=2 p=1 m=1 b=2 n=1 tp-sp-sel·core_attn+mlp"}


def test_mlp_recompute_missing_from_the_harness_fails(monkeypatch):
    """The layer forgets to checkpoint its MLP: GeLU's and fc2's inputs are measured where the
    formula has none."""
    monkeypatch.setattr(gpt.LayerSpec, "recomputes", lambda self, module: module == "core_attn")
    rows, failures = measured_with_modules(("core_attn", "mlp"))
    for term in ("gelu_input", "fc2_input"):
        assert row(rows, term)["formula_bytes"] == 0 and row(rows, term)["gate"] == "fail"
    assert any("gelu_input measured" in line for line in failures)


def _clear_engine_caches():
    from actmem.memory import engine

    for value in vars(engine).values():
        getattr(value, "cache_clear", lambda: None)()


def test_mlp_recompute_missing_from_the_formula_fails(monkeypatch):
    """The engine forgets the MLP module: the formula counts rows the checkpoint never keeps."""
    from actmem.memory.techniques import Technique

    drops = Technique.drops
    monkeypatch.setattr(Technique, "drops",
                        lambda self, term, arch: drops(self, term, arch) and term.module_of(arch) != "mlp")
    _clear_engine_caches()                 # its expressions are cached by technique
    try:
        rows, failures = measured_with_modules(("core_attn", "mlp"))
    finally:
        monkeypatch.undo()
        _clear_engine_caches()
    gelu = row(rows, "gelu_input")
    assert gelu["measured_bytes"] == 0 and gelu["formula_bytes"] > 0 and gelu["gate"] == "fail"
    assert failures


def test_mlp_recompute_alone_under_flash_keeps_the_attention_core():
    """mlp without core_attn under flash (grid.FLASH, TE's spec: the norm fused into fc1, inside
    the checkpoint): the core's log-sum-exp is kept and counted, the MLP's rows are neither,
    fc1's input and the norm's statistics included; the norm's input is the checkpoint's."""
    from actmem_validate.grid import FLASH

    rows, failures = measured_with_modules(("mlp",), name="small-flash", **FLASH)
    assert failures == []
    assert row(rows, "softmax_lse")["measured_bytes"] > 0
    assert not {"fc1_input", "swiglu_input", "fc2_input", "mlp_norm_statistics"} & {r["term"] for r in rows}
    assert row(rows, "mlp_layernorm_input")["measured_bytes"] == 2 * 2 * 16 * 2 * 64


def test_unfused_rope_measured_as_the_fused_kernel_fails(monkeypatch):
    """The spec says --no-rope-fusion but the layer rotates with the fused kernel's Function:
    the formula's cos and sin (4 x 2·s·d = 2,048 B a layer) are measured as nothing."""
    from actmem_validate.grid import FLASH

    spec = small_spec(2, 2, name="small-flash-unfused-rope", rope_fusion=False, **FLASH)
    healthy = run_fake(configs_for(spec, ["tp-sp"], 1))
    assert judge(healthy, 0.0) == [] and row(healthy, "rope_cos_sin")["measured_bytes"] == 2 * 2_048
    monkeypatch.setattr(gpt, "rotate_unfused", gpt.rotate)
    rows = run_fake(configs_for(spec, ["tp-sp"], 1))
    assert judge(rows, 0.0)
    cos_sin = row(rows, "rope_cos_sin")
    assert cos_sin["measured_bytes"] == 0 and cos_sin["formula_bytes"] == 2 * 2_048 and cos_sin["gate"] == "fail"


def test_a_partial_rotation_is_measured_at_its_width():
    """--rotary-percent 0.5 under the unfused rope: cos and sin are d/2 = 4 wide, 4 x 2·32·4 =
    1,024 B a layer (half the whole-head 2,048), measured so in both layers; TE's fused rope
    (the Function that keeps its table only) keeps no layer byte for it either way."""
    from actmem_validate.grid import FLASH

    spec = small_spec(2, 2, name="small-flash-unfused-rope-half", rope_fusion=False, rotary_percent=0.5, **FLASH)
    rows = run_fake(configs_for(spec, ["tp-sp"], 1))
    assert judge(rows, 0.0) == []
    assert row(rows, "rope_cos_sin")["measured_bytes"] == row(rows, "rope_cos_sin")["formula_bytes"] == 2 * 1_024
    fused = run_fake(configs_for(small_spec(2, 2, name="small-flash-half", rotary_percent=0.5, **FLASH), ["tp-sp"], 1))
    assert judge(fused, 0.0) == [] and "rope_cos_sin" not in {r["term"] for r in fused}


def test_qk_norms_the_layer_skips_fail(monkeypatch):
    """The spec says --qk-layernorm but the layer runs no q and k norms: the formula's copies
    of q and k (2sb·(a + g)d/t = 2·32·2·(8 + 4)·8/2 = 6,144 B a layer) and their statistics
    (4sb·(a + g)/t = 1,536 B) are measured as nothing."""
    from actmem_validate.grid import FLASH

    spec = small_spec(2, 2, name="small-flash-qk-norm", qk_norm=True, **FLASH)
    healthy = run_fake(configs_for(spec, ["tp-sp"], 1))
    assert judge(healthy, 0.0) == []
    assert row(healthy, "qk_norm_input")["measured_bytes"] == 2 * 6_144
    assert row(healthy, "qk_norm_statistics")["measured_bytes"] == 2 * 1_536
    monkeypatch.setattr(gpt, "_normalise_head", lambda x, norm: x)
    rows = run_fake(configs_for(spec, ["tp-sp"], 1))
    assert judge(rows, 0.0)
    for term, each in (("qk_norm_input", 6_144), ("qk_norm_statistics", 1_536)):
        missing = row(rows, term)
        assert missing["measured_bytes"] == 0 and missing["formula_bytes"] == 2 * each and missing["gate"] == "fail"


def test_qk_norms_the_formula_leaves_out_fail(monkeypatch):
    """The layer normalises q and k but the spec has no --qk-layernorm: what the norms keep is
    measured where the formula has none, and the gate turns red."""
    from dataclasses import replace

    from actmem_validate.grid import FLASH

    of = gpt.LayerSpec.of
    monkeypatch.setattr(gpt.LayerSpec, "of", staticmethod(lambda *args, **kw: replace(of(*args, **kw), qk_norm=True)))
    rows = run_fake(configs_for(small_spec(2, 2, name="small-flash", **FLASH), ["tp-sp"], 1))
    failures = judge(rows, 0.0)
    extra = row(rows, "qk_norm_input")
    assert extra["formula_bytes"] == 0 and extra["measured_bytes"] == 2 * 6_144 and extra["gate"] == "fail"
    assert any("qk_norm_input measured" in line for line in failures)


def test_a_healthy_flash_core_recompute_passes_with_the_qkv_output_counted():
    """Selective recompute of the core under flash (grid.FLASH, t = 2, SP): the checkpoint keeps
    the rotated q and k and the view v, so the QKV output, 2sb·(a + 2g)d/t = 2·32·2·16·8/2 =
    8,192 B a layer; TE's copy of v and the log-sum-exp are made again in the backward."""
    rows, failures = measured_flash("tp-sp-sel")
    assert failures == []
    assert row(rows, "qkv_output")["measured_bytes"] == 2 * 8_192          # 2 layers
    assert not {"value", "softmax_lse"} & {r["term"] for r in rows}      # neither counted nor measured


def test_a_flash_core_checkpoint_given_a_copy_of_v_fails(monkeypatch):
    """Megatron hands its checkpoint the view v; a harness that hands it a contiguous copy keeps
    2sb·gd/t of v and none of the QKV output: both rows fail."""
    checkpoint = gpt.checkpoint

    def given_a_copy(function, q, k, v, *rest, **kw):
        return checkpoint(function, q, k, label(v.clone(memory_format=torch.contiguous_format), "value"), *rest, **kw)

    monkeypatch.setattr(gpt, "checkpoint", given_a_copy)
    rows, failures = measured_flash("tp-sp-sel")
    qkv, value = row(rows, "qkv_output"), row(rows, "value")
    assert qkv["measured_bytes"] == 0 < qkv["formula_bytes"] and qkv["gate"] == "fail"
    assert value["measured_bytes"] > value["formula_bytes"] == 0 and value["gate"] == "fail"
    assert failures


def test_the_qkv_output_missing_from_the_formula_fails(monkeypatch):
    """The engine forgets that core_attn's checkpoint keeps the QKV output (Term.kept_by): the
    harness measures it where the formula has none."""
    from actmem.memory.techniques import Technique

    drops = Technique.drops
    monkeypatch.setattr(Technique, "drops", lambda self, term, arch: drops(self, term, arch) or term.name == "qkv_output")
    _clear_engine_caches()
    try:
        rows, failures = measured_flash("tp-sp-sel")
    finally:
        monkeypatch.undo()
        _clear_engine_caches()
    qkv = row(rows, "qkv_output")
    assert qkv["measured_bytes"] > qkv["formula_bytes"] == 0 and qkv["gate"] == "fail"
    assert failures


def measured_with_mask(technique="tp-sp-full"):
    """The flash layer (grid.FLASH) with Megatron's dataloader mask, 1F1B over p = 2 (two
    masks in flight), rank 0 of t = 2, fake."""
    from actmem_validate.grid import FLASH

    rows = run_fake(configs_for(small_spec(4, 2, 2, name="small-flash", attention_mask=True, **FLASH), [technique]))
    return rows, judge(rows, 0.0)


def test_a_healthy_run_with_the_dataloader_mask_passes():
    """Two microbatches in flight, each mask b·s² = 2·32² = 2,048 B: 4,096."""
    rows, failures = measured_with_mask()
    assert failures == [] and row(rows, "attention_mask")["measured_bytes"] == 4_096


def test_a_mask_the_checkpoints_never_get_fails(monkeypatch):
    """A harness whose layers are not handed the mask keeps none: the formula's mask fails."""
    from actmem_validate import schedule

    monkeypatch.setattr(schedule, "run_layers", lambda layers, x, mask=None, offload=None: gpt.run_layers(layers, x))
    rows, failures = measured_with_mask()
    mask = row(rows, "attention_mask")
    assert mask["measured_bytes"] == 0 < mask["formula_bytes"] and mask["gate"] == "fail" and failures


def test_the_mask_missing_from_the_formula_fails(monkeypatch):
    """The engine forgets the mask the checkpoints save: measured where the formula has none."""
    from actmem.memory import engine

    term_bytes = engine.term_bytes
    monkeypatch.setattr(engine, "term_bytes", lambda term, technique, arch=None: 0 if term.name == "attention_mask"
                        else term_bytes(term, technique, arch))
    _clear_engine_caches()
    try:
        rows, failures = measured_with_mask()
    finally:
        monkeypatch.undo()
        _clear_engine_caches()
    mask = row(rows, "attention_mask")
    assert mask["measured_bytes"] > mask["formula_bytes"] == 0 and mask["gate"] == "fail" and failures


@pytest.mark.parametrize("technique", ["tp", "tp-sp", "tp-sp-sel"])
def test_unfused_weight_gradients_are_measured_above_the_floor(technique):
    """--no-gradient-accumulation-fusion: no dummy weight gradients, and fc1's 16-bit weight
    gradient (2·4h·h/t = 2·256·64/2 = 16,384 B) live at fc1's backward beside its gathered
    input and both input gradients, as TE orders them. Every counted term 0 B off; the peak
    at or above the floor, which drops by the dummies and gains that gradient."""
    fused = run_fake(configs_for(small_spec(2, 2), [technique], 1))
    unfused = run_fake(configs_for(small_spec(2, 2, gradient_accumulation_fusion=False), [technique], 1))
    assert judge(unfused, 0.0, 30.0) == []
    floor = lambda rows: row(rows, "peak")["formula_bytes"]
    assert floor(unfused) <= row(unfused, "peak")["measured_bytes"]
    assert floor(unfused) != floor(fused)
