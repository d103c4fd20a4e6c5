"""Which configurations to measure: from a spec and a list of techniques, or a named grid."""

from dataclasses import replace

from actmem.sources.presets import load_preset
from actmem.model.spec import Spec, build_spec
from actmem.memory.techniques import BY_NAME, TECHNIQUES, layer_checkpointing, op_checkpointing, \
    run_technique, unnamed_run
from actmem.model.recompute import Recompute
from actmem_validate.measure import Config, config_for

DEFAULT_TECHNIQUES = tuple(t.name for t in TECHNIQUES if t.tensor_parallel)
"""Every technique but 'none' (which runs at t = 1, in a run of its own)."""
#: torch-native's selective recompute, torchtitan's per-op checkpointing, without and with SP ('op', 'tp-sp-op')
OP_TECHNIQUES = {technique.name: technique for technique in (op_checkpointing(False), op_checkpointing(True))}
NAMED = BY_NAME | OP_TECHNIQUES
"""Every technique validate measures, by name."""


def default_techniques(spec: Spec) -> list:
    """What `validate` measures when not told: every tensor-parallel technique actmem models
    for the spec's architecture and implementation, less those with sequence parallelism
    when t = 1 (they need t > 1); 'none' alone for an implementation run on one device. The
    selective rows recompute the spec's --recompute-modules where it gives them (the spec
    checked that actmem models them). Under CPU offloading, those that do not recompute (Megatron
    refuses the two together)."""
    from actmem.memory.estimate import modelled_techniques

    if "tensor" not in spec.architecture.code.runs:
        return [BY_NAME["none"]]
    modelled = {technique.name for technique in modelled_techniques(spec)}
    if spec.run.recompute_modules is not None:
        modelled |= {name for name in DEFAULT_TECHNIQUES if BY_NAME[name].recompute is Recompute.SELECTIVE}
    t = spec.run.tensor_parallel
    ops = list(OP_TECHNIQUES.values()) if spec.architecture.code.op_checkpointing else []
    return [technique for technique in [BY_NAME[name] for name in DEFAULT_TECHNIQUES if name in modelled] + ops
            if (t > 1 or not technique.sequence_parallel)
            and not (spec.run.offload_layers and technique.recompute is not Recompute.NONE)]


def option_techniques(spec: Spec) -> list:
    """The spec's torchtitan selective checkpointing (--selective-ac-option op or N), without SP, and with it where
    t > 1: 'op', 'tp-sp-op'; 'full·every 2', 'tp-sp-full·every 2'."""
    policy = spec.run.policy
    return [unnamed_run(run_technique(sp, policy)) for sp in (False, True) if not sp or spec.run.tensor_parallel > 1]


def filling_microbatches(p: int, m: int) -> int:
    """The fewest microbatches that fill the schedule: p for 1F1B; 2p interleaved (n must be
    a multiple of p, and n = p never reaches the steady state)."""
    return p if m == 1 else 2 * p


def techniques_named(names) -> list:
    """actmem's techniques by name; unknown names are one error naming the known ones."""
    from actmem.errors import SpecError

    unknown = [name for name in names if name not in NAMED]
    if unknown or not names:
        raise SpecError(f"unknown techniques {', '.join(unknown) or '(none given)'}; "
                        f"known: {', '.join(NAMED)}")
    return [NAMED[name] for name in names]


def configs_for(spec: Spec, techniques, microbatches: int | None = None) -> list[Config]:
    """One configuration a technique (names or Techniques), on the spec's model and pipeline,
    each run checked whole (the spec may be dims_only: its own gpus and batch are not the run
    measured, one data-parallel rank of n microbatches)."""
    run = spec.run
    n = microbatches or filling_microbatches(run.pipeline_parallel, run.interleave)
    chosen = [NAMED[t] if isinstance(t, str) else t for t in techniques]
    configs = [config_for(spec, technique, n) for technique in chosen]
    return [replace(config, spec=replace(config.spec, dims_only=False)) for config in configs]


#: today's MLP and norm at small shapes: SwiGLU with f = 96, RMSNorm, no biases, an untied
#: output layer, no dropout
GATED = dict(activation="swiglu", ffn_hidden=96, normalization="rmsnorm", bias=False, tied_output=False,
             attention_dropout=0.0, hidden_dropout=0.0)


#: today's Llama-style layer: GATED with flash attention, rope and 4 query groups of 2 heads
FLASH = GATED | dict(attention_core="flash", position_embedding="rope", query_groups=4)


#: FLASH as PyTorch-native DTensor TP/SP runs torchtitan's Llama block
TORCH_NATIVE = FLASH | dict(implementation="torch-native")

#: FLASH as transformers' LlamaForCausalLM runs it (attention_core eager or flash: sdpa)
HF = FLASH | dict(implementation="hf")

#: HF as transformers' MixtralForCausalLM and Qwen3MoeForCausalLM run it: 8 experts of f_e = 48, top-2
HF_MIXTRAL = dict(num_experts=8, moe_topk=2, moe_ffn_hidden=48)
HF_QWEN3_MOE = HF_MIXTRAL | dict(qk_norm=True)
#: ... and its Qwen2MoeForCausalLM: biases on q, k and v, a gated shared expert of f_s = 40
HF_QWEN2_MOE = HF_MIXTRAL | dict(qkv_bias=True, moe_shared_ffn=40, moe_shared_gate=True)
#: a Megatron preset's MoE settings that transformers has no use for (one device, its own grouped_mm)
HF_EXPERTS = dict(moe_dispatcher="allgather", moe_grouped_gemm=False)

