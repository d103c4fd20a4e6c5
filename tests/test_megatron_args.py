"""A Megatron-LM launch script pasted whole: used, ignored, or refused; nothing dropped."""

import pytest

from tests.conftest import assert_one_line_error

MODEL = ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 8192 "
         "--vocab-size 128256 --ffn-hidden-size 14336 --swiglu --normalization RMSNorm "
         "--disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0")
RUN = "--tensor-model-parallel-size 8 --sequence-parallel --recompute-activations --micro-batch-size 1"
NOISE = "--bf16 --lr 3e-4 --save /ckpt --log-interval 10 --use-mcore-models"


def test_a_pasted_script_gives_the_same_estimate_as_the_flags(actmem, tmp_path):
    """The same run as tests/test_architecture.py's hand-derived layer: 155,189,248 B."""
    script = tmp_path / "args.txt"
    script.write_text(f"# launch\n{MODEL} \\\n  {RUN} \\\n  --max-position-embeddings 8192 {NOISE}\n")
    pasted = actmem.json("estimate", "--megatron-args", f"@{script}")
    flags = actmem.json("estimate", *MODEL.split(), *RUN.split())
    assert pasted["techniques"] == flags["techniques"] and pasted["run_terms"] == flags["run_terms"]
    assert {r["technique"]: r["per_layer_bytes"] for r in pasted["techniques"]}["tp-sp-sel"] == 155_189_248
    assert pasted["assumptions"][-1] == ("Megatron arguments ignored, as they cannot change memory: "
                                         "--lr, --save, --log-interval, --use-mcore-models")


def test_equals_signs_and_inline_text_work(actmem):
    text = MODEL.replace("--num-layers 32", "--num-layers=32") + " " + RUN + " --bf16"
    assert actmem.json("estimate", "--megatron-args", text)["model"]["layers"] == 32


@pytest.mark.parametrize("extra, fragments", [
    ("--use-flash-attn --frobnicate 3 --turbo",
     ["not modelled yet: --use-flash-attn", "unknown to actmem: --frobnicate, --turbo"]),
    ("--max-position-embeddings 4096", ["--max-position-embeddings (4096) differs from the sequence length (8192)"]),
    ("stray", ["unknown to actmem: stray"]),
])
def test_what_cannot_be_used_is_refused_in_one_message(actmem, extra, fragments):
    assert_one_line_error(actmem("estimate", "--megatron-args", f"{MODEL} {RUN} {extra} --bf16"), *fragments)


def test_a_script_without_16_bit_training_is_refused(actmem):
    """No --bf16 or --fp16: Megatron trains in fp32, twice the bytes actmem counts."""
    assert_one_line_error(actmem("estimate", "--megatron-args", f"{MODEL} {RUN}"),
                          "neither --bf16 nor --fp16", "fp32")


def test_a_pasted_value_that_disagrees_with_a_flag_is_refused(actmem):
    assert_one_line_error(actmem("estimate", "--megatron-args", f"{MODEL} {RUN} --bf16", "--tp", "4"),
                          "--tp 4 and --tensor-model-parallel-size 8")


def test_a_missing_file_is_one_line(actmem):
    assert_one_line_error(actmem("estimate", "--megatron-args", "@/no/such/args.txt"), "cannot read it")


def test_query_groups_need_megatron_s_switch(actmem):
    """Megatron reads --num-query-groups only with --group-query-attention."""
    gqa = f"{MODEL} {RUN} --bf16 --num-query-groups 8 --kv-channels 128"
    assert_one_line_error(actmem("estimate", "--megatron-args", gqa), "only with --group-query-attention")
    out = actmem.json("estimate", "--megatron-args", gqa + " --group-query-attention")
    assert (out["architecture"]["query_groups"], out["architecture"]["head_dim"]) == (8, 128)
