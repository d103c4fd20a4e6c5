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
    """'80GiB' -> 85899345920. A bare number is bytes; GB is 10^9, GiB is 2^30."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or (unit and unit not in _UNITS):
        raise SpecError(f"memory size {text!r} is not a number with a unit "
                        f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 80GiB")
    size = Fraction(match.group(1)) * _UNITS[unit or "b"]
    if size.denominator != 1 or size < 0 or (size == 0 and not allow_zero):
        raise SpecError(f"memory size {text!r} must be a positive whole number of bytes")
    return int(size)


def gib(n_bytes: int) -> float:
    return n_bytes / 2**30


def format_gib(n_bytes: int) -> str:
    """Bytes as GiB (2^30 bytes), two decimals; small sizes in MiB so they do not read as 0."""
    if abs(n_bytes) < 2**30 // 100 and n_bytes:
        return f"{n_bytes / 2**20:,.2f} MiB"
    return f"{gib(n_bytes):,.2f} GiB"
