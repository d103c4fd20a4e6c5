"""Megatron's local (eager) attention core runs its fused causal softmax, which keeps only its
probabilities, where FusedScaleMaskSoftmax.is_kernel_available (megatron/core/fusions/
fused_softmax.py) allows: 16 < sk <= 4096, sq and sk multiples of 4, and b·a/t attention
batches a multiple of the kernel's rows a block (get_batch_per_block in scaled_masked_softmax.h:
8 rows up to sk = 128, 4 above). Elsewhere, or with --no-masked-softmax-fusion, Megatron runs
torch's softmax (forward_torch_softmax), and actmem counts what it keeps, derived op by op:

- input.float() (only with --attention-softmax-in-fp32) and the cast back keep nothing;
- attention_mask_func's masked_fill_ (utils.py) keeps its mask: handed none, the core makes the
  causal mask at each call (get_default_causal_mask: triu(ones(s, s)).bool(), not cached), s²
  bytes of bool a layer, whole on every rank (softmax_causal_mask); handed the dataloader's, it
  keeps that one, under every recompute mode;
- torch.nn.Softmax keeps its output: 16-bit, 2as²b/t, the fused kernel's bytes; or fp32,
  4as²b/t (softmax_output_fp32), and then ·V keeps the 16-bit copy (2as²b/t) unless attention
  dropout comes between (the dropout keeps only its mask of it).

So per layer, against the paper's rows: + s² in 16 bits; + 2as²b/t + s² in fp32 with dropout;
+ 4as²b/t + s² in fp32 without; under selective recompute of the core and full recompute, no
change (all of it is inside the checkpoint)."""

from dataclasses import replace

import pytest

from actmem.memory import backward, engine
from actmem.model import symbols
from actmem.model.architecture import Architecture
from actmem.memory.estimate import estimate
from actmem.planner.plan import candidates, evaluate
from actmem.model.spec import Model, build_spec
from actmem.memory.techniques import BY_NAME
from tests.conftest import assert_one_line_error
from tests.test_plan import request

# heads 8, hidden 512, t = 2: 4 heads a rank
SMALL = ["--heads", "8", "--hidden", "512", "--layers", "2", "--vocab", "512", "--tp", "2"]


@pytest.mark.parametrize("s, b", [
    (4096, 1),      # the kernel's largest sk; b·a/t = 4, four rows a block above sk = 128
    (132, 1),       # just above 128: 4 rows a block
    (128, 2),       # up to 128: 8 rows a block, b·a/t = 8
    (20, 2),        # the smallest multiple of 4 above 16
])
def test_where_the_fused_kernel_runs_the_estimate_is_the_paper_s(actmem, s, b):
    out = actmem.json("estimate", *SMALL, "--seq-len", str(s), "--micro-batch", str(b))
    tp = {row["technique"]: row for row in out["techniques"]}["tp"]
    # the paper's tp row, sbh(10 + 24/t) + 5as²b/t, with h = 512, a = 8, t = 2
    assert tp["per_layer_bytes"] == s * b * 512 * 22 + 5 * 8 * s * s * b // 2
    assert not any("forward_torch_softmax" in note for note in out["assumptions"])


