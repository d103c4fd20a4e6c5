"""The flags that describe a model, its architecture and a run, and how they become a Spec.

Megatron-LM's argument names are accepted beside actmem's, so the parallelism flags of a
launch script can be pasted as they are. Each spelling is its own click option that may
repeat: a setting given twice with different values, or under two spellings that
disagree (``--tp 4 --tensor-model-parallel-size 8``), is refused rather than the last one
silently winning.
"""

from dataclasses import dataclass

import click

from actmem.model.architecture import POSITION_EMBEDDING_ALIASES, POSITION_EMBEDDINGS
from actmem.errors import SpecError
from actmem.model.defaults import VOCAB_DIVISIBLE_BY
from actmem.model.hardware import DEFAULT_RESERVE
from actmem.model.implementation import IMPLEMENTATIONS, MEGATRON, implementation


_NO_CONSTANT = object()


class _Named(click.Choice):
    """A choice with other spellings read as one name (Megatron's learned_absolute: learned)."""

    def __init__(self, names: dict):
        super().__init__(list(names), case_sensitive=False)
        self.names = names

    def convert(self, value, param, ctx):
        return self.names[super().convert(value, param, ctx)]


class Once(click.Option):
    """An option that may be given once, or repeated with the same value: click keeps the
    last of two values without a word, and a setting given twice that disagrees is refused."""

    def add_to_parser(self, parser, ctx):
        if self.multiple or self.count or self.is_flag:
            return super().add_to_parser(parser, ctx)
        parser.add_option(obj=self, opts=self.opts, dest=self.name, action="append", nargs=self.nargs)

    def consume_value(self, ctx, opts):
        value, source = super().consume_value(ctx, opts)
        if isinstance(value, list) and not (self.multiple or self.count or self.is_flag):
            if len(set(map(str, value))) > 1:
                raise SpecError(f"{self.opts[0]} is given more than once and the values disagree: "
                                f"{' and '.join(dict.fromkeys(f'{self.opts[0]} {v}' for v in value))}; give it once")
            value = value[0]
        return value, source


def option(*names, **kw):
    """click.option, refusing a setting given twice with two values (Once)."""
    return click.option(*names, cls=kw.pop("cls", Once), **kw)


class _Ratio(click.ParamType):
    """A decimal as an exact fraction ('1.25' is 5/4), so the bytes it scales stay whole numbers."""

    name = "RATIO"

    def convert(self, value, param, ctx):
        from fractions import Fraction

        try:
            ratio = Fraction(str(value))
        except (ValueError, ZeroDivisionError):
            self.fail(f"{value!r} is not a number", param, ctx)
        return int(ratio) if ratio.denominator == 1 else ratio


_RATIO = _Ratio()


class _Loads(click.ParamType):
    """A per-expert load histogram file, read, or Megatron's logs' directory (actmem.sources.expert_loads)."""

    name = "FILE|DIR"

    def convert(self, value, param, ctx):
        from actmem.sources.expert_loads import read_loads

        if isinstance(value, tuple):
            return value
        try:
            return read_loads(value)
        except SpecError as error:
            self.fail(str(error), param, ctx)
POSITION_EMBEDDING_NAMES = _Named({name: name for name in POSITION_EMBEDDINGS} | POSITION_EMBEDDING_ALIASES)


@dataclass(frozen=True)
class Flag:
    names: tuple
    """actmem's spelling first, then Megatron-LM's; "--a/--no-a" for an on/off switch."""
    key: str
    """The spec's name for the setting; several flags may set one key (--swiglu and
    --activation), and they must agree like any two spellings."""
    help: str
    type: object = int
    constant: object = _NO_CONSTANT
    """For a switch that sets the key to a fixed value (--swiglu: 'swiglu')."""
    same: object = None
    """value -> what two spellings must agree on (None: the value itself); --recompute-modules
    names a set, so 'mlp,core_attn' and 'core_attn mlp' agree."""
    metavar: str | None = None

    def dest(self, index: int) -> str:
        """click's name for one spelling's values; --gradient-checkpointing and the Trainer's
        --gradient_checkpointing are two spellings, not one."""
        spelling = self.names[index].partition("/")[0].lstrip("-").replace("_", "__").replace("-", "_")
        return f"{self.key}__{spelling}"


