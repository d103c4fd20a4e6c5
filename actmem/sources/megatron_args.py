"""A Megatron-LM launch script's arguments, pasted whole (`--megatron-args "$(cat args.txt)"`
or `--megatron-args @args.txt`), sorted into what actmem uses, what cannot change memory,
and what it refuses.

- Used: every argument actmem has a flag for (its Megatron spelling), parsed by the same
  click options as the flags themselves, so a pasted value that disagrees with a flag given
  beside it is an error like any two spellings that disagree.
- Ignored: arguments that cannot change memory (learning rate, paths, logging, ...), listed
  in the estimate's assumptions.
- Refused, all in one message: arguments that change memory and are not modelled yet, and
  arguments actmem does not know. Nothing is dropped without a word.

Every argument of Megatron-LM's parser is classified in one table (megatron_table.py, from the
pinned source); "unknown" is left for names Megatron does not have. A bash launch script is
read as bash would expand it (launch_script.py) and its training command's arguments sorted.
"""

import shlex

from actmem.sources import megatron_pipeline, megatron_table
from actmem.errors import SpecError

MANY = "many"
#: 16-bit training, which actmem assumes: used as a check, never ignored
PRECISION = ("--bf16", "--fp16")
#: Megatron reads --num-query-groups only with this switch; alone it means g = 1
GQA_SWITCH = "--group-query-attention"
#: what decides the attention core (Megatron's defaults: auto, transformer_engine)
ATTENTION = ("--attention-backend", "--transformer-impl")
#: --attention-backend -> actmem's core: fused is TE's cuDNN kernel, flash the flash-attn
#: package (a copy of its output at b > 1), auto what TE picks on Hopper and newer: cuDNN
#: (dot_product_attention/utils.py prefers FusedAttention there; on Ampere it picks
#: flash-attn: give --attention-backend flash)
BACKEND_CORES = {"local": "eager", "flash": "flash-attn", "fused": "flash", "auto": "flash"}
#: what each backend a script names is counted as, said in the notes
_BACKEND_NOTES = {"local": "Megatron's own core (the eager path: the softmax and its mask kept)",
                  "flash": "TE's flash-attn backend (flash-attn's kernel: its output and fp32 log-sum-exp)",
                  "fused": "TE's cuDNN fused attention, counted as the flash path (its output and fp32 softmax "
                           "statistics, no s² tensor)"}
