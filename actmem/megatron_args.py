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
"""

import shlex

from actmem.errors import SpecError

#: Megatron arguments that cannot change the memory of a training step, and whether each
#: takes a value. (Numerics of the optimizer, the schedule, data, checkpoints, logging.)
IGNORED = {
    **dict.fromkeys(("--lr", "--min-lr", "--lr-decay-style", "--lr-warmup-iters", "--lr-warmup-fraction",
                     "--lr-decay-iters", "--lr-decay-samples", "--lr-warmup-samples", "--train-iters",
                     "--train-samples", "--weight-decay", "--clip-grad", "--adam-beta1", "--adam-beta2",
                     "--adam-eps", "--init-method-std", "--seed", "--save", "--load", "--data-path",
                     "--vocab-file", "--merge-file", "--tokenizer-type", "--tokenizer-model",
                     "--log-interval", "--save-interval", "--eval-interval", "--eval-iters",
                     "--tensorboard-dir", "--tensorboard-log-interval", "--wandb-project",
                     "--wandb-exp-name", "--split", "--distributed-backend",
                     "--distributed-timeout-minutes", "--data-cache-path", "--num-workers",
                     "--exit-interval", "--exit-duration-in-mins", "--norm-epsilon",
                     "--rotary-base", "--attention-backend"), True),
    **dict.fromkeys(("--use-mcore-models", "--no-load-optim", "--no-load-rng", "--log-throughput",
                     "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard",
                     "--no-async-tensor-model-parallel-allreduce", "--use-checkpoint-args",
                     "--no-save-optim", "--no-save-rng"), False),
}
#: 16-bit training, which actmem assumes: used as a check, never ignored
PRECISION = ("--bf16", "--fp16")
#: Megatron reads --num-query-groups only with this switch on
GQA_SWITCH = "--group-query-attention"
#: the learned position embedding's size; actmem sizes it at s and needs them equal
MAX_POSITIONS = "--max-position-embeddings"


def split(text: str) -> list[str]:
    """Shell words of the pasted text, or of the file named after '@'; backslash line ends
    and '#' comments as a shell reads them."""
    if text.startswith("@"):
        try:
            with open(text[1:], encoding="utf-8") as file:
                text = file.read()
        except OSError as error:
            raise SpecError(f"--megatron-args {text}: cannot read it ({error.strerror})")
    try:
        return shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as error:
        raise SpecError(f"--megatron-args: not shell words ({error})")


def sort(words: list[str], takes_value: dict, not_modelled) -> tuple[list[str], list[str], dict]:
    """(words actmem parses, ignored argument names, {'--seq-length': ...} checks to make).
    takes_value: each argument actmem knows -> whether it takes a value."""
    used, ignored, unknown, refused, checks = [], [], [], [], {}
    words = [part for word in words for part in (word.split("=", 1) if word.startswith("--") else [word])]
    i = 0
    while i < len(words):
        name = words[i]
        if not name.startswith("--"):
            unknown.append(name)
            i += 1
        elif name in takes_value:
            width = 2 if takes_value[name] else 1
            used += words[i:i + width]
            i += width
        elif name in IGNORED:
            ignored.append(name)
            i += 2 if IGNORED[name] else 1
        elif name in PRECISION or name == GQA_SWITCH:
            checks[name if name == GQA_SWITCH else "precision"] = name
            i += 1
        elif name == MAX_POSITIONS:
            checks[MAX_POSITIONS] = words[i + 1] if i + 1 < len(words) else ""
            i += 2
        else:
            (refused if name in not_modelled else unknown).append(name)
            i += 1 if i + 1 >= len(words) or words[i + 1].startswith("--") else 2
    problems = []
    if refused:
        problems.append(f"changes memory and is not modelled yet: {', '.join(refused)}")
    if unknown:
        problems.append(f"unknown to actmem: {', '.join(unknown)}")
    if ("--num-query-groups" in words) != (GQA_SWITCH in checks):
        problems.append("Megatron reads --num-query-groups only with --group-query-attention (and the "
                        "switch alone means nothing): give both or neither")
    if "precision" not in checks:
        problems.append("neither --bf16 nor --fp16: Megatron would train in fp32, and actmem counts "
                        "16-bit activations")
    if problems:
        raise SpecError(f"--megatron-args: {'; '.join(problems)}")
    return used, ignored, checks