#: the paper's layer as transformers' GPT2LMHeadModel runs it, by attention core (sdpa only
#: without attention dropout: a CPU's SDPA with dropout is its math kernel)
HF_GPT2 = {"eager": dict(implementation="hf", attention_core="eager"),
           "flash": dict(implementation="hf", attention_core="flash", attention_dropout=0.0)}


#: (t, b) of the eager small configs: 8 heads over t, times b, a multiple of the fused softmax's
#: 8 rows a block at s = 32
EAGER_BATCHES = ((2, 2), (4, 4))

#: Megatron's local core on torch's fallback softmax (forward_torch_softmax): switched off
#: (--no-masked-softmax-fusion), or in fp32 (--attention-softmax-in-fp32)
UNFUSED, FP32_SOFTMAX = dict(masked_softmax_fusion=False), dict(softmax_in_fp32=True)


def small_spec(layers: int, t: int, p: int = 1, m: int = 1, dropout: float = 0.1, name: str = "",
               first_stage_layers: int | None = None, recompute: tuple = (None, None), c: int = 1,
               b: int = 2, modules: tuple | None = None, seq_len: int = 32, gpu_fp8: str | None = None,
               sp: bool = False, offload_layers: int = 0, **architecture) -> Spec:
    """recompute: (method, N) of a partial full recompute; modules: what selective recompute
    recomputes (--recompute-modules); the technique sets the mode; offload_layers: N of
    --cpu-offloading-num-layers."""
    model = dict(heads=8, hidden=64, vocab=512, seq_len=seq_len, layers=layers)
    run = dict(tensor_parallel=t, pipeline_parallel=p, interleave=m, micro_batch=b, context_parallel=c,
               first_stage_layers=first_stage_layers, recompute_method=recompute[0],
               recompute_layers=recompute[1], recompute_modules=modules,
               recompute="full" if recompute[0] else "selective" if modules else "none", sequence_parallel=sp,
               offload_layers=offload_layers)
    architecture = dict(attention_dropout=dropout, hidden_dropout=dropout) | architecture
    gpu = {"gpu_fp8": gpu_fp8, "gpu_name": f"a {gpu_fp8} GPU"} if gpu_fp8 else {}
    return build_spec(model, run, name=name or ("small" if dropout else "small-nodrop"),
                      architecture=architecture, **gpu)


def fsdp_configs() -> list[Config]:
    """torchtitan's Llama under FSDP2 (validate's fsdp.py) over 2 gloo ranks, v = 511 and f = 97, whose first dims
    d = 2 does not divide (rank 0 keeps the padded half), one microbatch and two (the second holds the first's
    gradients), without recompute and with full; and over 4 ranks, t = 2 with SP inside d = 2 (torchtitan's 2-D
    mesh), v = 510 and f = 98: FSDP2 shards each rank's tensor-parallel shard, 255 rows of the embedding and the
    output layer padded to 2 x 128, 49 rows of w1 and w3 to 2 x 25 (t divides v: every rank's logits the same); and
    HSDP over 4, 2 replicas of 2 shards (--fsdp-replicate 2), two microbatches; and torchtitan's other resharding
    policies, always and never (--fsdp-reshard-after-forward); and v = 4095 beside s = 8, where the embedding's
    post-backward holds the most; and v = 64 beside s = 512 under full recompute, where the last block's SwiGLU
    backward does."""
    model = dict(heads=8, hidden=64, vocab=511, seq_len=32, layers=2)
    spec = build_spec(model, dict(micro_batch=2, gpus=2, fsdp=True), name="small-torchtitan-fsdp",
                      architecture=TORCH_NATIVE | dict(ffn_hidden=97))
    with_tp = build_spec(model | dict(vocab=510), dict(micro_batch=2, gpus=4, tensor_parallel=2, sequence_parallel=True, fsdp=True),
                         name="small-torchtitan-fsdp", architecture=TORCH_NATIVE | dict(ffn_hidden=98))
    hsdp = build_spec(model, dict(micro_batch=2, gpus=4, fsdp=True, fsdp_replicate=2), name="small-torchtitan-hsdp",
                      architecture=TORCH_NATIVE | dict(ffn_hidden=97))
    policies = [replace(spec, name=f"small-torchtitan-fsdp-{policy}", run=replace(spec.run, fsdp_reshard=policy))
                for policy in ("always", "never")]
    # a large vocabulary beside a short sequence: the embedding's post-backward, at the backward's end, is the peak
    vocab = build_spec(model | dict(vocab=4095, seq_len=8), dict(micro_batch=1, gpus=2, fsdp=True),
                       name="small-torchtitan-fsdp-vocab", architecture=TORCH_NATIVE | dict(ffn_hidden=97))
    # a short vocabulary beside a long sequence, checkpointed: the last block's SwiGLU backward is the peak
    swiglu = build_spec(model | dict(vocab=64, seq_len=512), dict(micro_batch=2, gpus=2, fsdp=True),
                        name="small-torchtitan-fsdp-checkpointing", architecture=TORCH_NATIVE | dict(ffn_hidden=97))
    op, tp_sp_op = op_checkpointing(False), op_checkpointing(True)       # torchtitan's per-op checkpointing
    # and its layer option, every second block checkpointed: of 2 the last, of 3 the middle one (the last kept whole)
    three = replace(spec, name="small-torchtitan-fsdp-3", model=replace(spec.model, layers=3))
    every = configs_for(spec, [layer_checkpointing(False, 2)], 1) + configs_for(three, [layer_checkpointing(False, 2)], 2)
    return ([config for n in (1, 2) for config in configs_for(spec, ["none", "full", op], n)] + every
            + configs_for(vocab, ["none", "full"], 1) + configs_for(swiglu, ["full", op], 1)
            + configs_for(with_tp, ["tp-sp", "tp-sp-full", tp_sp_op], 1) + configs_for(hsdp, ["none"], 2)
            + [config for policy in policies for config in configs_for(policy, ["none", "full"], 1)])


