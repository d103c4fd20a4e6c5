"""--no-gradient-accumulation-fusion: Megatron's linears make 16-bit weight gradients (TE
linear.py: the wgrad GEMM with no out) instead of accumulating into main_grad and handing
autograd TE's cached dummy. Hand numbers for 530B (a=128, h=20480, t=8, p=35, m=3, SP +
selective):

  dummies gone        = 12h²/t elements x 2 B = 1,258,291,200 B (tests/test_readme_example.py)
  fc1's weight grad   = 4h·h/t x 2 B = 4·20480·20480/8 x 2 = 419,430,400 B, at fc1's backward
  fc1's moment, fused = 2·4h·sb/t + 2sbh + 2sbh + 2sbh/t + 2sbh/t
                      = 41,943,040 + 83,886,080 x 2 + 10,485,760 x 2 = 230,686,720 B
"""

from tests.conftest import assert_one_line_error

DUMMIES, FC1_WGRAD, FC1_MOMENT = 1_258_291_200, 419_430_400, 230_686_720


def test_no_dummies_and_fc1_s_16_bit_weight_gradient_in_its_moment(actmem):
    fused = actmem.json("estimate", "--model", "530b")
    unfused = actmem.json("estimate", "--model", "530b", "--no-gradient-accumulation-fusion")
    assert fused["parameters"]["dummy_wgrads_bytes"] == DUMMIES
    assert unfused["parameters"]["dummy_wgrads_bytes"] == 0
    assert unfused["parameters"]["total_bytes"] == fused["parameters"]["total_bytes"] - DUMMIES
    rows = {row["name"]: row["bytes"] for row in unfused["peak_floor"]["rows"]}
    assert unfused["peak_floor"]["moment"] == "the last layer's fc1 backward"
    assert rows["fc1_backward"] == FC1_MOMENT + FC1_WGRAD == 650_117_120
    assert unfused["run_terms"] == fused["run_terms"]               # the forward keeps the same tensors
    assert any("no gradient accumulation fusion" in note for note in unfused["assumptions"])


def test_the_paste_and_the_flag_agree_and_other_codes_refuse_it(actmem):
    paste = ("--num-layers 2 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --vocab-size 32000 "
             "--micro-batch-size 1 --bf16 --attention-backend local --no-create-attention-mask-in-dataloader")
    pasted = actmem.json("estimate", "--megatron-args", paste + " --no-gradient-accumulation-fusion")
    flagged = actmem.json("estimate", "--megatron-args", paste, "--no-gradient-accumulation-fusion")
    assert pasted["verdict_bytes"] == flagged["verdict_bytes"] and pasted["parameters"]["dummy_wgrads_bytes"] == 0
    assert_one_line_error(actmem("estimate", "--model", "llama-3.1-8b", "--implementation", "hf",
                                 "--no-gradient-accumulation-fusion"),
                          "--no-gradient-accumulation-fusion is Megatron's switch")


def test_plan_keeps_no_dummies_either():
    from actmem.model.architecture import Architecture
    from actmem.model.hardware import GPUS
    from actmem.planner.plan import PlanRequest, candidates, evaluate
    from actmem.sources.presets import load_preset
    from actmem.model.spec import Model

    pr = load_preset("175b")
    arch = Architecture(gradient_accumulation_fusion=False)
    req = PlanRequest(model=Model(**pr.model), gpus=pr.run["gpus"], global_batch=pr.run["global_batch"],
                      gpu=GPUS["a100"], gpu_memory_bytes=GPUS["a100"].memory_bytes, architecture=arch)
    rows = evaluate(req, candidates(req))
    assert (rows.dummy_wgrads_bytes == 0).all()          # each row the estimate's: tests/test_stage_model.py
