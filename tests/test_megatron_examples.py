"""Megatron-LM's own example launch scripts (tests/data/megatron_examples, unchanged from the
pinned commit) passed as a user passes them: `actmem estimate --megatron-args @script.sh`.
Each is estimated, or refused in one line naming only what actmem does not model (or what
Megatron itself would refuse), never as "not an argument" of Megatron."""

import re
from pathlib import Path

import pytest

from tests.conftest import assert_one_line_error

EXAMPLES = Path(__file__).parent / "data" / "megatron_examples"


def _refused_names(message: str) -> set:
    """The arguments named after 'changes memory and is not modelled yet:'."""
    listed = message.split("changes memory and is not modelled yet: ", 1)[1]
    return set(re.findall(r"--[a-z0-9-]+", re.sub(r"\([^()]*(\([^()]*\))?[^()]*\)", "", listed)))


def test_gpt3_175b_as_it_is_is_refused_as_megatron_would_refuse_it(actmem):
    """The script gives --global-batch-size beside --step-batch-size-schedule, which Megatron's
    arguments.py refuses ('Cannot specify both'); and its schedule, a quoted array element
    expanded by an unquoted ${TRAINING_ARGS[@]}, reaches the parser as six words."""
    result = actmem("estimate", "--megatron-args", f"@{EXAMPLES / 'train_gpt3_175b_distributed.sh'}")
    assert_one_line_error(result, "Megatron refuses --step-batch-size-schedule beside --global-batch-size",
                          "words that follow no argument, as Megatron's parser would refuse them: 2.4B:320, "
                          "4.8B:624, 7.2B:928, 9.6B:1232, 12B:1536")
    assert "changes memory and is not modelled" not in result.stderr


def _gpt3_without_the_schedule(tmp_path) -> Path:
    text = (EXAMPLES / "train_gpt3_175b_distributed.sh").read_text()
    script = tmp_path / "gpt3.sh"
    script.write_text("\n".join(line for line in text.splitlines() if "--step-batch-size-schedule" not in line))
    return script


def test_gpt3_175b_without_its_schedule_is_the_paper_model_on_the_scripts_run(actmem, tmp_path):
    """The script's model (GPT-3 175B: L = 96, h = 12288, a = 96, s = 2048) and run (t = 8,
    p = 16, b = 1, global batch 1536); its one node of 8 GPUs cannot hold t·p = 128 ranks, so
    --gpus is given. Hand numbers: d = 1536/(8·16) = 12, 1536/(12·1) = 128 microbatches; GPT-2's
    50,257 tokens padded to a multiple of 128·8 = 1024: 51,200; the QKV input of a layer under
    plain TP, 2sbh = 2·2048·1·12288 = 50,331,648 B. The script trains in --fp16 without
    --accumulate-allreduce-grads-in-fp32, so Megatron's gradient buffers are 16-bit: 2 B a
    parameter (16 B with the 2 B weight and 12 B of Adam, not 18); with the switch, fp32."""
    script = _gpt3_without_the_schedule(tmp_path)
    assert_one_line_error(actmem("estimate", "--megatron-args", f"@{script}"),
                          "give --vocab-size N (GPT-2's BPE files, --vocab-file gpt2-vocab.json: 50257)")
    assert_one_line_error(actmem("estimate", "--megatron-args", f"@{script}", "--vocab", "50257"),
                          "t·p (8·16 = 128) must divide gpus (8)")
    out = actmem.json("estimate", "--megatron-args", f"@{script}", "--vocab", "50257", "--gpus", "1536")
    assert (out["model"]["layers"], out["model"]["hidden"], out["model"]["heads"], out["model"]["seq_len"]) == \
        (96, 12288, 96, 2048)
    assert (out["model"]["vocab"], out["model"]["padded_vocab"]) == (50257, 51200)
    run = out["run"]
    assert (run["tensor_parallel"], run["pipeline_parallel"], run["micro_batch"]) == (8, 16, 1)
    assert (run["gpus"], run["global_batch"], run["data_parallel"], run["microbatches_per_iteration"]) == (1536, 1536, 12, 128)
    assert {t["term"]: t["bytes_each"] for t in out["run_terms"]}["qkv_input"] == 50_331_648
    notes = " ".join(out["assumptions"])
    assert "read from a launch script: pretrain_gpt.py's arguments" in notes
    assert "GPUs: --gpus, in place of the launcher's 8" in notes
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1 read" in notes
    flags = actmem.json("estimate", "--layers", "96", "--hidden", "12288", "--heads", "96", "--seq-len", "2048",
                        "--vocab", "50257", "--tp", "8", "--pp", "16", "--micro-batch", "1", "--global-batch",
                        "1536", "--gpus", "1536", "--attention-core", "flash", "--attention-mask")
    assert out["run_terms"] == flags["run_terms"]
    count = out["parameters"]["count"]
    assert out["parameters"]["gradients_bytes"] == 2 * count
    assert out["verdict_bytes"] == flags["verdict_bytes"] - 2 * count       # fp32 gradients, less 2 B a parameter
    assert any("16-bit main gradients" in note for note in out["assumptions"])
    in_fp32 = script.read_text().replace("--fp16", "--fp16 --accumulate-allreduce-grads-in-fp32")
    script.write_text(in_fp32)
    fp32 = actmem.json("estimate", "--megatron-args", f"@{script}", "--vocab", "50257", "--gpus", "1536")
    assert fp32["parameters"]["gradients_bytes"] == 4 * count and fp32["verdict_bytes"] == flags["verdict_bytes"]


