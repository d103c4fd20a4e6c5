"""What a new user's trial of FP8, experts and latent attention (session 36) found, each a test that failed before
its fix: refusals that point to the way out, a pasted script's repeated argument, help and legends that name what
the numbers include, and JSON that carries what the run has (the GPU's default-ness: tests/test_gpu_default.py)."""

from tests.conftest import assert_one_line_error


def test_p_not_dividing_the_layers_points_to_an_uneven_pipeline(actmem):
    """DeepSeek-V3's 61 layers on 4 stages: refused, naming the flags that lay an uneven pipeline out."""
    assert_one_line_error(actmem("estimate", "--model", "deepseek-v3", "--pp", "4"),
                          "p (4) must divide layers (61)", "--first-stage-layers N --last-stage-layers N",
                          "--decoder-first-pipeline-num-layers")
    out = actmem.json("estimate", "--model", "deepseek-v3", "--pp", "4", "--first-stage-layers", "16",
                      "--last-stage-layers", "15")                    # 16 + 15·2 + 15 = 61
    assert [stage["layers"] for stage in out["stages"]] == [16, 15, 15, 15]


def test_an_expert_layout_too_big_for_the_gpus_names_etp(actmem):
    """Mixtral's preset run (EP 8, p 4, 32 GPUs) at t = 2: ETP follows t, so ETP·EP·p = 2·8·4 = 64 > 32. The
    refusal says ETP is t unless given; at --etp 1, 1·8·4 = 32 divides the GPUs and the run is priced."""
    result = actmem("estimate", "--model", "mixtral-8x7b", "--tp", "2", "--sp")
    assert_one_line_error(result, "ETP·EP·p (2·8·4 = 64) must divide gpus (32)",
                          "give --gpus a multiple of 64, or a smaller --ep or --pp or --etp (ETP is t unless given")
    out = actmem.json("estimate", "--model", "mixtral-8x7b", "--tp", "2", "--sp", "--etp", "1")
    assert out["run"]["expert_tensor_parallel"] == 1
    assert_one_line_error(actmem("estimate", "--model", "mixtral-8x7b", "--pp", "8"),     # ETP·EP·p = 1·8·8 = 64
                          "give --gpus a multiple of 64, or a smaller --ep or --pp")


def _paste(tmp_path, *extra):
    words = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "8", "--seq-length", "1024",
             "--max-position-embeddings", "1024", "--micro-batch-size", "1", "--global-batch-size", "8",
             "--vocab-size", "32000", "--bf16", "--position-embedding-type", "rope", *extra]
    path = tmp_path / "args.txt"
    path.write_text(" ".join(words) + "\n")
    return f"@{path}"


def test_a_scripts_repeated_argument_runs_with_its_last_value_and_says_so(actmem, tmp_path):
    """Megatron's argparse keeps an argument's last value: --tensor-model-parallel-size 2, later 4, runs at t = 4
    (the QKV input, 2sbh under SP, splits 4 ways: 2·1024·1024/4 = 524,288 B), and the notes say so; one given twice
    alike needs no note."""
    pasted = _paste(tmp_path, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                    "--tensor-model-parallel-size", "4")
    out = actmem.json("estimate", "--megatron-args", pasted)
    assert out["run"]["tensor_parallel"] == 4
    assert {row["term"]: row["bytes_each"] for row in out["run_terms"]}["qkv_input"] == 524_288
    assert ("--tensor-model-parallel-size is given 2 times (2 then 4): Megatron's parser keeps the last, and so "
            "does actmem") in out["assumptions"]
    alike = actmem.json("estimate", "--megatron-args", _paste(tmp_path, "--tensor-model-parallel-size", "2",
                                                              "--tensor-model-parallel-size", "2"))
    assert alike["run"]["tensor_parallel"] == 2 and not any("given 2 times" in n for n in alike["assumptions"])
    modules = actmem.json("estimate", "--megatron-args", _paste(
        tmp_path, "--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp",
        "--recompute-modules", "mlp"))
    assert modules["run"]["recompute_modules"] == ["mlp"]
    assert any(n.startswith("--recompute-modules is given 2 times (core_attn mlp then mlp)")
               for n in modules["assumptions"])


