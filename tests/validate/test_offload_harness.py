"""CPU offloading (--cpu-offloading-num-layers, issue 29) in the harness: Transformer Engine v2.11's schedule over a
CPU stand-in (actmem_validate.offload.CpuOffload), measured against actmem's rows and host line; each can fail."""

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the t = 2 runs need a CPU or two GPUs, and the host "
                                "bytes below are a CPU's (on a GPU the flash kernel's philox state is offloaded too, "
                                "24 B a layer: test_rank0_and_gpu)")

from actmem_validate.compare import judge  # noqa: E402
from actmem_validate.grid import offload_configs  # noqa: E402
from actmem_validate.launch import run_real  # noqa: E402
from actmem_validate.offload import CpuOffload  # noqa: E402


@pytest.fixture(scope="module")
def offload_rows():
    return run_real(offload_configs())


def _row(rows, name, t, term, rank=0):
    return next(row for row in rows if row["config"].startswith(f"{name} t={t} ") and row["rank"] == rank
                and row["term"] == term)


def test_every_offloaded_run_is_measured_to_the_byte(offload_rows):
    """Four layers of h = 64, s = 32, b = 2 (SwiGLU f = 96, g = 4 of a = 8 heads of d = 8, rope), two microbatches:
    the device keeps L - N layers, the host held N layers' saved tensors and their rope freqs. At t = 1 a layer
    saves 2·s·b·h = 8192 B for each of the attention norm's input, the QKV input, q, the projection's input, the MLP
    norm's input and fc1's input (49,152), k and v 2·s·b·g·d = 4096 each (8192), the log-sum-exp 4·b·a·s = 2048,
    the norms' rsigma 4·s·b = 256 each (512), SwiGLU's input 2·s·b·2f = 24,576 and fc2's 2·s·b·f = 12,288:
    96,768 B; its freqs 4·s·d = 1024. N = 2: q on the device 2 x 8192, the host 2 x 97,792 = 195,584 B."""
    assert judge(offload_rows, 0.0) == []
    assert _row(offload_rows, "small-flash-offload", 1, "query")["measured_bytes"] == 2 * 8192
    assert _row(offload_rows, "small-flash-offload", 1, "host_offload")["measured_bytes"] == 195_584


@pytest.mark.parametrize("wrong", [0, 2])
def test_the_gate_fails_a_host_line_counted_wrong(offload_rows, wrong):
    """Inject: actmem's host line left out (0: measured but not in the formula) or doubled: red."""
    rows = [dict(row) for row in offload_rows]
    for row in rows:
        if row["term"] == "host_offload":
            row["formula_bytes"] *= wrong
    assert judge(rows, 0.0)


def test_the_gate_fails_a_run_whose_layers_stay_on_the_device(monkeypatch):
    """Inject: the stand-in offloads nothing while the estimate takes N = 2 layers off the device: every layer row
    is measured at twice the formula, and the host holds nothing where actmem says 195,584 B: red both ways."""
    from actmem_validate import measure

    monkeypatch.setattr(measure, "CpuOffload", lambda layers, offloaded: CpuOffload(layers, 0))
    config = next(config for config in offload_configs() if config.spec.run.tensor_parallel == 1)
    rows = measure.measure(config, 0, fake=True)
    failures = judge(rows, 0.0)
    assert any("query measured 32,768 B, formula 16,384 B" in line for line in failures)
    assert any("host copies held 0 B at their most, actmem's host line says 195,584 B" in line for line in failures)


def _toy_layer(weight):
    return lambda x: torch.sigmoid(x * weight)           # saves x (and the weight) and the sigmoid's output


def test_the_schedule_is_transformer_engines():
    """L = 4, N = 2 (cpu_offload.py, DefaultOffloadSynchronizer): layer 0's copy starts as layer 1 begins and its
    device tensors go as layer L - N + 0 = 2 begins, layer 1's as layer 3 begins; layers 2 and 3 are never
    offloaded; in the backward layer 1 comes back as layer L - 1 - N + 1 = 2's backward begins, layer 0 as layer 1's;
    the gradients are those of the same layers run without offloading."""
    weights = [torch.nn.Parameter(torch.full((8,), 0.5 + i)) for i in range(4)]    # parameters: never offloaded
    x0 = torch.linspace(-1, 1, 8, requires_grad=True)
    offload, seen = CpuOffload(4, 2), []
    x = x0
    for i, weight in enumerate(weights):
        with offload.layer():
            seen.append([len(state.device) > 0 for state in offload.states])
            x = _toy_layer(weight)(x)
        x = offload.commit(x)
    assert seen == [[False] * 4, [True, False, False, False], [False, True, False, False], [False, False, True, False]]
    assert [state.state for state in offload.states] == ["offload_finished"] * 2 + ["not_offloaded"] * 2
    assert offload.host_bytes == 2 * 2 * 8 * 4           # two layers, two fp32 tensors of 8 each
    reloads, start_reload = [], offload._start_reload
    offload._start_reload = lambda state: reloads.append(
        (offload.current, next(i for i, held in enumerate(offload.states) if held is state))) \
        or start_reload(state)
    x.sum().backward()
    assert reloads == [(2, 1), (1, 0)]          # (the layer whose backward begins, the layer reloaded)
    grads = [weight.grad.clone() for weight in weights]
    for weight in weights:
        weight.grad = None
    y = x0
    for weight in weights:
        y = _toy_layer(weight)(y)
    y.sum().backward()
    assert all(torch.equal(got, weight.grad) for got, weight in zip(grads, weights))
    assert all(state.state == "not_offloaded" and not state.host for state in offload.states)   # all released


def test_a_permuted_tensor_comes_back_as_it_went():
    """The host copy keeps a dense tensor's bytes in storage order: a permuted one (the harness's flash core saves
    such) reloads equal, in its own layout."""
    from actmem_validate.offload import _to_device, _to_host

    tensor = torch.arange(2 * 3 * 4, dtype=torch.bfloat16).reshape(2, 4, 3).transpose(1, 2)    # strides (12, 1, 3)
    back = _to_device(_to_host(tensor))
    assert back.stride() == tensor.stride() and torch.equal(back, tensor)
