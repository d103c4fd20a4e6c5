"""What the model is, beyond its dims: the choices that decide which tensors a layer keeps.

The paper's GPT is the default, so its numbers never move. Each field that removes or adds
a row of the term table names that row; ``actmem.terms`` asks the predicates below.
"""

from dataclasses import dataclass, fields

from actmem.errors import SpecError

PAPER_DROPOUT = 0.1   # the GPT models of the paper train with dropout 0.1


@dataclass(frozen=True)
class Architecture:
    attention_dropout: float = PAPER_DROPOUT
    """Dropout on the attention probabilities (Megatron's --attention-dropout). At 0 the
    eager core keeps no mask and no separate dropout output: ·V keeps the softmax output."""
    hidden_dropout: float = PAPER_DROPOUT
    """Dropout after the embedding, the attention projection and the MLP (Megatron's
    --hidden-dropout). At 0 none of the three keeps a mask."""

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise SpecError(f"{f.name} must be a probability in [0, 1), got {value!r}")


PAPER = Architecture()


def attention_dropout(arch: Architecture) -> bool:
    """attention dropout > 0"""
    return arch.attention_dropout > 0


def hidden_dropout(arch: Architecture) -> bool:
    """hidden dropout > 0"""
    return arch.hidden_dropout > 0


def always(arch: Architecture) -> bool:
    """always"""
    return True
