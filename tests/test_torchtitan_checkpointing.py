"""torchtitan's selective activation checkpointing (activation_checkpoint.mode "selective"; issue 30), torch-native's
selective recompute: with selective_ac_option "op", what each block's checkpoint keeps, by hand from torchtitan
018740b7's policy (distributed/activation_checkpoint.py, _apply_op_sac) and save list (models/llama3/infra/
parallelize.py, _op_sac_save_list); with a number N, which blocks it checkpoints (_apply_layer_sac); and what is
refused.

The policy saves the outputs of the listed ops a block runs, but every second matmul: of wq, wk, wv, wo, w1, w3, w2
(model.py's order) the 1st, 3rd, 5th and 7th: wq's, wv's, w1's and w2's; SDPA's output and log-sum-exp; under
sequence parallelism the two reduce-scatters after wo and w2. The checkpoint keeps the block's input too."""

import pytest
from click.testing import CliRunner

from actmem.cli.main import cli
from actmem.errors import SpecError
from actmem.memory.estimate import estimate
from actmem.model.recompute import OP_CHECKPOINTING, Recompute, RecomputePolicy
from actmem.model.spec import build_spec
from actmem.sources.presets import load_preset

S = 8192          # Llama 3.1's sequence in torchtitan's configs


def _llama(name: str, gpus: int, t: int = 1, fsdp: bool = True, sp: bool | None = None, **run):
    preset = load_preset(name)
    run = {"tensor_parallel": t, "sequence_parallel": t > 1 if sp is None else sp, "gpus": gpus, "fsdp": fsdp,
           "recompute": "selective", "selective_ac_option": "op"} | run
    return build_spec(preset.model, run, name=name, architecture=preset.architecture | {"implementation": "torch-native"})


def _terms(spec) -> dict:
    return {row.term.name: row.bytes_each for row in estimate(spec).run_terms if row.term.scope.value == "layer"}


def test_llama_8b_on_8_gpus_keeps_four_matmul_outputs_attention_and_the_input():
    """Llama 3.1 8B (h = 4096, a = 32, g = 8, d_h = 128, f = 14,336) at t = 1, b = 1: the block's input 2sh, wq's
    output 2s·ad = 2sh, wv's 2s·gd = 2·8192·1024, SDPA's output 2sh and fp32 log-sum-exp 4as, w1's output 2sf,
    w2's output 2sh: 521,142,272 B a layer; nothing else of the block (no norm input, no rope output, no w3)."""
    terms = _terms(_llama("llama-3.1-8b", 8))
    assert terms == {"layer_input_checkpoint": 2 * S * 4096, "query_projection_output": 2 * S * 4096,
                     "value_projection_output": 2 * S * 1024, "projection_input": 2 * S * 4096,
                     "softmax_lse": 4 * 32 * S, "gate_projection_output": 2 * S * 14336,
                     "fc2_partial_output": 2 * S * 4096}
    assert sum(terms.values()) == 521_142_272
    assert estimate(_llama("llama-3.1-8b", 8)).run.per_layer_bytes == 521_142_272


def test_under_tp_and_sp_w2s_partial_sums_stay_whole():
    """At t = 8 with SP (16 GPUs, d = 2), everything inside the blocks divides by t but w2's matmul output: under
    RowwiseParallel it is the rank's partial sums of the whole (s, h), before the reduce-scatter, 2sh = 67,108,864;
    the two reduce-scatters' outputs are the rank's s/t rows, 2 x 2sh/t. A layer: 2sh/t (input) + 2sh/t (wq) +
    2s·gd/t + 2sh/t (SDPA out) + 4as/t + 2sf/t + 2sh + 4sh/t = 140,640,256 B, of which w2's output is 48%."""
    terms = _terms(_llama("llama-3.1-8b", 16, t=8))
    assert terms["fc2_partial_output"] == 2 * S * 4096 == 67_108_864
    assert terms["reduce_scatter_outputs"] == 2 * 2 * S * 4096 // 8
    assert terms["gate_projection_output"] == 2 * S * 14336 // 8
    assert terms["value_projection_output"] == 2 * S * 1024 // 8
    assert terms["softmax_lse"] == 4 * 32 * S // 8
    assert sum(terms.values()) == 140_640_256


