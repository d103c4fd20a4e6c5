"""Megatron-FSDP (megatron-core's own FSDP: --use-megatron-fsdp, --data-parallel-sharding-strategy): the model state
a rank keeps under each strategy, by hand, and Megatron-LM's own FSDP example as it prices.

Llama 3.1 8B at t = 1: N = 2·128,256·4096 (embedding, untied output) + 4096 (final norm) + 32 layers of
4096·(4096 + 2·8·128) (QKV) + 4096² (projection) + 3·4096·14,336 (SwiGLU) + 2·4096 (norms) = 218,112,000 each:
N = 1,050,673,152 + 4096 + 6,979,584,000 = 8,030,261,248.

Its buckets, padded as param_and_grad_buffer.py's build_data_parallel_buffer_index lays them out, at d·c = 8:
- optim, optim_grads, optim_grads_params: a bucket a layer (a unit: Megatron-LM d98e8a64) and one of the rest. A
  layer's rows widest first: fc2 [4096, 14,336] (row 14,336), the projection, QKV and fc1 (row 4096), the two norms (row 1); chunk factor lcm(14,336, 4096) =
  28,672. fc2 (2048 chunks) at 0; the projection (16,777,216 = 585 chunks + 4096) ends 4096 into a chunk, QKV
  (25,165,824 = 877 chunks + 20,480) shares that chunk's last 20,480, a norm fills the 4096 between; fc1 (4096
  chunks); the other norm at the end: 218,112,000 with no hole, padded to 8·28,672 = 229,376: 951·229,376 =
  218,136,576 (shard 27,267,072). The rest (embedding, final norm, output: rows 4096, 4096, 1): factor 4096,
  1,050,677,248 padded to 32,768: 32,065·32,768 = 1,050,705,920 (shard 131,338,240). P = 32·218,136,576 +
  1,050,705,920 = 8,031,076,352; a rank's shard S = P/8 = 1,003,884,544; padding only at each bucket's end, so
  rank 0's shard is all parameters and Adam's moments cover S elements there.
- no_shard: one bucket of every parameter. Rows: 32 fc2s, then the embedding, the layers'
  projection, QKV and fc1, the output layer, then 65 norms; factor 28,672. fc2s whole; the embedding (18,322 chunks
  + 8192) shares its last chunk with layer 1's projection (+4096), 4 norms fill the 16,384 left; each layer's QKV
  (+20,480) shares with the next layer's projection (+4096), a norm the 4096 left; layer 32's QKV with the output
  (+8192) exactly; 30 norms at the end: no hole, the layout is N long, unpadded under no_shard."""

import pytest

from tests.conftest import assert_one_line_error

N = 8_030_261_248
P, S = 8_031_076_352, 1_003_884_544            # the padded buckets, a rank's shard (all strategies but no_shard)
GATHERED = 2 * 1_050_705_920                   # the rest's padded bucket, 16-bit
EXAMPLE = "tests/data/megatron_examples/train_llama3_8b_fsdp_h100_fp8.sh"
#: TE's dummy weight gradients (fusion on): QKV [6144, 4096], projection [4096, 4096], fc1 [28,672, 4096],
#: fc2 [4096, 14,336], output [128,256, 4096], 2 B an element
DUMMIES = 2 * (6144 * 4096 + 4096 * 4096 + 28_672 * 4096 + 4096 * 14_336 + 128_256 * 4096)


def _state(actmem, *args):
    out = actmem.json("estimate", "-m", "llama-3.1-8b", "--use-megatron-fsdp", *args)
    params = out["parameters"]
    return params["weights_bytes"], params["gradients_bytes"], params["optimizer_bytes"], params["dummy_wgrads_bytes"]