def fp8_configs() -> list[Config]:
    """FLASH's layer under TE's FP8 recipes on a Hopper (actmem.model.fp8; the harness keeps what TE's linears
    and weight workspaces keep, in float8_e4m3fn on a CPU)."""
    configs = []
    for recipe, t, technique in (("delayed", 1, "none"), ("delayed", 2, "tp-sp"), ("delayed", 2, "tp-sp-sel"),
                                 ("tensorwise", 2, "tp-sp-sel"), ("delayed", 2, "tp-sp-full")):
        configs += configs_for(small_spec(2, t, name=f"small-flash-fp8-{recipe}", gpu_fp8="hopper", fp8_format="hybrid",
                                          fp8_recipe=recipe, fp8_amax_history_len=16 if recipe == "delayed" else 1,
                                          **FLASH), [technique], 1)
    # the block-scaled recipes at t = 1: MXFP8 on a Blackwell (its 32-element blocks fit f = 96, not f/2), blockwise
    # on a Hopper (under SP TE gathers the norms' outputs in 128-row blocks: more rows than the small grid has)
    for recipe, t, gpu in (("mxfp8", 1, "blackwell"), ("blockwise", 1, "hopper")):
        configs += configs_for(small_spec(2, t, name=f"small-flash-fp8-{recipe}", gpu_fp8=gpu, fp8_format="e4m3",
                                          fp8_recipe=recipe, sp=t > 1, **FLASH), ["tp-sp" if t > 1 else "none"], 1)
    # flash-attn's copy for the projection at b = 2, which under delayed scaling nothing keeps
    configs += configs_for(small_spec(2, 2, name="small-flash-attn-fp8-delayed", gpu_fp8="hopper", fp8_format="hybrid",
                                      **(FLASH | dict(attention_core="flash-attn"))), ["tp-sp"], 1)
    # --first-last-layers-bf16 (tensorwise): on one stage the first and last of 4 layers in bf16; on a pipeline's
    # first stage its first layer in bf16 beside an FP8 one, two microbatches in flight
    for p, n in ((1, 1), (2, None)):
        configs += configs_for(small_spec(4, 2, p, name="small-flash-fp8-first-last-bf16", gpu_fp8="hopper",
                                          fp8_format="hybrid", fp8_recipe="tensorwise", fp8_first_last_bf16=True,
                                          sp=True, **FLASH), ["tp-sp"], n)
    return configs


def offload_configs() -> list[Config]:
    """Transformer Engine's whole-layer CPU offloading (--cpu-offloading-num-layers N, p = 1, no recompute): N = 2
    of 4 layers at t = 1 and 2, N = 3 (L - 1: each layer's copy released as the next begins) under SP, two
    microbatches each (TE's state reset between them); delayed FP8 (its 1-byte copies and scales offloaded too)."""
    configs = []
    for t, n, technique in ((1, 2, "none"), (2, 2, "tp"), (2, 3, "tp-sp")):
        configs += configs_for(small_spec(4, t, name="small-flash-offload", offload_layers=n, **FLASH), [technique], 2)
    configs += configs_for(small_spec(4, 2, name="small-flash-fp8-offload", gpu_fp8="hopper", fp8_format="hybrid",
                                      offload_layers=2, **FLASH), ["tp-sp"], 1)
    return configs


def fallback_softmax_configs() -> list[Config]:
    """Megatron's local core where its fused softmax does not run, so torch's fallback does
    (rules.fused_softmax_runs): b·a/t = 4 at s = 32 (8 rows a block there), s = 30 (not a
    multiple of 4) and s = 132 at b·a/t = 2 (4 rows a block above 128); in 16 bits and in
    fp32, with and without attention dropout; switched off where the kernel would run; every
    recompute mode, an interleaved pipeline, and the dataloader's mask, which every layer then
    keeps (masked_fill_) whatever is recomputed."""
    configs = configs_for(small_spec(2, 2, b=1, name="small-torch-softmax"), ["tp", "tp-sp-sel", "tp-sp-full"], 1)
    configs += configs_for(small_spec(2, 2, b=1, name="small-torch-softmax-fp32", **FP32_SOFTMAX),
                           ["tp-sp", "tp-sel"], 1)
    configs += configs_for(small_spec(2, 2, dropout=0.0, name="small-unfused-softmax-fp32", **UNFUSED, **FP32_SOFTMAX),
                           ["tp-sp", "tp-sp-sel"], 1)
    configs += configs_for(small_spec(2, 2, name="small-s30", seq_len=30), ["tp-sp"], 1)
    configs += configs_for(small_spec(2, 4, b=1, name="small-s132", seq_len=132, **FP32_SOFTMAX), ["tp-sp"], 1)
    configs += configs_for(small_spec(4, 2, 2, 2, b=1, name="small-torch-softmax"), ["tp-sp"])
    configs += configs_for(small_spec(4, 2, 2, b=1, name="small-torch-softmax-mask", attention_mask=True), ["tp-sp"])
    configs += configs_for(small_spec(2, 2, b=1, name="small-torch-softmax-mask", modules=("mlp",),
                                      attention_mask=True), ["tp-sp-sel"], 1)
    return configs


