"""FP8 training as Megatron-Core 0.16.1 runs it through Transformer Engine (--fp8-format), read at TE v2.11
(the releases megatron-core 0.16.1 takes are 2.9 to 2.11; the lines below are the same in all three).

FP8 changes only what TE's linears keep, the GEMMs' inputs (actmem.memory.terms: qkv_input, fc1_input,
fc2_input, and under delayed scaling projection_input_fp8), and the weights' FP8 copies TE caches for the
microbatches of an iteration (model state). Everything else stays 16-bit: the norms' inputs, the attention
core's q, k, v, output and statistics (FP8 attention is off by default), the activation's input.

- QKV's and fc1's LayerNormLinear save the norm's output quantized, one byte an element, the local shard
  under sequence parallelism (layernorm_linear.py: ln_out, rowwise under SP, its transpose without; the
  same bytes), with its fp32 scale_inv [1];
- proj's and fc2's Linear quantize their input rowwise and columnwise and keep the columnwise copy alone,
  one byte an element (linear.py: update_usage(rowwise_usage=False); on Hopper the transpose), with its
  scale_inv; Megatron hands proj save_original_input under every recipe but delayed (attention.py, TE >= 2.6),
  so there proj keeps the 16-bit output of the attention core, already kept, and nothing more;
- the weights: TE quantizes each linear's weight on an iteration's first microbatch into a workspace it keeps
  (base.py, get_weight_workspace, cache_name "weight"): rowwise data and, on Hopper, its transpose (the FP8
  GEMM there is TN only: utils.py, is_non_tn_fp8_gemm_supported), one byte an element each.

- the scaling state: delayed scaling keeps, a module, fp32 scales and an amax history of
  --fp8-amax-history-len rows for its 3 forward (input, weight, output) and 2 backward (grad output, grad
  input) quantizers (quantization.py, DelayedScalingRecipeState; base.py, init_fp8_metadata: num_gemms 1),
  and each FP8 weight its fp32 scale_inv [1].
- --fp8-param-gather (fp8_model_init): the weights are FP8 themselves, one byte in DDP's uint8 buffer
  (param_and_grad_buffer.py), all-gathered in place; on Hopper each keeps its transpose beside it, rewritten
  after each gather (fp8_utils.py: post_all_gather_processing), and TE builds no workspace (base.py,
  get_weight_workspace returns the parameter). Megatron needs the distributed optimizer for it.

- the block-scaled recipes keep no per-tensor scale_inv but block scales beside the data (quantizer.cpp,
  get_scale_shape), and no scaling state: MXFP8 (Blackwell) one E8M0 byte a 32 elements, the saved inputs'
  columnwise copy [M, K] with scales [roundup(M/32, 4), roundup(K, 128)], a weight's rowwise and columnwise
  copies with [roundup(M, 128), roundup(K/32, 4)] and the columnwise scales; blockwise fp32 scales a
  128 elements, the norms' outputs in the gatherable COMPACT layout [ceil(M/128), K], fc2's input GEMM_READY
  [ceil(M/128), roundup(K, 4)], a weight's 128x128 blocks [ceil(M/128), roundup(ceil(K/128), 4)] and its
  transpose's; Megatron's projection keeps its 16-bit input under both (save_original_input).

- the experts (Megatron's TEGroupedMLP, --moe-grouped-gemm, over TE's GroupedLinear: grouped_linear.py,
  _GroupedLinear.forward): each local expert's rows are padded to a multiple of a = 16 (32 under MXFP8:
  experts.py, TEGroupedMLP.forward, quantization_padding; fp8_padding.py, Fp8Padding), probabilities too;
  fc1 and fc2 quantize their inputs a group at a time (split_quantize, one quantizer a group) and keep each
  group's columnwise copy alone, one byte an element, with its own fp32 scale_inv [1]; the 16-bit rows,
  padded or not, are kept by nothing; the weighted SwiGLU keeps fc1's 16-bit output and the probabilities
  over the padded rows; under --recompute-modules moe_act Megatron has fc2 save its original input
  (set_save_original_input), which the checkpoint frees. Under MXFP8 and blockwise, split_quantize puts every
  expert's columnwise copy and then its block scales in one buffer (cast.cpp, bulk_allocate_*: data 256-byte
  aligned, scales 16), scales for each 128 rows of an expert's. A GroupedLinear of G experts is G modules' worth
  of weight copies and scaling state (base.py: num_gemms·3 forward and num_gemms·2 backward quantizers).
  The router's GEMM is not TE's and stays 16-bit (moe_utils.py, RouterGatingLinearFunction).
- the shared experts (SharedExpertMLP over TE's column- and row-parallel Linear): fc2 keeps its input's columnwise
  copy, as a dense fc2; fc1, under every recipe but delayed, its original input (shared_experts.py:
  set_save_original_input), the router's own; under delayed scaling its input quantized, the rank's shard (or,
  overlapping the dispatcher, the input it gathered ahead, whose 16-bit copy is then freed).

Modelled: delayed and tensorwise scaling on Hopper and Blackwell, with and without --fp8-param-gather; MXFP8 on
Blackwell and blockwise on Hopper and Blackwell, with sequence parallelism at t > 1 (actmem's limit: the saved shards' block
scales are counted for the local rows) and without --fp8-param-gather; experts under every recipe, as TE's
grouped GEMM, with their shared experts (TE linears), --fp8-param-gather (each expert's weight an FP8 parameter,
base.py: reset_parameters) and --first-last-layers-bf16 (a bf16 layer's experts still padded: bf16_padding_multiple);
multi-latent attention (memory/terms_latent.py: each linear's input quantized, two copies of the input norm's
output), with --fp8-param-gather (its down projections' FP8 weights whole on every rank) and layernorm recompute
(the down projections then save the norm's 16-bit output, set_for_recompute_input_layernorm); the moe and
shared_experts recompute modules (TE's checkpoint keeps what Megatron's does); multi-token prediction (eh_proj's
input quantized; its layers FP8 beside --first-last-layers-bf16). Refused with the reason: the rest, and any code
but Megatron-Core with TE.
"""

