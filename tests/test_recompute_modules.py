"""Megatron's --recompute-modules: selective recompute of the attention core (core_attn, the
paper's), the MLP (mlp) and the norms (layernorm). Expected bytes are derived by hand below
from what each checkpoint keeps (transformer_layer.py, _forward_mlp; attention.py)."""

import pytest

from tests.conftest import assert_one_line_error, plan_row_run
from tests.test_llama import LLAMA_8B, LLAMA_8B_LAYER

# The paper's 22B run (Table 3): s = 2048, b = 4, h = 6144, a = 64, t = 8, SP on.
SBH_T = 2048 * 4 * 6144 // 8                  # 6,291,456 elements: one (s/t, b, h) shard
PAPER_22B = ("--model", "22b", "--recompute", "selective")


def _per_layer(out) -> dict:
    return {row["term"]: row["bytes_each"] for row in out["run_terms"] if row["scope"] == "layer"}


def _run_row(out) -> dict:
    return next(row for row in out["techniques"] if row["is_run"])


def _rerun(out) -> tuple[int, int]:
    """(rematerialised, freed before it) at the peak floor's rerun moment."""
    rows = {row["name"]: row["bytes"] for row in out["peak_floor"]["rows"]}
    assert out["peak_floor"]["moment"].startswith("the first backward, the ") and \
        out["peak_floor"]["moment"].endswith(" rerun done")
    return rows["rematerialised"], out["activations_bytes"] - rows["activations_in_flight"]


def test_mlp_recompute_under_the_eager_core_keeps_the_norm_s_output(actmem):
    """Eq 6 is 34sbh/t a layer. The eager core runs in Megatron's local spec, where the MLP's
    norm is a module of its own: the MLP's checkpoint keeps its input, the norm's output
    (fc1_input, 2sbh/t), and drops GeLU's input 8sbh/t and fc2's input 8sbh/t. Kept beside it:
    the norm's input (2sbh/t) and the mask of the dropout after the MLP (sbh/t).
    34 - 16 = 18sbh/t = 113,246,208 B."""
    out = actmem.json("estimate", *PAPER_22B, "--recompute-modules", "core_attn,mlp")
    layer = _per_layer(out)
    assert sum(layer.values()) == 18 * SBH_T == 113_246_208
    assert layer["mlp_layernorm_input"] == layer["fc1_input"] == 2 * SBH_T and layer["mlp_dropout_mask"] == SBH_T
    assert not {"gelu_input", "fc2_input"} & set(layer)
    assert out["run"]["technique"] == "tp-sp-sel·core_attn+mlp"
    assert _run_row(out)["per_layer_bytes"] == 113_246_208
    # the paper's selective row is still shown, at Eq 6's 34sbh/t
    assert {r["technique"]: r["per_layer_bytes"] for r in out["techniques"]}["tp-sp-sel"] == 34 * SBH_T


def test_the_order_and_spelling_of_the_modules_do_not_matter(actmem):
    a = actmem.json("estimate", *PAPER_22B, "--recompute-modules", "mlp,core_attn")
    b = actmem.json("estimate", *PAPER_22B, "--recompute-modules", "core_attn mlp")
    assert a["run_terms"] == b["run_terms"] and a["run"]["technique"] == b["run"]["technique"]
    # a flag and a paste that name the same modules in another order agree; other modules do not
    paste = ("--bf16 --transformer-impl local --recompute-granularity selective --recompute-modules core_attn mlp "
             "--no-create-attention-mask-in-dataloader")
    c = actmem.json("estimate", *PAPER_22B, "--recompute-modules", "mlp,core_attn", "--megatron-args", paste)
    assert c["run_terms"] == a["run_terms"]
    assert_one_line_error(actmem("estimate", *PAPER_22B, "--recompute-modules", "mlp", "--megatron-args", paste),
                          "--recompute-modules is given more than once and the values disagree")


