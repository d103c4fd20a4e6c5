"""`python -m actmem_validate ...` (and `torchrun -m actmem_validate ...`): `actmem validate ...`."""

import sys

from actmem.cli.main import cli

cli(["validate", *sys.argv[1:]], prog_name="python -m actmem_validate")
