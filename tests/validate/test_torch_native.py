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


def _op_small(sequence_parallel=True):
    from actmem.memory.techniques import op_checkpointing

    rows = run_fake(configs_for(small_spec(2, 2, name="small-torchtitan", **TORCH_NATIVE),
                                [op_checkpointing(sequence_parallel)], 1))
    return rows, judge(rows, 0.0)


def test_per_op_checkpointing_at_paper_scale():
    """torchtitan's per-op checkpointing, two layers of Llama 3.1 8B at t = 8 with SP, fake tensors: by hand a layer
    keeps its input 2sh/t = 8,388,608, wq's output 2sh/t and SDPA's 2sh/t, wv's 2s·gd/t = 2,097,152, the fp32
    log-sum-exp 4as/t = 131,072, w1's output 2sf/t = 29,360,128, w2's partial sums whole, 2sh = 67,108,864, and the
    two reduce-scatters' outputs 2 x 2sh/t = 16,777,216; nothing else of the block (no norm input, no rope output,
    no repeat_kv copy, no silu output)."""
    config = torch_native_presets(("tp-sp-op",))[0]
    rows = run_fake([config])
    assert judge(rows, 0.0) == []
    layer = {name: count // 2 for name, count in _terms(rows).items() if name not in (
        "final_layernorm_input", "final_norm_statistics", "output_layer_input", "logits_fp32", "token_ids",
        "cross_entropy_targets", "cross_entropy_total_weight", "total")}
    assert layer == {"layer_input_checkpoint": 8_388_608, "query_projection_output": 8_388_608,
                     "projection_input": 8_388_608, "value_projection_output": 2_097_152, "softmax_lse": 131_072,
                     "gate_projection_output": 29_360_128, "fc2_partial_output": 67_108_864,
                     "reduce_scatter_outputs": 16_777_216}


def test_per_op_checkpointing_on_real_ranks_matches_one_device():
    """t = 2 on real gloo ranks, with SP and without (RowwiseParallel all-reduces then, caching no collective): the
    blocks give the one-device output and gradients, every term on both ranks to the byte."""
    from actmem.memory.techniques import op_checkpointing

    configs = configs_for(small_spec(2, 2, name="small-torchtitan", **TORCH_NATIVE),
                          [op_checkpointing(True), op_checkpointing(False)], 1)
    rows = run_real(configs)
    assert judge(rows, 0.0) == [] and {r["rank"] for r in rows} == {0, 1}
    assert {r["term"] for r in rows if r["config"].endswith(" op")} >= {"fc2_partial_output", "layer_input_checkpoint"}
    assert not [r for r in rows if r["config"].endswith(" op") and r["term"] == "reduce_scatter_outputs"]


@pytest.mark.parametrize("injection", ["every_mm", "no_reduce_scatter"])
def test_per_op_checkpointing_kept_otherwise_turns_the_gate_red(monkeypatch, injection):
    """Were the checkpoint to keep every matmul's output (torch's list form of the policy: wk's, wo's and w3's too,
    which no term names, so unattributed), or none of the reduce-scatters' (the formula's row then measured at
    0 B), the gate is red."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    listed = torchtitan.op_sac_save_list()
    if injection == "no_reduce_scatter":
        monkeypatch.setattr(torchtitan, "op_sac_save_list",
                            lambda: listed - {torch.ops._c10d_functional.reduce_scatter_tensor.default})
    else:
        def every_mm(caches):
            caching, cached = create_selective_checkpoint_contexts(sorted(listed, key=str))
            caches.append(caching)
            return caching, cached

        monkeypatch.setattr(torchtitan, "op_sac_contexts", every_mm)
    rows, failures = _op_small()
    assert failures
    if injection == "every_mm":
        assert any("unattributed" in line for line in failures)
    else:
        assert next(r for r in rows if r["term"] == "reduce_scatter_outputs")["gate"] == "fail"


def test_the_layer_option_on_real_ranks():
    """torchtitan's layer option, every second block checkpointed, of 3 at t = 2 with SP: block 2 keeps its input
    (2sbh/t = 2·32·2·64/2 = 4096 B on the small spec: s = 32, b = 2, h = 64), blocks 1 and 3 everything, every
    term on both ranks 0 B off."""
    from actmem.memory.techniques import layer_checkpointing

    configs = configs_for(small_spec(3, 2, name="small-torchtitan", **TORCH_NATIVE), [layer_checkpointing(True, 2)], 1)
    rows = run_real(configs)
    assert judge(rows, 0.0) == [] and {r["rank"] for r in rows} == {0, 1}
    assert {r["measured_bytes"] for r in rows if r["term"] == "layer_input_checkpoint"} == {2 * 32 * 2 * 64 // 2}