def test_layernorm_recompute_changes_no_byte_under_te_and_says_why(actmem):
    """TE fuses both norms into the next linear (IdentityOp norms), and Megatron recomputes only
    a norm that is a module of its own: the same bytes as mlp alone, with a note."""
    selective = LLAMA_8B + " --recompute-granularity selective --recompute-modules mlp"
    plain = actmem.json("estimate", "--megatron-args", selective)
    with_norms = actmem.json("estimate", "--megatron-args", selective + " layernorm")
    assert with_norms["run_terms"] == plain["run_terms"]
    assert any("layernorm changes no byte here" in line for line in with_norms["assumptions"])


def test_llama_8b_with_mlp_recompute_under_flash(actmem):
    """Recomputing only the MLP is modelled under flash (the core is not checkpointed). The MLP
    drops fc1's input (8,388,608), SwiGLU's input (58,720,256), fc2's input (29,360,128) and its
    norm's rsigma (4,096): 142,745,600 - 96,473,088 = 46,272,512 B a layer."""
    out = actmem.json("estimate", "--megatron-args",
                      LLAMA_8B + " --recompute-granularity selective --recompute-modules mlp")
    dropped = {"fc1_input", "swiglu_input", "fc2_input", "mlp_norm_statistics"}
    assert _per_layer(out) == {name: n for name, n in LLAMA_8B_LAYER.items() if name not in dropped}
    assert _run_row(out)["per_layer_bytes"] == 46_272_512
    assert out["run"]["technique"] == "tp-sp-sel·mlp"
    assert any("the attention core is not recomputed" in line for line in out["assumptions"])


def test_the_mlp_rerun_is_the_peak_moment_on_a_stage_without_the_output_layer(actmem):
    """Stage 0 of p = 4 holds no output layer and, with no dropout, nothing of the last layer is
    freed before its MLP is rerun: the rerun adds the MLP's rows, 96,473,088 B."""
    out = actmem.json("estimate", "--megatron-args", LLAMA_8B + " --pipeline-model-parallel-size 4 "
                      "--recompute-granularity selective --recompute-modules mlp")
    assert _rerun(out) == (96_473_088, 0)


def test_the_attention_rerun_is_the_peak_moment_when_it_frees_less(actmem):
    """22B, core_attn and mlp. The core's rerun: 5as²b/t = 5·64·2048²·4/8 = 671,088,640 B and
    its output again, 2sbh/t = 12,582,912: 683,671,552 B, with the output layer's rows freed
    (fp32 logits 4sbv/t = 209,715,200, the final norm's and the output layer's inputs 2 x 2sbh/t)
    and the layer's rows after the core (projection input 2sbh/t, two masks sbh/t, the norm's
    input and output 2 x 2sbh/t): 234,881,024 + 50,331,648 = 285,212,672 B. The MLP's rerun, 16sbh/t = 100,663,296 B, frees more before it.
    Then the core's backward, at its dropout's: the rerun's dropout output 2as²b/t = 268,435,456
    freed, the probabilities' and the softmax output's gradients (2as²b/t each), v's, the core
    output's and the residual stream's (2sbh/t = 12,582,912 each) live."""
    out = actmem.json("estimate", *PAPER_22B, "--recompute-modules", "core_attn,mlp")
    rows = {row["name"]: row["bytes"] for row in out["peak_floor"]["rows"]}
    assert out["peak_floor"]["moment"] == "the last layer's attention core backward"
    assert rows["rematerialised"] == 671_088_640 + 12_582_912 - 268_435_456
    assert out["activations_bytes"] - rows["activations_in_flight"] == 285_212_672
    assert rows["core_backward"] == 2 * 268_435_456 + 3 * 12_582_912


