"""A Megatron-LM launch script pasted whole: used, ignored, or refused; nothing dropped."""

import pytest

from tests.conftest import assert_one_line_error

MODEL = ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 "
         "--vocab-size 128256 --ffn-hidden-size 14336 --swiglu --normalization RMSNorm "
         "--disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0")
RUN = "--tensor-model-parallel-size 8 --sequence-parallel --recompute-activations --micro-batch-size 1"
NOISE = "--bf16 --lr 3e-4 --save /ckpt --log-interval 10 --use-mcore-models --attention-backend local"


def test_a_pasted_script_gives_the_same_estimate_as_the_flags(actmem, tmp_path):
    """The same run as tests/test_architecture.py's hand-derived layer: 77,594,624 B; the paste
    has Megatron's dataloader mask, which the flags count with --attention-mask."""
    script = tmp_path / "args.txt"
    script.write_text(f"# launch\n{MODEL} \\\n  {RUN} \\\n  --max-position-embeddings 4096 {NOISE}\n")
    pasted = actmem.json("estimate", "--megatron-args", f"@{script}")
    flags = actmem.json("estimate", *MODEL.split(), *RUN.split(), "--attention-mask")
    assert pasted["techniques"] == flags["techniques"] and pasted["run_terms"] == flags["run_terms"]
    assert {r["technique"]: r["per_layer_bytes"] for r in pasted["techniques"]}["tp-sp-sel"] == 77_594_624
    assert pasted["assumptions"][-1] == ("Megatron arguments ignored, as they cannot change memory: "
                                         "--lr, --save, --log-interval, --use-mcore-models")


def test_equals_signs_and_inline_text_work(actmem):
    text = MODEL.replace("--num-layers 32", "--num-layers=32") + " " + RUN + " --bf16 --attention-backend=local"
    assert actmem.json("estimate", "--megatron-args", text)["model"]["layers"] == 32


@pytest.mark.parametrize("extra, fragments", [
    ("--recompute-modules core_attn,mlp --frobnicate 3 --turbo",
     ["--recompute-modules core_attn,mlp: Megatron takes the modules as separate words "
      "(--recompute-modules core_attn mlp)", "not an argument of Megatron-LM (at d98e8a64ddf3): --frobnicate, --turbo"]),
    ("--use-flash-attn", ["disagree: two values of one setting (attention core)"]),
    ("--max-position-embeddings 2048", ["the learned position table has 2,048 rows (--max-position-embeddings), "
                                        "fewer than the sequence's 4,096 positions"]),
    ("stray", ["words that follow no argument, as Megatron's parser would refuse them: stray"]),
])
def test_what_cannot_be_used_is_refused_in_one_message(actmem, extra, fragments):
    assert_one_line_error(actmem("estimate", "--megatron-args", f"{MODEL} {RUN} {extra} --bf16 "
                                                                "--attention-backend local"), *fragments)


def test_a_script_without_16_bit_training_is_refused(actmem):
    """No --bf16 or --fp16: Megatron trains in fp32, twice the bytes actmem counts."""
    assert_one_line_error(actmem("estimate", "--megatron-args", f"{MODEL} {RUN} --attention-backend local"),
                          "neither --bf16 nor --fp16", "fp32")


def test_a_pasted_value_that_disagrees_with_a_flag_is_refused(actmem):
    assert_one_line_error(actmem("estimate", "--megatron-args", f"{MODEL} {RUN} --bf16 --attention-backend local",
                                 "--tp", "4"),
                          "--tp 4 and --tensor-model-parallel-size 8")