def test_a_flag_typed_twice_with_two_values_is_still_refused(actmem):
    """On actmem's own command line two values are a slip, not a script's override."""
    assert_one_line_error(actmem("estimate", "--model", "22b", "--tp", "2", "--tp", "4"),
                          "--tp is given more than once and the values disagree")


def test_recompute_modules_help_names_the_expert_modules(actmem):
    text = " ".join(actmem("estimate", "--help").stdout.split())
    assert all(f" {module} (" in text for module in ("moe", "moe_act", "shared_experts", "mla_up_proj"))


def test_the_stage_tables_legend_names_fp8_state_and_the_gradients_dtype(actmem):
    """Llama 3.1 8B under tensorwise FP8 holds TE's FP8 weight copies in its model state: the legend says so; a bf16
    run with --grad-reduce-in-bf16 keeps 16-bit main gradients, and says that, not fp32."""
    fp8 = " ".join(actmem("estimate", "--model", "llama-3.1-8b", "--fp8-format", "hybrid", "--fp8-recipe",
                          "tensorwise", "--pp", "2", "--stage", "all").stdout.split())
    assert "TE's FP8 weight copies and scaling state" in fp8 and "fp32 main gradients" in fp8
    bf16 = " ".join(actmem("estimate", "--model", "llama-3.1-8b", "--pp", "2", "--stage", "all",
                           "--grad-reduce-in-bf16").stdout.split())
    assert "model state: weights, 16-bit main gradients, optimizer state, TE's dummy weight gradients;" in bf16


def test_json_carries_no_setting_of_a_feature_the_model_lacks(actmem):
    """Mixtral has no latent attention and no FP8: none of Megatron's MLA widths (kv_lora_rank 32 by default) or FP8
    settings appear, in the estimate's JSON or the plan's; its experts' do. DeepSeek-V3's MLA widths appear."""
    arch = actmem.json("estimate", "--model", "mixtral-8x7b")["architecture"]
    plan = actmem.json("plan", "--model", "mixtral-8x7b")["request"]["architecture"]
    for record in (arch, plan):
        assert record["multi_latent_attention"] is False and record["fp8_format"] is None
        assert not {"kv_lora_rank", "qk_head_dim", "fp8_recipe", "fp8_amax_history_len"} & set(record)
        assert (record["num_experts"], record["moe_topk"]) == (8, 2)
    dense = actmem.json("estimate", "--model", "22b")["architecture"]
    assert dense["num_experts"] is None and not any(name.startswith("moe_") for name in dense)
    deepseek = actmem.json("estimate", "--model", "deepseek-v3", "--pp", "1")["architecture"]
    assert (deepseek["kv_lora_rank"], deepseek["q_lora_rank"]) == (512, 1536)


def test_a_released_fp8_checkpoint_does_not_say_the_run_is_16_bit(actmem):
    """DeepSeek-V3's config.json carries its released weights' quantization_config; the note no longer claims 16
    bits when the run's flags choose FP8."""
    from tests.test_mla import HF_V3

    notes = actmem.json("estimate", "--model", str(HF_V3), "--seq-len", "4096", "--ep", "64", "--gpus",
                        "64")["assumptions"]
    note = next(n for n in notes if n.startswith("quantization_config"))
    assert "priced in 16 bits" not in note and "FP8 under --fp8-format" in note