@pytest.mark.parametrize("args, fragment", [
    (("--recompute", "full", "--recompute-modules", "mlp"),
     "--recompute-modules chooses what selective recompute recomputes (Megatron reads it only then; a preset "
     "names it recompute_modules); this run's recompute is full"),
    (("--recompute", "selective", "--recompute-modules", "moe_act"),
     "--recompute-modules moe_act recomputes the experts' activation, which Megatron does only in a grouped GEMM "
     "(it raises otherwise: transformer_config.py): this model has no experts"),
    (("--recompute", "selective", "--recompute-modules", "moe"),
     "--recompute-modules moe recomputes parts of a mixture-of-experts layer; this model has none"),
    (("--recompute", "selective", "--recompute-modules", "mla_up_proj"),
     "--recompute-modules mla_up_proj recomputes multi-latent attention's up projections; this model has none"),
    (("--recompute", "selective", "--recompute-modules", "attention"),
     "--recompute-modules attention is not one of Megatron's modules"),
    (("--recompute", "selective", "--recompute-modules", ","), "--recompute-modules names no module"),
    (("--recompute", "selective", "--recompute-modules", "core_attn,layernorm"),
     "--recompute-modules layernorm under the eager core: Megatron runs that core in its local spec"),
    (("--recompute", "selective", "--recompute-modules", "core_attn", "--attention-core", "flash",
      "--attention-dropout", "0"), "(Megatron's core_attn) under flash attention is modelled with rotary positions"),
])
def test_bad_recompute_modules_are_one_line(actmem, args, fragment):
    assert_one_line_error(actmem("estimate", "--model", "22b", *args), fragment)


def test_a_preset_file_may_name_the_modules(actmem, tmp_path):
    preset = tmp_path / "mine.toml"
    preset.write_text('[model]\nheads = 64\nhidden = 6144\nlayers = 48\nvocab = 51200\nseq_len = 2048\n'
                      '[run]\ntensor_parallel = 8\nsequence_parallel = true\nmicro_batch = 4\n'
                      'recompute = "selective"\nrecompute_modules = ["mlp", "core_attn"]\n')
    out = actmem.json("estimate", "--model", str(preset))
    assert _run_row(out)["per_layer_bytes"] == 18 * SBH_T


# -- the planner sweeps the MLP's recompute too ---------------------------------------------

def test_the_mlp_rerun_costs_one_forward_of_its_matmuls():
    """GPT-3 (B = 1536, s = 2048, L = 96, h = 12288): recomputing the MLP adds one forward of
    its two matmuls, 2·B·s·L·2·h·4h = 16·B·s·L·h², beside the core or alone; SwiGLU's three
    (f = 14336, h = 4096): 2·B·s·L·3·h·f."""
    from actmem.model.architecture import Architecture
    from actmem.planner.flops import hardware_flops
    from actmem.model.recompute import Recompute

    B, s, L, h, v = 1536, 2048, 96, 12288, 51200
    both, core, mlp = frozenset({"core_attn", "mlp"}), frozenset({"core_attn"}), frozenset({"mlp"})
    sel = lambda modules, arch=Architecture(): hardware_flops(B, s, L, h, v, Recompute.SELECTIVE, arch, 96, modules)
    assert sel(both) - sel(core) == pytest.approx(16 * B * s * L * h * h, rel=1e-12)
    assert sel(mlp) - hardware_flops(B, s, L, h, v, Recompute.NONE) == pytest.approx(16 * B * s * L * h * h, rel=1e-12)
    gated = Architecture(activation="swiglu", ffn_hidden=14336)
    none = hardware_flops(B, s, L, 4096, v, Recompute.NONE, gated, 32)
    assert hardware_flops(B, s, L, 4096, v, Recompute.SELECTIVE, gated, 32, mlp) - none == \
        pytest.approx(2 * B * s * L * 3 * 4096 * 14336, rel=1e-12)