def test_a_value_the_script_computes_is_named_and_a_flag_beside_the_paste_gives_it(actmem, tmp_path):
    """A script's positional parameter or command output as a value actmem must read: refused naming the paste,
    the argument and what to do; with that flag given beside the paste (either spelling), the flag decides, and
    the notes say so. A value click refuses that is no placeholder names the paste too."""
    script = tmp_path / "train.sh"
    script.write_text(f"torchrun --nproc-per-node 8 pretrain_gpt.py {MODEL.replace('--num-layers 32', '--num-layers $1')} {RUN} "
                      f"--seq-length $(cat seq.txt) {NOISE}\n".replace("--seq-length 4096 ", ""))
    assert_one_line_error(actmem("estimate", "--megatron-args", f"@{script}"),
                          "--megatron-args: --num-layers is $1, which the script computes when it runs",
                          "give --num-layers beside --megatron-args")
    out = actmem.json("estimate", "--megatron-args", f"@{script}", "--layers", "32", "--seq-length", "4096")
    assert (out["model"]["layers"], out["model"]["seq_len"]) == (32, 4096)
    notes = " ".join(out["assumptions"])
    assert "--num-layers: the flag's, in place of the script's $1" in notes
    assert "--seq-length: the flag's, in place of the script's $(cat…)" in notes
    assert_one_line_error(actmem("estimate", "--megatron-args", f"{MODEL.replace('32 --hidden', 'x --hidden')} {RUN} "
                                                                "--bf16 --attention-backend local"),
                          "--megatron-args: Invalid value for '--num-layers': 'x' is not a valid integer")


def test_a_setting_actmem_reads_itself_that_the_script_computes_is_refused_naming_it(actmem, tmp_path):
    """--attention-backend and --recompute-modules are read from the paste alone (no flag beside it takes their
    place): a value the script computes when it runs is refused before anything reads it, naming each."""
    script = tmp_path / "train.sh"
    script.write_text(f"torchrun --nproc-per-node 8 pretrain_gpt.py {MODEL} {RUN} --bf16 --attention-backend $2 "
                      "--recompute-granularity selective --recompute-modules $1\n")
    assert_one_line_error(actmem("estimate", "--megatron-args", f"@{script}"),
                          "--megatron-args: --attention-backend is $2; --recompute-modules is $1: values the script "
                          "computes when it runs", "write their values into the pasted script")


def test_a_case_on_the_scripts_argument_is_read_as_a_run_given_none_and_said(actmem, tmp_path):
    """bash run with no arguments takes case "$1"'s '*)' branch: 32 layers, and the notes say how $1 was read."""
    script = tmp_path / "train.sh"
    script.write_text('case "$1" in\n  big) LAYERS=80 ;;\n  *) LAYERS=32 ;;\nesac\n'
                      "torchrun --nproc-per-node 8 pretrain_gpt.py "
                      f"{MODEL.replace('--num-layers 32', '--num-layers $LAYERS')} {RUN} --bf16 --attention-backend local\n")
    out = actmem.json("estimate", "--megatron-args", f"@{script}")
    assert out["model"]["layers"] == 32
    assert "the script's own arguments ($1) read as a run given none: empty in a test or case statement" in " ".join(
        out["assumptions"])


def test_a_missing_file_is_one_line(actmem):
    assert_one_line_error(actmem("estimate", "--megatron-args", "@/no/such/args.txt"), "cannot read it")


def test_query_groups_need_megatron_s_switch(actmem):
    """Megatron reads --num-query-groups only with --group-query-attention."""
    run = RUN.replace("--recompute-activations", "")     # no selective recompute with eager GQA
    gqa = f"{MODEL} {run} --bf16 --attention-backend local --num-query-groups 8 --kv-channels 128"
    assert_one_line_error(actmem("estimate", "--megatron-args", gqa), "ignores --num-query-groups without")
    out = actmem.json("estimate", "--megatron-args", gqa + " --group-query-attention")
    assert (out["architecture"]["query_groups"], out["architecture"]["head_dim"]) == (8, 128)


BASE = f"{MODEL} {RUN} --bf16 --attention-backend local"


