"""What the model is, beyond its dims: the choices that decide which tensors a layer keeps
and how many parameters it has.

The paper's GPT is the default, so its numbers never move. Each field that removes or adds
a row of the term table names that row; ``actmem.terms`` asks the predicates below. The
kernels behind each choice are Megatron-Core's with Transformer Engine (cited in terms.py).
"""

from dataclasses import dataclass

from actmem.errors import SpecError

PAPER_DROPOUT = 0.1   # the GPT models of the paper train with dropout 0.1
ACTIVATIONS = ("gelu", "swiglu")
NORMALIZATIONS = ("layernorm", "rmsnorm")


@dataclass(frozen=True)
class Architecture:
    attention_dropout: float = PAPER_DROPOUT
    """Dropout on the attention probabilities (Megatron's --attention-dropout). At 0 the
    eager core keeps no mask and no separate dropout output: ·V keeps the softmax output."""
    hidden_dropout: float = PAPER_DROPOUT
    """Dropout after the embedding, the attention projection and the MLP (Megatron's
    --hidden-dropout). At 0 none of the three keeps a mask."""
    ffn_hidden: int | None = None
    """The MLP's hidden size f (Megatron's --ffn-hidden-size); None: 4h, the paper's."""
    activation: str = "gelu"
    """'gelu' (the paper's) or 'swiglu' (gated: the first linear is 2f wide; --swiglu)."""
    normalization: str = "layernorm"
    """'layernorm' (weight and bias) or 'rmsnorm' (weight only; --normalization RMSNorm)."""
    bias: bool = True
    """Biases on the linear layers (Megatron's --disable-bias-linear turns them off)."""
    tied_output: bool = True
    """The output layer shares the word embedding's weights (the paper's); False is
    Megatron's --untie-embeddings-and-output-weights."""
    query_groups: int | None = None
    """g: key/value heads (Megatron's --num-query-groups; MQA is 1); None: one a head."""
    head_dim: int | None = None
    """d (Megatron's --kv-channels); None: h/a."""

    def __post_init__(self):
        for name in ("activation", "normalization"):       # Megatron writes RMSNorm, LayerNorm
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, getattr(self, name).lower())
        for name in ("attention_dropout", "hidden_dropout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise SpecError(f"{name} must be a probability in [0, 1), got {value!r}")
        for name in ("ffn_hidden", "query_groups", "head_dim"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise SpecError(f"{name} must be a positive integer, got {value!r}")
        for name, allowed in (("activation", ACTIVATIONS), ("normalization", NORMALIZATIONS)):
            if getattr(self, name) not in allowed:
                raise SpecError(f"{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        for name in ("bias", "tied_output"):
            if not isinstance(getattr(self, name), bool):
                raise SpecError(f"{name} must be true or false, got {getattr(self, name)!r}")

    def ffn(self, hidden):
        """f: the given size, or 4h (works on ints, arrays and sympy symbols)."""
        return 4 * hidden if self.ffn_hidden is None else self.ffn_hidden

    def attention_width(self, hidden, heads):
        """a·d, the width of the queries and of the attention's output: h unless d is given."""
        return hidden if self.head_dim is None else heads * self.head_dim

    def query_groups_or(self, heads):
        return heads if self.query_groups is None else self.query_groups

    def head_dim_or(self, hidden, heads):
        return hidden // heads if self.head_dim is None else self.head_dim

    @property
    def fc1_width(self) -> int:
        """How many f-wide outputs the first MLP linear has: 2 for SwiGLU (gate and up)."""
        return 2 if self.activation == "swiglu" else 1

    def describe(self) -> str:
        """One line a person reads: 'gelu MLP (f = 4h) · layernorm · biases · tied output'."""
        f = "4h" if self.ffn_hidden is None else f"{self.ffn_hidden:,}"
        groups = "" if self.query_groups is None else f"g = {self.query_groups} query groups · "
        head = "" if self.head_dim is None else f"d = {self.head_dim} · "
        return (f"{groups}{head}{self.activation} MLP (f = {f}) · {self.normalization} · "
                f"{'biases' if self.bias else 'no biases'} · {'tied' if self.tied_output else 'untied'} output")

    @property
    def norm_parameters(self) -> int:
        """Parameters of one norm per unit of h: weight and bias, or weight only."""
        return 2 if self.normalization == "layernorm" else 1


PAPER = Architecture()


def attention_dropout(arch: Architecture) -> bool:
    """attention dropout > 0"""
    return arch.attention_dropout > 0


def hidden_dropout(arch: Architecture) -> bool:
    """hidden dropout > 0"""
    return arch.hidden_dropout > 0


def gelu(arch: Architecture) -> bool:
    """the activation is GeLU"""
    return arch.activation == "gelu"


def swiglu(arch: Architecture) -> bool:
    """the activation is SwiGLU"""
    return arch.activation == "swiglu"


def always(arch: Architecture) -> bool:
    """always"""
    return True
