"""The MLP and norm of today's models (issue 8, first step): ffn size f, SwiGLU, RMSNorm,
no biases, an untied output layer. Expected numbers are derived by hand next to each test."""

import pytest

from actmem.memory import engine
from actmem.model.architecture import Architecture
from actmem.planner.flops import hardware_flops, model_flops
from actmem.memory.parameters import first_stage_parameters
from actmem.model.symbols import b, h, s, t
from actmem.memory.techniques import BY_NAME
from actmem.model.recompute import Recompute
from tests.conftest import assert_one_line_error

LLAMA_8B_MLP = ["--heads", "32", "--hidden", "4096", "--layers", "32", "--vocab", "128256",
                "--seq-len", "4096", "--tp", "8", "--sp", "--recompute", "selective",
                "--ffn-hidden-size", "14336", "--swiglu", "--normalization", "RMSNorm",
                "--disable-bias-linear", "--attention-dropout", "0", "--hidden-dropout", "0"]


def test_a_gated_mlp_layer_by_hand(actmem):
    """s = 4096, b = 1, h = 4096, f = 14336, t = 8, SP + selective, no dropout, as Megatron-Core
    with TE keeps it (attention still the paper's eager core, which selective recompute drops):
    attention: norm input 2sbh, QKV input 2sbh, Q and K 4sbh, V 2sbh, projection input 2sbh;
    MLP: norm input 2sbh, fc1 input 2sbh, SwiGLU input 2·2sbf, fc2 input 2sbf; all over t:
    (16sbh + 6sbf)/t = (16·16,777,216 + 6·58,720,256)/8 = 77,594,624 B. (At s = 8192 Megatron's
    local core would run torch's softmax, not its fused kernel: tests/test_fused_softmax.py.)"""
    sbh, sbf = 4096 * 4096, 4096 * 14336
    out = actmem.json("estimate", *LLAMA_8B_MLP)
    run = {row["technique"]: row for row in out["techniques"]}["tp-sp-sel"]
    assert run["per_layer_bytes"] == (16 * sbh + 6 * sbf) // 8 == 77_594_624
    terms = {term["term"]: term["bytes_each"] for term in out["run_terms"]}
    assert terms["swiglu_input"] == 4 * sbf // 8 and terms["fc2_input"] == 2 * sbf // 8
    assert "gelu_input" not in terms and not [name for name in terms if "dropout" in name]


def test_the_mlp_rows_follow_f_symbolically():
    """Under tp: GeLU keeps 2sbf/t and fc2 2sbf/t, so f = 1000 instead of 4h changes a layer by
    4sb(1000 - 4h)/t; SwiGLU's input is 2·2sbf/t instead of GeLU's 2sbf/t: 2sbf/t more, 8sbh/t
    at f = 4h."""
    tp = BY_NAME["tp"]
    paper = engine.per_layer_bytes(tp)
    narrow = engine.per_layer_bytes(tp, Architecture(ffn_hidden=1000))
    gated = engine.per_layer_bytes(tp, Architecture(activation="swiglu"))
    assert (narrow - paper - 4 * s * b * (1000 - 4 * h) / t).simplify() == 0
    assert (gated - paper - 8 * s * b * h / t).simplify() == 0


def test_llama_2_7b_parameters_by_hand():
    """Llama 2 7B: h 4096, f 11008, 32 layers, v 32000, SwiGLU, RMSNorm, no biases, untied:
    L(4h² + 3hf + 2h) + 2vh + h = 6,738,415,616, the published count. actmem still gives the
    paper's learned positions (s·h) until rotary embeddings are modelled: s = 4096 adds
    16,777,216."""
    arch = Architecture(ffn_hidden=11008, activation="swiglu", normalization="rmsnorm", bias=False,
                        tied_output=False)
    count = first_stage_parameters(4096, 32, 1, 1, 32000, 4096, arch)
    assert count == 6_738_415_616 + 4096 * 4096


def test_tensor_parallel_split_of_a_gated_layer():
    """t = 8, no biases: the weights split (4h² + 3hf)/8, the two RMSNorm weights (2h) stay."""
    arch = Architecture(ffn_hidden=11008, activation="swiglu", normalization="rmsnorm", bias=False)
    h_, f_ = 4096, 11008
    one_layer = first_stage_parameters(h_, 2, 2, 8, 32000, 1, arch) - 32000 * h_ // 8 - h_
    assert one_layer == (4 * h_ * h_ + 3 * h_ * f_) // 8 + 2 * h_


def test_flops_follow_the_layer():
    """Model FLOPs 6·B·s·L·W + 12·B·s²·L·h + 6·B·s·h·v with W = 4h² + 3hf for SwiGLU; for the
    paper's layer W = 12h² gives the appendix formula (tests/test_flops.py)."""
    B, s_, L, h_, v, f_ = 8, 4096, 32, 4096, 32000, 11008
    arch = Architecture(ffn_hidden=f_, activation="swiglu")
    W = 4 * h_ * h_ + 3 * h_ * f_
    assert model_flops(B, s_, L, h_, v, arch) == pytest.approx(
        6 * B * s_ * L * W + 12 * B * s_ * s_ * L * h_ + 6 * B * s_ * h_ * v, rel=1e-12)
    full = hardware_flops(B, s_, L, h_, v, Recompute.FULL, arch)
    assert full == pytest.approx(8 * B * s_ * L * W + 16 * B * s_ * s_ * L * h_ + 6 * B * s_ * h_ * v, rel=1e-12)


