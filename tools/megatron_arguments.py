"""Regenerate actmem/sources/data/megatron_arguments.tsv: every argument of Megatron-LM's training
parser at a pinned commit, as its own parser builds it.

    python tools/megatron_arguments.py /path/to/Megatron-LM

Megatron builds much of its parser from config dataclasses (ArgumentGroupFactory), so the list
is read from the parser itself, not from the text of arguments.py: this imports
megatron.training.arguments (needs torch, and triton, which megatron imports unconditionally;
on Python 3.11, typing.override is stood in for) and walks add_megatron_arguments' actions.
The TSV records the commit; tests/test_megatron_table.py checks that actmem's classification
(actmem/sources/data/megatron_memory.toml) covers exactly these names.
"""

import argparse
import subprocess
import sys
import typing
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "actmem" / "sources" / "data" / "megatron_arguments.tsv"


def _values(action) -> str:
    """How many values follow the option: 0, 1, many (up to the next option), or a number."""
    nargs = action.nargs
    if nargs == 0 or isinstance(action, (argparse._StoreConstAction, argparse._HelpAction)):
        return "0"
    if nargs is None:
        return "1"
    if nargs in ("+", "*"):
        return "many"
    if nargs == "?":
        return "optional"
    return str(nargs)


def main(megatron: str) -> None:
    sys.path.insert(0, megatron)
    if not hasattr(typing, "override"):
        typing.override = lambda function: function
    from megatron.training.arguments import add_megatron_arguments

    commit = subprocess.run(["git", "-C", megatron, "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    parser = argparse.ArgumentParser()
    add_megatron_arguments(parser)
    rows = []
    for group in parser._action_groups:
        for action in group._group_actions:
            for option in action.option_strings:
                if option.startswith("--"):
                    rows.append(f"{option}\t{action.dest}\t{_values(action)}\t{group.title}")
    header = (f"# Megatron-LM's training arguments at NVIDIA/Megatron-LM@{commit}\n"
              "# (megatron/training/arguments.py: add_megatron_arguments), from tools/megatron_arguments.py\n"
              "option\tdest\tvalues\tgroup\n")
    OUT.write_text(header + "\n".join(rows) + "\n")
    print(f"{len(rows)} options from {commit} -> {OUT}")


if __name__ == "__main__":
    main(sys.argv[1])