def test_llama_70b_at_t_8():
    """Llama 3.1 70B (h = 8192, a = 64, g = 8, f = 28,672) at t = 8 with SP: 3 x 2sh/t (input, wq, SDPA out)
    = 50,331,648, 4as/t = 262,144, 2s·gd/t = 2,097,152, 2sf/t = 58,720,256, 2sh = 134,217,728, 4sh/t = 33,554,432:
    279,183,360 B a layer (tp-sp without recompute keeps about twice that)."""
    spec = _llama("llama-3.1-70b", 64, t=8)
    assert sum(_terms(spec).values()) == 3 * 16_777_216 + 262_144 + 2_097_152 + 58_720_256 + 134_217_728 \
        + 33_554_432 == 279_183_360
    plain = estimate(build_spec(load_preset("llama-3.1-70b").model, {"tensor_parallel": 8, "sequence_parallel": True},
                                architecture=load_preset("llama-3.1-70b").architecture | {"implementation": "torch-native"}))
    assert plain.run.per_layer_bytes > 2 * 279_183_360


def test_plain_tp_all_reduces_and_caches_no_collective():
    """Without SP RowwiseParallel all-reduces, which torchtitan's list does not name: no reduce-scatter row; the
    block's input is then whole on every rank (2sh)."""
    terms = _terms(_llama("llama-3.1-8b", 16, t=8, sp=False))
    assert "reduce_scatter_outputs" not in terms
    assert terms["layer_input_checkpoint"] == terms["fc2_partial_output"] == 2 * S * 4096


def test_the_last_blocks_rerun_makes_the_whole_layer_less_what_the_checkpoint_kept():
    """The backward reruns the last block whole, the cached outputs handed back (SDPA's, w1's) or freed before the
    rerun ends (wq's, wv's, w2's): the layer as kept without recompute, less the 521,142,272 B the checkpoint kept,
    plus the block's output again (2sh), as under full recompute (engine.rematerialised_bytes)."""
    moments = {moment.name: {row.name: row.bytes for row in moment.parts}
               for moment in estimate(_llama("llama-3.1-8b", 8)).run.moments}
    whole = estimate(build_spec(load_preset("llama-3.1-8b").model, {},
                                architecture=load_preset("llama-3.1-8b").architecture
                                | {"implementation": "torch-native"})).run.per_layer_bytes
    assert moments["last_block"]["rematerialised"] == whole - 521_142_272 + 2 * S * 4096


def test_its_one_value_reads_and_writes_torchtitans_words():
    assert RecomputePolicy.parse("selective:op") == OP_CHECKPOINTING
    assert OP_CHECKPOINTING.label == "selective:op" and OP_CHECKPOINTING.word == "op"
    assert OP_CHECKPOINTING.granularity is Recompute.FULL and not OP_CHECKPOINTING.partial
    assert OP_CHECKPOINTING.run_values == {"recompute": "selective", "recompute_modules": None,
                                           "recompute_method": None, "recompute_layers": None,
                                           "selective_ac_option": "op"}
    assert RecomputePolicy.of_run("selective", option="op") == OP_CHECKPOINTING
    assert _llama("llama-3.1-8b", 8).run.policy == OP_CHECKPOINTING
    with pytest.raises(SpecError, match="checkpoints every layer alone"):
        RecomputePolicy(Recompute.FULL, method="block", layers=2, ops=True)


@pytest.mark.parametrize("run, architecture, message", [
    ({"recompute": "selective"}, {"implementation": "torch-native"}, "given its option: --selective-ac-option op"),
    ({"recompute": "selective", "selective_ac_option": "0"}, {"implementation": "torch-native"},
     "positive whole number N .* which is --recompute full"),
    ({"recompute": "selective", "selective_ac_option": "layer"}, {"implementation": "torch-native"},
     "give op .* or a positive whole number"),
    ({"recompute": "full", "selective_ac_option": "op"}, {"implementation": "torch-native"},
     "give --recompute selective"),
    ({"recompute": "selective", "selective_ac_option": "op"}, {}, "--implementation megatron has no such option"),
    ({"recompute": "selective", "selective_ac_option": "op", "recompute_modules": ("core_attn",)},
     {"implementation": "torch-native"}, "give one or the other"),
])
def test_refused(run, architecture, message):
    preset = load_preset("llama-3.1-8b")
    with pytest.raises(SpecError, match=message):
        build_spec(preset.model, run, architecture=preset.architecture | architecture)