MODEL_FLAGS = (
    Flag(("--heads", "--num-attention-heads"), "heads", "attention heads a"),
    Flag(("--hidden", "--hidden-size"), "hidden", "hidden size h"),
    Flag(("--layers", "--num-layers"), "layers", "transformer layers L"),
    Flag(("--vocab", "--vocab-size"), "vocab", "vocabulary size v (padded as Megatron does)"),
    Flag(("--seq-len", "--seq-length"), "seq_len", "sequence length s"),
)
ARCHITECTURE_FLAGS = (
    Flag(("--attention-dropout",), "attention_dropout",
         "dropout on the attention probabilities (default 0.1, the paper's); 0 keeps no mask",
         float),
    Flag(("--hidden-dropout",), "hidden_dropout",
         "dropout after the embedding, attention and MLP (default 0.1); 0 keeps no mask", float),
    Flag(("--ffn", "--ffn-hidden-size"), "ffn_hidden", "the MLP's hidden size f (default 4h)"),
    Flag(("--activation",), "activation", "the MLP's activation: gelu (default), swiglu or squared_relu",
         click.Choice(["gelu", "swiglu", "squared_relu"], case_sensitive=False)),
    Flag(("--swiglu",), "activation", "Megatron's switch for --activation swiglu", constant="swiglu"),
    Flag(("--squared-relu",), "activation", "Megatron's switch for --activation squared_relu",
         constant="squared_relu"),
    Flag(("--normalization",), "normalization", "layernorm (default) or rmsnorm (Megatron's "
         "LayerNorm, RMSNorm are read too)", click.Choice(["layernorm", "rmsnorm"], case_sensitive=False)),
    Flag(("--disable-bias-linear",), "bias", "linear layers without biases (Megatron's switch)",
         constant=False),
    Flag(("--add-bias-linear",), "bias", "linear layers with biases (the default)", constant=True),
    Flag(("--add-qkv-bias",), "qkv_bias", "a bias on the QKV linear even with --disable-bias-linear "
         "(Megatron's switch; Qwen2)", constant=True),
    Flag(("--query-groups", "--num-query-groups"), "query_groups",
         "key/value heads g (grouped-query attention; 1 is multi-query); default: one a head"),
    Flag(("--head-dim", "--kv-channels"), "head_dim", "head dim d (default h/a)"),
    Flag(("--untie-embeddings-and-output-weights",), "tied_output",
         "an output layer with weights of its own (Megatron's switch; default: tied to the "
         "word embedding)", constant=False),
    Flag(("--attention-core",), "attention_core",
         "eager (default, the paper's: keeps the s² softmax output), flash (TE's cuDNN kernel: "
         "keeps q, k, v, its output and an fp32 log-sum-exp) or flash-attn (the same, and at "
         "b > 1 a copy of its output)", click.Choice(["eager", "flash", "flash-attn"], case_sensitive=False)),
    Flag(("--use-flash-attn",), "attention_core", "Megatron's switch for --attention-core flash-attn",
         constant="flash-attn"),
    Flag(("--position-embedding", "--position-embedding-type"), "position_embedding",
         "learned (default, an s·h table), rope (rotary; flash core only) or none; Megatron's "
         "learned_absolute is read as learned", POSITION_EMBEDDING_NAMES),
    Flag(("--max-position-embeddings",), "position_rows",
         "rows of the learned position table (Megatron's name; default s): a longer table is more parameters "
         "on the first stage; with rotary or no positions there is no table, and it changes nothing"),
    Flag(("--use-rotary-position-embeddings",), "position_embedding",
         "Megatron's older switch for --position-embedding rope", constant="rope"),
    Flag(("--rotary-percent",), "rotary_percent",
         "the share of each head rope rotates (Megatron's name; default 1): under --no-rope-fusion the kept cos "
         "and sin are int(d·percent) wide; TE's fused rope keeps no more either way", float),
    Flag(("--rope-fusion/--no-rope-fusion",), "rope_fusion",
         "rotary positions by TE's fused kernel (default), or Megatron's unfused rope_utils.py, "
         "which keeps a 16-bit cos and sin for q and for k each layer (4 x 2sd)", bool),
    Flag(("--qk-norm/--no-qk-norm", "--qk-layernorm"), "qk_norm",
         "a norm on each head of q and k before rope, of the model's normalization (Qwen3; Megatron's "
         "--qk-layernorm; flash core): keeps a contiguous copy of q and k and fp32 statistics a head", bool),
    Flag(("--multi-latent-attention",), "multi_latent_attention",
         "multi-head latent attention (DeepSeek-V2/V3; Megatron's switch): q, k and v projected up from low-rank "
         "latents; modelled under TE's flash core with Megatron's fused YaRN rope", constant=True),
    Flag(("--q-lora-rank",), "q_lora_rank", "MLA: the q latent's width (default: none, q from the hidden state)"),
    Flag(("--kv-lora-rank",), "kv_lora_rank", "MLA: the kv latent's width (Megatron's default 32)"),
    Flag(("--qk-head-dim",), "qk_head_dim", "MLA: each head's q and k width without rope (default 128)"),
    Flag(("--qk-pos-emb-head-dim",), "qk_pos_emb_head_dim", "MLA: each head's rope part of q and k (default 64)"),
    Flag(("--v-head-dim",), "v_head_dim", "MLA: each head's v width (default 128)"),
    Flag(("--mtp-num-layers",), "mtp_layers",
         "multi-token prediction (DeepSeek-V3's 1; Megatron's name): D more layers on the last stage, each with its "
         "norms, projection and logits (default 0: none)"),
    Flag(("--rope-type",), "rope_type",
         "Megatron's rope kind: yarn (multi-latent attention's default, the only one modelled there) or rope (other "
         "attention's)", click.Choice(["rope", "yarn"])),
    Flag(("--attention-mask/--no-attention-mask",), "attention_mask",
         "count the causal mask Megatron's dataloader makes for each microbatch, b·s² bytes of bool, "
         "which the recompute checkpoints keep (Megatron's default; a pasted argument list without "
         "--no-create-attention-mask-in-dataloader has it); default: not counted, as the paper", bool),
    Flag(("--no-create-attention-mask-in-dataloader",), "attention_mask",
         "Megatron's switch for --no-attention-mask", constant=False),
    Flag(("--masked-softmax-fusion/--no-masked-softmax-fusion",), "masked_softmax_fusion",
         "the local (eager) core's softmax by Megatron's fused kernel where it runs (default), or always torch's "
         "fallback (forward_torch_softmax), which keeps the causal mask it fills, s² bytes a layer; nothing "
         "changes under TE's flash cores", bool),
    Flag(("--attention-softmax-in-fp32",), "softmax_in_fp32",
         "torch's fallback softmax in fp32 (Megatron's switch): it keeps its fp32 output, 4as²b/t; the fused "
         "kernel and TE's cores keep no fp32 softmax", constant=True),
    Flag(("--gradient-accumulation-fusion/--no-gradient-accumulation-fusion",), "gradient_accumulation_fusion",
         "Megatron's fused weight gradients into main_grad, with TE's dummy kept (default), or 16-bit weight "
         "gradients made at each linear's backward and freed once added (Megatron's --no-gradient-accumulation-"
         "fusion)", bool),
    Flag(("--num-experts",), "num_experts",
         "a mixture-of-experts MLP of E experts in every layer (Megatron's switch; modelled: the allgather and "
         "alltoall dispatchers, SwiGLU experts without biases, dropless routing)"),
    Flag(("--moe-router-topk",), "moe_topk", "experts each token is routed to, k (default 2)"),
    Flag(("--moe-layer-freq",), "moe_layer_freq",
         "which layers are MoE layers: N (every N-th from the first; default 1, all) or Megatron's pattern of 0 "
         "(dense) and 1 (MoE), e.g. '([0]*3+[1]*58)'", str),
    Flag(("--moe-ffn-hidden-size",), "moe_ffn_hidden", "an expert's hidden size f_e (default: --ffn)"),
    Flag(("--moe-load-balancing", "--moe-router-load-balancing-type"), "moe_load_balancing",
         "the router's load balancing: aux_loss (default; above a coefficient of 0 it keeps its own scores over "
         "every expert), seq_aux_loss (the same a sequence; DeepSeek) or none",
         click.Choice(["aux_loss", "none", "seq_aux_loss", "global_aux_loss", "sinkhorn"])),
    Flag(("--moe-aux-loss", "--moe-aux-loss-coeff"), "moe_aux_loss_coeff",
         "the aux loss's coefficient (default 0, Megatron's: no aux loss is computed, nor its scores kept)", float),
    Flag(("--moe-shared-expert-intermediate-size",), "moe_shared_ffn",
         "the shared experts' hidden size f_s (all of them as one MLP every token passes; default none)"),
    Flag(("--moe-shared-expert-gate",), "moe_shared_gate", "a sigmoid gate on the shared experts' output",
         constant=True),
    Flag(("--moe-shared-expert-overlap",), "moe_shared_overlap",
         "the shared experts beside the dispatcher's communication (alltoall): fc1 keeps its gathered input",
         constant=True),
    Flag(("--moe-router-score-function",), "moe_score_function",
         "the router's scores: softmax (default) or sigmoid (DeepSeek-V3)", click.Choice(["softmax", "sigmoid"])),
    Flag(("--moe-router-enable-expert-bias",), "moe_expert_bias",
         "a per-expert bias on the sigmoid scores for the choice only (DeepSeek-V3's aux-loss-free balancing)",
         constant=True),
    Flag(("--moe-router-num-groups",), "moe_router_groups",
         "group-limited routing: the experts in this many groups (DeepSeek-V3's node-limited choice)"),
    Flag(("--moe-router-group-topk",), "moe_router_group_topk", "... and the groups a token's experts may come from"),
    Flag(("--moe-router-pre-softmax",), "moe_pre_softmax",
         "the router's softmax over every expert before its top-k (no renormalisation; what top-1 needs)",
         constant=True),
    Flag(("--moe-router-dtype",), "moe_router_dtype",
         "the router's logits and probabilities: fp32 or fp64 (default: the activations' 16 bits)",
         click.Choice(["fp32", "fp64"])),
    Flag(("--moe-token-dispatcher-type",), "moe_dispatcher",
         "how tokens reach their experts: allgather (Megatron's default), alltoall or flex (not modelled)",
         click.Choice(["alltoall", "allgather", "flex"])),
    Flag(("--moe-expert-capacity-factor",), "moe_capacity_factor",
         "each expert's capacity, ⌈k·N/E·factor⌉ tokens from each rank (Megatron's name; default none: dropless): "
         "the tokens over it are dropped, which bounds the busiest rank's rows", float),
    Flag(("--moe-token-drop-policy",), "moe_drop_policy",
         "with a capacity factor, which tokens are dropped: probs (the lowest probabilities; default) or position",
         click.Choice(["probs", "position"])),
    Flag(("--fp8-format",), "fp8_format",
         "FP8 training through Transformer Engine (e4m3 or hybrid, one byte an element either way): TE's linears "
         "keep their inputs quantized and cache FP8 copies of their weights (actmem.model.fp8)",
         click.Choice(["e4m3", "hybrid"])),
    Flag(("--fp8-recipe",), "fp8_recipe",
         "with --fp8-format, FP8's scaling: delayed (Megatron's default), tensorwise, mxfp8 (Blackwell) or "
         "blockwise (Hopper, Blackwell)", click.Choice(["delayed", "tensorwise", "mxfp8", "blockwise", "custom"])),
    Flag(("--fp8-param-gather",), "fp8_param_gather",
         "with --fp8-format, the linears' weights FP8 themselves (one byte), gathered in FP8; needs the "
         "distributed optimizer", constant=True),
    Flag(("--fp8-amax-history-len",), "fp8_amax_history_len",
         "delayed scaling's amax history, rows (Megatron's default 1): fp32 [rows, 3] and [rows, 2] a TE linear"),
    Flag(("--first-last-layers-bf16",), "fp8_first_last_bf16",
         "with --fp8-format (not delayed scaling), the model's first and last layers run in bf16: they keep 16-bit "
         "inputs and no FP8 weight copies", constant=True),
    Flag(("--num-layers-at-start-in-bf16",), "fp8_bf16_start",
         "with --first-last-layers-bf16, how many of the first layers (Megatron's default 1)"),
    Flag(("--num-layers-at-end-in-bf16",), "fp8_bf16_end",
         "with --first-last-layers-bf16, how many of the last layers (Megatron's default 1)"),
    Flag(("--moe-pad-expert-input-to-capacity",), "moe_pad_to_capacity",
         "with a capacity factor, every expert's input padded to its capacity C (Megatron's 'drop and pad'): "
         "the experts then receive C·EP·ETP rows each whatever the routing", constant=True),
    Flag(("--moe-permute-fusion",), "moe_permute_fusion",
         "the permutation as Transformer Engine's fused kernels: an int32 row map in place of the routing map, "
         "its probabilities and the int64 indices", constant=True),
    Flag(("--moe-grouped-gemm",), "moe_grouped_gemm",
         "the experts as TE's grouped GEMM (the same saved tensors as one MLP each)", constant=True),
    Flag(("--implementation",), "implementation",
         "whose code runs the layer: megatron (default: Megatron-Core with Transformer Engine), "
         "torch-native (PyTorch DTensor TP/SP as torchtitan plans its Llama layer) or hf (Hugging "
         "Face transformers' Llama, Qwen3 or GPT-2, by the architecture, on one device: --attention-core "
         "eager is its eager attention, flash its sdpa)",
         click.Choice(list(IMPLEMENTATIONS), case_sensitive=False)),
)
GPUS = Flag(("--gpus",), "gpus", "GPUs in the run (data parallel d = gpus/(t·c·p))")
GLOBAL_BATCH = Flag(("--global-batch", "--global-batch-size"), "global_batch",
                    "global batch: sequences per iteration; with --gpus gives the microbatches")
