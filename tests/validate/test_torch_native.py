"""The torch-native backend: torchtitan's Llama blocks, parallelised by PyTorch's own
parallelize_module, keep what actmem's torch-native rows say, to the byte; and the gate turns
red when they keep anything else. Expected numbers are derived by hand next to each test."""

import pytest

torch = pytest.importorskip("torch")

from actmem.sources.presets import load_preset  # noqa: E402
from actmem.model.spec import build_spec  # noqa: E402
from actmem_validate import torchtitan  # noqa: E402
from actmem_validate.compare import judge  # noqa: E402
from actmem_validate.grid import TORCH_NATIVE, configs_for, small_spec, torch_native_presets  # noqa: E402
from actmem_validate.launch import run_fake, run_real  # noqa: E402
from actmem_validate.ledger import label  # noqa: E402


def _terms(rows, config_label=None):
    return {r["term"]: r["measured_bytes"] for r in rows if config_label is None or r["config"] == config_label}


def test_llama_8b_at_paper_scale_keeps_the_gathered_inputs():
    """Two layers of Llama 3.1 8B at t = 8 with SP, with its embedding, output layer and loss,
    fake tensors on rank 0 of the fake group. Per layer, by hand (s = 8192, b = 1, h = 4096,
    f = 14336, g = t = 8): the all-gathered inputs of wq/wk/wv and of w1/w3 are 2sbh =
    67,108,864 B each, not the shard 2sbh/t; k and v stay g/t = 1 group wide, 2 x 2·8192·128 =
    4,194,304 B (repeat_kv's reshape is a view); silu's output is kept, 2sbf/t = 29,360,128 B.
    Beside the layers: the output layer keeps its gathered input too (67,108,864 B), and the
    loss the fp32 log-softmax of rank 0's ceil(v/t) = 16,032 logits a token: 4·8192·16,032."""
    tp_sp, full = torch_native_presets(("tp-sp", "tp-sp-full"))[:2]
    rows = run_fake([tp_sp, full])
    assert judge(rows, 0.0) == []
    measured = _terms(rows, tp_sp.label)
    layer = {name: measured[name] // 2 for name in ("qkv_input", "fc1_input", "repeated_key_value", "silu_output",
                                                    "attention_layernorm_input", "attention_norm_statistics",
                                                    "mlp_norm_statistics")}
    assert layer["qkv_input"] == layer["fc1_input"] == 67_108_864
    assert layer["repeated_key_value"] == 4_194_304
    assert layer["silu_output"] == 29_360_128
    assert layer["attention_layernorm_input"] == 2 * 8192 * 4096 // 8
    assert layer["attention_norm_statistics"] == layer["mlp_norm_statistics"] == 4 * 8192 // 8   # fp32 rstd
    assert measured["output_layer_input"] == 67_108_864
    assert measured["final_layernorm_input"] == 2 * 8192 * 4096 // 8
    assert measured["logits_fp32"] == 4 * 8192 * 16_032
    assert measured["token_ids"] == measured["cross_entropy_targets"] == 8 * 8192   # int64, whole on each rank
    checkpointed = _terms(rows, full.label)
    assert checkpointed["layer_input_checkpoint"] == 2 * 2 * 8192 * 4096 // 8
    assert not {"qkv_input", "silu_output"} & set(checkpointed)


def test_llama_70b_at_t_4_copies_k_and_v_to_its_heads():
    """70B at t = 4: g/t = 2 groups a rank, so repeat_kv copies k and v to a/t = 16 heads:
    2 x 2·8192·16·128 = 67,108,864 B a layer (Megatron keeps 2 x 2·8192·2·128 = 8,388,608)."""
    config = torch_native_presets(("tp-sp",))[1]
    rows = run_fake([config])
    assert judge(rows, 0.0) == []
    assert _terms(rows)["repeated_key_value"] == 2 * 67_108_864


