"""Every `actmem ...` example in the README and docs/ runs: each command line of a code block is
run here as written (placeholders for the reader's own files swapped for files of tests/data,
outputs written to a temporary folder), or it is in ELSEWHERE, naming what runs it. An example
in neither fails, so a new one cannot go unchecked; an ELSEWHERE entry no page has fails too."""

import re
import shlex
from pathlib import Path

import pytest

from tests.conftest import Cli

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DATA = ROOT / "tests" / "data"

#: a reader's own files in the examples, and the files of tests/data that stand for them
PLACEHOLDERS = {
    "path/to/config.json": str(DATA / "hf" / "llama-3.1-8b" / "config.json"),
    "@args.txt": "@" + str(DATA / "docs" / "args.txt"),
    "@train_gpt.sh": "@" + str(DATA / "docs" / "train_gpt.sh"),
    "@train_mixtral_8x7b_distributed.sh": "@" + str(DATA / "megatron_examples" / "train_mixtral_8x7b_distributed.sh"),
    "ds_config_zero3.json": str(DATA / "deepspeed" / "ds_config_zero3.json"),
    "deepspeed_zero3.yaml": str(DATA / "accelerate" / "trl_deepspeed_zero3.yaml"),
}

#: examples that need torch, a GPU or minutes: where each is run
ELSEWHERE = {
    "actmem validate --model 22b --mode fake": "tests/validate/test_docs_validate_examples.py",
    "actmem validate --heads 8 --hidden 64 --layers 4 --vocab 512 --seq-len 32 --tp 2 --pp 2 --interleave 2 "
    "--micro-batch 2": "tests/validate/test_docs_validate_examples.py",
    "actmem validate --model 530b --mode fake": "benchmarks/validate_fake.py, run by .ci/run",
    "actmem validate --grid small": ".ci/run (with --max-peak-gap 30, its CSV into artifacts/)",
    "actmem validate --grid moe": "tests/validate/test_megatron_moe.py and .ci/run (its CSV into artifacts/)",
    "actmem validate --grid mla": "tests/validate/test_megatron_mla.py and .ci/run (its CSV into artifacts/)",
    "actmem validate --grid mtp": "tests/validate/test_megatron_mtp.py and .ci/run (its CSV into artifacts/)",
    "actmem validate --grid mfsdp": "tests/validate/test_megatron_fsdp.py and .ci/run (its CSV into artifacts/)",
    "actmem validate --grid zero --max-peak-gap 15": "tests/validate/test_zero_harness.py and .ci/run (its CSV into "
                                                     "artifacts/)",
    "actmem validate --grid presets --mode rank0": "a GPU's (docs/validation.md); on a CPU .ci/run runs the "
                                                   "same grid with --mode fake",
}


def examples() -> list[str]:
    """The `actmem ...` lines of the pages' code blocks, without trailing comments; in a
    transcript (a block with '$ ' prompts) only the prompted lines, the rest being output."""
    found = []
    for page in PAGES:
        for block in re.findall(r"```[a-z]*\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S):
            lines = block.splitlines()
            if any(line.startswith("$ ") for line in lines):
                lines = [line[2:] for line in lines if line.startswith("$ ")]
            found += [line.split("  #")[0].strip() for line in lines if line.startswith("actmem ")]
    return list(dict.fromkeys(found))


def runnable() -> list[str]:
    """The examples run here: every one not placed elsewhere."""
    return [line for line in examples() if line not in ELSEWHERE]


def test_the_pages_have_examples_and_every_elsewhere_entry_is_one_of_them():
    assert len(examples()) >= 15
    assert not set(ELSEWHERE) - set(examples())


@pytest.mark.parametrize("line", runnable())
def test_each_example_runs(line, tmp_path):
    words = [PLACEHOLDERS.get(word, word) for word in shlex.split(line)][1:]
    words = [str(tmp_path / word) if word.endswith((".png", ".svg", ".csv")) else word for word in words]
    result = Cli()(*words)
    assert result.exit_code == 0, (line, result.output[-2000:])
    assert result.stdout.strip()


def test_an_example_placed_nowhere_fails_the_gate(monkeypatch, tmp_path):
    """A page with a new example placed nowhere: it joins the examples run here, and one that
    cannot run fails there; an example placed elsewhere is not run here."""
    import tests.test_docs_examples as module

    page = tmp_path / "new.md"
    page.write_text("```bash\nactmem validate --grid everything   # new\n```\n", encoding="utf-8")
    monkeypatch.setattr(module, "PAGES", [*PAGES, page])
    assert "actmem validate --grid everything" in module.runnable()
    assert not set(ELSEWHERE) & set(module.runnable())
    result = Cli()("validate", "--grid", "everything")
    assert result.exit_code != 0