#: how context parallelism communicates; actmem models Megatron's default, the p2p ring
CP_COMM = "--cp-comm-type"
#: Megatron's switch for no learned position table (with rope, or with no positions at all)
NO_POSITION_TABLE = "--no-position-embedding"
#: Megatron's dataloader makes a causal attention mask unless told not to (arguments.py:
#: create_attention_mask_in_dataloader, store_false)
NO_MASK = "--no-create-attention-mask-in-dataloader"
#: what selective recompute recomputes (TransformerConfig.recompute_modules, read only under
#: --recompute-granularity selective): up to the next argument, handed on as actmem's flag
RECOMPUTE_MODULES = "--recompute-modules"
#: Megatron takes a list (one type, or one a layer: arguments.py makes a list of one its element)
LOAD_BALANCING = "--moe-router-load-balancing-type"
AUX_LOSS_COEFF = "--moe-aux-loss-coeff"             # a list too: one coefficient a load-balancing type
#: the tokenizer decides the vocabulary where --vocab-size is not given
TOKENIZER = "--tokenizer-type"
#: GPT-2's BPE files (gpt2-vocab.json) hold 50,257 tokens; Megatron's GPT2BPETokenizer takes
#: its vocabulary from them (build_tokenizer: MEGATRON_TOKENIZERS) and ignores --vocab-size
GPT2_VOCAB = 50257
#: a step-wise batch schedule ("0:16 2.4B:320 ... 12B:1536"): sized at its largest batch
BATCH_SCHEDULE = "--step-batch-size-schedule"
#: zero-centred norm weights (TransformerConfig.layernorm_zero_centered_gamma): TE's norms take
#: the flag into their kernels and keep the same tensors (layernorm_linear.py: apply_normalization
#: and layernorm_bwd/rmsnorm_bwd get zero_centered_gamma; the saved inputmat, ln_out, mu, rsigma
#: do not change); Megatron's local FusedLayerNorm makes weight + 1, a new tensor its norm keeps
#: (megatron/core/fusions/fused_layer_norm.py), which actmem does not count
LAYERNORM_1P = "--apply-layernorm-1p"
#: fp32 gradient buffers: bf16 training turns them on, fp16 training leaves them off unless asked
#: (arguments.py: accumulate_allreduce_grads_in_fp32; DDP's grad dtype is then the parameters',
#: param_and_grad_buffer.group_params_for_buffers); actmem counts fp32 main gradients
FP32_GRADIENTS = "--accumulate-allreduce-grads-in-fp32"
#: the data-parallel communication overlapped with compute: the reduce-scatter (or all-reduce) and
#: the parameter all-gather run per bucket into the buffers DDP already holds (param_and_grad_buffer.py:
#: a bucket is a view of its buffer); what they change is the bucket count, so the distributed
#: optimizer's bucket-end padding (optimizer/param_layout.py), which actmem names and does not count
OVERLAP = ("--overlap-grad-reduce", "--overlap-param-gather")
#: the bucket layout alone (distributed_data_parallel.py: bucket_size, num_buckets; param_layout.py:
#: bucket_end_divisor, lcm(d·c, 128) or, padded for NCCL's bus bandwidth, lcm(d·c, 128, 65536))
BUCKETS = ("--ddp-bucket-size", "--ddp-num-buckets", "--ddp-pad-buckets-for-high-nccl-busbw")
#: Megatron-FSDP's all-gather prefetch window (half of it) and reduce-scatter queue (megatron_fsdp.py); DDP has no use
#: for it
COMMUNICATION_UNIT = "--suggested-communication-unit-size"
#: NCCL's user buffers for Megatron-FSDP: its buffers allocated from a torch MemPool over ncclMemAlloc (the same
#: bytes, in torch's allocator); Megatron-LM turns --fsdp-double-buffer on with it (arguments.py, validate_args), and
#: --fsdp-manual-registration registers that pool once, after the first step (training.py)
NCCL_UB = ("--use-nccl-ub", "--fsdp-manual-registration")
#: Megatron's fused cross entropy (its default 'native' implementation): _VocabParallelCrossEntropy
#: in fusions/fused_cross_entropy.py saves what tensor_parallel/cross_entropy.py's saves (the fp32
#: exp_logits, the target mask, the masked target) and its backward casts the fp32 gradient to 16
#: bits while it is live (calculate_gradients), as the unfused one's gradient is cast
LOSS_FUSION = "--cross-entropy-loss-fusion"
#: query-key layer scaling: under the local core it scales QKᵀ by 1/layer (the baddbmm's alpha and
#: the softmax's scale, no tensor kept: dot_product_attention.py) and sets attention_softmax_in_fp32
#: (TransformerConfig.__post_init__); TE's attention needs NVTE_APPLY_QK_LAYER_SCALING=1 to match
#: (extensions/transformer_engine.py) and then chooses its own backend: not modelled there
QK_LAYER_SCALING = "--apply-query-key-layer-scaling"
#: Megatron's unfused bias and GeLU (mlp.py: intermediate + bias, then F.gelu, which saves its input):
#: the bytes the fused bias_gelu keeps; ignored, and needed beside --squared-relu with biases
BIAS_GELU_FUSION = "--no-bias-gelu-fusion"
#: the arguments read as settings (checked or turned into actmem's flags) rather than parsed
SETTINGS = (*PRECISION, GQA_SWITCH, NO_POSITION_TABLE, CP_COMM, *ATTENTION, RECOMPUTE_MODULES, LOAD_BALANCING,
            AUX_LOSS_COEFF,
            TOKENIZER, BATCH_SCHEDULE, LAYERNORM_1P, FP32_GRADIENTS, *OVERLAP, *BUCKETS, COMMUNICATION_UNIT, *NCCL_UB,
            LOSS_FUSION, QK_LAYER_SCALING, *megatron_pipeline.NAMES)
#: training scripts of model families actmem does not model
FAMILIES = {"pretrain_bert.py": "BERT", "pretrain_t5.py": "encoder-decoder (T5)", "pretrain_mamba.py":
            "hybrid Mamba", "pretrain_hybrid.py": "hybrid Mamba", "pretrain_vlm.py": "multimodal",
            "pretrain_vision_classify.py": "vision", "pretrain_vision_dino.py": "vision",
            "pretrain_vision_inpaint.py": "vision", "pretrain_ict.py": "biencoder", "train_rl.py":
            "reinforcement learning", "pretrain_retro.py": "retrieval (RETRO)",
            # Megatron-LM's examples whose training script is a train.py of their own folder
            "multimodal/train.py": "vision-language (examples/multimodal)", "mimo/train.py": "multimodal (MIMO)"}
