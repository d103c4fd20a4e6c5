"""Defaults that more than one module states: the one place each is written.

Light on purpose (no imports), so the CLI can show them in --help without loading the engine.
"""

VOCAB_DIVISIBLE_BY = 128   # Megatron's --make-vocab-size-divisible-by
GPUS_PER_NODE = 8          # tensor parallelism stays inside a node (NVLink)
MAX_MICRO_BATCH = 16       # the largest microbatch the planner tries