def small_grid() -> list[Config]:
    """Small shapes a 2-core CPU runs for real in minutes: t = 1, 2, 4; SP on and off; the
    three recompute modes; 1F1B and interleaved; the output layer (p = 1); and no dropout."""
    configs = []
    # under Megatron's eager core b·a/t = 8 at t = 2 and 4: its fused softmax runs 8 rows a
    # block up to s = 128 (actmem refuses the torch fallback elsewhere; rules.fused_softmax_runs)
    for t, b in EAGER_BATCHES:
        configs += configs_for(small_spec(2, t, b=b), DEFAULT_TECHNIQUES, 1)
        for technique, p, m in (("tp-sp-sel", 2, 1), ("tp-sel", 2, 2), ("tp-sp", 2, 2), ("tp-sp-full", 4, 1)):
            configs += configs_for(small_spec(4, t, p, m, b=b), [technique])
    configs += configs_for(small_spec(2, 1), ["none"], 1)
    configs += configs_for(small_spec(4, 1, 2, 2), ["none"], 4)
    configs += fallback_softmax_configs()
    # no dropout: no masks, no separate attention dropout output, and under SP the embedding's
    # scattered view must not be held whole (Megatron clones it)
    configs += configs_for(small_spec(2, 2, dropout=0.0), ["tp", "tp-sp", "tp-sp-sel"], 1)
    configs += configs_for(small_spec(4, 2, 2, 2, dropout=0.0), ["tp-sp"])
    # SwiGLU, RMSNorm, no biases, untied output (p = 1 holds it), no dropout
    for t, b in EAGER_BATCHES:
        configs += configs_for(small_spec(2, t, b=b, name="small-gated", **GATED), ["tp", "tp-sp-sel", "tp-sp-full"], 1)
    configs += configs_for(small_spec(4, 2, 2, 2, name="small-gated", **GATED), ["tp-sp"])
    # grouped-query attention under the eager core, a head dim other than h/a: 4 groups of 2
    # heads, d = 16 (ad = 2h); selective recompute is not modelled there (g < a)
    for t, b in EAGER_BATCHES:
        configs += configs_for(small_spec(2, t, b=b, name="small-gqa", query_groups=4, head_dim=16),
                               ["tp", "tp-sp-full"], 1)
    # flash attention with rope (SDPA's CPU flash kernel), g/t = 2 and 1
    configs += configs_for(small_spec(2, 1, name="small-flash", **FLASH), ["none"], 1)
    for t in (2, 4):
        configs += configs_for(small_spec(2, t, name="small-flash", **FLASH), ["tp", "tp-sp", "tp-sp-full"], 1)
    # selective recompute of the attention core under flash: the checkpoint keeps q and k after
    # rope and v, a view that holds the QKV output; with and without SP, g/t = 1, interleaved,
    # beside c = 2 and the MLP's checkpoint; flash-attn at b = 2 (its output copy dropped); and
    # q and k norms with learned positions (the norms' outputs are the checkpoint's q and k)
    configs += configs_for(small_spec(2, 2, name="small-flash", **FLASH), ["tp-sel", "tp-sp-sel"], 1)
    configs += configs_for(small_spec(2, 4, name="small-flash", **FLASH), ["tp-sp-sel"], 1)
    configs += configs_for(small_spec(4, 2, 2, 2, name="small-flash", **FLASH), ["tp-sp-sel"])
    configs += configs_for(small_spec(2, 2, name="small-flash", c=2, **FLASH), ["tp-sp-sel"], 1)
    configs += configs_for(small_spec(2, 2, name="small-flash", modules=("core_attn", "mlp"), **FLASH),
                           ["tp-sp-sel"], 1)
    configs += configs_for(small_spec(2, 2, name="small-flash-attn", **(FLASH | dict(attention_core="flash-attn"))),
                           ["tp-sp-sel"], 1)
    configs += configs_for(small_spec(2, 2, name="small-flash-gelu-qk-norm", attention_dropout=0.0,
                                      attention_core="flash", qk_norm=True), ["tp-sp-sel"], 1)
    configs += configs_for(small_spec(4, 2, 2, 2, name="small-flash", **FLASH), ["tp-sp"])
    configs += offload_configs()
    # flash-attn through TE: at b = 2 its output and the projection's input are two copies
    for t in (1, 2):
        configs += configs_for(small_spec(2, t, name="small-flash-attn", **(FLASH | dict(attention_core="flash-attn"))),
                               ["none" if t == 1 else "tp-sp"], 1)
    # context parallelism on real gloo ranks: c = 2 alone, and beside t = 2 with SP (4 ranks)
    configs += configs_for(small_spec(2, 1, name="small-flash", c=2, **FLASH), ["none"], 1)
    configs += configs_for(small_spec(2, 2, name="small-flash", c=2, **FLASH), ["tp-sp", "tp-sp-full"], 1)
    configs += configs_for(small_spec(4, 2, 2, name="small-flash", c=2, **FLASH), ["tp-sp"])
    # an uneven pipeline (as Llama 3 405B's): 2 layers on the first stage, 3 on the second
    configs += configs_for(small_spec(5, 2, 2, name="small-flash", first_stage_layers=2, **FLASH), ["tp-sp"])
    # partial full recompute (Megatron's --recompute-method): block 1 of 3 layers a chunk
    # (interleaved), uniform groups of 2 (the last group of 1), eager and flash
    configs += configs_for(small_spec(12, 2, 2, 2, recompute=("block", 1)), ["tp-sp-full"])
    configs += configs_for(small_spec(6, 2, 2, recompute=("uniform", 2), name="small-flash", **FLASH), ["tp-sp-full"])
    # ... and on an uneven pipeline, each stage's chunk its own (2 layers, then 3): block 1 keeps
    # 1 and 2 layers whole, block 2 none and 1; uniform groups of 2 leave the second stage a
    # group of 1
    for recompute in (("block", 1), ("block", 2), ("uniform", 2)):
        configs += configs_for(small_spec(5, 2, 2, name="small-flash", first_stage_layers=2, recompute=recompute,
                                          **FLASH), ["tp-sp-full"])
    # selective recompute of the MLP too (--recompute-modules core_attn mlp): the paper's layer
    # with and without SP, the gated one interleaved; and of the MLP alone under flash
    configs += configs_for(small_spec(2, 2, modules=("core_attn", "mlp")), ["tp-sel", "tp-sp-sel"], 1)
    configs += configs_for(small_spec(4, 2, 2, 2, name="small-gated", modules=("core_attn", "mlp"), **GATED),
                           ["tp-sp-sel"])
    configs += configs_for(small_spec(2, 2, name="small-flash", modules=("mlp",), **FLASH), ["tp-sp-sel"], 1)
    # Megatron's dataloader mask, handed to every layer of the first stage's chunk 0 and saved by
    # the recompute checkpoints: 1F1B (p masks, eager core), interleaved (2p, full recompute),
    # p = 1 under flash; the MLP's checkpoint alone, which does not take it; and beside c = 2,
    # each rank keeping its s/c rows of it
    configs += configs_for(small_spec(4, 2, 2, name="small-mask", attention_mask=True), ["tp-sp-sel"])
    for p, m, technique in ((2, 2, "tp-sp-full"), (1, 1, "tp-sp-sel")):
        configs += configs_for(small_spec(2 * p, 2, p, m, name="small-flash-mask", attention_mask=True, **FLASH),
                               [technique])
    configs += configs_for(small_spec(2, 2, name="small-flash-mask", modules=("mlp",), attention_mask=True, **FLASH),
                           ["tp-sp-sel"], 1)
    configs += configs_for(small_spec(2, 2, name="small-flash-mask", c=2, attention_mask=True, **FLASH), ["tp-sp-full"], 1)
    # torch-native: torchtitan's Llama blocks under DTensor TP (+ SP), g/t = 2 (repeat_kv
    # copies) and 1 (a view), full activation checkpointing and its per-op selective policy; one microbatch's layers
    configs += configs_for(small_spec(2, 1, name="small-torchtitan", **TORCH_NATIVE), ["none", op_checkpointing(False)], 1)
    for t in (2, 4):
        configs += configs_for(small_spec(2, t, name="small-torchtitan", **TORCH_NATIVE),
                               ["tp", "tp-sp", "tp-sp-full", op_checkpointing(True)], 1)
    configs += configs_for(small_spec(2, 2, name="small-torchtitan", **TORCH_NATIVE), [op_checkpointing(False)], 1)
    configs += configs_for(small_spec(3, 2, name="small-torchtitan", **TORCH_NATIVE), [layer_checkpointing(True, 2)], 1)
    # hf: transformers' own LlamaForCausalLM on one device, eager and sdpa attention, with and without the
    # Trainer's activation checkpointing (full recompute: every layer's checkpoint holds its call's arguments)
    for core in ("eager", "flash"):
        configs += configs_for(small_spec(2, 1, name="small-hf", **(HF | dict(attention_core=core))),
                               ["none", "full"], 1)
    # and its Qwen2ForCausalLM (Llama's layer with q, k and v biases), sdpa, checkpointed too
    configs += configs_for(small_spec(2, 1, name="small-hf-qwen2", qkv_bias=True, **HF), ["none", "full"], 1)
    # and its Qwen3ForCausalLM (Llama's layer with q and k norms), eager and sdpa
    for core in ("eager", "flash"):
        configs += configs_for(small_spec(2, 1, name="small-hf-qwen3", qk_norm=True,
                                          **(HF | dict(attention_core=core))), ["none"], 1)
    # and its MixtralForCausalLM, Qwen3MoeForCausalLM and Qwen2MoeForCausalLM (8 experts, top-2, grouped_mm;
    # Qwen3-MoE and Qwen2-MoE with and without norm_topk_prob; Qwen2-MoE's gated shared expert), sdpa
    # (a name each, so the error table's rows tell them apart)
    for name, extra in (("mixtral", HF_MIXTRAL), ("qwen3-moe", HF_QWEN3_MOE),
                        ("qwen3-moe-pre-softmax", HF_QWEN3_MOE | dict(moe_pre_softmax=True)),
                        ("qwen2-moe", HF_QWEN2_MOE), ("qwen2-moe-pre-softmax", HF_QWEN2_MOE | dict(moe_pre_softmax=True))):
        configs += configs_for(small_spec(2, 1, name=f"small-hf-{name}", **(HF | extra)),
                               ["none", "full"] if name == "mixtral" else ["none"], 1)
    # and its GPT2LMHeadModel (the paper's layer, dropout 0.1): eager at b = 1 (q, k, v views of
    # the one QKV output) and b = 2 (copies); sdpa without attention dropout
    for core, b in (("eager", 1), ("eager", 2), ("flash", 2)):
        configs += configs_for(small_spec(2, 1, name="small-hf-gpt2", b=b, **HF_GPT2[core]),
                               ["none", "full"] if b == 2 else ["none"], 1)
    # Megatron's unfused rope (--no-rope-fusion): its cos and sin, whole on every rank
    configs += configs_for(small_spec(2, 2, name="small-flash-unfused-rope", rope_fusion=False, **FLASH),
                           ["tp", "tp-sp"], 1)
    configs += configs_for(small_spec(2, 2, name="small-flash-unfused-rope", c=2, rope_fusion=False, **FLASH),
                           ["tp-sp"], 1)
    # and rotating half of each head (--rotary-percent 0.5): cos and sin d/2 wide
    configs += configs_for(small_spec(2, 2, name="small-flash-unfused-rope-half", rope_fusion=False,
                                      rotary_percent=0.5, **FLASH), ["tp-sp"], 1)
    # flash with the paper's MLP, learned positions and dropout on the hidden states (MHA)
    configs += configs_for(small_spec(2, 2, name="small-flash-gelu", attention_dropout=0.0,
                                      attention_core="flash"), ["tp", "tp-sp"], 1)
    # FP8 (TE's linears over a CPU stand-in: layers.Fp8Save, make_fp8_state) on a Hopper (fp8_configs)
    configs += fp8_configs()
    # torch-native under FSDP2 over 2 gloo ranks: the model state rank 0 keeps and the step's peak (fsdp_configs)
    configs += fsdp_configs()
    # Nemotron's MLP (--squared-relu): relu(x)² on FLASH's layer, without and with the MLP recomputed
    squared = FLASH | dict(activation="squared_relu")
    configs += configs_for(small_spec(2, 2, name="small-flash-squared-relu", **squared), ["tp-sp"], 1)
    configs += configs_for(small_spec(2, 2, name="small-flash-squared-relu", modules=("mlp",), **squared),
                           ["tp-sp-sel"], 1)
    # q and k normalised per head (--qk-layernorm, Qwen3): g/t = 2 and 1 (q's reshape a copy and
    # a view), full recompute, beside c = 2; LayerNorm's two statistics; and with learned
    # positions, where the norms' outputs go to the kernel as they are
    configs += configs_for(small_spec(2, 2, name="small-flash-qk-norm", qk_norm=True, **FLASH),
                           ["tp", "tp-sp", "tp-sp-full"], 1)
    configs += configs_for(small_spec(2, 4, name="small-flash-qk-norm", qk_norm=True, **FLASH), ["tp-sp"], 1)
    configs += configs_for(small_spec(2, 2, name="small-flash-qk-norm", c=2, qk_norm=True, **FLASH), ["tp-sp"], 1)
    configs += configs_for(small_spec(2, 2, name="small-flash-qk-layernorm", qk_norm=True,
                                      **(FLASH | dict(normalization="layernorm"))), ["tp-sp"], 1)
    configs += configs_for(small_spec(2, 2, name="small-flash-gelu-qk-norm", attention_dropout=0.0,
                                      attention_core="flash", qk_norm=True), ["tp-sp"], 1)
    return configs


