"""A named grid measured once, through `actmem validate --grid NAME` as CI runs it: the same run serves the
tests and CI's artifact. .ci/run sets ACTMEM_ARTIFACTS (a directory) and the rows are also written there as
validation-NAME.csv, so it does not measure the grid a second time."""

import json
import os

from click.testing import CliRunner

from actmem.cli.main import cli


def validate_grid(grid: str, *options: str) -> list[dict]:
    """The rows of `actmem validate --grid GRID OPTIONS`, as its JSON gives them. Exit 1 (a gate failed) still
    gives the rows: the tests judge them and say which."""
    artifacts = os.environ.get("ACTMEM_ARTIFACTS")
    output = ["--output", os.path.join(artifacts, f"validation-{grid}.csv")] if artifacts else []
    result = CliRunner().invoke(cli, ["validate", "--grid", grid, *options, "--format", "json", *output])
    assert result.exit_code in (0, 1) and result.stdout.startswith("["), (result.exit_code, result.output[-2000:])
    return json.loads(result.stdout)