#: environment variables that decide what Megatron and TE run: TE's attention backends must
#: agree with --attention-backend (Megatron asserts it: language_module._set_attention_backend)
ATTENTION_ENVIRONMENT = {"local": (0, 0, 0), "flash": (1, 0, 0), "fused": (0, 1, 0), "unfused": (0, 0, 1),
                         "auto": (1, 1, 1)}
ATTENTION_VARIABLES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
#: variables that change no byte actmem counts, and why
QUIET_ENVIRONMENT = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "orders kernel launches (overlap), allocates nothing",
    "PYTORCH_CUDA_ALLOC_CONF": "shapes the allocator's segments (reserved memory, fragmentation); the "
                               "allocated bytes actmem counts are unchanged",
}


def read(text: str) -> tuple[list[str], list[str], int | None]:
    """(the training script's arguments, notes on how they were read, the launcher's GPU count
    or None) of pasted text or of the file named after '@': a bare argument list or a bash
    launch script."""
    from actmem.sources import launch_script

    text = _text(text)
    if not launch_script.looks_like_script(text):
        return split(text), [], None
    launch = launch_script.read(text)
    family = FAMILIES.get(launch.script.rsplit("/", 1)[-1]) or FAMILIES.get("/".join(launch.script.split("/")[-2:]))
    if family:
        raise SpecError(f"--megatron-args: the script trains with {launch.script}: {family} models are not "
                        "modelled (actmem models pretrain_gpt.py's decoder-only transformer)")
    notes = [f"read from a launch script: {launch.script}'s arguments, as bash expands them (positional "
             "parameters and $(commands) are placeholders; variables unset where it reads them, set nowhere or only "
             "in a branch bash would not take, read as unset"
             + (f": {', '.join(launch.unset)}" if launch.unset else "") + ")"]
    if launch.positional:
        notes.append(f"the script's own arguments ({', '.join(launch.positional)}) read as a run given none: empty "
                     "in a test or case statement (its branch for none taken), the default of ${N:-default}, and as an "
                     "argument's value a placeholder")
    notes += _environment(launch.environment, launch.arguments)
    gpus, note = launcher_gpus(launch.launcher)
    if note:
        notes.append(note)
    return launch.arguments, notes, gpus


def launcher_gpus(launcher: list[str]) -> tuple[int | None, str | None]:
    """torchrun's (or torch.distributed.run's) processes: --nproc_per_node x --nnodes."""
    if not launcher:
        return None, None
    runs_torchrun = launcher[0].endswith("torchrun") or any(
        word in ("torch.distributed.run", "torch.distributed.launch") for word in launcher)
    if not runs_torchrun:
        return None, f"the launcher ({' '.join(launcher[:3])} ...) does not say how many GPUs: give --gpus"
    options = dict(_launcher_options(launcher))
    per_node = options.get("--nproc-per-node", "1")
    nodes = options.get("--nnodes", "1")
    if not (per_node.isdigit() and nodes.isdigit()):
        return None, (f"torchrun's --nproc-per-node {per_node} --nnodes {nodes} is not a count actmem can read: "
                      "give --gpus")
    gpus = int(per_node) * int(nodes)
    return gpus, f"GPUs: {gpus} from the launcher (torchrun --nproc-per-node {per_node} x --nnodes {nodes})"


def _launcher_options(launcher):
    words = [part for word in launcher for part in (word.split("=", 1) if word.startswith("--") else [word])]
    for i, word in enumerate(words[:-1]):
        if word.startswith("--"):
            yield word.replace("_", "-"), words[i + 1]