#: today's models at full scale: Llama 3.1 405B on its two published runs (the second with
#: context parallelism 16 at 131,072 tokens); 8B and 70B (model only) on 8-way tensor
#: parallelism, 70B with a 4-stage pipeline; Qwen3 8B (model only, QK norms) on 8
LLAMA_RUNS = {"llama-3.1-8b": dict(tensor_parallel=8),
              "llama-3.1-70b": dict(tensor_parallel=8, pipeline_parallel=4),
              "llama-3.1-405b": {}, "llama-3.1-405b-128k": {}, "qwen3-8b": dict(tensor_parallel=8)}


def preset_grid(names=("22b", "175b", "530b", "1t"), techniques=("tp", "tp-sp-sel"),
                llama=tuple(LLAMA_RUNS), llama_techniques=("tp-sp", "tp-sp-full"),
                mlp_recompute=("22b", "llama-3.1-8b"), unfused_rope=("llama-3.1-8b",),
                core_recompute=("llama-3.1-8b", "llama-3.1-405b-128k", "qwen3-8b"),
                attention_mask=("llama-3.1-70b",)) -> list[Config]:
    """The paper's Table 3 models at full scale, for fake mode: the baseline and the paper's
    run; the Llama 3.1 models, flash attention, with and without full recompute, and with
    selective recompute of the attention core on the ``core_recompute`` ones; selective
    recompute of the MLP too (of it alone under flash) on the ``mlp_recompute`` models;
    Megatron's unfused rope on the ``unfused_rope`` ones; and full recompute with Megatron's
    dataloader mask on the ``attention_mask`` ones."""
    configs = []
    for name in names + llama:
        preset = load_preset(name)
        spec = build_spec(preset.model, preset.run | LLAMA_RUNS.get(name, {}), name=preset.name,
                          architecture=preset.architecture)
        configs += configs_for(spec, techniques if name in names else llama_techniques)
        if name in core_recompute:
            configs += configs_for(spec, ["tp-sp-sel"])
        if name in mlp_recompute:
            modules = ("core_attn", "mlp") if spec.architecture.attention_core == "eager" else ("mlp",)
            run = replace(spec.run, recompute=Recompute.SELECTIVE, recompute_modules=modules)
            configs += configs_for(replace(spec, run=run), ["tp-sp-sel"])
        if name in unfused_rope:
            unfused = replace(spec, name=f"{spec.name}-unfused-rope",
                              architecture=replace(spec.architecture, rope_fusion=False))
            configs += configs_for(unfused, ["tp-sp"])
        if name in attention_mask:
            masked = replace(spec, name=f"{spec.name}-attention-mask",
                             architecture=replace(spec.architecture, attention_mask=True))
            configs += configs_for(masked, ["tp-sp-full"])
    return configs


