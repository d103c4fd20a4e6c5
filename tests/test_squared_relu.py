"""Megatron's --squared-relu (Nemotron's MLP): squared_relu(x) = torch.pow(F.relu(x), 2)
(megatron/core/activations.py), called unfused by mlp.py. It keeps one f-wide 16-bit tensor,
as GeLU keeps its input: relu saves its output and pow the same tensor (eager); under
Megatron's jit_fuser, torch.compile's partitioner saves one tensor of that shape
(tests/validate/test_squared_relu_compiled.py)."""

from tests.conftest import assert_one_line_error


def _terms(out):
    return {row["term"]: row for row in out["run_terms"]}


def test_it_keeps_2sbf_over_t_a_layer_as_gelu_keeps_its_input(actmem):
    """22B (Table 3): s = 2048, b = 4, h = 6144, f = 4h = 24576, t = 8, L/p = 48 layers held
    on the first stage of p = 1: 2·2048·4·24576/8 = 50,331,648 B a layer."""
    relu = actmem.json("estimate", "--model", "22b", "--activation", "squared_relu")
    gelu = actmem.json("estimate", "--model", "22b")
    term = _terms(relu)["squared_relu_output"]
    assert term["bytes_each"] == 2 * 2048 * 4 * 24576 // 8 == 50_331_648
    assert "gelu_input" not in _terms(relu) and "squared_relu_output" not in _terms(gelu)
    assert term["bytes"] == _terms(gelu)["gelu_input"]["bytes"] == 48 * 50_331_648
    assert relu["activations_bytes"] == gelu["activations_bytes"]


def test_the_paste_reads_squared_relu_and_megatron_s_fusion_rule(actmem):
    base = ("--num-layers 2 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --vocab-size 32000 "
            "--micro-batch-size 1 --bf16 --attention-backend local --no-create-attention-mask-in-dataloader "
            "--squared-relu")
    for extra in ("--disable-bias-linear", "--no-bias-gelu-fusion"):
        out = actmem.json("estimate", "--megatron-args", f"{base} {extra}")
        assert _terms(out)["squared_relu_output"]["bytes_each"] == 2 * 1024 * 1 * 4096
    assert_one_line_error(actmem("estimate", "--megatron-args", base),
                          "Megatron refuses --squared-relu with its default fused bias-GeLU")
    assert_one_line_error(actmem("estimate", "--megatron-args", f"{base} --disable-bias-linear --swiglu"),
                          "disagree: two values of one setting (activation)")