def _environment(environment: dict, arguments: list[str]) -> list[str]:
    """Notes on the exported variables; an attention variable that disagrees with
    --attention-backend is refused, as Megatron asserts."""
    notes = []
    backend = _value_after(arguments, "--attention-backend") or "auto"
    expected = dict(zip(ATTENTION_VARIABLES, ATTENTION_ENVIRONMENT.get(backend, ())))
    for name, value in environment.items():
        if name in expected and str(value) != str(expected[name]):
            raise SpecError(f"--megatron-args: the script exports {name}={value}, and Megatron asserts "
                            f"{name}={expected[name]} under --attention-backend {backend} "
                            "(language_module._set_attention_backend): choose the core with --attention-backend")
        if name == "CUDA_DEVICE_MAX_CONNECTIONS" and str(value) == "1" and "--use-megatron-fsdp" in arguments:
            raise SpecError("--megatron-args: the script exports CUDA_DEVICE_MAX_CONNECTIONS=1, and Megatron refuses "
                            "it beside --use-megatron-fsdp (arguments.py: 'FSDP requires CUDA_DEVICE_MAX_CONNECTIONS > "
                            "1 or unset')")
        if name in QUIET_ENVIRONMENT:
            notes.append(f"environment: {name}={value} read: {QUIET_ENVIRONMENT[name]}")
    return notes


def _text(text: str) -> str:
    if text.startswith("@"):
        try:
            with open(text[1:], encoding="utf-8") as file:
                text = file.read()
        except OSError as error:
            raise SpecError(f"--megatron-args {text}: cannot read it ({error.strerror})")
        except UnicodeDecodeError:
            raise SpecError(f"--megatron-args {text}: not UTF-8 text")
    return text


def split(text: str) -> list[str]:
    """Shell words of a bare argument list; backslash line ends and '#' comments as a shell
    reads them."""
    try:
        return shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as error:
        raise SpecError(f"--megatron-args: not shell words ({error})")


def _values(words: list[str], i: int, count) -> tuple[list[str], int]:
    """The values after argument i: a count of them, or all up to the next argument."""
    if count in (MANY, "optional"):
        j = i + 1
        while j < len(words) and not words[j].startswith("--") and (count == MANY or j == i + 1):
            j += 1
        return words[i + 1:j], j
    return words[i + 1:i + 1 + count], i + 1 + count


def sort(words: list[str], takes_value: dict, vocab_given: bool = False) -> tuple[list[str], list[str], dict]:
    """(words actmem parses, ignored argument names, {'--seq-length': ...} checks to make).
    takes_value: each Megatron argument actmem reads -> whether it takes a value; vocab_given: a
    flag beside the paste gives the vocabulary (--vocab, --vocab-size). Every other
    Megatron argument is ignored or refused by its class (megatron_table); a name Megatron
    does not have is refused as unknown."""
    used, ignored, unknown, refused, missing, stray, settings = [], [], [], [], [], [], {}
    stopped = []
    words = [part for word in words for part in (word.split("=", 1) if word.startswith("--") else [word])]
    words, repeated = _last_of_each(words, takes_value)
    i = 0
    while i < len(words):
        name = words[i]
        count = _value_count(name, takes_value)
        values, after = _values(words, i, count or 0)
        if not name.startswith("--"):
            stray.append(name)
            after = i + 1
        elif count is None:
            unknown.append(_unknown(name))          # its values, if any, go with it
            after = _values(words, i, MANY)[1]
        elif count not in (0, MANY, "optional") and (len(values) < count or values[0].startswith("--")):
            missing.append(name)
            after = i + 1
        elif name in takes_value:
            used += [name, *values]
        elif name in SETTINGS:
            settings.setdefault(name, tuple(values) if count == MANY else values[0] if values else True)
        else:
            kind, why = megatron_table.classify(name, values)
            if kind == megatron_table.IGNORED:
                ignored.append(name)
            elif kind == megatron_table.MEGATRON_REFUSES:
                stopped.append(f"Megatron refuses {name}: {why} (arguments.py)")
            else:
                refused.append((why, name))
        i = after
    _refuse_computed_settings(settings)
    used += _implied(words, settings)
    layout, layout_notes, layout_problems = megatron_pipeline.read(words, settings)
    used += layout
    settings["notes"] = repeated + _read_notes(settings, "--use-megatron-fsdp" in used) + layout_notes
    if "--sequence-parallel" in used and _value_after(words, "--tensor-model-parallel-size") in (None, "1"):
        used.remove("--sequence-parallel")      # Megatron turns it off at t = 1 (arguments.py, with a warning)
        settings["notes"].append(
            "--sequence-parallel at tensor-parallel size 1: Megatron turns it off (arguments.py), and so does actmem")
    problems = layout_problems + list(dict.fromkeys(stopped)) + _problems(
        words + ["--vocab-size"] * vocab_given, settings, refused, unknown, missing)
    if stray:
        problems.append(f"words that follow no argument, as Megatron's parser would refuse them: {', '.join(stray)} "
                        "(in a script, an unquoted ${ARRAY[@]} splits a quoted element at its spaces)")
    if problems:
        raise SpecError(f"--megatron-args: {'; '.join(problems)}")
    return used, ignored, settings