@pytest.mark.parametrize("extra, fragments", [
    ("--attention-backend unfused", ["--transformer-impl transformer_engine with --attention-backend "
                                     "unfused is not modelled"]),
    ("--attention-backend flash", ["(Megatron's core_attn) under flash attention is modelled with rotary "
                                   "positions or q and k norms"]),
    ("--save --swiglu", ["expects a value: --save"]),
    ("--fp16", ["give one of --bf16 or --fp16"]),
    ("--tp 8", ["not an argument of Megatron-LM (at d98e8a64ddf3): --tp"]),
    ("--gpu-memory 40GB", ["not an argument of Megatron-LM (at d98e8a64ddf3): --gpu-memory"]),
    ("--make-vocab-size-divisible-by 0", ["vocab_divisible_by must be a positive integer, got 0"]),
    ("--recompute-method block --recompute-num-layers 2",
     ["shape full recompute; this run's recompute is selective"]),
    ("--attention-backend local --transformer-impl local --use-flash-attn",
     ["--use-flash-attn with --transformer-impl local is not modelled"]),
])
def test_paste_mistakes_reviewers_found(actmem, extra, fragments):
    """An argument missing its value no longer swallows the next one; actmem's own spellings
    are not Megatron's; a pasted 0 is a value; the attention core must be a modelled one, with a
    recompute modelled for it."""
    if extra.startswith("--attention-backend"):
        text = BASE.replace("--attention-backend local", extra)
    else:
        text = f"{BASE} {extra}"
    assert_one_line_error(actmem("estimate", "--megatron-args", text), *fragments)