MOE_IMBALANCE = Flag(("--moe-imbalance",), "routing_imbalance",
                     "the busiest rank's expert rows over the balanced count, r >= 1 (default 1: balanced routing); "
                     "1.25 prices a rank that receives 25% more tokens than its share", _RATIO)
MOE_LOADS = Flag(("--moe-load-histogram",), "expert_loads",
                 "a per-expert load histogram: the tokens each expert received, one row of E counts a layer (JSON, or "
                 "text/CSV a layer a line), the counts Megatron's router makes (tokens_per_expert), or the directory "
                 "Megatron-LM's --save-tokens-per-expert-interval writes; the busiest EP "
                 "rank's share of it, in "
                 "its busiest layer, sizes the expert rows (in place of --moe-imbalance)", _Loads())
RUN_FLAGS = (
    Flag(("--tp", "--tensor-model-parallel-size"), "tensor_parallel", "tensor-parallel size t"),
    Flag(("--pp", "--pipeline-model-parallel-size"), "pipeline_parallel", "pipeline-parallel size p"),
    Flag(("--cp", "--context-parallel-size"), "context_parallel",
         "context-parallel size c: ranks splitting each sequence (ring attention; flash core)"),
    Flag(("--interleave", "--num-virtual-stages-per-pipeline-rank"), "interleave",
         "interleaved schedule: model chunks per pipeline rank m (1 = plain 1F1B)"),
    Flag(("--first-stage-layers", "--decoder-first-pipeline-num-layers"), "first_stage_layers",
         "an uneven pipeline: layers on the first stage (the others share the rest)"),
    Flag(("--last-stage-layers", "--decoder-last-pipeline-num-layers"), "last_stage_layers",
         "an uneven pipeline: layers on the last stage"),
    Flag(("--micro-batch", "--micro-batch-size", "--per-device-train-batch-size", "--per_device_train_batch_size"),
         "micro_batch", "microbatch size b (the Trainer's per-device batch)"),
    GLOBAL_BATCH,
    Flag(("--gradient-accumulation-steps", "--gradient_accumulation_steps"), "gradient_accumulation",
         "microbatches a step on each data-parallel rank (the Trainer's and DeepSpeed's): with --gpus, the global "
         "batch b·N·d"),
    GPUS,
    Flag(("--recompute", "--recompute-granularity"), "recompute",
         "activation recomputation: none, selective or full (Megatron's --recompute-granularity; under "
         "--implementation hf, full is the Trainer's activation checkpointing)",
         click.Choice(["none", "selective", "full"])),
    Flag(("--recompute-activations",), "recompute", "Megatron's older switch for --recompute selective",
         constant="selective"),
    Flag(("--activation-checkpointing", "--gradient-checkpointing", "--activation_checkpointing",
          "--gradient_checkpointing"), "recompute",
         "the Hugging Face Trainer's switch, as it spells it too (gradient_checkpointing, its older name): "
         "--recompute full, every layer checkpointed alone", constant="full"),
    Flag(("--recompute-method",), "recompute_method",
         "with full recompute: uniform (groups of N layers, each keeping its input) or block "
         "(the first N layers of each model chunk; the rest keep everything)",
         click.Choice(["uniform", "block"])),
    Flag(("--recompute-num-layers",), "recompute_layers",
         "N for --recompute-method (default: every layer checkpointed alone, uniform 1)"),
    Flag(("--recompute-modules",), "recompute_modules",
         "with selective recompute: what it recomputes, from core_attn (the attention core, the "
         "default and the paper's), mlp (a dense layer's MLP with its fused norm, keeping its input), "
         "layernorm (the norms that are modules of their own: multi-latent attention's input norm, a MoE "
         "layer's pre-MLP norm; no change where TE fuses a norm into the next linear), mla_up_proj "
         "(multi-latent attention's up projections), and a mixture of experts' moe (the whole MoE layer, keeping its input), moe_act (the experts' "
         "activation) and shared_experts (the shared experts), e.g. core_attn,mlp", str,
         same=lambda value: frozenset(value.replace(",", " ").split())),
    Flag(("--selective-ac-option",), "selective_ac_option",
         "with --recompute selective under --implementation torch-native: torchtitan's "
         "activation_checkpoint.selective_ac_option; op, its per-op policy (each block checkpointed, keeping the "
         "outputs of every second matmul, attention and the reduce-scatters), or N, its layer policy (every N-th "
         "block checkpointed whole, the others kept whole; torchtitan's default, 2)", str),
    Flag(("--ep", "--expert-model-parallel-size"), "expert_parallel",
         "expert-parallel size EP: ranks the experts are spread over, E/EP a rank (Megatron carves ETP·EP from "
         "the t·c·d ranks)"),
    Flag(("--etp", "--expert-tensor-parallel-size"), "expert_tensor_parallel",
         "expert-tensor-parallel size ETP: ranks each expert's linears are split over (default t)"),
    MOE_IMBALANCE,
    MOE_LOADS,
    Flag(("--cpu-offloading-num-layers",), "offload_layers",
         "Megatron's whole-layer CPU offloading: Transformer Engine copies the saved activations of the first N "
         "layers to host memory, freeing them on the GPU once L - N layers are held (p = 1, no recompute; "
         "0: none, the default)"),
    Flag(("--fsdp/--no-fsdp",), "fsdp",
         "PyTorch's FSDP2 (fully_shard) as torchtitan applies it (--implementation torch-native): fp32 weights, "
         "gradients and AdamW state sharded over the d = gpus/t data-parallel ranks (give --gpus), each group's "
         "bf16 weights gathered while it computes", bool),
    Flag(("--fsdp-reshard-after-forward",), "fsdp_reshard",
         "with --fsdp, which groups the forward reshards (torchtitan's fsdp_reshard_after_forward): default (the "
         "blocks, not the output layer's group), always, or never (every group gathered until its backward)",
         click.Choice(["default", "always", "never"])),
    Flag(("--fsdp-replicate",), "fsdp_replicate",
         "with --fsdp, HSDP: the model state replicated R times and sharded over d/R ranks (torchtitan's "
         "data_parallel_replicate_degree; default 1)"),
    Flag(("--zero-stage",), "zero_stage",
         "DeepSpeed's ZeRO stage 1, 2 or 3 as the Hugging Face Trainer runs it (--implementation hf; give --gpus): "
         "bf16, the Trainer's AdamW, DeepSpeed's defaults for the rest (a 1 GB reduce bucket); --deepspeed reads "
         "your own config", click.IntRange(1, 3)),
    Flag(("--deepspeed",), "deepspeed",
         "a DeepSpeed config file (ds_config.json, as the Trainer's --deepspeed takes it), or an accelerate config "
         "(x.yaml, distributed_type DEEPSPEED, as accelerate launch --config_file takes it: its GPUs too): the ZeRO "
         "stage, bucket sizes, optimizer and batch, \"auto\" resolved as the Trainer resolves it; what changes "
         "memory and is not modelled (offloading, fp16, quantized or hierarchical partitions, AutoTP, ...) is "
         "refused by name, and keys DeepSpeed ignores are named", click.Path(dir_okay=False), metavar="DS_CONFIG"),
    Flag(("--megatron-fsdp/--no-megatron-fsdp", "--use-megatron-fsdp"), "megatron_fsdp",
         "megatron-core's own FSDP (Megatron-FSDP, --implementation megatron; give --gpus): the model state sharded "
         "over the d·c data-parallel ranks as --data-parallel-sharding-strategy says, held at every moment; its "
         "main gradients in --megatron-fsdp-main-grads-dtype (the weights' dtype unless given)", bool),
    Flag(("--fsdp-double-buffer/--no-fsdp-double-buffer",), "fsdp_double_buffer",
         "with --use-megatron-fsdp, its units' gathered weights and gradient buckets in a fixed pool of two buffers "
         "each, allocated once and held for the run, in place of a bucket allocated and freed per gather (Megatron's "
         "--fsdp-double-buffer; its --use-nccl-ub turns it on)", bool),
    Flag(("--data-parallel-sharding-strategy",), "fsdp_sharding",
         "with --use-megatron-fsdp, what it shards: no_shard, optim (the fp32 main weights and Adam's state), "
         "optim_grads (and the main gradients), optim_grads_params (and the 16-bit weights; the default)",
         click.Choice(["no_shard", "optim", "optim_grads", "optim_grads_params"])),
    Flag(("--sp/--no-sp", "--sequence-parallel/--no-sequence-parallel"), "sequence_parallel",
         "sequence parallelism (needs t > 1)", bool),
    Flag(("--distributed-optimizer/--no-distributed-optimizer", "--use-distributed-optimizer"),
         "distributed_optimizer", "shard the optimizer state over the d data-parallel ranks "
         "(6 + 12/(d·c) B a parameter; over one rank it shards nothing)", bool),
)