def test_real_ranks_match_one_device_and_the_formula():
    """t = 2 on real gloo ranks (g/t = 2: repeat_kv copies): the parallel blocks give the
    one-device output and gradient, and every rank's terms match to the byte."""
    configs = configs_for(small_spec(2, 2, name="small-torchtitan", **TORCH_NATIVE), ["tp-sp", "tp"], 1)
    rows = run_real(configs)
    assert judge(rows, 0.0) == [] and {r["rank"] for r in rows} == {0, 1}


def _small(technique="tp-sp"):
    rows = run_fake(configs_for(small_spec(2, 2, name="small-torchtitan", **TORCH_NATIVE), [technique], 1))
    return rows, judge(rows, 0.0)


def test_a_tensor_no_term_names_turns_the_gate_red(monkeypatch):
    """silu's output left unnamed: it lands in 'unattributed', which fails whatever its size."""
    def forward(self, x):
        label(x, "fc1_input")
        return self.w2(torch.nn.functional.silu(label(self.w1(x), "swiglu_input")) * label(self.w3(x), "swiglu_input"))

    monkeypatch.setattr(torchtitan.FeedForward, "forward", forward)
    rows, failures = _small()
    assert any("unattributed" in line for line in failures)
    assert next(r for r in rows if r["term"] == "silu_output")["gate"] == "fail"     # formula, not measured


def test_megatron_placement_would_turn_the_gate_red(monkeypatch):
    """Were actmem to count torch-native's linear inputs as Megatron's local shards (2sbh/t),
    the measured all-gathered inputs (2sbh) must fail the gate: t = 2, so twice the formula,
    for the layers' two and the output layer's."""
    from dataclasses import replace

    from actmem.memory import engine
    from actmem.model import implementation

    native = implementation.IMPLEMENTATIONS["torch-native"]
    monkeypatch.setitem(implementation.IMPLEMENTATIONS, "torch-native", replace(native, gathered_under_sp=frozenset()))
    engine.term_bytes.cache_clear()
    try:
        rows, failures = _small()
    finally:
        engine.term_bytes.cache_clear()
    for term in ("qkv_input", "fc1_input", "output_layer_input"):
        row = next(r for r in rows if r["term"] == term)
        assert row["measured_bytes"] == 2 * row["formula_bytes"] and row["gate"] == "fail"
    assert len(failures) == 4                                     # the three inputs and the total


def test_the_cpu_norm_keeps_what_the_gpu_kernel_keeps():
    """torch 2.13's CPU RMSNorm decomposes and keeps two fp32 copies of its input; the GPU's
    aten::_fused_rms_norm keeps the 16-bit input and the fp32 rstd (derivatives.yaml). The
    harness's FusedRMSNorm keeps the latter: 2·(2·16·8) + 4·(2·16) B for a (2, 16, 8) input."""
    norm = torchtitan.FusedRMSNorm(8, "attention_layernorm_input", "attention_norm_statistics").to(torch.bfloat16)
    x = torch.randn(2, 16, 8, dtype=torch.bfloat16, requires_grad=True)
    saved = {}
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.setdefault(t.untyped_storage()._cdata, t) if t is not norm.weight else t, lambda t: t):
        out = norm(x)
    assert sorted((str(t.dtype), t.untyped_storage().nbytes()) for t in saved.values()) == \
        [("torch.bfloat16", 2 * 2 * 16 * 8), ("torch.float32", 4 * 2 * 16)]
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (8,), norm.weight, 1e-5), atol=0.02, rtol=0.02)


def test_pipelines_are_refused_before_anything_is_built():
    """torch.distributed.pipelining keeps each microbatch's stage output until its backward,
    where Megatron frees it: not modelled, so the spec itself is refused."""
    from actmem.errors import SpecError

    preset = load_preset("llama-3.1-8b")
    with pytest.raises(SpecError, match="pipeline parallelism"):
        build_spec(preset.model | {"layers": 2}, {"tensor_parallel": 2, "pipeline_parallel": 2},
                   architecture=preset.architecture | {"implementation": "torch-native"})