@pytest.mark.parametrize("strategy, args, expected", [
    # the default, optim_grads_params, over d = 8: 2 + 2 (bf16 gradients: auto, the weights' dtype) + 4 + 8 B a
    # shard element (fp32 main weights; Adam's moments on the S parameter elements of rank 0's shard)
    (None, ("--gpus", "8"), (2 * S, 2 * S, 12 * S)),
    # optim: the main weights and Adam's moments alone sharded; the 16-bit weights and gradients padded, whole
    ("optim", ("--gpus", "8"), (2 * P, 2 * P, 12 * S)),
    # optim_grads: and the gradients, here fp32 (--megatron-fsdp-main-grads-dtype fp32)
    ("optim_grads", ("--gpus", "8", "--megatron-fsdp-main-grads-dtype", "fp32"), (2 * P, 4 * S, 12 * S)),
    # no_shard over d·c = 8·2: nothing sharded nor padded, 2 + 4 + 12 = 18 B a parameter, DDP's
    ("no_shard", ("--gpus", "16", "--cp", "2", "--megatron-fsdp-main-grads-dtype", "fp32"), (2 * N, 4 * N, 12 * N)),
])
def test_each_strategy_shards_what_its_buffers_shard(actmem, strategy, args, expected):
    """param_and_grad_buffer.py (_init_each_parameter_group_buffers): which of the weight, gradient and main-weight
    buffers a strategy distributes, each bucket padded (the module docstring's layouts); Adam's moments live on the
    main weights' shards."""
    chosen = ("--data-parallel-sharding-strategy", strategy) if strategy else ()
    assert _state(actmem, *args, *chosen) == (*expected, DUMMIES)
    assert DUMMIES == 1_486_880_768


def test_the_state_is_held_at_every_moment_and_named(actmem):
    """The buffers are allocated once: the peak counts all of them (and the activations' moment beside them);
    the output names the strategy, what it shards and what is not counted."""
    out = actmem.json("estimate", "-m", "llama-3.1-8b", "--use-megatron-fsdp", "--gpus", "8")
    state = {row["name"]: row["bytes"] for row in out["stages"][0]["peak_floor"]["rows"]}
    assert (state["weights"], state["main_gradients"], state["optimizer_state"]) == (2 * S, 2 * S, 12 * S)
    # the peak is the loss's moment: the three units the final norm's forward prefetch gathered again, 2·218,136,576
    # each (the window: 5·10⁸ elements, three padded layer buckets)
    assert state["regathered_unit_weights"] == 3 * 2 * 218_136_576 == 1_308_819_456
    assert out["run"]["megatron_fsdp"] == "optim_grads_params"
    notes = " ".join(out["assumptions"])
    assert ("--data-parallel-sharding-strategy optim_grads_params: 16-bit weights, main gradients, fp32 main "
            "weights and Adam's moments sharded over d = 8") in notes
    assert "each bucket padded as build_data_parallel_buffer_index lays it out" in notes
    assert f"{P:,} elements for {N:,} parameters (+0.01%)" in notes
    text = actmem("estimate", "-m", "llama-3.1-8b", "--use-megatron-fsdp", "--gpus", "8").output
    assert "recompute none · Megatron-FSDP" in text and "optim_grads_params over d=8" in text    # (wrapped)


def _example(tmp_path, strategy=None, fsdp=True, user_buffers=True):
    """Megatron-LM's Megatron-FSDP example as a user edits it to run in bf16 (FP8 beside Megatron-FSDP is not
    modelled): DTYPE; ``strategy``, its SHARDING_STRATEGY default; ``fsdp`` False, its DDP path (USE_MEGATRON_FSDP=0);
    ``user_buffers`` False, without its three lines of --use-nccl-ub, --fsdp-double-buffer and
    --fsdp-manual-registration."""
    text = open(EXAMPLE).read().replace('DTYPE="fp8"', 'DTYPE="bf16"')
    text = "\n".join(line for line in text.splitlines() if user_buffers or line.strip() not in (
        "--use-nccl-ub", "--fsdp-double-buffer", "--fsdp-manual-registration"))
    if strategy:
        text = text.replace('SHARDING_STRATEGY:-"optim_grads_params"', f'SHARDING_STRATEGY:-"{strategy}"')
    if not fsdp:
        text = text.replace("USE_MEGATRON_FSDP:-1", "USE_MEGATRON_FSDP:-0")
    script = tmp_path / f"fsdp_{strategy}_{fsdp}.sh"
    script.write_text(text)
    return f"@{script}"