def _gradient_bytes(dtype: str) -> int:
    from actmem.model.widths import GRADIENT_DTYPE_BYTES

    return GRADIENT_DTYPE_BYTES[dtype]


MAIN_GRADS = Flag(
    ("--main-grads-dtype",), "grad_dtype",
    "Megatron's precision-aware optimizer's spelling of --grad-dtype (fp32 or bf16; bf16 needs "
    "--use-precision-aware-optimizer, as Megatron asserts)", click.Choice(["fp32", "bf16"]), same=_gradient_bytes)
PRECISION_AWARE = Flag(
    ("--precision-aware-optimizer/--no-precision-aware-optimizer", "--use-precision-aware-optimizer"),
    "precision_aware", "TE's precision-aware Adam (Megatron's --use-precision-aware-optimizer; the distributed "
    "optimizer only): no fp32 master copy, and the state in the dtypes below", bool)

#: the model state's dtypes, the main gradients' (spec.gradient_bytes) and the optimizer's
#: (spec.optimizer): settings of the run's model state, not of Run
STATE_FLAGS = (
    Flag(("--grad-dtype",), "grad_dtype",
         "the main gradients' dtype: fp32 (the default, bf16 training's in Megatron) or bf16/fp16, Megatron's "
         "16-bit buffers (fp16 training without --accumulate-allreduce-grads-in-fp32, or --grad-reduce-in-bf16)",
         click.Choice(["fp32", "bf16", "fp16"]), same=_gradient_bytes),
    Flag(("--grad-reduce-in-bf16",), "grad_dtype", "Megatron's switch for --grad-dtype bf16", constant="bf16",
         same=_gradient_bytes),
    MAIN_GRADS,
    Flag(("--megatron-fsdp-main-grads-dtype",), "fsdp_main_grads",
         "with --use-megatron-fsdp, its main gradients' dtype: auto (the default: the weights' dtype, 2 B), fp32, "
         "bf16 or fp16 (Megatron-FSDP's gradient buffer; --grad-dtype is Megatron's DDP's)",
         click.Choice(["auto", "fp32", "bf16", "fp16"])),
    PRECISION_AWARE,
    Flag(("--main-params-dtype",), "main_params_dtype",
         "the precision-aware optimizer's master weights: fp32 (default; beside bf16 weights TE keeps only the 16 "
         "bits they lack, 2 B) or fp16 (2 B)", click.Choice(["fp32", "fp16"])),
    Flag(("--exp-avg-dtype",), "exp_avg_dtype", "the precision-aware optimizer's first moment: fp32 (default, "
         "4 B), fp16 or bf16 (2 B) or fp8 (1 B)", click.Choice(["fp32", "fp16", "bf16", "fp8"])),
    Flag(("--exp-avg-sq-dtype",), "exp_avg_sq_dtype", "... and its second moment",
         click.Choice(["fp32", "fp16", "bf16", "fp8"])),
    Flag(("--params-dtype",), "params_dtype", "the 16-bit weights' dtype: bf16 (default) or fp16 (Megatron's "
         "--bf16, --fp16); under the precision-aware optimizer fp32 master remainders need bf16",
         click.Choice(["bf16", "fp16"])),
)


def optimizer_state(flags: dict):
    """The OptimizerState the resolved flags ask for (Megatron's defaults where not given)."""
    from actmem.model.optimizer_state import OptimizerState

    given = {"precision_aware": flags.get("precision_aware"), "main_params": flags.get("main_params_dtype"),
             "exp_avg": flags.get("exp_avg_dtype"), "exp_avg_sq": flags.get("exp_avg_sq_dtype"),
             "params": flags.get("params_dtype")}
    return OptimizerState(**{key: value for key, value in given.items() if value is not None})


def _check_main_grads(flags: dict) -> None:
    """Megatron asserts --main-grads-dtype is fp32 without the precision-aware optimizer
    (optimizer_config.py); it is otherwise --grad-dtype, checked with it (before ``resolve``)."""
    if "bf16" in flags.get(MAIN_GRADS.dest(0), ()) and not any(
            value for i in range(2) for value in flags.get(PRECISION_AWARE.dest(i), ())):
        raise SpecError("--main-grads-dtype bf16 needs --use-precision-aware-optimizer (Megatron asserts "
                        "main_grads_dtype is fp32 without it: optimizer_config.py); --grad-dtype bf16 "
                        "(Megatron's --grad-reduce-in-bf16) is the same buffer without it")


