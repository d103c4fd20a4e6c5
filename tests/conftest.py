import json

import pytest
from click.testing import CliRunner

from actmem.cli.main import cli


class Cli:
    """Runs `actmem ...` in-process through click's CliRunner."""

    def __init__(self):
        self.runner = CliRunner()

    def __call__(self, *args, env=None):
        return self.runner.invoke(cli, list(args), env=env, prog_name="actmem")

    def json(self, *args):
        result = self(*args, "--format", "json")
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)


@pytest.fixture
def actmem():
    return Cli()


def assert_one_line_error(result, *fragments):
    """Bad input: exit 2, one line on stderr naming the constraint, no traceback."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("actmem: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert "Traceback" not in result.output
    assert result.stdout == ""


def plan_row_run(row, **settings) -> dict:
    """The run values a plan row is, read back from its label as --explain reads it (an
    uneven split and block=N included; an even pipeline says so, over a preset's split),
    with ``settings`` (gpus, global_batch) added."""
    from actmem.planner.explain import parse_config
    from actmem.planner.plan import config_label

    even = {"first_stage_layers": None, "last_stage_layers": None}
    return even | parse_config(config_label(row)) | settings