#: what a read setting does to the count, said in the assumptions: (the names, the note)
_READ_NOTES = (
    (OVERLAP, "{names} read: the reduce-scatter and the parameter all-gather run per bucket into the buffers DDP "
              "already holds (a bucket is a view of its buffer); with the distributed optimizer the buckets "
              "(max(40M, 1M·d·c) parameters each) change only its padding of bucket ends, not counted; "
              "`plan` takes them as overlapping that communication with compute in its time"),
    (BUCKETS, "{names} read: they shape the buckets, views of DDP's buffers; with the distributed optimizer each "
              "bucket's end is padded (param_layout.py: to lcm(d·c, 128), or lcm(d·c, 128, 65536) padded for "
              "NCCL's bus bandwidth), not counted"),
    ((COMMUNICATION_UNIT,), "{names} read: only Megatron-FSDP uses it (its prefetch window and reduce-scatter "
                            "queue); here it changes nothing"),
    (NCCL_UB, "{names} read: Megatron-FSDP's buffers come from a torch MemPool over NCCL's ncclMemAlloc "
              "(megatron/core/nccl_allocator.py): the same bytes, counted by torch's allocator, its segments rounded "
              "to NCCL's granularity (not counted); --use-nccl-ub turns --fsdp-double-buffer on (arguments.py), and "
              "registering the pool (--fsdp-manual-registration, after the first step) allocates nothing"),
    ((LOSS_FUSION,), "{names} read: Megatron's native fused cross entropy keeps what the unfused one keeps (the fp32 "
                     "softmax, the target mask and the masked target: fusions/fused_cross_entropy.py) and casts its "
                     "fp32 gradient to 16 bits in its backward, the same moment"),
    ((LAYERNORM_1P,), "{names}: TE's norms take zero-centred weights inside their kernels and keep the same tensors "
                      "(transformer_engine/pytorch/module/layernorm_linear.py: zero_centered_gamma)"),
)


#: the notes of _READ_NOTES that say otherwise under Megatron-FSDP, whose buckets are its own
_MEGATRON_FSDP_NOTES = {
    OVERLAP: "{names} read: under Megatron-FSDP they overlap its gradient reduce-scatters and its units' all-gathers "
             "with compute, and --overlap-grad-reduce splits its buckets outside the units at --ddp-bucket-size "
             "(max(4·10⁷, 10⁶·d·c) elements unless given: training.py, resolve_ddp_bucket_size), each padded: "
             "counted",
    (COMMUNICATION_UNIT,): "{names} read: under Megatron-FSDP its backward's prefetch gathers units ahead while "
                           "they are below half of it, and its reduce-scatter queue holds it (megatron_fsdp.py): "
                           "counted in the last layer's backward",
    BUCKETS: "{names} read: under Megatron-FSDP --ddp-bucket-size splits its buckets outside the units once "
             "--overlap-grad-reduce is on (training.py, resolve_ddp_bucket_size), each padded: counted",
}


def _read_notes(settings, megatron_fsdp: bool = False) -> list[str]:
    """The assumptions' notes on the read settings; ``megatron_fsdp``: the paste runs Megatron-FSDP, whose
    buckets are not DDP's."""
    backend = settings.get("--attention-backend")
    notes = [f"--attention-backend {backend} read: {_BACKEND_NOTES[backend]}"] if backend in _BACKEND_NOTES else []
    for names, note in _READ_NOTES:
        note = _MEGATRON_FSDP_NOTES.get(names, note) if megatron_fsdp else note
        given = [name for name in names if name in settings]
        if given:
            notes.append(note.format(names=" and ".join(given)))
    return notes


def _unknown(name: str) -> str:
    near = megatron_table.closest(name) if name.startswith("--") else None
    return f"{name} (did you mean {near}?)" if near else name