#: the torch-native implementation at full scale: Llama 3.1 8B at t = 8 (g/t = 1) and 70B at
#: t = 4 (g/t = 2: repeat_kv copies k and v to a/t heads); two layers of one microbatch
TORCH_NATIVE_RUNS = {"llama-3.1-8b": 8, "llama-3.1-70b": 4}


def hf_presets() -> list[Config]:
    """transformers' LlamaForCausalLM at Llama 3.1 8B's dims, Qwen3ForCausalLM at Qwen3 8B's
    and GPT2LMHeadModel at the paper's 22B dims, two layers, eager and sdpa; MixtralForCausalLM at
    Mixtral 8x7B's and Qwen3MoeForCausalLM at Qwen3-30B-A3B's, two layers, sdpa."""
    llama, qwen3, gpt = load_preset("llama-3.1-8b"), load_preset("qwen3-8b"), load_preset("22b")
    archs = [(model, {"implementation": "hf", "attention_core": core}) for model in (llama, qwen3)
             for core in ("eager", "flash")]
    archs += [(gpt, HF_GPT2[core]) for core in ("eager", "flash")]
    archs += [(load_preset(name), {"implementation": "hf", "attention_core": "flash"} | HF_EXPERTS)
              for name in ("mixtral-8x7b", "qwen3-30b-a3b")]
    return [config_for(build_spec(preset.model | {"layers": 2}, {}, name=f"{preset.name}·2 layers",
                                  architecture=preset.architecture | arch), BY_NAME["none"], 1)
            for preset, arch in archs]


