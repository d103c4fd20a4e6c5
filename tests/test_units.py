import pytest

from actmem.errors import SpecError
from actmem.units import format_gib, parse_bytes


@pytest.mark.parametrize("text, expected", [
    ("80GiB", 80 * 2**30), ("80 GiB", 80 * 2**30), ("80gib", 80 * 2**30),
    ("40GB", 40 * 10**9), ("81920MiB", 80 * 2**30), ("1.5TiB", 3 * 2**39),
    ("1024", 1024), ("2KB", 2000),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["80G", "eighty GiB", "", "0GiB", "-1GB", "0.1B", "1e9", "GiB"])
def test_bad_sizes_name_the_units(text):
    with pytest.raises(SpecError, match="memory size"):
        parse_bytes(text)


def test_format_gib():
    assert format_gib(80 * 2**30) == "80.00 GiB"
    assert format_gib(5 * 2**20) == "5.00 MiB"