def _last_of_each(words: list[str], takes_value: dict) -> tuple[list[str], list[str]]:
    """(the words with each argument's earlier occurrences dropped, a note for each whose value changed): a script
    that gives an argument twice (a later override) runs with the last, as Megatron's argparse keeps it (every
    argument of add_megatron_arguments at d98e8a64 stores; none appends). An occurrence whose value is missing
    stays for sort to refuse, as Megatron's parser does; only the arguments actmem reads get a note."""
    spans, i = {}, 0                        # name -> [(start, end, values)], in order
    while i < len(words):
        count = _value_count(words[i], takes_value) if words[i].startswith("--") else None
        if count is None:                   # a stray word or an unknown name: sort names it
            i += 1
            continue
        values, after = _values(words, i, count or 0)
        if count not in (0, MANY, "optional") and (len(values) < count or any(v.startswith("--") for v in values)):
            i += 1                          # its value is missing: sort refuses it
            continue
        spans.setdefault(words[i], []).append((i, after, tuple(values)))
        i = after
    dropped = {index for given in spans.values() for start, end, _ in given[:-1] for index in range(start, end)}
    notes = [f"{name} is given {len(given)} times ({' then '.join(' '.join(values) or 'alone' for *_, values in given)}): "
             f"Megatron's parser keeps the last, and so does actmem"
             for name, given in spans.items() if len({values for *_, values in given}) > 1
             and (name in takes_value or name in SETTINGS)]
    return [word for index, word in enumerate(words) if index not in dropped], notes


def _value_count(name: str, takes_value: dict):
    """How many values follow an argument: 0, 1, a count, MANY or 'optional' (None for a name
    Megatron-LM does not have)."""
    if name in takes_value:
        return int(takes_value[name])
    count = megatron_table.value_count(name)
    return MANY if count == "many" else count


def _implied(words, settings) -> list[str]:
    """What Megatron makes of the settings: --group-query-attention alone means g = 1; the
    attention backend and implementation choose the core; the dataloader makes an attention
    mask unless told not to."""
    implied = []
    if QK_LAYER_SCALING in settings and "--attention-softmax-in-fp32" not in words:
        implied += ["--attention-softmax-in-fp32"]                   # TransformerConfig sets it
    if "--fp16" in settings and FP32_GRADIENTS not in settings and "--use-megatron-fsdp" not in words:
        implied += ["--grad-dtype", "fp16"]      # fp16's DDP gradient buffers stay 16-bit (Megatron-FSDP's: its own)
    if "--fp16" in settings:                     # the precision-aware optimizer's remainders need bf16
        implied += ["--params-dtype", "fp16"]
    if GQA_SWITCH in settings and "--num-query-groups" not in words:
        implied += ["--num-query-groups", "1"]
    core = attention_core(settings)
    legacy_switch = "--use-flash-attn" in words and "--attention-backend" not in settings
    if core is not None and not legacy_switch:      # --use-flash-attn alone: Megatron's flash backend
        implied += ["--attention-core", core]
    if settings.get(RECOMPUTE_MODULES):
        implied += [RECOMPUTE_MODULES, ",".join(settings[RECOMPUTE_MODULES])]
    for setting, flag in ((LOAD_BALANCING, "--moe-load-balancing"), (AUX_LOSS_COEFF, "--moe-aux-loss")):
        if len(settings.get(setting) or ()) == 1:
            implied += [flag, settings[setting][0]]
    schedule = settings.get(BATCH_SCHEDULE)
    if schedule and "--global-batch-size" not in words:
        implied += ["--global-batch-size", str(largest_batch(schedule))]
    vocab = tokenizer_vocab(settings.get(TOKENIZER))
    if vocab is not None and "--vocab-size" not in words:
        implied += ["--vocab-size", str(vocab)]
    if NO_MASK not in words:                         # Megatron's dataloader makes one by default
        implied += ["--attention-mask"]
    return implied


def largest_batch(schedule: str) -> int:
    """The largest batch of a step schedule "THRESHOLD:BS THRESHOLD:BS ..." (TrainingConfig.
    step_batch_size_schedule): a run holds no more microbatches in flight at a smaller one."""
    sizes = [step.partition(":")[2] for step in schedule.split()]
    if not sizes or not all(size.isdigit() for size in sizes):
        raise SpecError(f"--megatron-args: {BATCH_SCHEDULE} {schedule!r}: expected THRESHOLD:BATCH steps")
    return max(int(size) for size in sizes)


def tokenizer_vocab(tokenizer) -> int | None:
    """The vocabulary a tokenizer fixes: GPT-2's BPE files (None where it comes from a file
    actmem does not read, or from --vocab-size)."""
    return GPT2_VOCAB if tokenizer == "GPT2BPETokenizer" else None