@pytest.mark.parametrize("s, b, t, why", [
    (4100, 1, 2, "it needs 16 < s <= 4096 (s = 4100)"),
    (8192, 1, 2, "it needs 16 < s <= 4096 (s = 8192)"),
    (16, 2, 2, "it needs 16 < s <= 4096 (s = 16)"),
    (130, 2, 2, "it needs s a multiple of 4 (s = 130)"),
    (128, 1, 2, "it needs b·a/t a multiple of 8 at s = 128 (b·a/t = 1·8/2 = 4 attention batches a rank)"),
    (256, 1, 4, "it needs b·a/t a multiple of 4 at s = 256 (b·a/t = 1·8/4 = 2 attention batches a rank)"),
])
def test_where_megatron_falls_back_to_torch_s_softmax_its_mask_is_counted_and_named(actmem, s, b, t, why):
    """16 bits, attention dropout 0.1: the paper's tp row sbh(10 + 24/t) + 5as²b/t, and the causal
    mask the fallback makes and keeps, s² bytes a layer on every rank."""
    out = actmem.json("estimate", *SMALL[:-1], str(t), "--seq-len", str(s), "--micro-batch", str(b))
    tp = {row["technique"]: row for row in out["techniques"]}["tp"]
    paper = s * b * 512 * (10 + 24 // t) + 5 * 8 * s * s * b // t
    assert tp["per_layer_bytes"] == paper + s * s
    notes = " ".join(out["assumptions"])
    assert why in notes and "FusedScaleMaskSoftmax.forward_torch_softmax" in notes
    assert f"tp {paper + s * s:,} B (paper {paper:,} B)" in notes


def _spec(t=4, b=1, gpus=4, run=None, **architecture):
    """The issue's example: the 22B's L = 48 and v = 51,200 with a = 8, h = 640, s = 512."""
    model = dict(heads=8, hidden=640, layers=48, vocab=51200, seq_len=512)
    run = dict(tensor_parallel=t, micro_batch=b, gpus=gpus, global_batch=4) | (run or {})
    return build_spec(model, run, architecture=architecture)


def _rows(spec) -> dict:
    return {row.technique.name: row.per_layer_bytes for row in estimate(spec).techniques}


# s = 512, b = 1, h = 640, a = 8, t = 4: sbh = 327,680, as²b = 8·512² = 2,097,152, s² = 262,144.
# b·a/t = 2 attention batches a rank, not a multiple of 4 (s > 128): torch's fallback; 'none' runs
# at t = 1, b·a = 8: the fused kernel. Per layer:
#   none       sbh(34 + 5as/h) = 34·327,680 + 5·2,097,152                    = 21,626,880 (fused)
#   tp         16·327,680 + 5·2,097,152/4 = 7,864,320 (paper); + s²         =  8,126,464
#   tp-sp      34·327,680/4 + 2,621,440 = 5,406,720 (paper); + s²           =  5,668,864
#   tp-sel     16·327,680 (the core and its mask recomputed)                 =  5,242,880
#   tp-sp-sel  34·327,680/4                                                  =  2,785,280
#   full       2sbh = 655,360; tp-sp-full 2sbh/t = 163,840
ISSUE_EXAMPLE_16BIT = {"none": 21_626_880, "tp": 8_126_464, "tp-sp": 5_668_864, "tp-sel": 5_242_880,
                       "tp-sp-sel": 2_785_280, "full": 655_360, "tp-sp-full": 163_840}


def test_the_issue_s_refused_example_evaluates_by_hand(actmem):
    """`estimate --model 22b --tp 4 --heads 8 --hidden 640 --seq-len 512` (b = 1 on 4 GPUs, so that
    b·a/t = 2): every row of Table 2, the fallback's named beside the paper's."""
    assert _rows(_spec()) == ISSUE_EXAMPLE_16BIT
    out = actmem.json("estimate", "--model", "22b", "--tp", "4", "--heads", "8", "--hidden", "640", "--seq-len",
                      "512", "--micro-batch", "1", "--gpus", "4")
    assert {row["technique"]: row["per_layer_bytes"] for row in out["techniques"]} == ISSUE_EXAMPLE_16BIT
    terms = {term["term"]: term["bytes_each"] for term in out["run_terms"]}      # the preset's tp-sp-sel
    assert "softmax_causal_mask" not in terms and "softmax_output" not in terms
    notes = " ".join(out["assumptions"])
    assert "(b·a/t = 1·8/4 = 2 attention batches a rank)" in notes
    assert "tp 8,126,464 B (paper 7,864,320 B); tp-sp 5,668,864 B (paper 5,406,720 B)" in notes


def test_the_fallback_in_fp32_keeps_its_fp32_output_and_with_no_dropout_the_16_bit_copy():
    """--attention-softmax-in-fp32 (softmax_in_fp32): with attention dropout 0.1 the fp32 output
    4as²b/t replaces the 16-bit 2as²b/t: + 2,097,152/4·2 = 1,048,576 on the fallback's rows
    (tp 8,126,464 + 1,048,576 = 9,175,040; tp-sp 5,668,864 + 1,048,576 = 6,717,440). Without
    attention dropout the paper's tp row is sbh(10 + 24/t) + 2as²b/t = 5,242,880 + 1,048,576 =
    6,291,456, and the fallback keeps 4as²b/t more (the fp32 output beside the 16-bit copy ·V
    keeps) and s²: 6,291,456 + 2,097,152 + 262,144 = 8,650,752."""
    fp32 = _rows(_spec(softmax_in_fp32=True))
    assert (fp32["tp"], fp32["tp-sp"], fp32["tp-sel"], fp32["none"]) == (9_175_040, 6_717_440, 5_242_880, 21_626_880)
    terms = {row.term.name: row.bytes_each for row in estimate(_spec(softmax_in_fp32=True, run={
        "sequence_parallel": False, "recompute": "none"})).run_terms}
    assert terms["softmax_output_fp32"] == 4 * 2_097_152 // 4 and "softmax_output" not in terms
    no_dropout = _spec(softmax_in_fp32=True, attention_dropout=0.0, run={"recompute": "none"})
    assert _rows(no_dropout)["tp"] == 8_650_752
    terms = {row.term.name: row.bytes_each for row in estimate(no_dropout).run_terms}
    assert (terms["softmax_output_fp32"], terms["softmax_output"], terms["softmax_causal_mask"]) == \
        (2_097_152, 1_048_576, 262_144)


def test_switched_off_the_fallback_runs_at_every_t():
    """--no-masked-softmax-fusion (masked_softmax_fusion = false): 'none' at t = 1 too, where the
    kernel would run: 21,626,880 + s² = 21,889,024."""
    rows = _rows(_spec(masked_softmax_fusion=False))
    assert rows == ISSUE_EXAMPLE_16BIT | {"none": 21_626_880 + 262_144}


def test_the_dataloader_s_mask_is_kept_by_every_layer_s_masked_fill_under_the_fallback():
    """Handed the dataloader's [b, 1, s, s] mask the fallback fills the scores with it, so it is
    kept (b·s² = 262,144 B a microbatch) without recompute and under the MLP's checkpoint alone,
    where the fused kernel keeps none; and no mask of its own is made."""
    for recompute in ({"recompute": "none"}, {"recompute": "selective", "recompute_modules": ("mlp",)}):
        terms = {row.term.name: row.total_bytes for row in
                 estimate(_spec(attention_mask=True, run=recompute)).run_terms}
        assert terms["attention_mask"] == 262_144 and "softmax_causal_mask" not in terms
        fused = {row.term.name for row in estimate(_spec(t=2, b=2, gpus=2, attention_mask=True, run=recompute)).run_terms}
        assert "attention_mask" not in fused


def test_layers_the_dataloader_s_mask_does_not_reach_are_refused_by_name(actmem):
    """It arrives with the batch on the first and last stages only: at p = 3 the stage between
    makes masks of its own beside it, which actmem does not count yet."""
    assert_one_line_error(actmem("estimate", "--heads", "8", "--hidden", "640", "--layers", "6", "--vocab", "512",
                                 "--seq-len", "512", "--tp", "4", "--pp", "3", "--attention-mask"),
                          "the layers that mask does not reach", "(p = 3, m = 1", "--no-attention-mask")
    assert actmem("estimate", "--heads", "8", "--hidden", "640", "--layers", "6", "--vocab", "512",
                  "--seq-len", "512", "--tp", "4", "--pp", "3").exit_code == 0


def test_the_fallback_s_backward_is_a_moment_of_the_peak_floor():
    """The last layer's backward at torch's softmax, tp (no SP), s = 512, b = 1, h = 640, a = 8,
    t = 4, no output layer held (holds_output = 0). 16 bits, at masked_fill_'s backward inside
    CopySlices: the scores' gradient from the view's backward, CopySlices' copy and clone, and
    masked_fill's output, 4 x 2as²b/t = 4 x 1,048,576, with v's 2sb·ad/t = 163,840 and the
    residual stream's 2sbh = 655,360: 5,013,504. Freed: the rows after the core, projection input
    2sbh/t 163,840 + its mask sbh 327,680 + MLP norm input, fc1 input 2sbh 2 x 655,360 + GeLU and
    fc2 inputs 8sbh/t 2 x 655,360 + MLP mask 327,680 = 3,440,640; and the dropout's output
    1,048,576 and mask 524,288 and the softmax output 1,048,576: 6,062,080. In fp32 the same
    5,013,504 live (the fp32 gradient the softmax reads and the one it makes, 2 x 4as²b/t), and
    freed the rows after the core, the dropout's output and mask: 5,013,504 (no 16-bit copy with
    dropout); the fp32 output, 2,097,152, still held."""
    bindings = {symbols.s: 512, symbols.b: 1, symbols.h: 640, symbols.a: 8, symbols.t: 4, engine.holds_output: 0,
                symbols.v: 51200}
    tp = BY_NAME["tp"]
    for arch, freed in ((Architecture(masked_softmax_fusion=False), 6_062_080),
                        (Architecture(masked_softmax_fusion=False, softmax_in_fp32=True), 5_013_504)):
        moment = backward.moment_bytes("softmax", tp, arch)
        assert engine.exact(moment.transient, bindings) == 5_013_504
        assert engine.exact(moment.freed_held, bindings) == freed
        assert backward.modelled("softmax", tp, arch)
    assert not backward.modelled("softmax", tp, Architecture())          # the fused kernel works in place


def test_the_planner_sweeps_the_fallback():
    """A 175B-like model with 24 heads at s = 2048 (4 rows a block): at t = 8, 3 heads a rank, b
    not a multiple of 4 falls back to torch's softmax; those rows are swept now, and their memory
    is the estimate's to the byte."""
    req = request("175b", model=Model(heads=24, hidden=12288, layers=96, vocab=51200, seq_len=2048))
    frame = evaluate(req, candidates(req))
    fallback = frame[~frame.fused_softmax]
    assert {1, 2} <= set(fallback[fallback.t == 8].b) and 4 not in set(fallback[fallback.t == 8].b)
    # each row the estimate's to the byte: tests/test_stage_model.py


def test_the_growth_plot_runs_past_the_kernel_s_4096(actmem, tmp_path):
    """530B at s = 2048: s/8 to 8s, all of them now (the longer ones on torch's fallback)."""
    result = actmem("plot", "growth", "--model", "530b", "--csv", str(tmp_path / "growth.csv"))
    assert result.exit_code == 0, result.output
    assert "left out" not in result.stdout
    import pandas as pd

    assert pd.read_csv(tmp_path / "growth.csv").seq_len.max() == 16384


PASTE = ("--num-layers 2 --hidden-size 512 --num-attention-heads 8 --seq-length 2048 --vocab-size 512 "
         "--bf16 --micro-batch-size 1 --tensor-model-parallel-size 2 --no-create-attention-mask-in-dataloader")


@pytest.mark.parametrize("switch", ["--no-masked-softmax-fusion", "--attention-softmax-in-fp32"])
def test_a_pasted_softmax_switch_under_the_local_core_is_read_as_the_flag(actmem, switch):
    """The paste and actmem's own flag of the same name give the same bytes."""
    pasted = actmem.json("estimate", "--megatron-args", f"{PASTE} --attention-backend local {switch}")
    flagged = actmem.json("estimate", "--megatron-args", f"{PASTE} --attention-backend local", switch)
    assert pasted["techniques"] == flagged["techniques"] and pasted["verdict_bytes"] == flagged["verdict_bytes"]


def test_the_softmax_switches_at_the_fused_kernel_s_shapes(actmem):
    """s = 2048, b·a/t = 4: the fused kernel runs, and keeps its 16-bit probabilities whatever
    --attention-softmax-in-fp32 says; --no-masked-softmax-fusion turns it off, and torch's
    softmax (16-bit) then also keeps the causal mask it makes, s² = 4,194,304 B a layer."""
    plain = actmem.json("estimate", "--megatron-args", f"{PASTE} --attention-backend local")
    fp32 = actmem.json("estimate", "--megatron-args", f"{PASTE} --attention-backend local --attention-softmax-in-fp32")
    off = actmem.json("estimate", "--megatron-args", f"{PASTE} --attention-backend local --no-masked-softmax-fusion")
    per_layer = lambda out: {row["technique"]: row["per_layer_bytes"] for row in out["techniques"]}
    assert per_layer(fp32) == per_layer(plain)
    assert per_layer(off)["tp"] - per_layer(plain)["tp"] == 2048 * 2048 == 4_194_304


def test_softmax_switches_under_te_s_kernels_change_nothing(actmem):
    """TE's kernels keep no softmax: the same estimate as without."""
    switches = "--attention-softmax-in-fp32 --no-masked-softmax-fusion"
    plain = actmem.json("estimate", "--megatron-args", f"{PASTE} --attention-backend fused")
    switched = actmem.json("estimate", "--megatron-args", f"{PASTE} --attention-backend fused {switches}")
    assert switched["techniques"] == plain["techniques"] and switched["verdict_bytes"] == plain["verdict_bytes"]


def test_the_switches_are_megatron_s_alone():
    for name, value in (("masked_softmax_fusion", False), ("softmax_in_fp32", True)):
        with pytest.raises(Exception, match="Megatron's switches of its local core's softmax"):
            Architecture(implementation="hf", attention_core="eager", **{name: value})
    flash = replace(Architecture(attention_core="flash"), masked_softmax_fusion=False)
    assert flash.with_fused_softmax(False) is flash                      # TE's kernels: nothing to fall back from


def test_query_key_layer_scaling_is_the_fp32_softmax_under_the_local_core(actmem):
    """Megatron scales QKᵀ by 1/layer through the baddbmm's alpha and the softmax's scale (no
    tensor kept) and sets attention_softmax_in_fp32 (TransformerConfig.__post_init__): the same
    bytes as --attention-softmax-in-fp32; under TE's attention it is refused."""
    local = f"{PASTE} --attention-backend local --no-masked-softmax-fusion"
    scaled = actmem.json("estimate", "--megatron-args", f"{local} --apply-query-key-layer-scaling")
    fp32 = actmem.json("estimate", "--megatron-args", f"{local} --attention-softmax-in-fp32")
    assert scaled["techniques"] == fp32["techniques"] and scaled["verdict_bytes"] == fp32["verdict_bytes"]
    assert_one_line_error(actmem("estimate", "--megatron-args",
                                 f"{PASTE} --attention-backend fused --apply-query-key-layer-scaling"),
                          "--apply-query-key-layer-scaling under TE's attention is not modelled")