def test_fp8_says_what_it_nets_against_the_same_run_in_bf16(actmem):
    """Llama 3.1 8B on one H100 (p = 1, one microbatch of 32 layers) under tensorwise FP8: a layer keeps 957,415,436
    B against bf16's 1,141,964,800 (tests/test_fp8.py), so the activations shrink by 32·184,549,364 = 5,905,579,648
    B; TE keeps each layer's weights' FP8 copy and Hopper transpose, QKV [6144, 4096] + proj [4096, 4096] + fc1
    [28,672, 4096] + fc2 [4096, 14,336] = 218,103,808 elements, 2 B each, and 4 modules' 44 B of scaling state:
    32·436,207,792 = 13,958,649,344 B more model state. The peak moves by their sum; a bf16 run has no such line."""
    out = actmem.json("estimate", "--model", "llama-3.1-8b", "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise")
    net = out["against_bf16"]
    assert (net["stage"], net["activations_delta_bytes"], net["model_state_delta_bytes"]) == (
        0, -5_905_579_648, 13_958_649_344)
    bf16 = actmem.json("estimate", "--model", "llama-3.1-8b")
    assert bf16["against_bf16"] is None and net["bf16_verdict_bytes"] == bf16["verdict_bytes"]
    assert net["verdict_delta_bytes"] == out["verdict_bytes"] - bf16["verdict_bytes"] == -5_905_579_648 + 13_958_649_344
    text = " ".join(actmem("estimate", "--model", "llama-3.1-8b", "--fp8-format", "e4m3", "--fp8-recipe",
                           "tensorwise").stdout.split())
    # (13,958,649,344 - 5,905,579,648)/2^30 = 7.50, 5,905,579,648/2^30 = 5.50, 13,958,649,344/2^30 = 13.00; the two
    # peaks as the JSON gives them
    peaks = f"({out['verdict_bytes'] / 2**30:,.2f} against {bf16['verdict_bytes'] / 2**30:,.2f} GiB)"
    assert (f"FP8 against this run in bf16: +7.50 GiB at the peak {peaks}; on the first stage the "
            "activations −5.50 GiB, the model state +13.00 GiB") in text
    assert "FP8 against" not in actmem("estimate", "--model", "llama-3.1-8b").stdout


def test_a_repeated_argument_with_a_missing_value_is_still_refused(actmem, tmp_path):
    """`--tensor-model-parallel-size --sequence-parallel`: Megatron's parser wants a value; the later
    `--tensor-model-parallel-size 2` does not take --sequence-parallel's place. A bare --recompute-modules (nargs='*',
    Megatron's [] recomputes nothing) is refused, alone or after a first list. An unknown argument given twice is
    named once; a repeated argument actmem ignores (--lr) gets no note."""
    missing = _paste(tmp_path, "--tensor-model-parallel-size", "--sequence-parallel", "--tensor-model-parallel-size", "2")
    assert_one_line_error(actmem("estimate", "--megatron-args", missing), "expects a value: --tensor-model-parallel-size")
    for modules in (("--recompute-modules",), ("--recompute-modules", "core_attn", "--recompute-modules")):
        bare = _paste(tmp_path, "--recompute-granularity", "selective", *modules)
        assert_one_line_error(actmem("estimate", "--megatron-args", bare), "--recompute-modules names no module")
    unknown = actmem("estimate", "--megatron-args", _paste(tmp_path, "--foo", "1", "--foo", "2"))
    assert_one_line_error(unknown, "not an argument of Megatron-LM")
    assert unknown.stderr.count("--foo") == 1
    lr = actmem.json("estimate", "--megatron-args", _paste(tmp_path, "--lr", "1e-4", "--lr", "3e-4"))
    assert not any("--lr" in note and "times" in note for note in lr["assumptions"])


def test_deepseek_v3_s_last_stage_counts_its_prediction_layer(actmem):
    """DeepSeek-V3 on 4 stages of 16, 15, 15 and 15 layers: the last stage holds one microbatch of its 15 layers and
    the prediction layer, 16 layers of attention rows (qkv_input x 16), all of them MoE layers."""
    out = actmem.json("estimate", "--model", "deepseek-v3", "--pp", "4", "--first-stage-layers", "16",
                      "--last-stage-layers", "15", "--ep", "8", "--gpus", "32", "--stage", "last")
    counts = {row["term"]: row["count"] for row in out["run_terms"]}
    assert counts["qkv_input"] == 16 and counts["experts_input"] == 16 and "fc1_input" not in counts