from actmem.errors import SpecError

FORMATS = ("e4m3", "hybrid")
RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
BLOCK_RECIPES = ("mxfp8", "blockwise")
#: the GPU generations each block-scaled recipe runs on (TE asserts: quantization.py, check_mxfp8_support,
#: check_fp8_block_scaling_support; on Blackwell blockwise runs its GEMMs as MXFP8, converting the scales at
#: each GEMM, a transient: gemm.cpp; it keeps the same bytes)
BLOCK_RECIPE_GPU = {"mxfp8": ("blackwell",), "blockwise": ("hopper", "blackwell")}
#: Megatron's other recipes, and why actmem does not price them yet
_NOT_MODELLED = {
    "custom": "a custom recipe's quantizers are the user's own",
}
#: a GPU generation's FP8 weight copies: bytes a weight element TE caches (rowwise, and Hopper's transpose)
WEIGHT_COPY_BYTES = {"hopper": 2, "blackwell": 1}
#: ... under --fp8-param-gather, beside the FP8 parameter itself: Hopper's transpose alone
PARAM_GATHER_COPY_BYTES = {"hopper": 1, "blackwell": 0}
FORWARD_QUANTIZERS, BACKWARD_QUANTIZERS = 3, 2
SCALE_INV_BYTES = 4
"""Each quantized tensor's fp32 scale_inv, [1] (quantizer.cpp: Float8Quantizer, Float8CurrentScalingQuantizer)."""


