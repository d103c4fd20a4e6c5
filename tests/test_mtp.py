"""Multi-token prediction (issue 27): megatron-core 0.16.1's MultiTokenPredictionBlock, hand-derived
(measured against megatron-core's own block in tests/validate/test_megatron_mtp.py).

D prediction layers on the last stage, each around a transformer layer of the model's last kind
(counted as a layer of that stage), keep a microbatch, N = s·b/t tokens a rank (SP): the rolled tokens
the embedding looks up, int64 8bs (and at t > 1 its mask, bs), enorm's input (the embedding's output)
2Nh and hnorm's (the hidden states) 2Nh with their fp32 statistics 4N each, eh_proj's input 4Nh, under
SP the rest of the gathered layer input 2sbh(t - 1)/t, the final norm's input 2Nh and statistics 4N;
the output layer keeps (1 + D)·2Nh and the loss (1 + D)·4sbv/t.
"""

from tests.conftest import assert_one_line_error

#: a Llama-like layer at t = 2 with SP, one prediction layer
BASE = ["--layers", "4", "--hidden", "2048", "--heads", "16", "--seq-len", "4096", "--vocab", "102400",
        "--micro-batch", "1", "--attention-core", "flash", "--position-embedding", "rope", "--swiglu",
        "--normalization", "rmsnorm", "--disable-bias-linear", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--tp", "2", "--sp", "--untie-embeddings-and-output-weights", "--mtp-num-layers", "1"]


def _terms(out) -> dict:
    return {row["term"]: (row["bytes_each"], row["count"]) for row in out["run_terms"]}


def test_one_prediction_layer_at_t_2(actmem):
    """s = 4096, b = 1, h = 2048, t = 2 (N = 2048), v = 102,400:
    - tokens 8·4096 = 32,768, their mask 4096; enorm's and hnorm's inputs 2·2048·2048 = 8,388,608 each, their
      statistics 4·2048 = 8192; eh_proj's input 16,777,216; the gathered input's rest 2·4096·2048/2 = 8,388,608;
      the final norm's input 8,388,608;
    - the output layer's input 2 x 8,388,608 = 16,777,216, the logits 2 x 4·4096·102,400/2 = 1,677,721,600;
    - the prediction's transformer layer counted as a fifth layer of the stage (attention_layernorm_input x 5)."""
    terms = _terms(actmem.json("estimate", *BASE))
    assert terms["mtp_token_ids"] == (32_768, 1) and terms["mtp_token_mask"] == (4096, 1)
    assert terms["mtp_embedding_output"] == terms["mtp_hidden_input"] == terms["mtp_final_norm_input"] == \
        (8_388_608, 1)
    assert terms["mtp_embedding_norm_statistics"] == (8192, 1)
    assert terms["mtp_eh_proj_input"] == (16_777_216, 1) and terms["mtp_layer_input_gathered"] == (8_388_608, 1)
    assert terms["output_layer_input"] == (16_777_216, 1) and terms["logits_fp32"] == (1_677_721_600, 1)
    assert terms["attention_layernorm_input"] == (8_388_608, 5)


def test_the_parameters_of_the_last_stage(actmem):
    """A layer: QKV 2048·6144 = 12,582,912, projection 4,194,304, SwiGLU 3·2048·8192 = 50,331,648, split over
    t = 2: 33,554,432, two norms 4096: 33,558,528. The prediction layer's own: three norms 6144 and eh_proj
    2·2048·2048/2 = 4,194,304. p = 1: 4 layers 134,234,112 + embedding and output 2·102,400·2048/2 =
    209,715,200 + final norm 2048 + the prediction 33,558,528 + 6144 + 4,194,304 = 381,710,336.
    p = 2, the last stage: 2 layers 67,117,056 + output 104,857,600 + final norm 2048 + the prediction
    37,758,976 + its own copy of the embedding 104,857,600 = 314,593,280; the first stage none of it:
    67,117,056 + 104,857,600 = 171,974,656."""
    assert actmem.json("estimate", *BASE)["parameters"]["count"] == 381_710_336
    piped = [*BASE, "--pp", "2", "--gpus", "4"]
    assert actmem.json("estimate", *piped, "--stage", "1")["parameters"]["count"] == 314_593_280
    first = actmem.json("estimate", *piped, "--stage", "0")
    assert first["parameters"]["count"] == 171_974_656
    assert not [name for name in _terms(first) if name.startswith("mtp")]


def test_full_recompute_keeps_each_prediction_checkpoints_arguments(actmem):
    """Megatron checkpoints each prediction layer whole (uniform 1): it keeps the tokens, the embedding's output
    and the hidden states; its transformer layer is no layer of the stage (layer_input_checkpoint x 4)."""
    terms = _terms(actmem.json("estimate", *BASE, "--recompute", "full"))
    assert terms["layer_input_checkpoint"] == (8_388_608, 4)
    assert {name for name in terms if name.startswith("mtp")} == {"mtp_token_ids", "mtp_token_mask",
                                                                   "mtp_embedding_output", "mtp_hidden_input"}


def test_deepseek_v3s_config_trains_its_prediction_layer(actmem):
    """The released config's num_nextn_predict_layers 1: one MLA + MoE layer more, 187,121,664 + shared expert
    44,040,192 + router 1,835,008 + 256 experts 11,274,289,152, eh_proj 2·7168² = 102,760,448 and three norms
    21,504: 11,610,067,968 beside the main model's 671,026,404,352: 682,636,472,320."""
    import pathlib

    config = pathlib.Path(__file__).parent / "data" / "hf" / "deepseek-v3" / "config.json"
    out = actmem.json("estimate", "--model", str(config), "--seq-len", "4096")
    assert out["parameters"]["count"] == 682_636_472_320


def test_the_predictions_embedding_keeps_its_dropout_mask(actmem):
    """At --hidden-dropout 0.1 each prediction's embedding dropout keeps a 1-byte mask, sbh/t = 4096·2048/2 =
    4,194,304, outside full recompute's checkpoint too."""
    args = list(BASE)
    args[args.index("--hidden-dropout") + 1] = "0.1"
    for recompute in ("none", "full"):
        assert _terms(actmem.json("estimate", *args, "--recompute", recompute))["mtp_embedding_dropout_mask"] == \
            (4_194_304, 1)


def test_megatrons_own_full_recompute_arguments_are_every_layer_alone(actmem):
    """Megatron needs --recompute-method with full recompute; uniform 1 is actmem's full, and the predictions'
    checkpoints assert N = 1."""
    explicit = actmem.json("estimate", *BASE, "--recompute", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "1")
    assert _terms(explicit) == _terms(actmem.json("estimate", *BASE, "--recompute", "full"))


def test_a_layout_places_the_prediction_on_the_last_stage(actmem):
    """--pipeline-model-parallel-layout with its 'm' last (Megatron's DeepSeek-V3 recipe: "Et|(tt|)*30mL") reads as
    actmem's placement; its 'm' count must be --mtp-num-layers, and on an earlier stage it is refused."""
    megatron = ("--num-layers 4 --hidden-size 2048 --num-attention-heads 16 --seq-length 4096 --vocab-size 102400 "
                "--ffn-hidden-size 8192 --swiglu --disable-bias-linear --normalization RMSNorm --bf16 "
                "--position-embedding-type rope --attention-dropout 0 --hidden-dropout 0 --micro-batch-size 1 "
                "--global-batch-size 8 --pipeline-model-parallel-size 2 --untie-embeddings-and-output-weights")
    out = actmem.json("estimate", "--megatron-args", megatron + " --mtp-num-layers 1 --pipeline-model-parallel-layout "
                      "Ett|ttmL", "--gpus", "2", "--stage", "1")
    assert _terms(out)["mtp_eh_proj_input"][0] > 0
    assert_one_line_error(actmem("estimate", "--megatron-args", megatron + " --mtp-num-layers 1 "
                                 "--pipeline-model-parallel-layout Ett|ttL", "--gpus", "2"),
                          "its 0 'm' (multi-token prediction) layers must be --mtp-num-layers (1)")
    assert_one_line_error(actmem("estimate", "--megatron-args", megatron + " --mtp-num-layers 1 "
                                 "--pipeline-model-parallel-layout Ettm|ttL", "--gpus", "2"),
                          "multi-token prediction layers on a stage before the last are not modelled")


def test_what_mtp_does_not_model_is_refused(actmem):
    no_sp = [arg for arg in BASE if arg != "--sp"]
    assert_one_line_error(actmem("estimate", *no_sp), "multi-token prediction at t = 2 is modelled with sequence "
                                                      "parallelism")
    assert_one_line_error(actmem("estimate", *BASE, "--pp", "2", "--gpus", "4", "--interleave", "2"),
                          "multi-token prediction is modelled without interleaving")
    assert_one_line_error(actmem("estimate", *BASE, "--recompute", "full", "--recompute-method", "block",
                                 "--recompute-num-layers", "1"), "multi-token prediction is modelled without")


def test_the_plan_sweeps_mtp_within_what_actmem_models(actmem):
    """The sweep keeps what actmem's rules allow with prediction layers (no interleaving, SP at t > 1, no block
    method: its limits, not Megatron's) and sizes the last stage with its D layers, their norms and projection and D more logits
    (tests/test_plan_moe.py checks rows against the estimate)."""
    model = [arg for i, arg in enumerate(BASE) if arg not in ("--micro-batch", "--tp", "--sp")
             and BASE[i - 1] not in ("--micro-batch", "--tp")]
    out = actmem.json("plan", *model, "--gpus", "8", "--global-batch", "8", "--top", "0")
    rows = out["best"]
    assert rows and all(row["m"] == 1 and row["recompute"] != "full:block" for row in rows)
    assert all(row["sequence_parallel"] for row in rows if row["t"] > 1)