def test_megatron_lm_s_fsdp_example_prices_as_it_is(actmem):
    """examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh on its H100s: every argument is read or ignored (its
    FP8 weights in Megatron-FSDP's buckets, its NCCL user buffers and double buffers: tests/test_megatron_fsdp.py)."""
    out = actmem.json("estimate", "--megatron-args", f"@{EXAMPLES / 'train_llama3_8b_fsdp_h100_fp8.sh'}", "--gpu",
                      "h100")
    assert out["parameters"]["double_buffer_bytes"] > 0 and out["parameters"]["fp8_bytes"] > 0
    assert out["fits"] is True


def test_t5_s_script_is_refused_for_what_it_trains(actmem):
    """examples/t5/train_t5_220m_distributed.sh ends in a line continued into the end of the file, which bash
    runs: the refusal names the model family, not a parse error."""
    assert_one_line_error(actmem("estimate", "--megatron-args", f"@{EXAMPLES / 'train_t5_220m_distributed.sh'}"),
                          "trains with pretrain_t5.py: encoder-decoder (T5) models are not modelled")


def test_mamba_s_script_is_read_through_its_case_and_refused_for_what_it_trains(actmem):
    """examples/mamba/train.sh picks its shape in a case statement on MODEL_SCALE, set two lines above: read as
    bash runs it, the refusal names the model family (its hybrid layer pattern), not the case."""
    assert_one_line_error(actmem("estimate", "--megatron-args", f"@{EXAMPLES / 'train_mamba.sh'}"),
                          "trains with ../../pretrain_hybrid.py: hybrid Mamba models are not modelled")


def test_a_vision_language_example_is_refused_for_what_it_trains(actmem):
    """examples/multimodal/pretrain_mistral_clip.sh runs examples/multimodal/train.py, a training script of its
    folder's own: the refusal names the family, not the script's own flags as unknown to Megatron."""
    assert_one_line_error(actmem("estimate", "--megatron-args", f"@{EXAMPLES / 'pretrain_mistral_clip.sh'}"),
                          "trains with examples/multimodal/train.py: vision-language (examples/multimodal) models "
                          "are not modelled")


def test_an_argument_megatron_stops_on_is_refused_with_its_advice(actmem, tmp_path):
    """Megatron's validate_args stops on its removed arguments (arguments.py, "Deprecated arguments"):
    --checkpoint-activations prints its advice and exits; --batch-size is an assertion."""
    script = tmp_path / "old.sh"
    script.write_text("torchrun pretrain_gpt.py --bf16 --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
                      "--seq-length 128 --max-position-embeddings 128 --micro-batch-size 1 --vocab-size 100 "
                      "--checkpoint-activations --batch-size 4\n")
    result = actmem("estimate", "--megatron-args", f"@{script}")
    assert_one_line_error(result, "Megatron refuses --checkpoint-activations: no longer valid (Megatron prints so "
                                  "and exits): use --recompute-activations, or --recompute-granularity and "
                                  "--recompute-method (arguments.py)")
    assert "Megatron refuses --batch-size: no longer valid (an assertion): use --micro-batch-size" in result.stderr
    assert "not modelled" not in result.stderr