def test_megatron_lms_fsdp_example_prices_and_its_optim_strategy_pads_what_its_ddp_path_does_not(actmem, tmp_path):
    """The example (8 GPUs, t = 1, optim_grads_params, --no-gradient-accumulation-fusion: no dummy weight
    gradients) keeps 16S = 16,062,152,704 B of model state a rank (the module docstring's shard S), and the weights
    outside its units gathered through the step: the rest's padded bucket, 2·1,050,705,920 = 2,101,411,840 B (its
    parameters 2·(2·128,256·4096 + 4096) = 2,101,354,496 B, and 28,672 elements of padding). With
    SHARDING_STRATEGY=optim and fp32 main gradients: 2P + 4P + 12S, where its DDP path (USE_MEGATRON_FSDP=0: DDP
    with the distributed optimizer, fp32 gradients; the dummies beside) keeps 2N + 4N + 12N/8. Here without its NCCL
    user buffers (their double buffers: test_the_double_buffers_pools_...)."""
    out = actmem.json("estimate", "--megatron-args", _example(tmp_path, user_buffers=False))
    assert out["parameters"]["gathered_bytes"] == GATHERED == 2_101_354_496 + 2 * 28_672
    notes = " ".join(out["assumptions"])       # its buckets and hooks are Megatron-FSDP's, not DDP's
    assert "--overlap-grad-reduce and --overlap-param-gather read: under Megatron-FSDP" in notes
    assert "Megatron-FSDP's hook adds to main_grad" in notes and "DDP already holds" not in notes
    assert out["parameters"]["total_bytes"] == 16 * S + GATHERED == 16_062_152_704 + GATHERED
    assert out["parameters"]["dummy_wgrads_bytes"] == 0
    optim = actmem.json("estimate", "--megatron-args", _example(tmp_path, "optim", user_buffers=False),
                        "--megatron-fsdp-main-grads-dtype", "fp32")
    ddp = actmem.json("estimate", "--megatron-args", _example(tmp_path, fsdp=False))
    state = ("weights_bytes", "gradients_bytes", "optimizer_bytes")
    assert [optim["parameters"][key] for key in state] == [2 * P, 4 * P, 12 * S]
    assert [ddp["parameters"][key] for key in state] == [2 * N, 4 * N, 12 * N // 8]


def test_a_pasted_bucket_size_splits_the_buckets_outside_the_units_once_grad_reduce_overlaps(actmem, tmp_path):
    """Megatron-LM hands Megatron-FSDP --ddp-bucket-size where --overlap-grad-reduce is on (training.py,
    resolve_ddp_bucket_size), None without it. The example gives --overlap-grad-reduce: at its default size,
    max(4·10⁷, 10⁶·8), the rest splits into [embedding] and [final norm, output]: 525,336,576 (a multiple of
    8·4096) and 525,340,672 padded to 525,369,344: 1,050,705,920, as one bucket pads it. At --ddp-bucket-size 1
    each parameter is a bucket: the embedding and the output whole, the norm (factor 1) padded to 8: nothing
    padded, the gathered weights 2·(2·128,256·4096 + 4096) = 2,101,354,496. Without --overlap-grad-reduce the size
    is not read: the one bucket again."""
    example = _example(tmp_path)[1:]
    text = open(example).read().replace("--overlap-grad-reduce", "--overlap-grad-reduce --ddp-bucket-size 1")
    (tmp_path / "one.sh").write_text(text)
    (tmp_path / "none.sh").write_text(text.replace("--overlap-grad-reduce ", ""))
    gathered = {name: actmem.json("estimate", "--megatron-args", f"@{tmp_path / name}")["parameters"]["gathered_bytes"]
                for name in ("one.sh", "none.sh")}
    assert gathered == {"one.sh": 2_101_354_496, "none.sh": GATHERED}
    (tmp_path / "count.sh").write_text(text.replace("--ddp-bucket-size 1", "--ddp-num-buckets 4"))
    assert_one_line_error(actmem("estimate", "--megatron-args", f"@{tmp_path / 'count.sh'}"),
                          "--ddp-num-buckets under Megatron-FSDP (its buckets outside the units sized from the rank's "
                          "parameter count) is not modelled yet")


@pytest.mark.parametrize("edit, fragment", [
    (("--ckpt-format fsdp_dtensor", ""), "Megatron refuses --use-megatron-fsdp without --ckpt-format fsdp_dtensor"),
    (('SHARDING_STRATEGY:-"optim_grads_params"', 'SHARDING_STRATEGY:-"no_shard"'),
     "Megatron refuses --init-model-with-meta-device beside --data-parallel-sharding-strategy no_shard"),
    (("unset CUDA_DEVICE_MAX_CONNECTIONS", "export CUDA_DEVICE_MAX_CONNECTIONS=1"),
     "the script exports CUDA_DEVICE_MAX_CONNECTIONS=1, and Megatron refuses it beside --use-megatron-fsdp"),
])
def test_what_megatron_stops_on_beside_megatron_fsdp_is_refused(actmem, tmp_path, edit, fragment):
    """Megatron-LM d98e8a64's validate_args (arguments.py) asserts the checkpoint format, refuses meta-device
    initialization under no_shard and CUDA_DEVICE_MAX_CONNECTIONS=1 beside Megatron-FSDP: its own example, edited."""
    text = open(_example(tmp_path)[1:]).read()
    assert edit[0] in text
    (tmp_path / "edited.sh").write_text(text.replace(edit[0], edit[1]))
    assert_one_line_error(actmem("estimate", "--megatron-args", f"@{tmp_path / 'edited.sh'}"), fragment)


@pytest.mark.parametrize("args, fragment", [
    (("--data-parallel-sharding-strategy", "optim"), "--data-parallel-sharding-strategy optim is Megatron-FSDP's"),
    (("--megatron-fsdp-main-grads-dtype", "fp32", "--gpus", "8"),
     "--megatron-fsdp-main-grads-dtype fp32 is Megatron-FSDP's: give --use-megatron-fsdp too"),
    (("--use-megatron-fsdp",), "--use-megatron-fsdp shards the model state over the d·c data-parallel ranks: give --gpus"),
    (("--use-megatron-fsdp", "--gpus", "8", "--grad-reduce-in-bf16"),
     "sets the gradient buffer of Megatron's DDP, which Megatron-FSDP does not read"),
    (("--use-megatron-fsdp", "--gpus", "8", "--pp", "2"), "--use-megatron-fsdp is modelled at p = 1"),
    (("--use-megatron-fsdp", "--gpus", "8", "--mtp-num-layers", "1"),
     "--use-megatron-fsdp is modelled for standard attention without multi-token prediction"),
    (("--use-megatron-fsdp", "--gpus", "8", "--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--gpu", "h100"),
     "--use-megatron-fsdp under --fp8-recipe blockwise is not modelled yet"),
    (("--use-megatron-fsdp", "--gpus", "8", "--fp8-format", "e4m3", "--gpu", "h100", "--fp8-param-gather",
      "--data-parallel-sharding-strategy", "optim_grads"),
     "--use-megatron-fsdp with --fp8-param-gather is modelled for --data-parallel-sharding-strategy "
     "optim_grads_params"),
    (("--use-megatron-fsdp", "--gpus", "8", "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--gpu", "h100",
      "--first-last-layers-bf16"),
     "--use-megatron-fsdp beside --first-last-layers-bf16 is not modelled yet"),
    (("--use-megatron-fsdp", "--gpus", "8", "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--gpu", "b200"),
     "--use-megatron-fsdp under FP8 is modelled on Hopper"),
    (("--use-megatron-fsdp", "--gpus", "8", "--implementation", "hf"),
     "--use-megatron-fsdp is megatron-core's own FSDP, modelled under --implementation megatron, not hf"),
])
def test_what_megatron_fsdp_is_not_modelled_beside_is_refused(actmem, args, fragment):
    assert_one_line_error(actmem("estimate", "-m", "llama-3.1-8b", *args), fragment)


def test_plan_refuses_a_megatron_fsdp_paste(actmem, tmp_path):
    assert_one_line_error(actmem("plan", "--megatron-args", _example(tmp_path), "--gpus", "8"),
                          "plan does not sweep Megatron-FSDP yet")


def test_an_fp16_paste_keeps_fp16_gradients_and_turns_the_distributed_optimizer_on(actmem, tmp_path):
    """Under --fp16 Megatron's DDP keeps 16-bit gradient buffers (actmem implies --grad-dtype fp16 for a paste);
    Megatron-FSDP's own follow the weights' dtype, fp16, 2 B: not refused as a DDP setting. Megatron-FSDP v1 turns
    the distributed optimizer on (arguments.py: 'Using DistributedOptimizer')."""
    text = open(EXAMPLE).read().replace('DTYPE="fp8"', 'DTYPE="fp16"').replace("    --bf16\n", "    --fp16\n")
    text = "\n".join(line for line in text.splitlines()
                     if line.strip() not in ("--use-nccl-ub", "--fsdp-double-buffer", "--fsdp-manual-registration"))
    script = tmp_path / "fp16.sh"
    script.write_text(text)
    out = actmem.json("estimate", "--megatron-args", f"@{script}")
    assert out["parameters"]["gradients_bytes"] == 2 * S
    assert out["run"]["distributed_optimizer"] is True


def test_a_bucket_is_laid_out_as_megatron_lays_it_out():
    """build_data_parallel_buffer_index by hand. Shapes A [4, 6], B [5, 4], C [3, 4], G [7, 4], D [2, 2], E [3]:
    rows 6, 4, 4, 4, 2, 1; the factor starts at 6, B's row 4 makes it lcm(6, 4) = 12; C (12 elements) and G (28: not
    a whole number of chunks, but larger than one) keep it (4 divides 12); D (4) and E (3) are smaller than a chunk.
    A at 0 (2 chunks); B (20 = a chunk + 8) at 24, its last chunk shared with G (28 = 2 chunks + 4: G's remnant
    fits the 4 left) at 48 - 4 = 44, running to 72; C at 72; D and E at the end, 84 and 88: 91 long, padded to
    2 ranks · 12 = 24: 96. Rank 0's shard [0, 48) holds 48 parameter elements, rank 1's [48, 96) 43.
    Without G: B's chunk has 4 free at 44, where D goes (a fragment in the gap); C at 48, E at 60: 63, padded 72;
    rank 1's shard [36, 72) holds B's last 8, D, C and E: 27, with 9 of padding. Under no_shard no padding: 63."""
    from actmem.memory.megatron_fsdp import _covered_below, bucket_layout, chunk_factor

    A, B, C, G, D, E = (4, 6), (5, 4), (3, 4), (7, 4), (2, 2), (3,)
    assert chunk_factor([A, B, C, G, D, E]) == 12
    size, items = bucket_layout([A, B, C, G, D, E], 2, True)
    assert (size, items) == (96, [(0, 24), (24, 20), (44, 28), (72, 12), (84, 4), (88, 3)])
    covered = _covered_below(items)
    assert (covered(48) - covered(0), covered(96) - covered(48)) == (48, 43)
    size, items = bucket_layout([A, B, C, D, E], 2, True)
    assert (size, items) == (72, [(0, 24), (24, 20), (44, 4), (48, 12), (60, 3)])
    covered = _covered_below(items)
    assert (covered(36) - covered(0), covered(72) - covered(36)) == (36, 27)
    assert bucket_layout([A, B, C, D, E], 2, False)[0] == 63


def test_the_last_layers_backward_holds_its_unit_the_prefetched_ones_and_the_gradient_buckets():
    """Llama 3.1 8B at d = 8 (the module docstring's buckets), at the last layer's fc1 backward: its unit gathered
    again, 2·218,136,576 = 436,273,152; the prefetch window, half of max(10⁹, 2·218,112,000) = 5·10⁸ elements, adds
    units while what it added is below it: 0, 218,136,576, 436,273,152 → three units, 1,308,819,456; the unit's bf16
    gradient bucket, 436,273,152; the no-unit group's (one bucket, the final norm and output in it), 2·1,050,705,920
    = 2,101,411,840. Under full recompute the same at fc1 (after the rerun); optim_grads: the gradient buckets only."""
    def fc1(*args):
        return _fc1("-m", "llama-3.1-8b", "--use-megatron-fsdp", "--gpus", "8", *args)

    expected = {"gathered_unit_weights": 436_273_152, "prefetched_unit_weights": 1_308_819_456,
                "unit_gradient_bucket": 436_273_152, "outside_gradient_buckets": 2_101_411_840}
    assert fc1() == fc1("--recompute", "full") == expected
    assert fc1("--data-parallel-sharding-strategy", "optim_grads") == {
        "unit_gradient_bucket": 436_273_152, "outside_gradient_buckets": 2_101_411_840}


def _fc1(*args) -> dict:
    """Megatron-FSDP's rows of the last layer's fc1 moment."""
    from actmem.cli.flags import _paste_command, build_spec_from_flags
    from actmem.memory.estimate import estimate

    flags = _paste_command().make_context("estimate", list(args)).params
    moment = next(m for m in estimate(build_spec_from_flags(flags)).run.moments if m.name == "fc1")
    return {part.name: part.bytes for part in moment.parts if part.name in (
        "gathered_unit_weights", "prefetched_unit_weights", "unit_gradient_bucket", "outside_gradient_buckets")}


def test_the_gradient_buckets_made_before_the_layers_are_those_holding_the_norm_or_the_output(tmp_path):
    """--ddp-bucket-size 1 makes each parameter outside the units a bucket. Llama 3.1 8B's paste (untied): [embedding]
    [final norm] [output]: the norm's (4096, factor 1, padded to 8) and the output's (128,256·4096, a multiple of
    8·4096) are made before the layers: 2·(4096 + 525,336,576) = 1,050,681,344 B; the embedding's at the end, not
    counted. The 22b preset (tied, t = 8, d = 2): [embedding 6400 × 6144] [positions] [norm weight] [norm bias]: the
    norm's two, 2·2·6144 = 24,576 B (each a multiple of 2); and with gradient accumulation fusion (Megatron's
    default) the tied output layer's fused weight gradient goes into the embedding's main_grad at its backward
    (tensor_parallel/layers.py: get_main_grad), its bucket too: + 2·6400·6144 = 78,667,776 B in all."""
    text = open(_example(tmp_path)[1:]).read().replace("--overlap-grad-reduce",
                                                       "--overlap-grad-reduce --ddp-bucket-size 1")
    (tmp_path / "one.sh").write_text(text)
    assert _fc1("--megatron-args", f"@{tmp_path / 'one.sh'}")["outside_gradient_buckets"] == 1_050_681_344
    paste = "--bf16 --use-megatron-fsdp --ckpt-format fsdp_dtensor --overlap-grad-reduce --ddp-bucket-size 1"
    tied = ("-m", "22b", "--gpus", "16", "--global-batch", "8", "--recompute", "none", "--megatron-args")
    assert _fc1(*tied, paste)["outside_gradient_buckets"] == 78_667_776
    assert _fc1(*tied, paste + " --no-gradient-accumulation-fusion")["outside_gradient_buckets"] == 24_576


def test_the_backward_prefetch_counts_only_the_units_the_forwards_end_did_not_gather_again():
    """A unit's padded bucket U = 2·10⁸ under the default window, max(10⁹, 2·1.9·10⁸)/2 = 5·10⁸ elements: 0, 2·10⁸,
    4·10⁸ are below it, three units. The forward's end gathers units 1-3 again; the
    last layer's pre-backward window is L-1..L-3; its gather recycles 1-3, so the units of the window among them are
    not held: L = 32: 3; L = 6 (window 5, 4, 3): 2; L = 4 (window 3, 2, 1, all among them; 4 gathered): 0; L = 3
    (every unit among the three: nothing gathered, nothing recycled): 2. The forward's end holds min(3, L)."""
    from actmem.memory.megatron_fsdp import Buckets, prefetched_units, regathered_units

    laid = Buckets(count=0, padded=0, shard=0, local=0, outside_padded=0, unit_padded=200_000_000,
                   unit_count=190_000_000)
    assert [prefetched_units(laid, layers) for layers in (32, 6, 4, 3, 2)] == [3, 2, 0, 2, 1]
    assert [regathered_units(laid, layers) for layers in (32, 6, 4, 3, 2)] == [3, 3, 3, 3, 2]


#: the fixed pools of Llama 3.1 8B at d = 8 under --fsdp-double-buffer: two buffers of a unit's padded bucket
#: (218,136,576 elements: the module docstring), 16-bit
POOL = 2 * 218_136_576 * 2


def test_the_double_buffers_pools_are_two_units_buckets_and_hold_the_units_transients(actmem, tmp_path):
    """Megatron-LM's example as it is but for FP8 (its --use-nccl-ub turns --fsdp-double-buffer on: arguments.py):
    the weights' pool and the bf16 gradients' pool, 2·218,136,576·2 B = 872,546,304 each, held beside the state, in
    place of the unit gathered, the prefetched units, the unit's gradient bucket (fc1's moment) and the units
    gathered again at the forward's end (the loss's moment; 3 units, 1,308,819,456 B, without the pools); the no-unit
    group's gradient bucket stays (2,101,411,840). The peak at the loss then rises by 2·872,546,304 - 1,308,819,456
    = 436,273,152. Under optim_grads with fp32 gradients the gradients' pool alone, 2·218,136,576·4 B; under optim
    none (a note says it changes nothing)."""
    out = actmem.json("estimate", "--megatron-args", _example(tmp_path))
    plain = actmem.json("estimate", "--megatron-args", _example(tmp_path, user_buffers=False))
    assert out["parameters"]["double_buffer_bytes"] == 2 * POOL == 1_745_092_608
    assert out["parameters"]["total_bytes"] == 16 * S + GATHERED + 2 * POOL
    assert out["peak_floor"]["total_bytes"] - plain["peak_floor"]["total_bytes"] == 2 * POOL - 1_308_819_456
    assert "--use-nccl-ub and --fsdp-manual-registration read" in " ".join(out["assumptions"])
    assert _fc1("-m", "llama-3.1-8b", "--use-megatron-fsdp", "--gpus", "8", "--fsdp-double-buffer") == {
        "outside_gradient_buckets": 2_101_411_840}
    fp32 = actmem.json("estimate", "-m", "llama-3.1-8b", "--use-megatron-fsdp", "--gpus", "8", "--fsdp-double-buffer",
                       "--data-parallel-sharding-strategy", "optim_grads", "--megatron-fsdp-main-grads-dtype", "fp32")
    assert fp32["parameters"]["double_buffer_bytes"] == 2 * 218_136_576 * 4
    optim = actmem.json("estimate", "-m", "llama-3.1-8b", "--use-megatron-fsdp", "--gpus", "8", "--fsdp-double-buffer",
                        "--data-parallel-sharding-strategy", "optim")
    assert optim["parameters"]["double_buffer_bytes"] == 0
    assert any("--fsdp-double-buffer changes nothing under optim" in note for note in optim["assumptions"])


def test_a_megatron_fsdp_flag_given_on_the_command_line_prices_as_its_paste(actmem, tmp_path):
    pasted = actmem.json("estimate", "--megatron-args", _example(tmp_path))
    given = actmem.json("estimate", "--megatron-args", _example(tmp_path, user_buffers=False), "--fsdp-double-buffer")
    assert given["parameters"] == pasted["parameters"] and given["peak_floor"] == pasted["peak_floor"]


@pytest.mark.parametrize("dropped, fragment", [
    (("--use-megatron-fsdp", "--fsdp-manual-registration"),
     "--use-nccl-ub outside Megatron-FSDP (DDP's buffers in NCCL's memory pool)"),
    (("--use-megatron-fsdp",), "Megatron refuses --fsdp-manual-registration without --use-megatron-fsdp and"),
    (("--use-nccl-ub",), "Megatron refuses --fsdp-manual-registration without --use-megatron-fsdp and --use-nccl-ub"),
])
def test_nccl_user_buffers_where_megatron_lm_would_not_run_them_are_refused(actmem, tmp_path, dropped, fragment):
    """The example's lines dropped: Megatron-LM asserts manual registration beside both (arguments.py); NCCL's user
    buffers for DDP's own buffers are not read."""
    text = open(_example(tmp_path)[1:]).read()
    for line in dropped:
        assert f"        {line}\n" in text
        text = text.replace(f"        {line}\n", "")
    (tmp_path / "edited.sh").write_text(text)
    assert_one_line_error(actmem("estimate", "--megatron-args", f"@{tmp_path / 'edited.sh'}"), fragment)


def test_a_double_buffer_that_disagrees_or_without_megatron_fsdp_is_refused(actmem, tmp_path):
    assert_one_line_error(actmem("estimate", "--megatron-args", _example(tmp_path), "--no-fsdp-double-buffer"),
                          "--no-fsdp-double-buffer and --fsdp-double-buffer disagree")
    text = open(_example(tmp_path)[1:]).read().replace("        --fsdp-double-buffer\n", "")
    (tmp_path / "nccl_only.sh").write_text(text)         # --use-nccl-ub alone turns it on
    assert_one_line_error(actmem("estimate", "--megatron-args", f"@{tmp_path / 'nccl_only.sh'}",
                                 "--no-fsdp-double-buffer"),
                          "--no-fsdp-double-buffer disagrees with the pasted --use-nccl-ub")
    pasted = actmem.json("estimate", "--megatron-args", f"@{tmp_path / 'nccl_only.sh'}")
    assert pasted["parameters"]["double_buffer_bytes"] == 2 * POOL
    assert_one_line_error(actmem("estimate", "-m", "llama-3.1-8b", "--gpus", "8", "--fsdp-double-buffer"),
                          "--fsdp-double-buffer is Megatron-FSDP's")


def test_megatron_lms_fsdp_example_as_it_is_keeps_its_fp8_weights_in_groups_of_their_own(actmem):
    """The example as it is (FP8, delayed scaling with a 1024-long amax history, --fp8-param-gather, on H100s):
    each unit's four TE linears' weights are a "float8" group, 1 B an element, apart from its two norms (pgb,
    _get_parameter_groups; tests/validate checks megatron-core's grouping). The FP8 group by hand: fc2 (2048 chunks
    of 28,672) at 0; the projection (585 chunks + 4096) and QKV (877 chunks + 20,480) share a chunk, 4096 of it a
    hole (no norm to fill it now); fc1 (4096 chunks): 218,107,904, padded to 951·229,376 = 218,136,576. The norms'
    group: 2·4096 = 8192 (chunk 1, a multiple of 8). The rest splits at the bucket size as in bf16: 1,050,705,920.
    P = 32·(218,136,576 + 8192) + 1,050,705,920 = 8,031,338,496, S = P/8 = 1,003,917,312, the FP8 elements of a
    shard 32·218,136,576/8 = 872,546,304: weights 2S - 872,546,304 = 1,135,288,320; gradients (bf16, auto) 2S;
    optimizer 4S + 8S (rank 0's shard all parameters). The pools: weights 2·(218,136,576·1 + 8192·2) = 436,305,920,
    gradients 2·218,144,768·2 = 872,579,072. TE keeps the scaling state alone (4 modules a layer, each a 4-B
    scale_inv and 5 quantizers' scale and 1024-row amax history, 4 + 4·5·1025 = 20,504 B): 32·4·20,504 = 2,624,512;
    the FP8 weights' Hopper transposes are made at each unit's backward and dropped at its release: the last
    layer's, 4096·(4096 + 6144 + 28,672) + 4096·14,336 = 218,103,808 B, at its backward moments."""
    out = actmem.json("estimate", "--megatron-args", "@tests/data/megatron_examples/train_llama3_8b_fsdp_h100_fp8.sh",
                      "--gpu", "h100")
    params = out["parameters"]
    s = 1_003_917_312
    assert (params["weights_bytes"], params["gradients_bytes"], params["optimizer_bytes"]) == (
        1_135_288_320, 2 * s, 12 * s)
    assert params["double_buffer_bytes"] == 436_305_920 + 872_579_072
    assert params["fp8_bytes"] == 2_624_512
    flags = ("--megatron-args", "@tests/data/megatron_examples/train_llama3_8b_fsdp_h100_fp8.sh", "--gpu", "h100")
    assert _fc1_rows(*flags)["unit_fp8_transposes"] == 218_103_808


def test_fp8_without_its_param_gather_keeps_bf16_buckets_and_te_s_cached_copies(actmem):
    """FP8 compute with bf16 weights (no --fp8-param-gather): Megatron-FSDP's buckets as in bf16 (the module
    docstring's S = 1,003,884,544), and TE caches each linear's FP8 weight and its Hopper transpose for the
    iteration, unsharded (2 B a linear weight element: 32·218,103,808·2), beside the scaling state (delayed scaling
    at Megatron's default amax history of 1: 4 + 4·5·2 = 44 B a module, 32·4·44)."""
    out = actmem.json("estimate", "-m", "llama-3.1-8b", "--use-megatron-fsdp", "--gpus", "8", "--fp8-format", "hybrid",
                      "--gpu", "h100")
    params = out["parameters"]
    assert (params["weights_bytes"], params["gradients_bytes"]) == (2 * S, 2 * S)
    assert params["fp8_bytes"] == 32 * 218_103_808 * 2 + 32 * 4 * 44
    assert _fc1_rows("-m", "llama-3.1-8b", "--use-megatron-fsdp", "--gpus", "8", "--fp8-format", "hybrid", "--gpu",
                     "h100").get("unit_fp8_transposes", 0) == 0
    # the same under optim_grads (bf16 buckets, whole weights): the cache as under DDP
    optim_grads = actmem.json("estimate", "-m", "llama-3.1-8b", "--use-megatron-fsdp", "--gpus", "8", "--fp8-format",
                              "hybrid", "--gpu", "h100", "--data-parallel-sharding-strategy", "optim_grads")
    assert optim_grads["parameters"]["fp8_bytes"] == params["fp8_bytes"]
    assert optim_grads["parameters"]["weights_bytes"] == 2 * P


def _fc1_rows(*args) -> dict:
    """Every row of the last layer's fc1 moment."""
    from actmem.cli.flags import _paste_command, build_spec_from_flags
    from actmem.memory.estimate import estimate

    flags = _paste_command().make_context("estimate", list(args)).params
    moment = next(m for m in estimate(build_spec_from_flags(flags)).run.moments if m.name == "fc1")
    return {part.name: part.bytes for part in moment.parts}


def test_over_one_data_parallel_rank_nothing_is_gathered_nor_pooled(actmem):
    """d·c = 1: megatron-core distributes no buffer (pgb: is_data_distributed needs a group of more than one), so
    no bucket is gathered or allocated and no pool fetched into (measured: tests/validate, one rank): the buffers
    whole, padded as the strategy pads them, and nothing beside them."""
    out = actmem.json("estimate", "-m", "llama-3.1-8b", "--gpus", "1", "--use-megatron-fsdp", "--fsdp-double-buffer")
    assert out["parameters"]["gathered_bytes"] == out["parameters"]["double_buffer_bytes"] == 0
    assert _fc1_rows("-m", "llama-3.1-8b", "--gpus", "1", "--use-megatron-fsdp").get("outside_gradient_buckets", 0) == 0
    assert any("over one data-parallel rank no buffer is distributed" in note for note in out["assumptions"])
