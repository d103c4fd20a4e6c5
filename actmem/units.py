"""Byte sizes: parse what a user types ("80GiB"), format what we print."""

import re
from fractions import Fraction

from actmem.errors import SpecError

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str, allow_zero: bool = False) -> int:
    """'80GiB' -> 85899345920; GB is 10^9, GiB is 2^30. A bare number is refused: '80' could
    mean bytes or GB, and a wrong guess is a wrong answer."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise SpecError(f"memory size {text!r} is not a number with a unit "
                        f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 80GiB")
    size = Fraction(match.group(1)) * _UNITS[unit]
    if size.denominator != 1 or size < 0 or (size == 0 and not allow_zero):
        raise SpecError(f"memory size {text!r} must be a positive whole number of bytes")
    return int(size)


def gib(n_bytes: int) -> float:
    return n_bytes / 2**30


def column_unit(values) -> tuple[str, int]:
    """One unit for a whole column of byte counts: GiB unless every value is under 1 GiB."""
    largest = max((abs(int(n)) for n in values), default=0)
    return ("GiB", 2**30) if largest >= 2**30 else ("MiB", 2**20)


def format_in(n_bytes: int, unit: tuple[str, int]) -> str:
    """Bytes in a column's unit, two decimals, unit named."""
    name, size = unit
    return f"{n_bytes / size:,.2f} {name}"


def plural(count: int, noun: str) -> str:
    """'1 microbatch', '2 microbatches', '1 layer', '3 layers'."""
    if count == 1:
        return f"1 {noun}"
    return f"{count:,} {noun}{'es' if noun.endswith(('ch', 'sh', 's', 'x')) else 's'}"
