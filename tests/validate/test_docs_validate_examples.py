"""The docs' `actmem validate` examples that a CPU runs in seconds, run as written
(tests/test_docs_examples.py places the others)."""

import pytest

pytest.importorskip("torch")

from tests.conftest import Cli  # noqa: E402
from tests.test_docs_examples import ELSEWHERE, examples  # noqa: E402

HERE = [line for line, where in ELSEWHERE.items() if where == "tests/validate/test_docs_validate_examples.py"]


def test_they_are_the_pages_examples():
    assert len(HERE) == 2 and set(HERE) <= set(examples())


@pytest.mark.parametrize("line", HERE)
def test_each_runs_and_passes_its_gate(line):
    result = Cli()(*line.split()[1:])
    assert result.exit_code == 0, result.output[-2000:]
    assert "gate passed" in result.output