def torch_native_presets(techniques=("tp-sp", "tp-sp-full", op_checkpointing(True))) -> list[Config]:
    configs = []
    for name, t in TORCH_NATIVE_RUNS.items():
        preset = load_preset(name)
        spec = build_spec(preset.model | {"layers": 2}, {"tensor_parallel": t}, name=f"{preset.name}·2 layers",
                          architecture=preset.architecture | {"implementation": "torch-native"})
        configs += configs_for(spec, techniques, 1)
    return configs


def fsdp_presets() -> list[Config]:
    """Llama 3.1 8B under FSDP2 as torchtitan applies it, the whole model, one microbatch: on 8 GPUs (d = 8, no
    recompute: the loss's backward is the peak; and with torchtitan's per-op checkpointing, its llama3_8b.toml) and
    on 16 at t = 8 with SP (d = 2, the loss under loss_parallel)."""
    preset = load_preset("llama-3.1-8b")
    configs = []
    for gpus, t, technique in ((8, 1, "none"), (8, 1, op_checkpointing(False)), (16, 8, "tp-sp")):
        spec = build_spec(preset.model, {"gpus": gpus, "tensor_parallel": t, "sequence_parallel": t > 1, "fsdp": True},
                          name=f"{preset.name}-fsdp", architecture=preset.architecture | {"implementation": "torch-native"})
        configs += configs_for(spec, [technique], 1)
    return configs


def fp8_presets() -> list[Config]:
    """Llama 3.1 8B at t = 8 under FP8 at full scale (TE's saves over the harness's stand-in, layers.Fp8Save):
    delayed scaling with 1024 rows of amax history on an H100, as it is and with the core recomputed (where the
    projection's 16-bit input goes); MXFP8 on a B200."""
    preset = load_preset("llama-3.1-8b")
    configs = []
    for gpu, fp8, techniques in (("hopper", {"fp8_format": "hybrid", "fp8_amax_history_len": 1024},
                                  ["tp-sp", "tp-sp-sel"]),
                                 ("blackwell", {"fp8_format": "e4m3", "fp8_recipe": "mxfp8"}, ["tp-sp"])):
        spec = build_spec(preset.model, {"tensor_parallel": 8, "sequence_parallel": True},
                          name=f"{preset.name}-fp8-{fp8.get('fp8_recipe', 'delayed')}",
                          architecture=preset.architecture | fp8, gpu_fp8=gpu, gpu_name=f"a {gpu} GPU")
        configs += configs_for(spec, techniques)
    return configs


def offload_presets() -> list[Config]:
    """Llama 3.1 8B at t = 8 with SP on one pipeline stage, 20 of its 32 layers' activations offloaded to the
    host (--cpu-offloading-num-layers 20), at full scale."""
    preset = load_preset("llama-3.1-8b")
    spec = build_spec(preset.model, {"tensor_parallel": 8, "sequence_parallel": True, "offload_layers": 20},
                      name=f"{preset.name}-offload-20", architecture=preset.architecture)
    return configs_for(spec, ["tp-sp"])


def presets_grid() -> list[Config]:
    """What CI measures at full scale: the paper's and the Llama presets under Megatron's
    code (FP8 and CPU offloading too), and the torch-native and hf implementations."""
    return (preset_grid() + fp8_presets() + offload_presets() + torch_native_presets() + fsdp_presets()
            + hf_presets())


