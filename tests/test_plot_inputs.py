"""`actmem plot validation --from FILE.csv` on a file that is not what `actmem validate
--format csv` writes: one line naming the file, the line and the column, exit 2, never a
traceback from the drawing. Each bad file is the test_plot's valid one with one thing
changed, so that the change alone is what is refused."""

import pandas as pd
import pytest

from tests.conftest import assert_one_line_error
from tests.test_plot import _VALIDATION_CSV

HEADER = _VALIDATION_CSV.splitlines()[0].split(",")


def _changed(line: int, column: str, field: str) -> str:
    """The valid CSV with one field replaced; line 1 is the header."""
    lines = _VALIDATION_CSV.splitlines()
    fields = lines[line - 1].split(",")        # no field of the valid file holds a comma
    fields[HEADER.index(column)] = field
    lines[line - 1] = ",".join(fields)
    return "\n".join(lines) + "\n"


def _plot_validation(actmem, tmp_path, text: str | bytes, *args):
    source = tmp_path / "measured.csv"
    source.write_bytes(text if isinstance(text, bytes) else text.encode())
    return actmem("plot", "validation", "--from", str(source), "--csv", str(tmp_path / "frame.csv"), *args)


@pytest.mark.parametrize("line, column, field, said", [
    (3, "measured_bytes", "abc", "line 3: measured_bytes 'abc' is not a whole number of bytes"),
    (2, "formula_bytes", "", "line 2: formula_bytes is blank, not a whole number of bytes"),
    (4, "measured_bytes", "393216.5", "line 4: measured_bytes '393216.5' is not a whole number of bytes"),
    (5, "formula_bytes", "-4", "line 5: formula_bytes '-4' is not a whole number of bytes"),
    (3, "measured_bytes", "1e30", "line 3: measured_bytes '1e30' is not a whole number of bytes under 2^63"),
    (2, "error_percent", "n/a", "line 2: error_percent 'n/a' is not a percentage (or blank)"),
    (2, "rank", "zero", "line 2: rank 'zero' is not a rank"),
    (3, "term", " ", "line 3: term is blank"),
    (9, "measured_bytes", "lots", "line 9: measured_bytes 'lots'"),     # another run's row: the file is checked whole
])
def test_a_field_that_is_not_what_validate_writes_is_one_line(actmem, tmp_path, line, column, field, said):
    result = _plot_validation(actmem, tmp_path, _changed(line, column, field))
    assert_one_line_error(result, "measured.csv", said)
    assert not (tmp_path / "frame.csv").exists()


def test_a_bad_field_is_refused_before_the_picture(actmem, tmp_path):
    """The drawing is where a bad field used to fail (a 45-line traceback)."""
    pytest.importorskip("matplotlib")
    picture = tmp_path / "v.png"
    result = _plot_validation(actmem, tmp_path, _changed(3, "measured_bytes", "abc"), "-o", str(picture))
    assert_one_line_error(result, "line 3: measured_bytes 'abc'")
    assert not picture.exists()


@pytest.mark.parametrize("text, said", [
    ("", "it is empty"),
    (",".join(HEADER) + "\n", "it has a header and no rows"),
    (_VALIDATION_CSV.replace(",measured_bytes,", ",bytes,", 1), "it lacks measured_bytes"),
    ("[model]\nhidden = 12288\n", "it lacks config, technique, rank"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "cannot read it as CSV"),
    (_changed(3, "gate", "pass,extra"), "line 3 has 10 fields, the header 9"),
    (_VALIDATION_CSV.replace(",0.0,pass\n", ",0.0\n", 1), "line 2 has 8 fields, the header 9"),
], ids=["empty", "header-only", "a-column-missing", "toml", "png", "a-field-more", "a-field-less"])
def test_a_file_that_is_not_a_validate_table_is_one_line(actmem, tmp_path, text, said):
    assert_one_line_error(_plot_validation(actmem, tmp_path, text), "--from", "measured.csv", said)


def test_what_a_spreadsheet_or_an_editor_leaves_is_read(actmem, tmp_path):
    """A byte-order mark, blank lines, 1207959552.0 for 1207959552 and spaces around a
    number are the same table."""
    clean = _plot_validation(actmem, tmp_path, _VALIDATION_CSV)
    assert clean.exit_code == 0, clean.output
    expected = pd.read_csv(tmp_path / "frame.csv")
    edited = "\ufeff" + _changed(3, "formula_bytes", " 1207959552.0 ").replace("\n", "\n\n", 2)
    result = _plot_validation(actmem, tmp_path, edited)
    assert result.exit_code == 0, result.output
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "frame.csv"), expected)
