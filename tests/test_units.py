import pytest

from actmem.errors import SpecError
from actmem.units import column_unit, format_in, parse_bytes, plural


@pytest.mark.parametrize("text, expected", [
    ("80GiB", 80 * 2**30), ("80 GiB", 80 * 2**30), ("80gib", 80 * 2**30),
    ("40GB", 40 * 10**9), ("81920MiB", 80 * 2**30), ("1.5TiB", 3 * 2**39),
    ("1024B", 1024), ("2KB", 2000),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["80G", "eighty GiB", "", "0GiB", "-1GB", "0.1B", "1e9", "GiB",
                                  "80", "1024"])
def test_bad_sizes_name_the_units(text):
    with pytest.raises(SpecError, match="memory size"):
        parse_bytes(text)


def test_one_unit_a_column():
    """A column holding 2 GiB and 5 MiB shows both in GiB; only an all-small column uses MiB."""
    unit = column_unit([2 * 2**30, 5 * 2**20])
    assert [format_in(n, unit) for n in (2 * 2**30, 5 * 2**20)] == ["2.00 GiB", "0.00 GiB"]
    assert format_in(5 * 2**20, column_unit([5 * 2**20])) == "5.00 MiB"


def test_plural():
    assert [plural(1, "microbatch"), plural(4, "microbatch"), plural(1, "layer"), plural(2, "layer")] == [
        "1 microbatch", "4 microbatches", "1 layer", "2 layers"]
