"""Multi-head latent attention (MLA: DeepSeek-V2 and V3, Kimi K2) as actmem models it:
megatron-core 0.16.1's MLASelfAttention (transformer/multi_latent_attention.py) in Transformer
Engine's layer spec (models/gpt/gpt_layer_specs.py, get_gpt_layer_with_transformer_engine_spec),
read and measured (the harness runs that class on a CPU, TE's modules replaced by stand-ins that
keep what they keep: validate/actmem_validate/megatron_mla.py).

The layer projects each token down to two latents, q of --q-lora-rank and kv of --kv-lora-rank
(plus the rope part of k, --qk-pos-emb-head-dim wide, shared by the heads), normalises each under
--qk-layernorm (the norm fused into the up projection, TELayerNormColumnParallelLinear), projects
them up to a heads of q and k (--qk-head-dim + the rope dims) and of v (--v-head-dim), rotates
the rope parts by Megatron's fused YaRN kernel (fusions/fused_mla_yarn_rope_apply.py, which keeps
only its cached cos and sin) or, under --no-rope-fusion, by rope_utils.py's _apply_rotary_pos_emb_bshd
(YaRN or, with --rope-type rope, plain rope), whose t * cos_ and rotate_half(t) * sin_ keep 16-bit cos_
and sin_ [s, 1, 1, d_rope], made again for q and for k (the rope_cos_sin row; the interleaved halves it
makes keep nothing), and runs TE's fused attention. What each step keeps is a row of
actmem.memory.terms (MLA_TERMS); the down projections are replicated over the tensor-parallel
ranks (TELinear, parallel_mode 'duplicated'), the up projections split by heads.

Modelled: Megatron's layer with TE's flash core, rotary positions by the fused YaRN kernel
(Megatron's default for MLA) or unfused (YaRN or rope; not beside mla_up_proj recompute), no recompute, full recompute, and selective recompute of core_attn,
layernorm, mla_up_proj and mlp. The rest is refused with its reason.
"""

from actmem.errors import SpecError

#: Megatron's defaults of the MLA settings (megatron/training/arguments.py, the "mla" group)
DEFAULTS = {"q_lora_rank": None, "kv_lora_rank": 32, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64,
            "v_head_dim": 128}
ROPE_TYPES = ("rope", "yarn")


def query_width(arch, heads):
    """a·(d_qk + d_rope): q and k as the attention core takes them, each head's rope part appended."""
    return heads * (arch.qk_head_dim + arch.qk_pos_emb_head_dim)


def check_latent(arch) -> None:
    """Refuse an MLA setting without MLA, and an MLA layer actmem does not model, with why."""
    if arch.rope_type == "yarn" and not arch.multi_latent_attention:
        raise SpecError("--rope-type yarn applies to multi-latent attention only (Megatron asserts: "
                        "argument_utils.py, 'Common attention only support rope_type=\"rope\"')")
    if not arch.multi_latent_attention:
        given = [name for name, default in DEFAULTS.items() if getattr(arch, name) != default]
        if given:
            raise SpecError(f"{', '.join(given)} shape multi-latent attention: give --multi-latent-attention")
        return
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "q_lora_rank"):
        value = getattr(arch, name)
        if not (value is None and name == "q_lora_rank") and (
                isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise SpecError(f"{name} must be a positive integer, got {value!r}")
    if "multi_latent_attention" not in arch.code.has:
        raise SpecError(f"multi-latent attention is modelled as Megatron-Core runs it; {arch.implementation}'s "
                        f"(transformers' DeepseekV3Attention, torchtitan's) keeps other tensors, not measured yet")
    if arch.attention_core != "flash":
        raise SpecError(f"multi-latent attention is modelled under TE's fused attention (--attention-core flash): "
                        f"Megatron's local spec ({'eager' if arch.attention_core == 'eager' else 'flash-attn'}) "
                        f"builds other projections, not measured yet")
    if arch.position_embedding != "rope":
        raise SpecError(f"multi-latent attention rotates its rope dims: give --position-embedding rope, "
                        f"not {arch.position_embedding}")
    if arch.rope_type == "rope" and arch.rope_fusion:
        raise SpecError("--rope-type rope with multi-latent attention needs --no-rope-fusion: Megatron's fused MLA "
                        "rope runs YaRN only (transformer_config.py: 'apply_rope_fusion for MLA only works with YARN "
                        "RoPE')")
    if arch.query_groups is not None:
        raise SpecError("--num-query-groups with multi-latent attention: MLA's k and v have a heads, made from "
                        "one latent; drop --num-query-groups")
    if arch.qk_pos_emb_head_dim % 4:
        raise SpecError(f"--qk-pos-emb-head-dim ({arch.qk_pos_emb_head_dim}) must be a multiple of 4 (the fused "
                        "YaRN kernel asserts emb_dim % 4 == 0)")