def test_paste_forms_that_megatron_reads(actmem, tmp_path):
    """A data blend of several values is ignored whole; --group-query-attention alone means one
    group (multi-query); full recompute as Megatron spells it is actmem's full."""
    single = f"{MODEL} --micro-batch-size 1 --bf16 --attention-backend local"      # t = 1: g = 1 divides by t
    out = actmem.json("estimate", "--megatron-args", f"{single} --data-path 0.5 a 0.5 b --group-query-attention")
    assert out["architecture"]["query_groups"] == 1
    assert "--data-path" in out["assumptions"][-1]
    full = actmem.json("estimate", "--megatron-args", BASE.replace("--recompute-activations", "")
                       + " --recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    assert full["run"]["recompute"] == "full"
    binary = tmp_path / "args.bin"
    binary.write_bytes(b"--bf16 \xff\xfe")
    assert_one_line_error(actmem("estimate", "--megatron-args", f"@{binary}"), "not UTF-8 text")


def test_partial_full_recompute_as_megatron_spells_it(actmem):
    """--recompute-method block --recompute-num-layers 8 on Llama-8B-like dims at t = 8 with
    SP, 32 layers on one stage: 8 layers keep their input (2sbh/t = 4,194,304 B each), the
    other 24 keep everything the same run without recompute keeps."""
    base = BASE.replace("--recompute-activations", "")
    full = actmem.json("estimate", "--megatron-args", base + " --recompute-granularity full")
    none = actmem.json("estimate", "--megatron-args", base)
    block = actmem.json("estimate", "--megatron-args", base + " --recompute-granularity full "
                        "--recompute-method block --recompute-num-layers 8")
    per_layer = {row["technique"]: row["per_layer_bytes"] for row in none["techniques"]}
    run = next(row for row in block["techniques"] if row["is_run"])
    assert run["technique"] == "tp-sp-full·block 8"
    assert run["layers_bytes"] == 8 * 2 * 4096 * 4096 // 8 + 24 * per_layer["tp-sp"]
    assert full["run"]["recompute"] == block["run"]["recompute"] == "full"
    too_many = base + " --recompute-granularity full --recompute-method block --recompute-num-layers 64"
    assert_one_line_error(actmem("estimate", "--megatron-args", too_many),
                          "--recompute-num-layers (64) must not exceed the layers of a model chunk on the "
                          "first stage (32)")
    assert_one_line_error(actmem("estimate", "--megatron-args", base + " --recompute-granularity full "
                                 "--recompute-method block"), "give --recompute-method and --recompute-num-layers together")


def test_recompute_modules_core_attn_is_the_paper_s_selective_recompute(actmem):
    """Megatron's default --recompute-modules, core_attn, is what --recompute-activations
    (selective granularity) already recomputes: the same estimate, 77,594,624 B a layer."""
    plain = actmem.json("estimate", "--megatron-args", f"{MODEL} {RUN} {NOISE}")
    named = actmem.json("estimate", "--megatron-args", f"{MODEL} {RUN} --recompute-modules core_attn {NOISE}")
    assert named["run_terms"] == plain["run_terms"] and named["run"]["recompute"] == "selective"
    assert {r["technique"]: r["per_layer_bytes"] for r in named["techniques"]}["tp-sp-sel"] == 77_594_624


def test_recompute_modules_outside_selective_granularity_is_refused(actmem):
    """Megatron reads --recompute-modules only under selective granularity: beside full it would
    be silently ignored, so it is refused."""
    run = RUN.replace("--recompute-activations", "--recompute-granularity full --recompute-method uniform "
                                                  "--recompute-num-layers 1")
    assert_one_line_error(actmem("estimate", "--megatron-args", f"{MODEL} {run} --recompute-modules core_attn {NOISE}"),
                          "--recompute-modules chooses what selective recompute recomputes (Megatron reads it "
                          "only then; a preset names it recompute_modules); this run's recompute is full")


def test_zero_centred_norm_weights_are_read_under_te_and_refused_under_the_local_norms(actmem):
    """TE passes zero_centered_gamma into its norm kernels and keeps the same tensors (the same
    bytes as without it); Megatron's local FusedLayerNorm makes weight + 1, a tensor it keeps."""
    base = f"{MODEL} {RUN} --bf16 --attention-backend local --no-create-attention-mask-in-dataloader"
    with_1p = actmem.json("estimate", "--megatron-args", base + " --apply-layernorm-1p")
    without = actmem.json("estimate", "--megatron-args", base)
    assert with_1p["run_terms"] == without["run_terms"] and with_1p["verdict_bytes"] == without["verdict_bytes"]
    assert any("zero_centered_gamma" in note for note in with_1p["assumptions"])
    assert_one_line_error(actmem("estimate", "--megatron-args", base + " --apply-layernorm-1p --transformer-impl local"),
                          "--apply-layernorm-1p under --transformer-impl local is not modelled")


def test_a_learned_position_table_longer_than_s_is_counted_whole(actmem):
    """--max-position-embeddings 8192 at s = 4096: the table keeps 8,192 rows of h = 4096, all
    parameters of the first stage, 4,096 x 4,096 = 16,777,216 more than at s rows."""
    base = f"{MODEL} {RUN} --bf16 --attention-backend local --no-create-attention-mask-in-dataloader"
    at_s = actmem.json("estimate", "--megatron-args", base + " --max-position-embeddings 4096")
    longer = actmem.json("estimate", "--megatron-args", base + " --max-position-embeddings 8192")
    assert longer["parameters"]["count"] - at_s["parameters"]["count"] == 4096 * 4096 == 16_777_216
    assert longer["run_terms"] == at_s["run_terms"]             # no activation reads the rows beyond s
    assert any("8,192 rows" in note for note in longer["assumptions"])


def test_bucket_settings_are_read_and_their_padding_named(actmem):
    """Buckets are views of DDP's buffers: the bytes do not move; the padding they shape under the
    distributed optimizer is named, not counted. Averaging in the collective is a scaling."""
    base = f"{MODEL} {RUN} --bf16 --attention-backend local --no-create-attention-mask-in-dataloader"
    plain = actmem.json("estimate", "--megatron-args", base)
    bucketed = actmem.json("estimate", "--megatron-args", base + " --ddp-bucket-size 10000000 --ddp-num-buckets 4 "
                           "--ddp-pad-buckets-for-high-nccl-busbw --ddp-average-in-collective")
    assert bucketed["verdict_bytes"] == plain["verdict_bytes"]
    notes = " ".join(bucketed["assumptions"])
    assert "lcm(d·c, 128, 65536)" in notes and "--ddp-average-in-collective" in notes
