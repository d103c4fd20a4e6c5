"""An accelerate config (``accelerate launch --config_file``, TRL's examples/accelerate_configs) given to
--deepspeed: read as accelerate's DeepSpeedPlugin writes the DeepSpeed config from it (accelerate 16cb6eb8,
utils/dataclasses.py, __post_init__; utils/launch.py, prepare_deepspeed_cmd_env), the GPUs from num_processes.
A config without an optimizer section, ZeRO stage N, bf16 and DeepSpeed's other defaults is what --zero-stage N
prices, so the two agree to the byte."""

import pytest

from tests.conftest import assert_one_line_error

ZERO3 = "tests/data/accelerate/trl_deepspeed_zero3.yaml"
ZERO2 = "tests/data/accelerate/trl_deepspeed_zero2.yaml"
HF = ("estimate", "--model", "llama-3.1-8b", "--implementation", "hf", "--gradient_checkpointing")


@pytest.mark.parametrize("path, stage", [(ZERO3, 3), (ZERO2, 2)])
def test_trls_accelerate_configs_price_as_their_stage_on_their_gpus(actmem, path, stage):
    out = actmem.json(*HF, "--deepspeed", path)
    same = actmem.json(*HF, "--zero-stage", str(stage), "--gpus", "8")
    assert out["run"]["gpus"] == 8 and out["run"]["zero_stage"] == stage
    assert out["peak_floor"]["total_bytes"] == same["peak_floor"]["total_bytes"]
    assert any("accelerate's DeepSpeedPlugin writes the DeepSpeed config" in note for note in out["assumptions"])


def test_a_deepspeed_config_file_it_names_is_read(actmem, tmp_path):
    path = tmp_path / "accelerate.yaml"
    """Its settings are the file's; beside it accelerate refuses its own (DeepSpeedPlugin._deepspeed_config_checks,
    mixed_precision too), and so does actmem."""
    path.write_text("distributed_type: DEEPSPEED\nnum_processes: 8\ndeepspeed_config:\n"
                    "  deepspeed_config_file: tests/data/deepspeed/ds_config_zero3.json\n")
    out = actmem.json(*HF, "--deepspeed", str(path))
    direct = actmem.json(*HF, "--deepspeed", "tests/data/deepspeed/ds_config_zero3.json", "--gpus", "8")
    assert out["peak_floor"]["total_bytes"] == direct["peak_floor"]["total_bytes"]
    path.write_text("distributed_type: DEEPSPEED\nmixed_precision: bf16\nnum_processes: 8\ndeepspeed_config:\n"
                    "  zero_stage: 2\n  deepspeed_config_file: tests/data/deepspeed/ds_config_zero3.json\n")
    assert_one_line_error(actmem(*HF, "--deepspeed", str(path)),
                          "zero_stage, mixed_precision beside deepspeed_config_file: accelerate refuses them")


@pytest.mark.parametrize("change, fragment", [
    ({"num_processes": 16}, None),            # --gpus 8 against 16: refused below
    ({"distributed_type": "MULTI_GPU"}, "an accelerate config of distributed_type 'MULTI_GPU'; actmem reads "
                                        "DEEPSPEED's"),
    ({"mixed_precision": "fp16"}, "mixed_precision fp16: actmem prices bf16 training only"),
    ({"deepspeed_config": {"zero_stage": 3, "offload_optimizer_device": "cpu"}},
     "offload_optimizer_device cpu: ZeRO-Offload is not modelled yet"),
    ({"deepspeed_config": {"zero_stage": 3, "deepspeed_moe_layer_cls_names": "MixtralSparseMoeBlock"}},
     "deepspeed_config's deepspeed_moe_layer_cls_names: not read by actmem"),
])
def test_what_an_accelerate_config_cannot_price_is_refused(actmem, tmp_path, change, fragment):
    import yaml

    config = yaml.safe_load(open(ZERO3)) | change
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(config))
    if fragment is None:
        assert_one_line_error(actmem(*HF, "--deepspeed", str(path), "--gpus", "8"),
                              f"--gpus 8 and --deepspeed {path} (num_processes: 16) disagree")
    else:
        assert_one_line_error(actmem(*HF, "--deepspeed", str(path)), fragment)


def test_its_gradient_accumulation_must_agree_with_the_trainers(actmem):
    """TRL's ZeRO-3 config says gradient_accumulation_steps 1, which the Trainer's must match (it raises on a
    mismatch: integrations/deepspeed.py, trainer_config_process)."""
    assert_one_line_error(actmem(*HF, "--deepspeed", ZERO3, "--gradient_accumulation_steps", "4"),
                          f"--gradient-accumulation-steps 4 and --deepspeed {ZERO3}")
    out = actmem.json(*HF, "--deepspeed", ZERO3, "--gradient_accumulation_steps", "1")
    assert out["run"]["global_batch"] == 8


def test_a_named_file_without_gradient_accumulation_takes_accelerates_1(actmem, tmp_path):
    """DeepSpeedPlugin.__post_init__ sets gradient_accumulation_steps 1 in a named file that gives none: the Trainer's
    4 would then mismatch (trainer_config_process raises), and actmem refuses it."""
    import json

    config = json.loads(open("tests/data/deepspeed/ds_config_zero3.json").read())
    del config["gradient_accumulation_steps"]
    (tmp_path / "ds.json").write_text(json.dumps(config))
    path = tmp_path / "accelerate.yaml"
    path.write_text(f"distributed_type: DEEPSPEED\nnum_processes: 8\ndeepspeed_config:\n"
                    f"  deepspeed_config_file: {tmp_path / 'ds.json'}\n")
    assert actmem.json(*HF, "--deepspeed", str(path))["run"]["global_batch"] == 8
    assert_one_line_error(actmem(*HF, "--deepspeed", str(path), "--gradient_accumulation_steps", "4"),
                          "(gradient_accumulation_steps 1) disagree")


def test_a_file_without_a_micro_batch_says_what_b_it_priced(actmem):
    """TRL's configs leave train_micro_batch_size_per_gpu "auto" (accelerate's plugin writes it so): the Trainer's
    --per_device_train_batch_size fills it (8 by default: training_args.py), so the estimate says the b it priced."""
    notes = " ".join(actmem.json(*HF, "--deepspeed", ZERO3, "--per_device_train_batch_size", "2")["assumptions"])
    assert "the file gives no train_micro_batch_size_per_gpu" in notes and "priced at b = 2 (--micro-batch)" in notes
    notes = " ".join(actmem.json(*HF, "--zero-stage", "3", "--gpus", "8")["assumptions"])
    assert "train_micro_batch_size_per_gpu" not in notes
