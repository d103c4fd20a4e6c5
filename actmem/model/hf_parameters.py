"""transformers' model classes, parameter by parameter: what ZeRO partitions (actmem.memory.zero).

ZeRO pads and partitions per optimizer group (stages 1 and 2) or per parameter (stage 3), so its bytes
depend on the parameters' own sizes and order, not their sum alone. The list is named_parameters()'s, read
off modeling_llama.py, modeling_qwen2.py, modeling_qwen3.py, modeling_gpt2.py, modeling_mixtral.py,
modeling_qwen3_moe.py and modeling_qwen2_moe.py (transformers 5.23): a tied output layer is
the embedding's parameter, listed once. Whether the Trainer decays a parameter (trainer.py,
get_decay_parameter_names) decides its optimizer group: not the norms' weights (nn.LayerNorm, or a name with
'layernorm', 'rmsnorm', 'norm' or '_norm') nor any bias. tests/test_zero.py checks the list against the
model classes themselves.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Parameter:
    name: str
    numel: int
    decays: bool


LLAMA_LIKE = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM",
              "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")


def hf_parameters(class_name: str, h: int, v: int, s: int, layers: int, arch, heads: int) -> tuple:
    """The parameters of ``class_name`` (LlamaForCausalLM, Qwen3ForCausalLM, GPT2LMHeadModel, and the mixtures
    of experts MixtralForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, every layer sparse) in
    named_parameters() order."""
    if class_name == "GPT2LMHeadModel":
        return _gpt2(h, v, s, layers, arch)
    if class_name not in LLAMA_LIKE:
        raise ValueError(f"no parameter list for {class_name}")
    d, g = arch.head_dim_or(h, heads), arch.query_groups_or(heads)
    qkv_bias = arch.has_qkv_bias
    block = [("self_attn.q_proj.weight", heads * d * h, True), *_bias("self_attn.q_proj", heads * d, qkv_bias),
             ("self_attn.k_proj.weight", g * d * h, True), *_bias("self_attn.k_proj", g * d, qkv_bias),
             ("self_attn.v_proj.weight", g * d * h, True), *_bias("self_attn.v_proj", g * d, qkv_bias),
             ("self_attn.o_proj.weight", h * heads * d, True),
             # Llama's attention_bias puts one on o_proj too; Qwen2's and Qwen2-MoE's q, k, v biases do not
             *_bias("self_attn.o_proj", h, qkv_bias and class_name == "LlamaForCausalLM")]
    if class_name in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        block += [("self_attn.q_norm.weight", d, False), ("self_attn.k_norm.weight", d, False)]
    block += _mlp(class_name, h, arch) + [("input_layernorm.weight", h, False),
                                          ("post_attention_layernorm.weight", h, False)]
    return (Parameter("model.embed_tokens.weight", v * h, True), *_layers("model.layers", block, layers),
            Parameter("model.norm.weight", h, False),
            *(() if arch.tied_output else (Parameter("lm_head.weight", v * h, True),)))


def _mlp(class_name: str, h: int, arch) -> list:
    """The MLP's parameters: Llama's SwiGLU; or the router's [E, h] weight (mlp.gate) and the experts' fused
    gate_up_proj [E, 2f_e, h] and down_proj [E, h, f_e] (transformers' grouped experts), in the class's order,
    with Qwen2-MoE's shared expert (a SwiGLU of f_s) and its [1, h] gate after them."""
    if not arch.moe:
        f = arch.ffn(h)
        return [("mlp.gate_proj.weight", f * h, True), ("mlp.up_proj.weight", f * h, True),
                ("mlp.down_proj.weight", h * f, True)]
    e, f_e = arch.num_experts, arch.expert_ffn(h)
    router = [("mlp.gate.weight", e * h, True)]
    experts = [("mlp.experts.gate_up_proj", e * 2 * f_e * h, True), ("mlp.experts.down_proj", e * h * f_e, True)]
    if class_name == "Qwen3MoeForCausalLM":
        return experts + router
    if class_name == "Qwen2MoeForCausalLM":
        f_s = arch.moe_shared_ffn
        return router + experts + [("mlp.shared_expert.gate_proj.weight", f_s * h, True),
                                   ("mlp.shared_expert.up_proj.weight", f_s * h, True),
                                   ("mlp.shared_expert.down_proj.weight", h * f_s, True),
                                   ("mlp.shared_expert_gate.weight", h, True)]
    return router + experts


def _bias(module: str, n: int, present: bool) -> list:
    return [(f"{module}.bias", n, False)] if present else []


def _layers(prefix: str, block: list, layers: int) -> tuple:
    return tuple(Parameter(f"{prefix}.{i}.{name}", n, decays) for i in range(layers) for name, n, decays in block)


def _gpt2(h: int, v: int, s: int, layers: int, arch) -> tuple:
    """GPT2LMHeadModel: Conv1D weights [in, out] with biases, nn.LayerNorm's weight and bias, learned positions
    of n_positions rows (--max-position-embeddings, a config.json's n_positions; s where not given, as the harness
    builds it), the output layer tied to wte."""
    f = arch.ffn(h)
    s = s if arch.position_rows is None else arch.position_rows
    block = [("ln_1.weight", h, False), ("ln_1.bias", h, False), ("attn.c_attn.weight", h * 3 * h, True),
             ("attn.c_attn.bias", 3 * h, False), ("attn.c_proj.weight", h * h, True), ("attn.c_proj.bias", h, False),
             ("ln_2.weight", h, False), ("ln_2.bias", h, False), ("mlp.c_fc.weight", h * f, True),
             ("mlp.c_fc.bias", f, False), ("mlp.c_proj.weight", f * h, True), ("mlp.c_proj.bias", h, False)]
    return (Parameter("transformer.wte.weight", v * h, True), Parameter("transformer.wpe.weight", s * h, True),
            *_layers("transformer.h", block, layers), Parameter("transformer.ln_f.weight", h, False),
            Parameter("transformer.ln_f.bias", h, False),
            *(() if arch.tied_output else (Parameter("lm_head.weight", v * h, True),)))