def test_the_cli_names_the_run_and_its_rows():
    result = CliRunner().invoke(cli, ["estimate", "--model", "llama-3.1-8b", "--implementation", "torch-native",
                                      "--gpus", "16", "--tp", "8", "--fsdp", "--recompute", "selective",
                                      "--selective-ac-option", "op"])
    assert result.exit_code == 0, result.output
    assert "recompute selective:op" in result.output and "tp-sp-op ◀" in result.output
    assert "fc2_partial_output" in result.output
    refused = CliRunner().invoke(cli, ["estimate", "--model", "llama-3.1-8b", "--selective-ac-option", "op",
                                       "--recompute", "selective"])
    assert refused.exit_code == 2 and "no such option" in refused.output


# A block of Llama 3.1 8B kept whole under torch-native at t = 1, b = 1 (s = 8192, h = 4096, a = 32, f = 14,336): six
# 2sh tensors (the two norms' inputs, the gathered inputs of wq/wk/wv and of w1/w3, the rotated q, SDPA's output),
# k and v repeated to a heads 2 x 2sh, the two norms' fp32 rstd 2 x 4s, the log-sum-exp 4as, w1's and w3's outputs
# 2 x 2sf, silu's output 2sf and w2's input 2sf
WHOLE_8B = 6 * 2 * S * 4096 + 2 * 2 * S * 4096 + 2 * 4 * S + 4 * 32 * S + 4 * 2 * S * 14336


@pytest.mark.parametrize("n, checkpointed", [(2, 16), (3, 10)])
def test_the_layer_option_checkpoints_every_nth_block(n, checkpointed):
    """selective_ac_option N: _apply_layer_sac counts the blocks from 1 and wraps those the count divides by N in
    full checkpointing, the rest not at all: of 32, 16 at N = 2 and 10 at N = 3, each keeping its input (2sh), the
    others the whole block (1,477,509,120 B)."""
    assert WHOLE_8B == 1_477_509_120
    est = estimate(_llama("llama-3.1-8b", 8, selective_ac_option=str(n)))
    assert est.run.layers_bytes == checkpointed * 2 * S * 4096 + (32 - checkpointed) * WHOLE_8B
    rows = {row.term.name: row.count for row in est.run_terms if row.term.scope.value == "layer"}
    assert rows["layer_input_checkpoint"] == checkpointed and rows["swiglu_input"] == 32 - checkpointed
    assert est.spec.run.policy.label == f"selective:every={n}"


def test_the_last_block_reruns_only_where_n_divides_the_layers():
    """At N = 2 block 32 is checkpointed: the last block's backward reruns it beside every activation; at N = 3 it
    is kept whole (32 is not a multiple of 3): no rerun there, its own backward moments instead (the SwiGLU's)."""
    def last_block(n):
        return {moment.name: {row.name for row in moment.parts}
                for moment in estimate(_llama("llama-3.1-8b", 8, selective_ac_option=n)).run.moments}["last_block"]

    assert "rematerialised" in last_block("2")
    assert "rematerialised" not in last_block("3")


def test_the_layer_option_is_one_value_too():
    policy = RecomputePolicy.parse("selective:every=2")
    assert policy == RecomputePolicy(Recompute.FULL, method="every", layers=2) == RecomputePolicy.of_run(
        "selective", option="2")
    assert policy.partial and policy.word == "every=2" and policy.megatron_flags == ""
    assert policy.run_values == {"recompute": "selective", "recompute_modules": None, "recompute_method": None,
                                 "recompute_layers": None, "selective_ac_option": "2"}
    with pytest.raises(SpecError, match="selective:every=N"):
        RecomputePolicy.parse("full:every=2")        # Megatron's --recompute-method has no such method