def _spelling(flag: Flag, index: int, value) -> str:
    """How the user wrote it: '--tp 4', '--no-sp', '--use-distributed-optimizer'."""
    name = flag.names[index]
    if flag.constant is not _NO_CONSTANT:
        return name
    if flag.type is bool:
        on, _, off = name.partition("/")
        return on if value or not off else off
    return f"{name} {value}"


class _Spelled(click.Option):
    """An option whose help line lists the other spellings of its setting beside its own."""

    def __init__(self, *args, also=(), **kw):
        super().__init__(*args, **kw)
        self.also = also

    def get_help_record(self, ctx):
        record = super().get_help_record(ctx)
        if record is None or not self.also:
            return record
        names, _, rest = record[0].partition(" ")
        return f"{names}, {', '.join(self.also)}" + (f" {rest}" if rest else ""), record[1]


def add_flags(command, flags):
    """One repeatable click option a spelling; the help line of actmem's names Megatron's."""
    for flag in reversed(flags):
        for index in reversed(range(len(flag.names))):
            name = flag.names[index]
            also = tuple(n.partition("/")[0] for n in flag.names[1:]) if index == 0 else ()
            kw = dict(multiple=True, hidden=index > 0, help=flag.help, cls=_Spelled, also=also)
            if flag.constant is not _NO_CONSTANT:
                kw.update(is_flag=True, flag_value=flag.constant, default=None)
            elif flag.type is bool:
                kw.update(is_flag=True, default=None)
            elif flag.type in (int, float):
                kw.update(type=flag.type, metavar="FLOAT" if flag.type is float else "INTEGER")
            else:
                kw.update(type=flag.type)
            if flag.metavar:
                kw.update(metavar=flag.metavar)
            command = option(name, flag.dest(index), **kw)(command)
    return command


def with_setting(flags: dict, key: str, value) -> dict:
    """The unresolved flags with a setting given as its first spelling would give it (a command
    that sets one itself, as validate sets the recompute its shape needs)."""
    flag = next(flag for flag in SPEC_FLAGS if flag.key == key)
    return dict(flags, **{flag.dest(0): (value,)})


def resolve(flags: dict, table) -> dict:
    """Collapse the spellings of each flag in ``table`` into one value (None when not given);
    two different values are an error that names both spellings."""
    out = dict(flags)
    for key in dict.fromkeys(flag.key for flag in table):
        given = [(flag, index, value) for flag in table if flag.key == key
                 for index in range(len(flag.names)) for value in out.pop(flag.dest(index), ())]
        if len({(flag.same or _itself)(value) for flag, _, value in given}) > 1:
            spelled = dict.fromkeys(_spelling(flag, index, value) for flag, index, value in given)
            # one spelling given two values names itself (--model 530b --model 22b); --sp and --no-sp, or
            # two spellings, name the setting
            names = {flag.names[index] for flag, index, _ in given if flag.type is not bool}
            if len({(f, i) for f, i, _ in given}) == 1 and names:
                raise SpecError(f"{names.pop()} is given more than once and the values disagree: "
                                f"{' and '.join(spelled)}; give it once")
            raise SpecError(f"{' and '.join(spelled)} disagree: two values of one setting ({key.replace('_', ' ')}); "
                            "give one")
        out[key] = given[0][2] if given else None
    return out


def _itself(value):
    return value


GPU = Flag(("--gpu",), "gpu_name",
           "The GPU: a100 (a100-80), a100-40, h100, h200, h800, b200 or mi300x, at the memory its allocator can reach "
           "(h100: 79.10 GiB); default: the preset's, else a100 (the paper's).", str, metavar="NAME")
GPU_FLAGS = (
    GPU,
    Flag(("--gpu-memory",), "gpu_memory", "What the allocator can reach on one GPU, with its unit (e.g. 79GiB, "
         "40GB); in place of --gpu's.", str, metavar="SIZE"),
    Flag(("--reserve",), "reserve",
         f"Kept free above the peak floor for what actmem does not count: the CUDA context, NCCL and cuBLAS "
         f"workspaces, fragmentation, the kernels' own backward buffers (default {DEFAULT_RESERVE}, as `plan`); "
         f"'fits' needs the peak and the reserve.", str, metavar="SIZE"),
)
MEGATRON_ARGS = option(
    "--megatron-args", default=None, metavar="@SCRIPT|@FILE|TEXT",
    help="A Megatron-LM launch script (bash, read as bash expands it, never run) or its arguments, "
         "from a file or pasted: those that change memory are used, those that cannot are listed as "
         "ignored, the rest are refused in one message.")


VOCAB_PADDING = Flag(
    ("--make-vocab-size-divisible-by",), "vocab_divisible_by",
    f"Megatron pads the vocabulary to a multiple of this times t (default {VOCAB_DIVISIBLE_BY}; none under "
    "torch-native or hf).")
PRESET = Flag(("--model", "-m"), "preset", "Preset name or alias (see `actmem presets`) or a preset .toml file; "
              "flags override it.", str, metavar="NAME|PATH")
LAYERS_PER_CHUNK = Flag(("--num-layers-per-virtual-pipeline-stage",), "layers_per_chunk",
                        "Megatron's older way to ask for interleaving: m = (L/p)/N.")

#: every flag of a whole spec: one table, from which the options, the spellings and `given_flags` come
SPEC_FLAGS = (PRESET, *MODEL_FLAGS, *RUN_FLAGS, LAYERS_PER_CHUNK, *ARCHITECTURE_FLAGS, *STATE_FLAGS, *GPU_FLAGS,
              VOCAB_PADDING)


def spec_options(command):
    """The model, architecture and run flags of every command that takes a whole spec."""
    command = MEGATRON_ARGS(add_flags(command, RUN_FLAGS + (LAYERS_PER_CHUNK,) + ARCHITECTURE_FLAGS + STATE_FLAGS
                                      + GPU_FLAGS + (VOCAB_PADDING,)))
    return model_options(command)


def model_options(command):
    """--model and the model dims, shared by every command that takes a model."""
    return add_flags(command, (PRESET,) + MODEL_FLAGS)


def _run_defaults(flags: dict, preset, run: dict, architecture: dict, sweeping: bool = False) -> tuple:
    """Run values that follow from others the user gave, each named in a note: the preset's uneven pipeline
    dropped where --pp changes its p; under torch-native at t > 1 sequence parallelism on unless asked off
    (torchtitan's plan always has it). ``sweeping``: for a command that chooses the run itself (plan), which
    takes none of the preset's optimizer."""
    notes = ()
    uneven = {key: run[key] for key in ("first_stage_layers", "last_stage_layers")
              if preset and key in preset.run and flags.get(key) is None}
    if uneven and flags.get("pipeline_parallel") is not None and flags["pipeline_parallel"] != preset.run.get(
            "pipeline_parallel"):
        for key in uneven:
            del run[key]
        notes += (f"the preset's uneven pipeline ({', '.join(f'{key} {value}' for key, value in uneven.items())}) "
                  f"left out: --pp {flags['pipeline_parallel']} lays the layers out again",)
    code = implementation(architecture.get("implementation", MEGATRON))
    if preset:
        notes += _left_out_for(code, flags, preset, run, architecture)
    if (flags.get("gradient_accumulation") is not None and flags.get("global_batch") is None
            and run.get("global_batch") is not None):
        notes += (f"the preset's global batch {run.pop('global_batch')} left out: --gradient-accumulation-steps "
                  "sets it",)
    if code.sequence_parallel_default and run.get("tensor_parallel", 1) > 1 and run.get("sequence_parallel") is None:
        run["sequence_parallel"] = True
        notes += (f"sequence parallelism on: {code.sequence_parallel_default}",)
    return notes