def vocabulary_notes(words, settings) -> list[str]:
    """Where the vocabulary comes from, said; a tokenizer whose vocabulary lives in a file
    and no --vocab-size is one line asking for it."""
    tokenizer = settings.get(TOKENIZER)
    if tokenizer is None or (tokenizer == "NullTokenizer" and "--vocab-size" in words):
        return []
    if tokenizer == "GPT2BPETokenizer":
        note = f"vocabulary: {GPT2_VOCAB:,}, GPT-2's BPE files (GPT2BPETokenizer; --vocab-file is GPT-2's own)"
        return [note + ("; Megatron ignores --vocab-size beside it" if "--vocab-size" in words else "")]
    if "--vocab-size" in words:
        return [f"vocabulary: --vocab-size, taken as the size of {tokenizer}'s vocabulary (Megatron reads it "
                "from the tokenizer's files, which actmem does not)"]
    return []


def _value_after(words, name):
    return next((words[i + 1] for i, word in enumerate(words[:-1]) if word == name), None)


def attention_core(settings) -> str | None:
    """'eager' or 'flash' from --transformer-impl and --attention-backend (None for a
    combination actmem does not model; _problems names it)."""
    impl = settings.get("--transformer-impl", "transformer_engine")
    backend = settings.get("--attention-backend", "auto")
    if impl == "local":
        return "eager" if backend in ("local", "auto") else None
    return BACKEND_CORES.get(backend) if impl == "transformer_engine" else None


def _recompute_modules(settings) -> list[str]:
    """Megatron takes the modules as words of their own (nargs='*'): 'core_attn,mlp' would be
    one unknown module to it; given none, its selective recompute recomputes nothing, which actmem does not read
    as a run of its own."""
    if settings.get(RECOMPUTE_MODULES) == ():
        return [f"{RECOMPUTE_MODULES} names no module: Megatron's selective recompute then recomputes nothing "
                "(transformer_config.py: recompute_modules []); name the modules, or drop the recompute"]
    joined = [module for module in settings.get(RECOMPUTE_MODULES) or () if "," in module]
    if joined:
        return [f"{RECOMPUTE_MODULES} {' '.join(joined)}: Megatron takes the modules as separate words "
                f"({RECOMPUTE_MODULES} {' '.join(m for word in joined for m in word.split(',') if m)})"]
    return []


def _refuse_computed_settings(settings: dict) -> None:
    """A setting actmem reads itself (SETTINGS: --attention-backend, --recompute-modules, ...) whose value the script
    computes when it runs ($1, $(command), a variable it never sets: launch_script's placeholders) cannot be decided
    by a flag beside the paste: refused, naming it, before anything reads it."""
    computed = [(name, value) for name, value in settings.items()
                if any("$" in str(part) or "`" in str(part)
                       for part in (value if isinstance(value, tuple) else (value,)))]
    if computed:
        raise SpecError("--megatron-args: " + "; ".join(
            f"{name} is {' '.join(value) if isinstance(value, tuple) else value}" for name, value in computed)
            + (", which the script computes" if len(computed) == 1 else ": values the script computes")
            + " when it runs (a positional parameter, a command's output, a variable it never sets); actmem reads the "
            "script without running it and takes " + ("this setting" if len(computed) == 1 else "these settings")
            + " from the paste alone: write " + ("its value" if len(computed) == 1 else "their values")
            + " into the pasted script")


def _megatron_fsdp_problems(words) -> list[str]:
    """What Megatron-LM (d98e8a64, arguments.py: validate_args) stops on beside --use-megatron-fsdp."""
    if "--use-megatron-fsdp" not in words:
        return []
    problems = []
    if _value_after(words, "--ckpt-format") != "fsdp_dtensor":
        problems.append("Megatron refuses --use-megatron-fsdp without --ckpt-format fsdp_dtensor (arguments.py: "
                        "'Megatron-FSDP requires the `fsdp_dtensor` checkpointing format'): give it")
    strategy = _value_after(words, "--data-parallel-sharding-strategy") or "optim_grads_params"
    if "--init-model-with-meta-device" in words and strategy == "no_shard":
        problems.append("Megatron refuses --init-model-with-meta-device beside --data-parallel-sharding-strategy "
                        "no_shard (arguments.py: 'not supported or necessary for the no_shard sharding strategy')")
    return problems


