"""--mode rank0 (rank 0 of t with real tensors beside a fake process group), and what a GPU
run adds: the warm-up's one-time buffers and the flash kernel's saved RNG state. The GPU
itself is exercised by test_measurement.test_gpu_run_matches_on_cuda; these run anywhere."""

import pytest

torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from actmem.cli.main import cli  # noqa: E402
from actmem.memory.estimate import estimate  # noqa: E402
from actmem_validate import layers  # noqa: E402
from actmem_validate.compare import compare, expected_host_residual, expected_residuals, judge  # noqa: E402
from actmem_validate.footprint import gpu_bytes, rank0_runs  # noqa: E402
from actmem_validate.grid import FLASH, configs_for, offload_configs, small_spec  # noqa: E402
from actmem_validate.launch import run_rank0, run_real  # noqa: E402
from actmem_validate.ledger import Ledger  # noqa: E402
from actmem_validate.parallel import TensorParallel  # noqa: E402
from actmem_validate.schedule import StageRun  # noqa: E402
from actmem_validate.torch_compat import LiveStorages, fake_tensor_mode  # noqa: E402

SMALL = ["--heads", "8", "--hidden", "64", "--layers", "2", "--vocab", "512", "--seq-len", "32",
         "--micro-batch", "2"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a real t = 2 run needs a CPU or two GPUs")
def test_rank0_measures_what_rank_0_of_a_real_run_saves():
    """The same t = 2 run, twice: real gloo ranks, and rank 0 alone beside the fake process
    group. Every saved-tensor row is the same to the byte; the peak is not above the real
    one (gloo's own temporaries are not made), and both pass the gate."""
    configs = configs_for(small_spec(2, 2), ["tp-sp", "tp-sp-sel"], 1)
    alone = run_rank0(configs)
    real = [row for row in run_real(configs) if row["rank"] == 0]
    key = lambda row: (row["config"], row["term"])
    saved = lambda rows: {key(row): row["measured_bytes"] for row in rows
                          if row["kind"] in ("paper", "residual", "total")}
    assert saved(alone) == saved(real) and len(saved(alone)) > 10
    peaks = lambda rows: {key(row): row["measured_bytes"] for row in rows if row["term"] == "peak"}
    assert all(peaks(alone)[k] <= peaks(real)[k] for k in peaks(real))
    assert judge(alone, 0.0) == []


def test_rank0_leaves_out_what_it_cannot_measure():
    megatron = configs_for(small_spec(2, 2), ["tp-sp"], 1)[0]
    native = configs_for(small_spec(2, 2, **FLASH, implementation="torch-native"), ["tp-sp"], 1)[0]
    cp = configs_for(small_spec(2, 2, c=2, **FLASH),
                     ["tp-sp"], 1)[0]
    kept, left_out = rank0_runs([megatron, native, cp], gpu_free=None)      # on a CPU
    assert kept == [megatron, cp] and "measures the megatron backend" in left_out[0]
    need = gpu_bytes(megatron)
    kept, left_out = rank0_runs([megatron, cp], gpu_free=need)              # a GPU it just fits
    assert kept == [megatron] and "context parallelism" in left_out[0]
    kept, left_out = rank0_runs([megatron], gpu_free=need - 1)              # one byte short
    assert kept == [] and "free on this GPU" in left_out[0]


def test_rank0_measures_fsdp2_and_needs_its_whole_floor():
    """torch-native under FSDP2 is a training step rank 0 can run beside the fake process group (fsdp.py); its GPU
    need is the whole floor, AdamW's state included (the harness makes it), with the margin."""
    from actmem_validate.grid import fsdp_configs

    fsdp = fsdp_configs()[0]
    kept, left_out = rank0_runs([fsdp], gpu_free=None)
    assert kept == [fsdp] and left_out == []
    floor = estimate(fsdp.spec).peak
    assert floor.bytes_of("optimizer_state") > 0
    assert gpu_bytes(fsdp) == int(floor.total_bytes * 1.02) + 2 * 2**30


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU run_rank0 measures there: the next test")
def test_fsdp2_on_rank0_alone_is_measured_to_the_byte():
    """Rank 0 of d = 2 beside the fake process group, real tensors made as torchtitan makes them (meta, then each
    shard on the device): the state rows are those of the real gloo run (4S, 4S, 8S + 4 B a tensor: S = 63,968, by
    hand in test_fsdp_harness), the activations 0 B off, the peak at the floor and 12 B (no gloo copies)."""
    from actmem_validate.grid import fsdp_configs

    rows = run_rank0(fsdp_configs()[:1])
    assert judge(rows, 0.0, 0.01) == []
    state = {row["term"]: row["measured_bytes"] for row in rows if row["kind"] == "state"}
    assert state == {"fsdp_weights": 4 * 63_968, "fsdp_gradients": 4 * 63_968,
                     "fsdp_optimizer_state": 8 * 63_968 + 4 * 21}
    peak = next(row for row in rows if row["term"] == "peak")
    assert 0 <= peak["measured_bytes"] - peak["formula_bytes"] <= 1024


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fsdp2_on_a_gpu_is_measured_to_the_byte_and_peaks_at_the_floor():
    """On a GPU (torchtitan's SDPA order picks cuDNN's kernel, which keeps 16 B of philox state a layer), the same
    run through torch.cuda's allocator: every checked row passes; the workspaces the first step made reported.
    On an H200 (torch 2.11) the whole Llama 3.1 8B on 8 GPUs peaked 34,304 B above its 68.10 GiB floor."""
    from actmem_validate.grid import fsdp_configs

    rows = run_rank0(fsdp_configs()[:2])
    assert judge(rows, 0.0, 10) == []
    assert {row["measured_bytes"] for row in rows if row["term"] == "sdpa_rng_state"} == {2 * 16}
    assert all(row["measured_bytes"] > 0 for row in rows if row["term"] == "kept_for_the_process")


def test_cudnn_philox_state_is_expected_on_a_gpu_unless_blocks_are_recomputed():
    """torch-native on a GPU: cuDNN's attention keeps two int64 [1] a layer (16 B x L = 2 layers); none on a CPU,
    none saved under full recompute (the blocks keep their inputs only). A GPU run that kept none is red."""
    from actmem_validate.grid import fsdp_configs
    from actmem_validate.torch_native import _compare

    none, full = fsdp_configs()[:2]
    measured = {row.term.name: row.total_bytes for row in estimate(none.spec).run_terms}
    measured |= {"token_ids": 512, "cross_entropy_targets": 512, "cross_entropy_total_weight": 4}
    expected = lambda config, device: {row["term"]: row["formula_bytes"]
                                       for row in _compare(config, 0, measured, device)}
    assert expected(none, "cuda:0")["sdpa_rng_state"] == 32
    assert "sdpa_rng_state" not in expected(none, "cpu") and "sdpa_rng_state" not in expected(full, "cuda:0")
    assert judge(_compare(none, 0, measured, "cpu"), 0.0) == []
    assert any("sdpa_rng_state" in line for line in judge(_compare(none, 0, measured, "cuda:0"), 0.0))


def test_gpu_bytes_is_the_floor_without_the_optimizer_with_the_margin():
    """gpu_bytes = (floor - optimizer state) x 1.02 + 2 GiB (footprint.GPU_MARGIN)."""
    config = configs_for(small_spec(2, 2), ["tp-sp"], 1)[0]
    floor = estimate(config.spec).peak
    weights, gradients = floor.bytes_of("weights"), floor.bytes_of("gradients")
    rest = floor.total_bytes - weights - gradients - floor.bytes_of("optimizer_state")
    assert gpu_bytes(config) == int((weights + gradients + rest) * 1.02) + 2 * 2**30


def test_rank0_refuses_one_spec_it_cannot_measure():
    result = CliRunner().invoke(cli, ["validate", *SMALL, "--mode", "rank0", "--techniques", "none",
                                      "--implementation", "hf"])
    assert result.exit_code == 2
    assert "--mode rank0" in result.stderr and "measures the megatron backend" in result.stderr


def test_the_weight_gradient_goes_into_main_grad_under_the_ledger():
    """Under the ledger's saved_tensors_hooks, ctx.saved_tensors hands back a new tensor for
    the saved weight, without main_grad: the linear must find main_grad on the parameter,
    or it computes a 16-bit weight gradient Megatron does not. With fake tensors (which have
    addmm.dtype_out) and TE's dummy already made (from the second step on), the backward
    allocates only the input's gradient: 8 x 512 x 2 B = 8 KiB, against 512 KiB for a
    [512, 512] bf16 weight gradient; the dummy it hands autograd is dropped."""
    try:
        with fake_tensor_mode():
            weight = torch.nn.Parameter(torch.empty(512, 512, dtype=torch.bfloat16))
            layers.attach_main_grads(torch.nn.ParameterList([weight]))
            layers.make_dummy_wgrads([weight])
            x = torch.empty(8, 512, dtype=torch.bfloat16, requires_grad=True)
            with Ledger([weight]).recording():
                out = layers.linear(x, weight, None, TensorParallel())
            grad = torch.empty(8, 512, dtype=torch.bfloat16)
            with LiveStorages() as live:
                out.backward(grad)
    finally:
        layers.make_dummy_wgrads([])
    if not layers._FP32_ACCUMULATING_GEMM[(type(weight.main_grad), "cpu", torch.bfloat16)]:
        pytest.skip("this torch's fake tensors have no addmm.dtype_out (torch 2.11's raises TypeError)")
    assert live.peak == 8 * 512 * 2 and weight.grad is None


def test_main_grads_freed_and_attached_again_accumulate_once():
    """The GPU warm-up frees the main-gradient buffer and attaches a new one: the hook that
    adds autograd's gradients must not be registered twice."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.float64))
    bias = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))        # its gradient goes through the hook
    module = torch.nn.ParameterList([weight, bias])
    x, grad = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    layers.attach_main_grads(module)
    layers.free_main_grads(module)
    assert weight.main_grad is None
    layers.attach_main_grads(module)
    layers.linear(x, weight, bias, TensorParallel()).backward(grad)
    assert torch.allclose(bias.main_grad.double(), grad.sum(0), atol=1e-6)   # once, not twice


def test_the_flash_kernel_rng_state_is_expected_on_a_gpu_only():
    """24 B a flash core held on a GPU (flash_api.cpp: rng_state, 2 uint64, and an unused
    uint64): 2 layers x 24 B = 48 B at p = 1, n = 1; none on a CPU, none for the eager core,
    none where selective recompute reruns the core."""
    flash = dict(FLASH, attention_dropout=0.0, hidden_dropout=0.0)
    for technique, cuda_bytes in (("tp-sp", 48), ("tp-sp-full", 0), ("tp-sp-sel", 0)):
        config = configs_for(small_spec(2, 2, **flash), [technique], 1)[0]
        occupancy = estimate(config.spec).occupancy
        assert expected_residuals(config.spec, occupancy, "cuda:0")["flash_rng_state"] == cuda_bytes
        assert expected_residuals(config.spec, occupancy, "cpu")["flash_rng_state"] == 0
    eager = configs_for(small_spec(2, 2), ["tp-sp"], 1)[0]
    assert expected_residuals(eager.spec, estimate(eager.spec).occupancy, "cuda:0")["flash_rng_state"] == 0


def test_a_gpu_without_the_flash_rng_state_fails_the_gate():
    """Expected on a GPU and not measured (a kernel that stopped keeping it, or a name that
    no longer finds it): the residual row is one-sided, and the gate says so."""
    config = configs_for(small_spec(2, 2, **dict(FLASH, attention_dropout=0.0, hidden_dropout=0.0)),
                         ["tp-sp"], 1)[0]
    est = estimate(config.spec)
    run = StageRun(peak_saved_bytes=0, terms_at_peak={})
    rows = compare(config, est, run, 0, peak_bytes=10**12, device="cuda:0")
    rng = next(row for row in rows if row["term"] == "flash_rng_state")
    assert (rng["formula_bytes"], rng["measured_bytes"]) == (48, 0)
    failures = judge(rows, 0.0)
    assert any("flash_rng_state" in line for line in failures)


def test_a_gpu_run_expects_each_offloaded_layers_flash_rng_state_on_the_host():
    """Seen on an H200 (Llama 3.1 8B, t = 8, N = 20 of 32 layers offloaded): the host copies held 480 B over
    actmem's host line, 20 x 24 B, each offloaded layer's SDPA philox state (TE v2.11 offloads any contiguous CUDA
    tensor). Expected on a GPU only: N = 2 flash layers 48 B, none on a CPU; a GPU run whose host copies miss it
    (or hold it where the formula does not) is red."""
    config = next(config for config in offload_configs() if config.spec.run.tensor_parallel == 1)
    assert config.spec.run.offload_layers == 2
    assert (expected_host_residual(config.spec, "cuda:0"), expected_host_residual(config.spec, "cpu")) == (48, 0)
    est = estimate(config.spec)
    for measured, device, red in ((est.host_bytes, "cuda:0", True), (est.host_bytes + 48, "cuda:0", False),
                                  (est.host_bytes + 48, "cpu", True)):
        rows = compare(config, est, StageRun(peak_saved_bytes=0, terms_at_peak={}, host_bytes=measured), 0,
                       peak_bytes=10**12, device=device)
        host = next(row for row in rows if row["term"] == "host_offload")
        assert any("host copies held" in line for line in judge([host], 0.0)) is red


def test_the_one_time_buffers_are_reported_not_judged():
    config = configs_for(small_spec(2, 2), ["tp-sp"], 1)[0]
    rows = compare(config, estimate(config.spec), StageRun(), 0, peak_bytes=0, kept_for_the_process=64 * 2**20)
    kept = next(row for row in rows if row["term"] == "kept_for_the_process")
    judge(rows, 0.0)
    assert kept["measured_bytes"] == 64 * 2**20 and kept["gate"] == "info"


def test_rank0_on_a_cpu_leaves_out_what_one_process_cannot_hold():
    """One process whatever t: a run is kept where one rank's rank_bytes fit the memory
    available, left out and named where they do not (one spec alone is then refused)."""
    from actmem_validate.footprint import rank_bytes

    config = configs_for(small_spec(2, 4, b=4), ["tp-sp"], 1)[0]
    assert rank0_runs([config], gpu_free=None, host_free=rank_bytes(config)) == ([config], [])
    kept, left_out = rank0_runs([config], gpu_free=None, host_free=rank_bytes(config) - 1)
    assert kept == [] and "one process needs about" in left_out[0] and "--mode fake" in left_out[0]


def test_rank0_refuses_a_spec_too_large_for_this_machine(monkeypatch):
    from actmem_validate import footprint

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(footprint, "available_bytes", lambda: 2**20)        # 1 MiB
    result = CliRunner().invoke(cli, ["validate", *SMALL, "--mode", "rank0", "--techniques", "none"])
    assert result.exit_code == 2
    assert "--mode rank0" in result.stderr and "one process needs about" in result.stderr


def test_only_a_tied_output_layer_marks_the_embedding_zero_out_wgrad():
    """Megatron zeroes the shared embedding's dummy at p = 1 (the output layer's dummy and the
    embedding's gradient meet in one .grad); an untied embedding's dummy is never added."""
    from actmem_validate.gpt import LayerSpec
    from actmem_validate.schedule import FirstStage

    for tied in (True, False):
        spec = small_spec(2, 1, tied_output=tied)
        stage = FirstStage(LayerSpec.of(spec), spec.padded_vocab, TensorParallel(), 1, 1, spec.stage_layers)
        assert getattr(stage.embedding.words, "zero_out_wgrad", False) is tied