#: (run key, the value that is no run shape, the run shape a code must have for another): a preset's Megatron
#: layout, which a code without the shape leaves out
_RUN_SHAPES = (("tensor_parallel", 1, "tensor"), ("sequence_parallel", False, "tensor"),
               ("pipeline_parallel", 1, "pipeline"), ("interleave", 1, "pipeline"),
               ("first_stage_layers", None, "pipeline"), ("last_stage_layers", None, "pipeline"),
               ("context_parallel", 1, "context"), ("expert_parallel", 1, "expert"),
               ("expert_tensor_parallel", None, "expert"), ("distributed_optimizer", False, "distributed_optimizer"))


def _left_out_for(code, flags: dict, preset, run: dict, architecture: dict) -> tuple:
    """A preset's run shapes and Megatron settings that another implementation has no use for, which the flags
    did not give, left out (in place) and named in a note: its pipeline, experts spread over ranks and
    distributed optimizer under hf, its dispatcher and grouped GEMM under transformers' own experts. A flag
    that asks for one is the rules' to refuse."""
    if code.name == preset.architecture.get("implementation", MEGATRON):
        return ()
    left = {}
    for key, neutral, shape in _RUN_SHAPES:
        if shape not in code.runs and flags.get(key) is None and run.get(key, neutral) not in (neutral, None):
            left[key] = run.pop(key)
    for key, neutral in code.dropped_settings:
        if flags.get(key) is None and architecture.get(key, neutral) != neutral:
            left[key] = architecture.pop(key)
    if not left:
        return ()
    # the preset's GPUs were t·c·p·d: its data-parallel ranks d are kept, so its batch still divides
    split = 1
    for key in ("tensor_parallel", "pipeline_parallel", "context_parallel"):
        split *= left.get(key, 1)
    kept = ""
    if split > 1 and run.get("gpus") is not None and flags.get("gpus") is None:
        kept = f"; its GPUs {run['gpus']} become {run['gpus'] // split}, its d data-parallel ranks (--gpus to change)"
        run["gpus"] //= split
    return (f"the preset's Megatron settings left out under --implementation {code.name}, which has no use for them: "
            + ", ".join(f"{key} {value}" for key, value in left.items()) + kept,)


def _preset_and_flags(flags: dict, preset=None, sweeping: bool = False) -> tuple:
    """(name, model values, run values, architecture values, notes): the preset's, overridden
    by the flags given. ``flags`` is already resolved; ``sweeping``: for plan and flops (_run_defaults)."""
    from actmem.sources.presets import load_preset

    if preset is None and flags["preset"]:
        preset = load_preset(flags["preset"])
    model = dict(preset.model) if preset else {}
    run = dict(preset.run) if preset else {}
    architecture = dict(preset.architecture) if preset else {}
    model.update({f.key: flags[f.key] for f in MODEL_FLAGS if flags.get(f.key) is not None})
    run.update({f.key: flags[f.key] for f in RUN_FLAGS if flags.get(f.key) is not None})
    architecture.update({f.key: flags[f.key] for f in ARCHITECTURE_FLAGS if flags.get(f.key) is not None})
    if preset is None and not model:
        raise SpecError("give a preset with --model (see `actmem presets`) or the model dims "
                        "--heads, --hidden, --layers, --vocab, --seq-len")
    notes = _run_defaults(flags, preset, run, architecture, sweeping)
    unmeasured = preset.unmeasured.get(architecture.get("implementation")) if preset else None
    if unmeasured:
        code = implementation(architecture["implementation"])
        raise SpecError(f"--implementation {code.name} is measured as "
                        f"{', '.join(model.name for model in code.models)}; {preset.source}: {unmeasured}")
    notes = (preset.notes if preset else ()) + notes
    if preset and preset.seq_len_note and flags.get("seq_len") is None:
        notes += (preset.seq_len_note,)
    rows = preset.position_table if preset else None
    if rows and architecture.get("position_rows") is None:          # a config.json's n_positions
        architecture["position_rows"] = rows
    return (preset.name if preset else "custom"), model, run, architecture, notes


@dataclass(frozen=True)
class ModelChoice:
    """What the commands that choose the run themselves (plan, flops) take from a preset and
    the flags: the model and architecture, the GPU count and batch, and the preset's run."""

    name: str
    model: object
    architecture: object
    preset_run: dict
    """The preset's own run (checked with the preset, as `estimate` would), for --explain."""
    gpus: int | None
    global_batch: int | None
    gpu: str | None = None
    """The preset's GPU (the default of --gpu)."""
    gradient_bytes: int | None = None
    """Bytes a main gradient where --grad-dtype (or a paste) says; None: fp32."""
    optimizer: object = None
    """The OptimizerState the flags (or a paste) ask for."""
    vocab_divisible_by: int | None = None
    """--make-vocab-size-divisible-by where given."""
    pasted: frozenset = frozenset()
    """The Megatron settings a pasted --megatron-args read (megatron_args.SETTINGS), by name."""


def model_from_flags(flags: dict) -> ModelChoice:
    from actmem.sources.presets import load_preset
    from actmem.model.spec import build_spec

    flags, pasted = with_megatron_args(flags)
    script_run = _script_run(flags) if pasted else {}
    _check_main_grads(flags)
    flags = resolve(flags, (PRESET,) + MODEL_FLAGS + (GPUS, GLOBAL_BATCH) + ARCHITECTURE_FLAGS + STATE_FLAGS
                    + (VOCAB_PADDING,))
    preset = load_preset(flags["preset"]) if flags["preset"] else None
    if preset is not None:       # a preset file is checked whole, whatever the flags change, on its own GPU
        build_spec(preset.model, preset.run, name=preset.name, architecture=preset.architecture,
                   **gpu_options({}, preset.gpu))
    name, model, run, architecture, _ = _preset_and_flags(flags, preset, sweeping=True)
    _check_paste(pasted, model, architecture)
    spec = build_spec(model, {}, architecture=architecture, dims_only=True)   # the dims; names what is missing
    pick = lambda key: flags[key] if flags[key] is not None else run.get(key)
    gradient_bytes = _gradient_bytes(flags["grad_dtype"]) if flags.get("grad_dtype") else None
    return ModelChoice(name, spec.model, spec.architecture, (run if preset else {}) | script_run,
                       pick("gpus"), pick("global_batch"), preset.gpu if preset else None, gradient_bytes,
                       optimizer_state(flags), flags["vocab_divisible_by"],
                       frozenset(key for key in pasted if key.startswith("--")))


def _script_run(flags: dict) -> dict:
    """The run a pasted script sets (t, p, b, recompute, ...), for `plan --explain` to start from
    as it starts from a preset's run; the pasted run flags are consumed here."""
    keys = {f.key for f in RUN_FLAGS} - {"gpus", "global_batch"}
    given = resolve({k: v for k, v in flags.items() if "__" in k and k.split("__")[0] in keys},
                    [f for f in RUN_FLAGS if f.key in keys])
    for key in list(flags):
        if "__" in key and key.split("__")[0] in keys:
            del flags[key]
    return {k: v for k, v in given.items() if v is not None}


def _paste_command():
    """A click command with the spec's options, to parse pasted Megatron arguments exactly as
    the flags are parsed."""
    return click.command()(spec_options(lambda **flags: flags))


def megatron_spellings() -> dict:
    """{name: takes a value} of the spec's options that Megatron-LM's parser has too: the
    Megatron arguments a paste hands to these very options, derived from the one flag table
    (less the settings megatron_args reads itself, such as --recompute-modules' words)."""
    from actmem.sources import megatron_args, megatron_table

    known = megatron_table.arguments()
    return {name: not param.is_flag for param in _paste_command().params if isinstance(param, click.Option)
            for name in param.opts + param.secondary_opts if name in known and name not in megatron_args.SETTINGS}


