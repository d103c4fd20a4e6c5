"""Parameters, gradients and optimizer state on one GPU of the first stage.

Figure 1 of the paper sets these beside the activations. The count follows
Megatron's GPT layer; arithmetic only, so it runs on ints and numpy arrays alike.
"""

from dataclasses import dataclass

from actmem.widths import GRADIENT_BYTES, OPTIMIZER_BYTES, WEIGHT_BYTES


def layer_parameters(h, t):
    """One transformer layer's parameters on one of t GPUs.

    QKV 3h²+3h, projection h²+h, h→4h 4h²+4h, 4h→h 4h²+h, two layer norms 4h:
    12h² + 13h in all. Tensor parallelism splits the weights and the QKV and h→4h
    biases (12h² + 7h); the row-parallel biases and the layer norms (6h) are replicated.
    """
    return (12 * h * h + 7 * h) // t + 6 * h


def first_stage_parameters(h, L, p, t, v, s):
    """L/p layers, the word embedding split over the vocabulary (v·h/t), the learned
    position embedding (s·h), and the final layer norm (2h) when p = 1. The output
    layer shares the word embedding's weights (section 3)."""
    return L // p * layer_parameters(h, t) + v * h // t + s * h + 2 * h * (p == 1)


@dataclass(frozen=True)
class ParameterBytes:
    count: int
    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self):
        return self.weights_bytes + self.gradients_bytes + self.optimizer_bytes


def parameter_bytes(count, data_parallel, distributed_optimizer) -> ParameterBytes:
    """18 bytes a parameter, or 6 + 12/d with the distributed optimizer (rounded up: the
    largest shard). Arithmetic only: the planner passes numpy arrays, one element a
    configuration."""
    shards = 1 + (data_parallel - 1) * distributed_optimizer
    optimizer = -(-OPTIMIZER_BYTES * count // shards)
    return ParameterBytes(count, WEIGHT_BYTES * count, GRADIENT_BYTES * count, optimizer)
