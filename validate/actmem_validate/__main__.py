"""`python -m actmem_validate ...` (and `torchrun -m actmem_validate ...`): actmem validate."""

from actmem.cli import _OneLineErrors
from actmem_validate.cli import validate


def main():
    group = _OneLineErrors(name="actmem_validate", commands={"validate": validate})
    import sys

    group.main(["validate", *sys.argv[1:]], prog_name="python -m actmem_validate")


main()