def with_megatron_args(flags: dict) -> tuple[dict, dict]:
    """The flags with the pasted --megatron-args merged in (a pasted value that disagrees with
    a flag is an error), and what else the paste says: {'ignored': [...], checks...}."""
    from actmem.sources import megatron_args

    if flags.get("megatron_args") is None:
        return flags, {}
    command = _paste_command()
    takes_value = megatron_spellings()
    words, notes, launcher_gpus = megatron_args.read(flags["megatron_args"])
    vocab_given = any(flags.get(flag.dest(i)) for flag in MODEL_FLAGS if flag.key == "vocab"
                      for i in range(len(flag.names)))
    used, ignored, checks = megatron_args.sort(words, takes_value, vocab_given)
    notes += megatron_args.vocabulary_notes(words + ["--vocab-size"] * vocab_given, checks) + checks.pop("notes", [])
    used, decided = _placeholders_given(used, takes_value, flags)
    notes += [f"{name}: the flag's, in place of the script's {value} (a value it computes when it runs)"
              for name, value in decided]
    default_mask = megatron_args.NO_MASK not in used          # (make_context consumes ``used``)
    try:
        pasted = command.make_context("--megatron-args", list(used)).params
    except click.BadParameter as error:
        raise SpecError(_bad_pasted_value(error, used)) from None
    if default_mask and any(flags.get(key) for key in flags if key.startswith("attention_mask__")):
        # the paste's mask is only Megatron's default: a flag given beside it says otherwise
        pasted = {key: value for key, value in pasted.items() if not key.startswith("attention_mask__")}
    merged = dict(flags, megatron_args=None)
    for key, value in pasted.items():
        if isinstance(value, tuple):
            merged[key] = tuple(merged.get(key) or ()) + value
        elif value is not None and value is not False:
            if merged.get(key) is not None and merged.get(key) is not False and merged[key] != value:
                raise SpecError(f"--megatron-args gives {key} = {value!r}, a flag gives {merged[key]!r}")
            merged[key] = value
    if launcher_gpus is not None and not any(merged.get(GPUS.dest(i)) for i in range(len(GPUS.names))):
        merged[GPUS.dest(0)] = (launcher_gpus,)
    elif launcher_gpus is not None:
        notes = [note for note in notes if not note.startswith("GPUs:")] + [
            f"GPUs: --gpus, in place of the launcher's {launcher_gpus}"]
    return merged, dict(checks, ignored=ignored, notes=notes)


def _placeholder(value: str) -> bool:
    """A value the script computes when it runs (launch_script: $1, $(command), a variable it never sets), which
    actmem reads without running: no value of actmem's options has a $ or a backtick in it."""
    return "$" in value or "`" in value


def _placeholders_given(used: list, takes_value: dict, flags: dict) -> tuple[list, list]:
    """(the pasted words less each option whose value is a placeholder and that a flag beside the paste gives,
    [(name, placeholder)] of those): the flag decides there, as the script's run would."""
    spellings = {name: flag for flag in SPEC_FLAGS for name in flag.names}
    kept, decided, i = [], [], 0
    while i < len(used):
        name = used[i]
        flag = spellings.get(name)
        value = used[i + 1] if takes_value.get(name) and i + 1 < len(used) else None
        if value is not None and _placeholder(value) and flag is not None and any(
                flags.get(flag.dest(index)) not in (None, False, ()) for index in range(len(flag.names))):
            decided.append((name, value))
            i += 2
            continue
        kept.append(name)
        i += 1
    return kept, decided


def _bad_pasted_value(error: click.BadParameter, used: list) -> str:
    """One line for a pasted value click refuses, naming the paste, and for a placeholder what to do."""
    names = error.param.opts if error.param is not None else []
    at = next((i for i, word in enumerate(used) if word in names), None)
    value = used[at + 1] if at is not None and at + 1 < len(used) else ""
    if at is not None and _placeholder(value):
        return (f"--megatron-args: {used[at]} is {value}, which the script computes when it runs (a positional "
                f"parameter, a command's output, a variable it never sets); actmem reads the script without "
                f"running it: give {used[at]} beside --megatron-args")
    return f"--megatron-args: {error.format_message()}"


def build_spec_from_flags(flags: dict, dims_only: bool = False):
    """Merge a preset with the flags into a validated Spec (raises SpecError); dims_only:
    the run's kernel rules wait (Spec.dims_only), for a caller that checks each run it makes."""
    from actmem.model.spec import build_spec, interleave_from_layers_per_chunk

    flags, pasted = with_megatron_args(flags)
    _check_main_grads(flags)
    flags = resolve(flags, SPEC_FLAGS)
    from actmem.sources.presets import load_preset

    preset = load_preset(flags["preset"]) if flags["preset"] else None
    name, model, run, architecture, notes = _preset_and_flags(flags, preset)
    _check_paste(pasted, model, architecture)
    if run.get("deepspeed") is not None:             # the file, read here: "auto" needs the hidden size
        from actmem.sources.deepspeed_config import read

        if model.get("hidden") is None:
            raise SpecError("--deepspeed resolves \"auto\" from the model's hidden size: give --hidden or a preset")
        run["deepspeed"] = read(run["deepspeed"], model["hidden"])
    if flags["layers_per_chunk"] is not None:
        if flags["interleave"] is not None:
            raise SpecError("give the interleave once: --interleave or "
                            "--num-layers-per-virtual-pipeline-stage, not both")
        run["interleave"] = interleave_from_layers_per_chunk(
            model.get("layers", 0), run.get("pipeline_parallel", 1), flags["layers_per_chunk"])
    if run.get("expert_loads") is not None:             # Megatron's logs: joined once E is known
        from actmem.sources.expert_loads import loads_for

        run["expert_loads"] = loads_for(run["expert_loads"], architecture.get("num_experts"))
    options = {"notes": notes} if notes else {}
    if dims_only:
        options["dims_only"] = True
    options.update(gpu_options(flags, preset.gpu if preset else None))
    if flags["grad_dtype"] is not None:
        options["gradient_bytes"] = _gradient_bytes(flags["grad_dtype"])
    code = implementation(architecture.get("implementation", MEGATRON))
    options.update(_megatron_fsdp_gradients(flags, run, code))
    run.update(_megatron_fsdp_bucket_settings(pasted, run))
    options["optimizer"] = optimizer_state(flags)
    if flags["vocab_divisible_by"] is not None:
        options["vocab_divisible_by"] = code.vocab_divisible_by(flags["vocab_divisible_by"], VOCAB_DIVISIBLE_BY)
    options["notes"] = notes + tuple(pasted.get("notes", ()))
    if pasted.get("ignored"):
        options["notes"] += (f"Megatron arguments ignored, as they cannot change memory: "
                             f"{', '.join(pasted['ignored'])}",)
    if not options["notes"]:
        del options["notes"]
    try:
        return build_spec(model, run, name=name, architecture=architecture, **options)
    except SpecError as error:
        raise _from_the_launcher(error, pasted.get("notes", ())) from None


def _megatron_fsdp_gradients(flags: dict, run: dict, code) -> dict:
    """{'gradient_bytes': ...} under Megatron-FSDP: its gradient buffer follows --megatron-fsdp-main-grads-dtype
    (Megatron-LM d98e8a64, arguments.py: auto, the default, the weights' dtype; its param_and_grad_buffer.py,
    _resolve_group_grad_dtype), not DDP's --grad-dtype, which Megatron-FSDP there does not read: given beside it,
    refused. (megatron-core 0.16.1 had no such flag: fp32 unless --grad-reduce-in-bf16.) Megatron-FSDP v1 turns
    the distributed optimizer on (``run``, in place), whose state it then shards as its strategy says."""
    given = flags.get("fsdp_main_grads")
    if not run.get("megatron_fsdp"):
        if given is not None:
            raise SpecError(f"--megatron-fsdp-main-grads-dtype {given} is Megatron-FSDP's: give --use-megatron-fsdp "
                            "too, or leave it out")
        return {}
    if flags["grad_dtype"] is not None:
        raise SpecError("--grad-dtype (Megatron's --grad-reduce-in-bf16, --main-grads-dtype) sets the gradient "
                        "buffer of Megatron's DDP, which Megatron-FSDP does not read: its main gradients follow "
                        "--megatron-fsdp-main-grads-dtype (auto, the weights' dtype, unless given)")
    dtype = given if given not in (None, "auto") else flags.get("params_dtype") or "bf16"
    if "megatron_fsdp" in code.runs:        # Megatron-FSDP v1 sets it (arguments.py: 'Using DistributedOptimizer')
        run["distributed_optimizer"] = True
    return {"gradient_bytes": _gradient_bytes(dtype)}