def test_deepseek_v3s_sbatch_script_is_read_from_the_command_it_hands_to_srun(actmem):
    """The training command lives in TRAINING_CMD, run by `srun bash -c "${TRAINING_CMD}"` inside
    an sbatch here-document: its arguments are refused for the flex dispatcher and Megatron-FSDP's bf16 gradient
    communication (Megatron-FSDP itself, and its main gradients' dtype, are read); its
    multi-latent attention and multi-token prediction are read (--multi-latent-attention, the ranks and head
    dims, --mtp-num-layers; YaRN's scaling and the MTP loss's factor change values only)."""
    result = actmem("estimate", "--megatron-args", f"@{EXAMPLES / 'sbatch_mfsdp_deepseek_v3.sh'}")
    assert_one_line_error(result, "the flex dispatcher (DeepEP or HybridEP",
                          "HuggingFaceTokenizer takes its vocabulary from its files")
    names = _refused_names(result.stderr)
    assert {"--moe-flex-dispatcher-backend", "--megatron-fsdp-grad-comm-dtype"} <= names
    assert not {"--fsdp-double-buffer", "--use-nccl-ub"} & names       # read under Megatron-FSDP
    assert not {"--use-megatron-fsdp", "--data-parallel-sharding-strategy", "--megatron-fsdp-main-grads-dtype"} & names
    assert not {"--num-experts", "--moe-layer-freq"} & names       # read: the experts and their layout are modelled
    assert not {"--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
                "--v-head-dim", "--rotary-scaling-factor", "--mscale", "--mscale-all-dim", "--mtp-num-layers",
                "--mtp-loss-scaling-factor"} & names
    assert not names & {"--num-layers", "--hidden-size", "--seq-length", "--lr", "--save", "--bf16"}
    assert "not an argument" not in result.stderr


def test_llama3_8b_in_bf16_is_estimated(actmem, tmp_path):
    """The script with DTYPE set to bf16 (its `if [[ "$DTYPE" == "fp8" ]]` then adds no FP8
    argument) and nothing else changed: Llama 3 8B on the script's one node of 8 GPUs (torchrun
    --nproc_per_node 8 --nnodes 1), t = 1 so Megatron turns --sequence-parallel off; global batch
    128 over d = 8: 16 microbatches; --vocab-size 128256 with NullTokenizer, padded to a
    multiple of 128: 128,256 = 1002·128 already; every other argument read or ignored."""
    script = _llama_in_bf16(tmp_path)
    out = actmem.json("estimate", "--megatron-args", f"@{script}")
    assert (out["model"]["layers"], out["model"]["hidden"], out["model"]["vocab"]) == (32, 4096, 128256)
    assert (out["run"]["gpus"], out["run"]["data_parallel"], out["run"]["microbatches_per_iteration"]) == (8, 8, 16)
    assert out["run"]["sequence_parallel"] is False
    notes = " ".join(out["assumptions"])
    assert "GPUs: 8 from the launcher (torchrun --nproc-per-node 8 x --nnodes 1)" in notes
    assert "Megatron turns it off" in notes
    assert out["parameters"]["gradients_bytes"] == 2 * out["parameters"]["count"]    # --grad-reduce-in-bf16
    assert "--apply-layernorm-1p: TE's norms take zero-centred weights inside their kernels" in notes
    assert "--calculate-per-token-loss" in notes                 # ignored: scalar divisions only
    assert "--overlap-grad-reduce and --overlap-param-gather read" in notes
    assert "--cross-entropy-loss-fusion read" in notes
    assert "not counted: the distributed optimizer's buffer padding" in notes


def _llama_in_bf16(tmp_path, tp="1") -> Path:
    text = (EXAMPLES / "train_llama3_8b_h100_fp8.sh").read_text().replace('DTYPE="fp8"', 'DTYPE="bf16"')
    script = tmp_path / "llama.sh"
    script.write_text(text.replace("TP_SIZE=1 ", f"TP_SIZE={tp} "))
    return script


def test_plan_and_flops_take_the_script_too(actmem, tmp_path):
    """plan sweeps the script's model on its launcher's 8 GPUs at its global batch 128, and
    --explain starts from the script's run (t = 2 with sequence parallelism, the distributed
    optimizer) where its text says nothing; flops takes the script's batch."""
    script = _llama_in_bf16(tmp_path, tp="2")
    out = actmem.json("plan", "--megatron-args", f"@{script}", "--gpu", "h100", "--top", "1")
    assert (out["request"]["gpus"], out["request"]["global_batch"]) == (8, 128)
    explained = actmem("plan", "--megatron-args", f"@{script}", "--gpu", "h100", "--explain", "b=1")
    assert explained.exit_code == 0, explained.output
    assert "run    t=2 p=1 m=1 b=1 · SP on · recompute none" in explained.stdout
    flops = actmem.json("flops", "--megatron-args", f"@{script}")
    assert flops["global_batch"] == 128


def test_the_attention_backend_a_script_names_is_said(actmem):
    """examples/llama/train_llama3_8b_h100_fp8.sh gives --attention-backend fused: priced as the flash path
    (TE's cuDNN attention keeps no s² tensor), and the notes say which flag decided it."""
    out = actmem.json("estimate", "--megatron-args", f"@{EXAMPLES / 'train_llama3_8b_h100_fp8.sh'}", "--gpu", "h100")
    assert out["architecture"]["attention_core"] == "flash"
    assert any(note.startswith("--attention-backend fused read: TE's cuDNN fused attention") for note in out["assumptions"])