def zero_grid() -> list[Config]:
    """transformers' models under DeepSpeed's ZeRO over gloo ranks (validate's zero.py, --grid zero): Llama (h = 64,
    f = 97 and v = 511, sizes d does not divide) with a config as the Trainer's documentation writes it (every size
    "auto": a bucket of h² = 4,096 elements, the norms kept whole at stage 3) at stages 1, 2 and 3, one microbatch
    and two (the first's gradients held through the second); stage 3 at DeepSpeed's defaults (a 1 GB bucket, every
    parameter of this small model kept whole); stages 2 and 3 over 4 ranks; stage 3 with sub-groups of 5,000
    elements; GPT-2 (a tied output layer, biases and LayerNorms in the undecayed group, learned positions) at stages
    2 and 3; Qwen3 (q and k norms) at stage 1; Mixtral at stage 2 and Qwen2-MoE at stage 3; stages 1 and 2 with overlap_comm (two buckets) and with
    round_robin_gradients; the Trainer's activation checkpointing at stages 1, 2 and 3 (s = 512 beside v = 64: the
    last layer's SwiGLU backward decides), and at stage 3 with a tied output layer. Each of actmem's moments decides some peak: the loss's (the "auto" Llama runs), the
    reduce (stages 1 and 2 at DeepSpeed's defaults, and over 4 ranks with buckets of 200,000 and 300,000 elements
    beside an embedding of 262,080), the gradient norm's (v = 4,095 beside s = 8 at stages 1 and 2) and the
    optimizer step's (the same at stage 3)."""
    from actmem.sources.deepspeed_config import from_dict

    model = dict(heads=8, hidden=64, vocab=511, seq_len=32, layers=2)
    vocab = model | dict(vocab=4095, seq_len=8)
    rerun = model | dict(vocab=64, seq_len=512)

    def spec(stage, name="small-hf-zero", gpus=2, architecture=HF | dict(ffn_hidden=97), shape=model, **zero):
        sizes = {"reduce_bucket_size": "auto"} | ({"stage3_param_persistence_threshold": "auto"} if stage == 3 else {})
        config = from_dict({"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": stage} | sizes | zero},
                           model["hidden"], source="the Trainer's documented config")
        return build_spec(shape, dict(micro_batch=2, gpus=gpus, zero=config), name=name, architecture=architecture)

    def defaults(stage, **zero):
        run = dict(zero=from_dict({"zero_optimization": {"stage": stage} | zero}, model["hidden"]) if zero else None,
                   zero_stage=None if zero else stage)
        return build_spec(model, dict(micro_batch=2, gpus=2) | {k: v for k, v in run.items() if v is not None},
                          name="small-hf-zero-defaults" + ("-overlap" if zero else ""),
                          architecture=HF | dict(ffn_hidden=97))

    gpt2 = HF_GPT2["flash"] | dict(hidden_dropout=0.0)
    return ([config for stage in (1, 2, 3) for n in (1, 2) for config in configs_for(spec(stage), ["none"], n)]
            # the Trainer's activation checkpointing, at s = 512 beside v = 64: the last layer's rerun decides
            + [config for stage in (1, 2, 3) for config in
               configs_for(spec(stage, name="small-hf-zero-checkpointing", shape=rerun), ["full"], 1)]
            # ... with the output layer tied to the embedding at stage 3: its weight stays gathered to the
            # embedding's backward
            + configs_for(spec(3, name="small-hf-zero-checkpointing-tied", shape=rerun,
                               architecture=HF | dict(ffn_hidden=97, tied_output=True)), ["full"], 1)
            + [config for stage in (1, 2, 3) for config in configs_for(defaults(stage), ["none"], 1)]
            + [config for stage in (1, 2, 3) for config in
               configs_for(spec(stage, name="small-hf-zero-vocab", shape=vocab), ["none"], 1)]
            + [config for stage in (2, 3) for config in configs_for(spec(stage, gpus=4), ["none"], 1)]
            + configs_for(spec(3, name="small-hf-zero-subgroups", sub_group_size=5000), ["none"], 1)
            + [config for stage in (1, 2) for config in
               configs_for(spec(stage, name="small-hf-zero-overlap", overlap_comm=True), ["none"], 2)]
            + [config for stage in (1, 2) for config in
               configs_for(spec(stage, name="small-hf-zero-round-robin", round_robin_gradients=True), ["none"], 1)]
            # the reduce decides over 4 ranks: the embedding larger than the bucket (reduced alone in place) or
            # inside the first bucket at stage 1, and beside the earlier microbatch's partition at stage 2
            + [config for stage, bucket, n in ((1, 200_000, 1), (1, 300_000, 1), (2, 200_000, 2)) for config in
               configs_for(spec(stage, name=f"small-hf-zero-reduce-{bucket // 1000}k", gpus=4, shape=vocab,
                                reduce_bucket_size=bucket),
                           ["none"], n)]
            + [config for stage in (1, 2) for config in configs_for(defaults(stage, overlap_comm=True), ["none"], 1)]
            + [config for stage in (2, 3) for config in
               configs_for(spec(stage, name="small-gpt2-zero", architecture=gpt2), ["none"], 1)]
            + configs_for(spec(1, name="small-qwen3-zero", architecture=HF | dict(ffn_hidden=97, qk_norm=True)),
                          ["none"], 1)
            # transformers' mixtures of experts: Mixtral's fused experts and router, Qwen2-MoE's shared expert too
            + configs_for(spec(2, name="small-mixtral-zero", architecture=HF | HF_MIXTRAL), ["none"], 1)
            + configs_for(spec(3, name="small-qwen2-moe-zero", architecture=HF | HF_QWEN2_MOE), ["none"], 1))


GRIDS = {"small": small_grid, "presets": presets_grid, "zero": zero_grid}
