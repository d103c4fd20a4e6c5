"""transformers' model classes, parameter by parameter: what ZeRO partitions (actmem.memory.zero).

ZeRO pads and partitions per optimizer group (stages 1 and 2) or per parameter (stage 3), so its bytes
depend on the parameters' own sizes and order, not their sum alone. The list is named_parameters()'s, read
off modeling_llama.py, modeling_qwen3.py and modeling_gpt2.py (transformers 5.23): a tied output layer is
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


def hf_parameters(class_name: str, h: int, v: int, s: int, layers: int, arch, heads: int) -> tuple:
    """The parameters of ``class_name`` (LlamaForCausalLM, Qwen3ForCausalLM, GPT2LMHeadModel) in
    named_parameters() order."""
    if class_name == "GPT2LMHeadModel":
        return _gpt2(h, v, s, layers, arch)
    if class_name not in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        raise ValueError(f"no parameter list for {class_name}")
    d, g, f = arch.head_dim_or(h, heads), arch.query_groups_or(heads), arch.ffn(h)
    qkv_bias = arch.has_qkv_bias
    block = [("self_attn.q_proj.weight", heads * d * h, True), *_bias("self_attn.q_proj", heads * d, qkv_bias),
             ("self_attn.k_proj.weight", g * d * h, True), *_bias("self_attn.k_proj", g * d, qkv_bias),
             ("self_attn.v_proj.weight", g * d * h, True), *_bias("self_attn.v_proj", g * d, qkv_bias),
             ("self_attn.o_proj.weight", h * heads * d, True),
             *_bias("self_attn.o_proj", h, qkv_bias)]           # attention_bias puts one on o_proj too
    if class_name == "Qwen3ForCausalLM":
        block += [("self_attn.q_norm.weight", d, False), ("self_attn.k_norm.weight", d, False)]
    block += [("mlp.gate_proj.weight", f * h, True), ("mlp.up_proj.weight", f * h, True),
              ("mlp.down_proj.weight", h * f, True),
              ("input_layernorm.weight", h, False), ("post_attention_layernorm.weight", h, False)]
    return (Parameter("model.embed_tokens.weight", v * h, True), *_layers("model.layers", block, layers),
            Parameter("model.norm.weight", h, False),
            *(() if arch.tied_output else (Parameter("lm_head.weight", v * h, True),)))


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