def test_the_second_trial_s_fixes(actmem, tmp_path):
    """A new user's second trial (session 37): FP8's net in markdown and CSV too; Megatron's space-separated
    --recompute-modules typed as a flag says to join them with commas; a flag beside a pasted script's value names
    the flag, not actmem's internal name; the MTP layer in the held count; the refusals say which recompute to give
    and name only the FP8 flag given."""
    fp8 = ("--model", "llama-3.1-8b", "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise")
    assert "FP8 against this run in bf16: +7.50 GiB at the peak" in actmem("estimate", *fp8, "--format", "markdown").stdout
    assert "settings,against_bf16_activations_delta_bytes,-5905579648" in actmem("estimate", *fp8, "--format", "csv").stdout
    spaced = actmem("estimate", "--model", "deepseek-v3", "--recompute", "selective", "--recompute-modules",
                    "layernorm", "mla_up_proj")
    assert_one_line_error(spaced, "--recompute-modules takes its modules as one word, comma-separated")
    pasted = _paste(tmp_path, "--tensor-model-parallel-size", "4", "--sequence-parallel")
    assert_one_line_error(actmem("estimate", "--megatron-args", pasted, "--tp", "8"),
                          "--tp 8 and --tensor-model-parallel-size 4 disagree: two values of one setting (tensor parallel)")
    header = " ".join(actmem("estimate", "--model", "deepseek-v3", "--pp", "1").stdout.split())
    assert "61 layer activations and 1 multi-token-prediction layer activation held" in header
    assert_one_line_error(actmem("estimate", "--model", "22b", "--recompute", "none", "--recompute-modules", "mlp"),
                          "this run's recompute is none: give --recompute selective")
    alone = actmem("estimate", "--model", "22b", "--fp8-amax-history-len", "4")
    assert_one_line_error(alone, "--fp8-amax-history-len shapes FP8 training: give --fp8-format")
    assert "--fp8-param-gather" not in alone.stderr


def test_the_second_review_s_fixes(actmem):
    """Session 37's review: (1) recomputing shared_experts, Megatron does not hand fc1 save_original_input
    (shared_experts.py: only without that recompute), so under tensorwise too the rerun keeps fc1's quantized input,
    the rank's shard, 2048·7168 = 14,680,064 B for DeepSeek-V3 at t = 2, with its 4-byte scale_inv: the rerun is
    delayed scaling's (measured since: tests/validate, the shared experts' FP8 rerun row); (2) the precision-aware optimizer under a recipe but delayed keeps
    Megatron's own fp32 master shard (optimizer_config.py: use_precision_aware_optimizer_no_fp8_or_ds_fp8), 4 B,
    not TE's 2-byte remainder: Llama 3.1 8B at t = 2, d = 4: 4 + 4 + 4 = 12 B a parameter against 2 + 4 + 4 = 10 B,
    over the same parameters and shards."""
    from actmem.memory import engine
    from actmem.memory.techniques import run_technique
    from actmem.model.recompute import RecomputePolicy
    from actmem.model.spec import build_spec
    from actmem.sources.presets import load_preset

    preset = load_preset("deepseek-v3")
    shared = run_technique(True, RecomputePolicy.parse("selective:shared_experts"))

    def rerun(recipe):       # (the shared experts' rerun is below the stage's start: it finds the routed rows freed)
        spec = build_spec(preset.model, {"tensor_parallel": 2, "sequence_parallel": True, "expert_parallel": 8,
                                         "gpus": 16, "micro_batch": 1},
                          architecture=preset.architecture | {"mtp_layers": 0, "fp8_format": "e4m3", "fp8_recipe": recipe},
                          gpu_name="h100", gpu_fp8="hopper")
        arch = spec.architecture_at(1)
        return engine.exact(engine.rematerialised_bytes(shared, arch, module="shared_experts"), spec.bindings())

    assert rerun("delayed") == rerun("tensorwise")
    llama = ("-m", "llama-3.1-8b", "--tp", "2", "--sp", "--gpus", "8", "--use-distributed-optimizer",
             "--use-precision-aware-optimizer", "--fp8-format", "e4m3")
    tensorwise = actmem.json("estimate", *llama, "--fp8-recipe", "tensorwise")["parameters"]
    delayed = actmem.json("estimate", *llama, "--fp8-recipe", "delayed")["parameters"]
    assert tensorwise["count"] == delayed["count"]
    assert (tensorwise["optimizer_bytes"] * 10, delayed["optimizer_bytes"] * 4) == (
        delayed["optimizer_bytes"] * 12, delayed["count"] * 10)