def test_the_mlp_rerun_repeats_its_forward_collective():
    """A layer's collectives: 2 forward + 2 backward; the MLP's rerun adds its one (5/4), full
    recompute both forward ones (6/4); the attention core has none (4/4)."""
    from actmem.planner.iteration import tensor_parallel_seconds

    seconds = {mode: tensor_parallel_seconds(2048, 1, 12288, 96 // 8, 8, 64, mode, 230e9)
               for mode in ("none", "selective", "selective:core_attn+mlp", "selective:mlp", "full")}
    assert seconds["selective"] == seconds["none"]
    assert seconds["selective:mlp"] == seconds["selective:core_attn+mlp"] == pytest.approx(seconds["none"] * 5 / 4)
    assert seconds["full"] == pytest.approx(seconds["none"] * 6 / 4)


def test_the_planner_sweeps_every_recompute_module_under_flash_with_rope():
    """Under flash with rotary positions both modules are modelled (the core's checkpoint too):
    the sweep has sel, sel+mlp and mlp rows; their peaks are the exact estimate's verdicts."""
    from actmem.memory.estimate import estimate
    from actmem.model.hardware import GPUS
    from actmem.planner.plan import PlanRequest, plan
    from actmem.sources.presets import load_preset
    from actmem.model.spec import build_spec
    from actmem.memory.techniques import PLAN_RECOMPUTE

    preset = load_preset("llama-3.1-70b")
    spec = build_spec(preset.model, {}, architecture=preset.architecture)
    req = PlanRequest(model=spec.model, gpus=64, global_batch=64, gpu=GPUS["h100"], gpu_memory_bytes=80 * 2**30,
                      architecture=spec.architecture)
    evaluated = plan(req).evaluated
    # and block=N (plan.block_recompute) where full recompute fits and none does not
    assert set(evaluated.recompute) == {"none", "selective", "selective:core_attn+mlp", "selective:mlp", "full",
                                        "full:block"}
    for row in evaluated[evaluated.recompute.str.startswith("selective")].groupby("recompute").head(3).itertuples():
        run = plan_row_run(row, gpus=64, global_batch=64)
        est = estimate(build_spec(preset.model, run, architecture=preset.architecture))
        assert row.peak_bytes == est.verdict_bytes, row
    from tests.test_plan import request

    evaluated = plan(request("530b")).evaluated
    # the eager core: all five of Megatron's (torchtitan's per-op checkpointing is torch-native's)
    assert set(evaluated.recompute) == set(PLAN_RECOMPUTE) - {"selective:op"} | {"full:block"}
    for name in ("selective:mlp", "selective:core_attn+mlp"):   # the MLP keeps fc1_input there
        for row in evaluated[evaluated.recompute == name].head(3).itertuples():
            run = dict(tensor_parallel=row.t, pipeline_parallel=row.p, interleave=row.m, micro_batch=row.b,
                       sequence_parallel=row.sequence_parallel, gpus=280, global_batch=280,
                       distributed_optimizer=row.distributed_optimizer, **PLAN_RECOMPUTE[name].run_values)
            preset = load_preset("530b")
            est = estimate(build_spec(preset.model, preset.run | run, architecture=preset.architecture))
            assert row.peak_bytes == est.verdict_bytes, row


def test_explain_reads_the_mlp_words_back(actmem):
    text = actmem("plan", "--model", "530b", "--gpus", "280", "--global-batch", "280", "--explain",
                  "t=8 p=35 m=3 b=1 sp sel+mlp").output
    assert "recompute selective:core_attn+mlp" in text and "sp sel+mlp" in text


def _llama_8b_preset(tmp_path, modules) -> str:
    preset = tmp_path / "llama.toml"
    listed = ", ".join(f'"{module}"' for module in modules)
    preset.write_text(open("presets/llama-3.1-8b.toml").read()
                      + f'\n[run]\nrecompute = "selective"\nrecompute_modules = [{listed}]\n')
    return str(preset)


def test_explain_takes_the_preset_s_modules_or_says_it_cannot(actmem, tmp_path):
    """A preset's mlp recompute is the plan's mlp; layernorm is none of the plan's choices."""
    args = ("plan", "--gpus", "8", "--global-batch", "8", "--explain", "t=8 p=1 m=1 b=1 sp")
    text = actmem(*args[:1], "--model", _llama_8b_preset(tmp_path, ["mlp"]), *args[1:]).output
    assert "recompute selective:mlp" in text and "sp mlp" in text
    assert_one_line_error(actmem(*args[:1], "--model", _llama_8b_preset(tmp_path, ["mlp", "layernorm"]), *args[1:]),
                          "the preset's recompute modules (mlp, layernorm) are not among the plan's choices")