def _problems(words, settings, refused, unknown, missing) -> list[str]:
    problems = []
    for setting in (LOAD_BALANCING, AUX_LOSS_COEFF):
        if len(settings.get(setting) or ()) > 1:
            problems.append(f"{setting} {' '.join(settings[setting])}: several load-balancing types (and "
                            "their coefficients) are not modelled; give one")
    tokenizer = settings.get(TOKENIZER)
    if tokenizer not in (None, "GPT2BPETokenizer") and "--vocab-size" not in words:
        problems.append(f"{TOKENIZER} {tokenizer} takes its vocabulary from its files, which actmem does not read: "
                        "give --vocab-size N (the tokenizer's vocabulary, before Megatron's padding)")
    if QK_LAYER_SCALING in settings and attention_core(settings) != "eager":
        problems.append(f"{QK_LAYER_SCALING} under TE's attention is not modelled: Megatron then needs "
                        "NVTE_APPLY_QK_LAYER_SCALING=1 (transformer_engine.py) and TE chooses its own backend; "
                        "under the local core it is read (the softmax in fp32)")
    if LAYERNORM_1P in settings and settings.get("--transformer-impl") == "local":
        problems.append(f"{LAYERNORM_1P} under --transformer-impl local is not modelled: Megatron's FusedLayerNorm "
                        "makes weight + 1, a tensor of its own that the norm keeps (fused_layer_norm.py)")
    if "--squared-relu" in words and "--disable-bias-linear" not in words and BIAS_GELU_FUSION not in words:
        problems.append("Megatron refuses --squared-relu with its default fused bias-GeLU (transformer_config.py: "
                        "'When bias_activation_fusion is True, activation function should be either gelu, swiglu, "
                        f"or quick_geglu'): give {BIAS_GELU_FUSION} or --disable-bias-linear")
    problems += _megatron_fsdp_problems(words)
    if BATCH_SCHEDULE in settings and "--global-batch-size" in words:
        problems.append(f"Megatron refuses {BATCH_SCHEDULE} beside --global-batch-size (arguments.py: "
                        "'Cannot specify both'): give one")
    if refused:
        reasons = {}
        for why, name in refused:
            reasons.setdefault(why, {})[name] = None         # each name once, however often given
        problems.append("changes memory and is not modelled yet: " +
                        "; ".join(f"{', '.join(names)} ({why})" for why, names in reasons.items()))
    if unknown:
        problems.append(f"not an argument of Megatron-LM (at {megatron_table.pinned_commit()[:12]}): "
                        f"{', '.join(dict.fromkeys(unknown))}")
    if missing:
        problems.append(f"expects a value: {', '.join(dict.fromkeys(missing))}")
    if "--num-query-groups" in words and GQA_SWITCH not in settings:
        problems.append("Megatron ignores --num-query-groups without --group-query-attention")
    precision = [name for name in PRECISION if name in settings]
    if len(precision) != 1:
        problems.append("give one of --bf16 or --fp16: actmem counts 16-bit activations" if precision else
                        "neither --bf16 nor --fp16: Megatron would train in fp32, and actmem counts "
                        "16-bit activations")
    rope = "--use-rotary-position-embeddings" in words or _value_after(words, "--position-embedding-type") == "rope"
    if NO_POSITION_TABLE in settings and not rope:
        problems.append("Megatron refuses --no-position-embedding unless the positions are rotary "
                        "(--position-embedding-type rope); for none, give --position-embedding-type none")
    problems += _recompute_modules(settings)
    communication = settings.get(CP_COMM, ("p2p",))     # one a layer, or one for all (nargs '+')
    if set(communication) != {"p2p"}:
        problems.append(f"{CP_COMM} {' '.join(communication)} is not modelled: actmem counts the p2p ring, "
                        "Megatron's default")
    if "--use-flash-attn" in words and settings.get("--transformer-impl") == "local":
        problems.append("--use-flash-attn with --transformer-impl local is not modelled: the local spec's core is "
                        "Megatron's own DotProductAttention, and actmem reads --use-flash-attn as TE's flash-attn")
    elif attention_core(settings) is None:
        problems.append(f"--transformer-impl {settings.get('--transformer-impl', 'transformer_engine')} with "
                        f"--attention-backend {settings.get('--attention-backend', 'auto')} is not modelled: "
                        "actmem models local (eager), flash, fused and auto (TE's flash or cuDNN kernels) "
                        "under transformer_engine, and local under the local implementation")
    return problems