def _megatron_fsdp_bucket_settings(pasted: dict, run: dict) -> dict:
    """Under Megatron-FSDP, the pasted --overlap-grad-reduce and --ddp-bucket-size, with which Megatron-LM splits
    its buckets outside the units (training.py, resolve_ddp_bucket_size), and --suggested-communication-unit-size,
    its prefetch window's and reduce-scatter queue's size; --ddp-num-buckets, which sizes the buckets from the rank's
    parameter count, is refused there. Elsewhere they change no byte counted: not read into the run."""
    nccl_ub = _nccl_user_buffers(pasted, run)
    if not run.get("megatron_fsdp") or not pasted:
        return {}
    if "--ddp-num-buckets" in pasted:
        raise SpecError("--megatron-args: --ddp-num-buckets under Megatron-FSDP (its buckets outside the units sized "
                        "from the rank's parameter count) is not modelled yet: give --ddp-bucket-size in its place")
    sizes = {}
    for name in ("--ddp-bucket-size", "--suggested-communication-unit-size"):
        size = pasted.get(name)
        if size is not None and not str(size).isdigit():
            raise SpecError(f"--megatron-args: {name} must be a whole number of elements, got {size}")
        sizes[name] = int(size) if size is not None else None
    if sizes["--suggested-communication-unit-size"] == 0:
        raise SpecError("--megatron-args: --suggested-communication-unit-size 0 makes Megatron-FSDP's reduce-scatter "
                        "queue hold nothing, which is not modelled: leave it out or give a size")
    return {"overlap_grad_reduce": "--overlap-grad-reduce" in pasted, "ddp_bucket_size": sizes["--ddp-bucket-size"],
            "fsdp_communication_unit": sizes["--suggested-communication-unit-size"], **nccl_ub}


def _nccl_user_buffers(pasted: dict, run: dict) -> dict:
    """{'fsdp_double_buffer': True} where the paste gives --use-nccl-ub under Megatron-FSDP, which Megatron-LM turns
    on with it (arguments.py, validate_args: nccl_ub sets fsdp_double_buffer and fsdp_manual_registration; its
    buffers' bytes do not change). Refused: --use-nccl-ub outside Megatron-FSDP (DDP's buffers in NCCL's pool, not
    read), --fsdp-manual-registration without both (Megatron asserts), --no-fsdp-double-buffer beside it."""
    nccl_ub = "--use-nccl-ub" in pasted
    if "--fsdp-manual-registration" in pasted and not (nccl_ub and run.get("megatron_fsdp")):
        raise SpecError("--megatron-args: Megatron refuses --fsdp-manual-registration without --use-megatron-fsdp and "
                        "--use-nccl-ub (arguments.py: 'FSDP manual registration is only supported with ...')")
    if not nccl_ub:
        return {}
    if not run.get("megatron_fsdp"):
        raise SpecError("--megatron-args: changes memory and is not modelled yet: --use-nccl-ub outside Megatron-FSDP "
                        "(DDP's buffers in NCCL's memory pool)")
    if run.get("fsdp_double_buffer") is False:
        raise SpecError("--no-fsdp-double-buffer disagrees with the pasted --use-nccl-ub, which turns Megatron-FSDP's "
                        "double buffer on (arguments.py)")
    return {"fsdp_double_buffer": True}


def _from_the_launcher(error: SpecError, notes) -> SpecError:
    """A refusal about the GPU count, where the count is the pasted script's launcher's: said so, with the way
    to give the run's own."""
    launcher = next((note for note in notes if note.startswith("GPUs: ") and "from the launcher" in note), None)
    if launcher is None or "gpus (" not in str(error):
        return error
    said = launcher.removeprefix("GPUs: ").replace("from the launcher (", "from the script's launcher, ").rstrip(")")
    return SpecError(f"{error} (gpus: {said})")


def chosen_gpu(given: str | None, preset_gpu: str | None) -> tuple:
    """(the Gpu: --gpu, else the preset's, else actmem's default, the paper's A100; whether it is the default)."""
    from actmem.model.hardware import DEFAULT_GPU, gpu_named

    return gpu_named(given or preset_gpu or DEFAULT_GPU), not (given or preset_gpu)


def gpu_options(flags: dict, preset_gpu: str | None) -> dict:
    """The GPU a spec must fit: --gpu (else the preset's, else the paper's A100, said to be the default), its
    memory (--gpu-memory in place of the table's) and the reserve."""
    from actmem.units import parse_bytes

    gpu, default = chosen_gpu(flags.get("gpu_name"), preset_gpu)
    memory = flags.get("gpu_memory")
    # --gpu-memory replaces the memory alone: a GPU named beside it stays named (its FP8 and speed are read)
    name = gpu.name if memory is None else f"--gpu-memory {memory}" if default else f"{gpu.name} at --gpu-memory {memory}"
    memory_bytes = gpu.memory_bytes if memory is None else parse_bytes(memory)
    if flags.get("gpu_name") and memory_bytes > gpu.memory_bytes:
        # (beside a preset's GPU it may stand for another GPU: the name says "at --gpu-memory")
        raise SpecError(f"--gpu-memory {memory} is more than the {gpu.name} named by --gpu lets its allocator reach "
                        f"({gpu.memory_bytes / 2**30:.2f} GiB): give at most that, or --gpu-memory alone for a GPU "
                        "actmem does not know")
    return {"gpu_name": name, "gpu_fp8": gpu.fp8,
            "gpu_default": default,
            "gpu_memory_bytes": memory_bytes,
            "reserve_bytes": parse_bytes(flags.get("reserve") or DEFAULT_RESERVE, allow_zero=True)}


def _check_paste(pasted: dict, model: dict, architecture: dict) -> None:
    """What a pasted script needs of the model beside the flags: Megatron's code, a learned
    position table of s rows, and a vocabulary."""
    from actmem.sources.megatron_args import GPT2_VOCAB, TOKENIZER

    if not pasted:
        return
    if "megatron_args" not in implementation(architecture.get("implementation", MEGATRON)).has:
        raise SpecError(f"--megatron-args describes a Megatron-LM run; it cannot be read as "
                        f"--implementation {architecture['implementation']}")
    if model.get("vocab") is None:
        tokenizer = pasted.get(TOKENIZER)
        raise SpecError("--megatron-args: no vocabulary: " + (
            f"{TOKENIZER} {tokenizer} needs --vocab-size" if tokenizer else
            f"the script names neither {TOKENIZER} (Megatron requires one) nor --vocab-size; give --vocab-size N "
            f"(GPT-2's BPE files, --vocab-file gpt2-vocab.json: {GPT2_VOCAB})"))


def given_flags(flags: dict) -> list[str]:
    """The spellings of the spec flags a user gave (before ``resolve``), for a mode that sets
    them itself and must refuse them rather than ignore them."""
    given = []
    for flag in SPEC_FLAGS:
        for index in range(len(flag.names)):
            given += [_spelling(flag, index, value).split(" ")[0] for value in flags.get(flag.dest(index), ())]
    if flags.get("megatron_args") is not None:
        given.append("--megatron-args")
    return list(dict.fromkeys(given))