def test_its_rerun_flops_are_the_three_matmuls_it_does_not_cache():
    """The per-op rerun runs again only the matmuls its policy does not cache, wk's, wo's and w3's (2·h·(gd + ad + f)
    FLOPs a token a layer: 2·4096·(1024 + 4096 + 14,336) = 159,383,552 for Llama 3.1 8B), and no attention scores
    (SDPA is cached); full recompute reruns every layer's matmuls and scores."""
    from actmem.planner.flops import _parts, hardware_parts

    preset = load_preset("llama-3.1-8b")
    arch = build_spec(preset.model, {}, architecture=preset.architecture | {"implementation": "torch-native"}
                      ).architecture
    B, s, L, h, v = 16, S, 32, 4096, 128_256
    layers, scores, logits = _parts(B, s, L, h, v, arch, 32)
    op = hardware_parts(B, s, L, h, v, Recompute.FULL, arch, 32, ops=True)
    assert op == (3 * layers + B * s * L * 159_383_552, 3 * scores, 3 * logits)
    assert hardware_parts(B, s, L, h, v, Recompute.FULL, arch, 32) == (4 * layers, 4 * scores, 3 * logits)


def test_the_planner_sweeps_it_under_torch_native_and_ranks_torchtitans_config_first():
    """torchtitan's Llama 3 8B on 8 H100s (benchmarks/llama3_h100_202412_torchtitan.md, Table 1: FSDP over 8, t = 1,
    local batch 2, global 16, selective op checkpointing; llama3_8b.toml: the same at local batch 1) is among the
    planner's first three for its cluster and batch, both its batches; and Megatron's sweep has no such choice."""
    from actmem.model.architecture import Architecture
    from actmem.model.hardware import GPUS
    from actmem.model.spec import Model
    from actmem.planner.plan import PlanRequest, config_label, plan, unmodelled_recompute

    preset = load_preset("llama-3.1-8b")
    request = PlanRequest(model=Model(**preset.model), gpus=8, global_batch=16, gpu=GPUS["h100"],
                          gpu_memory_bytes=GPUS["h100"].memory_bytes,
                          architecture=Architecture(**preset.architecture | {"implementation": "torch-native"}))
    top = [config_label(row) for row in plan(request).fitting.head(3).itertuples()]
    assert "t=1 p=1 m=1 b=2 nosp op fsdp" in top and "t=1 p=1 m=1 b=1 nosp op fsdp" in top, top
    megatron = PlanRequest(model=Model(**preset.model), gpus=8, global_batch=16, gpu=GPUS["h100"],
                           gpu_memory_bytes=GPUS["h100"].memory_bytes, architecture=Architecture(**preset.architecture))
    assert "selective:op" in unmodelled_recompute(megatron) and "selective:op" not in unmodelled_recompute(request)


def test_explain_reads_the_op_choice_back_and_times_it_as_the_sweep_does():
    """--explain 'op' is the sweep's row: its label, its run, and its time model's rerun (not full recompute's)."""
    import json

    args = ["plan", "--model", "llama-3.1-8b", "--implementation", "torch-native", "--gpus", "8", "--global-batch",
            "16"]
    sweep = CliRunner().invoke(cli, args + ["--top", "0", "--format", "json"])
    row = next(r for r in json.loads(sweep.output)["best"] if r["config"] == "t=1 p=1 m=1 b=1 nosp op fsdp")
    explained = CliRunner().invoke(cli, args + ["--explain", "t=1 p=1 m=1 b=1 op fsdp"])
    assert explained.exit_code == 0, explained.output
    text = " ".join(explained.output.split())
    assert "t=1 p=1 m=1 b=1 nosp op fsdp" in text and "recompute selective:op" in text
    assert f"iteration {row['iteration_s']:.3f}" in text


@pytest.mark.parametrize("extra, said", [(["--format", "json"], "--format shapes"),
                                         (["--top", "3", "--format", "csv"], "--format and --top shape")])
def test_explain_refuses_the_tables_flags(extra, said):
    """--explain prints one configuration on the terminal: a --format or --top beside it would be ignored."""
    result = CliRunner().invoke(cli, ["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--global-batch", "16",
                                      "--explain", "t=1 p=1 m=1 b=1 full", *extra])
    assert result.exit_code == 2 and said in result.output