def check_fp8(arch) -> None:
    """Refuse an FP8 setting actmem does not model, with why."""
    if arch.fp8_format is None and (arch.fp8_param_gather or arch.fp8_amax_history_len != 1):
        given = " and ".join(flag for flag, on in (("--fp8-param-gather", arch.fp8_param_gather),
                                                   ("--fp8-amax-history-len", arch.fp8_amax_history_len != 1)) if on)
        raise SpecError(f"{given} shape{'s' * (' and ' not in given)} FP8 training: give --fp8-format")
    if isinstance(arch.fp8_amax_history_len, bool) or not isinstance(arch.fp8_amax_history_len, int) \
            or arch.fp8_amax_history_len < 1:
        raise SpecError(f"--fp8-amax-history-len must be a whole number >= 1, got {arch.fp8_amax_history_len!r}")
    for name, flag in (("fp8_bf16_start", "--num-layers-at-start-in-bf16"), ("fp8_bf16_end", "--num-layers-at-end-in-bf16")):
        value = getattr(arch, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SpecError(f"{flag} must be a whole number of layers, 0 or more, got {value!r}")
        if value != 1 and not arch.fp8_first_last_bf16:
            raise SpecError(f"{flag} {value} counts the layers --first-last-layers-bf16 runs in bf16; Megatron reads "
                            f"it only with that switch: give it")
    if arch.fp8_first_last_bf16 and arch.fp8_format is None:
        raise SpecError("--first-last-layers-bf16 keeps layers out of FP8 training: give --fp8-format")
    if arch.moe_bf16_padding not in (None, 16, 32) or (arch.moe_bf16_padding and arch.fp8_format is not None):
        raise SpecError(f"moe_bf16_padding is a bf16 layer's of an FP8 run (16 or 32, without FP8 of its own); got "
                        f"{arch.moe_bf16_padding!r}")
    if arch.fp8_recipe is not None and arch.fp8_format is None:
        raise SpecError(f"--fp8-recipe {arch.fp8_recipe} chooses FP8's scaling; Megatron reads it only with "
                        "--fp8-format (e4m3 or hybrid), which turns FP8 on: give it")
    if arch.fp8_format is None:
        return
    if arch.fp8_format not in FORMATS:
        raise SpecError(f"fp8_format must be e4m3 or hybrid; got {arch.fp8_format!r}")
    recipe = arch.fp8
    if recipe in _NOT_MODELLED:
        raise SpecError(f"--fp8-recipe {recipe}: {_NOT_MODELLED[recipe]}; give delayed, tensorwise, mxfp8 or "
                        "blockwise")
    if recipe not in RECIPES:
        raise SpecError(f"--fp8-recipe must be delayed, tensorwise, mxfp8, blockwise or custom; got {recipe!r}")
    if "fp8" not in arch.code.has:
        raise SpecError(f"FP8 is modelled as Transformer Engine's linears under Megatron-Core (--implementation "
                        f"megatron); {arch.implementation}'s own FP8 (torchtitan's float8 converter, torchao) is not "
                        "modelled yet")
    if arch.attention_core == "eager":
        raise SpecError("FP8 runs in Transformer Engine's linears: modelled with TE's layer spec (--attention-core "
                        "flash or flash-attn), not Megatron's local spec of the eager core")
    if recipe in BLOCK_RECIPES and arch.fp8_param_gather:
        raise SpecError(f"--fp8-param-gather under --fp8-recipe {recipe}: its FP8 weights keep both copies and their "
                        "block scales, read but not priced yet; drop it")
    if arch.fp8_first_last_bf16 and recipe == "delayed":
        raise SpecError("--first-last-layers-bf16 under delayed scaling: Megatron refuses it (transformer_config.py: "
                        "'Delayed scaling does not support first / last layer in BF16'); give --fp8-recipe tensorwise, "
                        "mxfp8 or blockwise")
    if arch.fp8_amax_history_len != 1 and recipe != "delayed":
        raise SpecError(f"--fp8-amax-history-len {arch.fp8_amax_history_len} sizes delayed scaling's amax history; "
                        f"the {recipe} recipe keeps none")
    if arch.moe:
        _check_fp8_experts(arch)


def _check_fp8_experts(arch) -> None:
    """FP8 experts are priced as TE's GroupedLinear under the per-tensor recipes (the module's docstring)."""
    if not arch.moe_grouped_gemm:
        raise SpecError("FP8 experts are modelled as TE's grouped GEMM (TEGroupedMLP): give --moe-grouped-gemm, as "
                        "Megatron's FP8 MoE runs do; SequentialMLP's per-expert TE linears under FP8 are not priced yet")


def bf16_padding_multiple(generation) -> int:
    """a of a MoE layer run in bf16 inside an FP8 run (Architecture.moe_bf16_padding): Megatron's TEGroupedMLP pads
    whenever config.fp8 (experts.py: quantization_padding), and Megatron runs a bf16 layer under no FP8 autocast
    (fp8_utils.py, get_fp8_context: nullcontext()), where TE's Fp8Padding takes the default recipe's alignment
    (fp8_padding.py: FP8GlobalStateManager.get_fp8_recipe(), restored to None on each autocast's exit;
    quantization.py, get_default_fp8_recipe: MXFP8BlockScaling where MXFP8 runs, Blackwell, so 32; else
    DelayedScaling, 16), once, at the module's first forward (it caches align_size). 'blackwell' is the B200's sm100
    here; a compute capability 12 part would take current scaling's 16 (none is in actmem's GPU table)."""
    return 32 if generation == "blackwell" else 16


def row_padding(arch) -> int | None:
    """a: the multiple a MoE layer pads each expert's rows to, under FP8 (padding_multiple) or as a bf16 layer of
    an FP8 run (moe_bf16_padding); None where it does not pad."""
    return padding_multiple(arch.fp8) if arch.fp8 else arch.moe_bf16_padding


def padding_multiple(recipe) -> int:
    """a: the rows each expert's input is padded to a multiple of under FP8 (TE's fp8_padding.py, Fp8Padding;
    quantization.py, get_align_size_for_quantization: 32 under MXFP8, 16 otherwise)."""
    return 32 if recipe == "mxfp8" else 16


def expert_padding_rows(arch, ep):
    """P: the rows FP8's padding may add to a rank's expert rows T, at their most: each of its G = E/EP local
    experts padded up to a multiple of a adds at most a - 1 (experts.py, TEGroupedMLP.forward:
    quantization_padding), so T_pad = a·floor((T + P)/a) is the most that T rows can become whatever their
    split among the experts. 0 without FP8 experts. Ints, or arrays of EP over a sweep."""
    if not (arch.fp8 and arch.moe):
        return 0
    return arch.num_experts // ep * (padding_multiple(arch.fp8) - 1)


BLOCK_ROWS = 128
"""The rows of a block-scaled recipe's columnwise scale block: MXFP8's [roundup(M/32, 4), ...] is 4 rows of 32
for each 128 rows of an expert's M (a multiple of 32), blockwise's [ceil(M/128), ...] one (quantizer.cpp)."""


def expert_block_rows(arch, ep):
    """Q: under a block-scaled recipe the experts' columnwise copies keep scales for B = Σ ceil(M_i/128) blocks of
    their G = E/EP experts' padded rows M_i, each expert's at most (128 - a)/128 of a block more than its rows:
    B = floor((T_pad + Q)/128) with Q = G·(128 - a) is the most B can be. 0 under the other recipes. Ints, or
    arrays of EP over a sweep."""
    if not (arch.moe and arch.fp8 in BLOCK_RECIPES):
        return 0
    return arch.num_experts // ep * (BLOCK_ROWS - padding_multiple(arch.fp8))


def _up(x, n):
    """roundup(x, n) of TE's quantizer.cpp, on ints or arrays."""
    return -(-x // n) * n


def weight_copy_bytes(arch, generation, rows, cols):
    """Bytes TE keeps of a [rows, cols] weight (a TE module's out x in on this rank) beside the 16-bit weight (or,
    under --fp8-param-gather, beside the FP8 weight that replaces it): its cached FP8 workspace, or Hopper's
    transpose; under the block-scaled recipes its rowwise and columnwise copies with their scales; 0 without FP8."""
    if not arch.fp8:
        return 0
    data = rows * cols
    if arch.fp8 == "mxfp8":
        return 2 * data + _up(rows, 128) * _up(cols // 32, 4) + _up(rows // 32, 4) * _up(cols, 128)
    if arch.fp8 == "blockwise":
        return 2 * data + SCALE_INV_BYTES * (-(-rows // 128) * _up(-(-cols // 128), 4)
                                             + -(-cols // 128) * _up(-(-rows // 128), 4))
    return (PARAM_GATHER_COPY_BYTES if arch.fp8_param_gather else WEIGHT_COPY_BYTES)[generation] * data


def module_state_bytes(arch) -> int:
    """Fixed bytes a TE module keeps for FP8: its weight's scale_inv; under delayed scaling its quantizers'
    fp32 scales and amax history ([history, n] forward and backward: quantization.py,
    DelayedScalingRecipeState); under tensorwise each quantizer's own fp32 scale and amax, [1] each
    (float8_tensor.py, Float8CurrentScalingQuantizer)."""
    if arch.fp8 in (None, *BLOCK_RECIPES):         # the block-scaled quantizers keep no state of their own
        return 0
    quantizers = FORWARD_QUANTIZERS + BACKWARD_QUANTIZERS
    rows = arch.fp8_amax_history_len + 1 if arch.fp8 == "delayed" else 2
    return SCALE_INV_BYTES + SCALE_INV_BYTES * quantizers * rows


def check_megatron_fsdp(arch, generation, gpu_name: str) -> None:
    """FP8 beside Megatron-FSDP is read for Hopper (its FP8 weights' transposes, made at each unit's backward and
    dropped at its release); on Blackwell TE keeps other copies, not read there yet."""
    if arch.fp8 and generation != "hopper":
        raise SpecError(f"--use-megatron-fsdp under FP8 is modelled on Hopper (--gpu h100, h200 or h800), not on "
                        f"{gpu_name}: TE's FP8 weight copies on {str(generation).capitalize()} beside Megatron-FSDP "
                        "are not read yet")


def check_gpu(arch, generation, gpu_name: str, default: bool = False) -> None:
    """FP8 needs FP8 tensor cores: Hopper or Blackwell (TE raises on older GPUs); MXFP8 runs on Blackwell and
    blockwise on Hopper alone. ``default``: the GPU is actmem's, not the input's (the refusal says so)."""
    recipe = arch.fp8
    if recipe is not None and generation not in WEIGHT_COPY_BYTES:
        from actmem.model.hardware import DEFAULT_GPU, GPUS

        named = (f"no --gpu was given and actmem's default, the paper's {GPUS[DEFAULT_GPU].name}," if default
                 else gpu_name)
        raise SpecError(f"FP8 needs a GPU with FP8 tensor cores (Hopper or Blackwell); {named} has none that "
                        "actmem has read Transformer Engine for: give --gpu h100, h200, h800 or b200")
    if recipe in BLOCK_RECIPE_GPU and generation not in BLOCK_RECIPE_GPU[recipe]:
        raise SpecError(f"--fp8-recipe {recipe} runs on {' or '.join(g.capitalize() for g in BLOCK_RECIPE_GPU[recipe])} "
                        f"(Transformer Engine asserts it); {gpu_name} is {generation.capitalize()}")
    if arch.moe and arch.fp8_first_last_bf16 and recipe and padding_multiple(recipe) != bf16_padding_multiple(generation):
        raise SpecError(f"--first-last-layers-bf16 beside experts under --fp8-recipe {recipe} on {gpu_name}: its bf16 "
                        f"layers pad each expert's rows to {bf16_padding_multiple(generation)} (TE's default recipe "
                        f"there), its FP8 layers to {padding_multiple(recipe)}; not priced yet: give --fp8-recipe "
                        f"mxfp8")