@pytest.mark.parametrize("args, fragments", [
    (["--ffn-hidden-size", "1001"], ["t (8) must divide ffn_hidden (1001)"]),
    (["--ffn", "0"], ["ffn_hidden must be a positive integer, got 0"]),
    (["--swiglu", "--activation", "gelu"], ["disagree: two values of one setting (activation)", "--swiglu"]),
    (["--activation", "relu"], ["'relu' is not one of"]),
    (["--normalization", "batchnorm"], ["'batchnorm' is not one of"]),
    (["--disable-bias-linear", "--add-bias-linear"], ["disagree: two values of one setting (bias)"]),
])
def test_bad_architecture_flags(actmem, args, fragments):
    assert_one_line_error(actmem("estimate", "--model", "530b", *args), *fragments)


def test_megatron_spellings_are_read(actmem):
    out = actmem.json("estimate", "--model", "gpt3", "--normalization", "RMSNorm", "--swiglu",
                      "--untie-embeddings-and-output-weights", "--disable-bias-linear")
    arch = out["architecture"]
    assert (arch["normalization"], arch["activation"], arch["tied_output"], arch["bias"]) == (
        "rmsnorm", "swiglu", False, False)


def test_a_preset_architecture_table(tmp_path, actmem):
    path = tmp_path / "gated.toml"
    path.write_text("[model]\nheads = 8\nhidden = 64\nlayers = 2\nvocab = 512\nseq_len = 32\n"
                    "[architecture]\nactivation = 'swiglu'\nffn_hidden = 96\nnormalization = 'rmsnorm'\n")
    out = actmem.json("estimate", "--model", str(path))
    assert out["architecture"]["ffn_hidden"] == 96
    swiglu = next(term for term in out["run_terms"] if term["term"] == "swiglu_input")
    assert swiglu["bytes_each"] == 2 * 2 * 32 * 1 * 96      # 2 B x 2f x s x b, t = 1
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nheads = 8\nhidden = 64\nlayers = 2\nvocab = 512\nseq_len = 32\n"
                   "[architecture]\nactivation = 'relu'\n")
    assert_one_line_error(actmem("estimate", "--model", str(bad)), "activation must be one of gelu, swiglu")


def test_llama_2_70b_parameters_by_hand():
    """Llama 2 70B: h 8192, 64 heads of d 128 in g = 8 groups, f 28672, 80 layers, v 32000,
    SwiGLU, RMSNorm, no biases, untied. A layer: QKV h·(ad + 2gd) = 8192·10240, projection
    ad·h = 8192², MLP 3hf, two norms 2h: 855,654,400. 80 layers + 2vh + h = 68,976,648,192,
    the published count; learned positions would add s·h, rotary ones add nothing."""
    arch = Architecture(ffn_hidden=28672, activation="swiglu", normalization="rmsnorm", bias=False,
                        tied_output=False, query_groups=8, head_dim=128)
    assert first_stage_parameters(8192, 80, 1, 1, 32000, 4096, arch, heads=64) == 68_976_648_192 + 4096 * 8192
    rope = Architecture(**{**arch.__dict__, "attention_core": "flash", "position_embedding": "rope"})
    assert first_stage_parameters(8192, 80, 1, 1, 32000, 4096, rope, heads=64) == 68_976_648_192


def test_grouped_query_attention_layer_by_hand(actmem):
    """530B's dims with g = 16 groups and d = 128 (ad = 16384, not h = 20480), t = 8, SP, no
    recompute: Megatron's local attention expands K and V to a heads, so Q and K keep
    2·2sb·ad/t = 16,777,216 B, V and the projection input 2sb·ad/t = 8,388,608 B each."""
    out = actmem.json("estimate", "--model", "530b", "--num-query-groups", "16", "--kv-channels", "128",
                      "--recompute", "none")
    terms = {term["term"]: term["bytes_each"] for term in out["run_terms"]}
    sb_ad = 2048 * 128 * 128
    assert terms["query_key"] == 2 * 2 * sb_ad // 8 == 16_777_216
    assert terms["value"] == terms["projection_input"] == 2 * sb_ad // 8 == 8_388_608


def test_grouped_query_attention_flops():
    """W = h·(ad + 2gd) + ad·h + 8h² (GeLU, f = 4h); scores 4·B·s²·L·ad."""
    B, s_, L, h_, v, a, g, d = 2, 1024, 4, 2048, 1000, 16, 4, 64
    arch = Architecture(query_groups=g, head_dim=d)
    W = h_ * (a * d + 2 * g * d) + a * d * h_ + 8 * h_ * h_
    assert model_flops(B, s_, L, h_, v, arch, heads=a) == pytest.approx(
        6 * B * s_ * L * W + 12 * B * s_ * s_ * L * a * d + 6 * B * s_ * h_ * v, rel=1e-12)


@pytest.mark.parametrize("args, fragments", [
    (["--query-groups", "16"], ["selective recompute with query groups under the eager core",
                                "choose none, full, or --recompute-modules mlp"]),
    (["--query-groups", "3"], ["query_groups (3) must divide heads (128)"]),
    (["--query-groups", "4"], ["t (8) must divide query_groups (4)"]),
    (["--head-dim", "0"], ["head_dim must be a positive integer, got 0"]),
])
def test_bad_attention_flags(actmem, args, fragments):
    assert_one_line_error(actmem("estimate", "--model", "530b", *args), *fragments)


def test_megatron_s_learned_absolute_is_learned_in_a_preset_file(actmem, tmp_path):
    """A preset may spell the learned table as Megatron does (learned_absolute): the same run
    as the 22B preset's own."""
    preset = tmp_path / "mine.toml"
    architecture = '[architecture]\nposition_embedding = "learned_absolute"\n\n[model]'
    preset.write_text(open("presets/22b.toml").read().replace("[model]", architecture, 1))
    mine, paper = (actmem.json("estimate", "--model", name) for name in (str(preset), "22b"))
    assert mine["run_terms"] == paper["run_terms"] and mine["architecture"]["position_embedding"] == "learned"
