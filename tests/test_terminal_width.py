"""No number is cut at any width (issue 25): piped, under COLUMNS=80, in a terminal of 80
columns and in a narrow one, every number column is whole and nothing is ellipsised; text
columns wrap instead, and a table too wide for its numbers is printed wider."""

import re

import pytest

from actmem.sources.presets import all_presets

SETTINGS = {
    "piped": {"COLUMNS": None, "FORCE_COLOR": None, "TTY_COMPATIBLE": None},
    "COLUMNS=80": {"COLUMNS": "80", "FORCE_COLOR": None, "TTY_COMPATIBLE": None},
    "terminal of 80": {"COLUMNS": "80", "FORCE_COLOR": "1", "TTY_COMPATIBLE": None},   # rich: a tty
    "terminal of 60": {"COLUMNS": "60", "FORCE_COLOR": "1", "TTY_COMPATIBLE": None},
}
_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def _run(actmem, setting, *args) -> str:
    result = actmem(*args, env=SETTINGS[setting])
    assert result.exit_code == 0, result.output
    out = _ESCAPE.sub("", result.stdout)
    assert "…" not in out
    return out


def _rows(out: str, first: str) -> list[list[str]]:
    """The table rows whose first cell is ``first``, split into words."""
    return [line.split() for line in out.splitlines() if line.split()[:1] == [first]]


@pytest.mark.parametrize("setting", SETTINGS)
def test_presets_show_every_dimension_whole(actmem, setting):
    """530B's row is Table 3's: a = 128, h = 20480, L = 105, v = 51200, s = 2048, t = 8, p = 35."""
    out = _run(actmem, setting, "presets")
    (row,) = _rows(out, "530b")
    assert row[-10:] == ["128", "20480", "105", "51200", "2048", "8", "35", "3", "1", "280"]
    for preset in all_presets():
        (row,) = _rows(out, preset.name)
        model = preset.model
        dims = [str(model[k]) for k in ("heads", "hidden", "layers", "vocab", "seq_len")]
        assert any(row[i:i + 5] == dims for i in range(len(row))), (preset.name, row)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("model", ["530b", "llama-3.1-405b"])
def test_plan_keeps_its_bubble_and_mfu_columns(actmem, setting, model):
    out = _run(actmem, setting, "plan", "--model", model)
    header = next(line.split() for line in out.splitlines() if line.startswith("config "))
    assert header[-4:] == ["pp", "bub", "dp", "MFU"], header
    rows = [line.split() for line in out.splitlines() if line.startswith("t=")]
    assert rows
    for row in rows:
        numbers = [word for word in row if re.fullmatch(r"[+]?\d+(\.\d+)?%?", word)]
        assert len(numbers) == len(header) - 1, row              # every column but config
        assert re.fullmatch(r"\+\d+%", numbers[-3]) and re.fullmatch(r"\d+%", numbers[-1]), row


@pytest.mark.parametrize("setting", SETTINGS)
def test_explain_keeps_the_verdict_on_one_line(actmem, setting):
    """GPT-3's own run (Table 3: t=8 p=8 m=3 b=1, SP + selective) is the preset's: its verdict
    names the busiest stage's peak floor, and from 80 columns up the sentence is one line (its
    bar shrinks to make room); narrower, it wraps between words."""
    peak_gib = actmem.json("estimate", "--model", "gpt3")["verdict_bytes"] / 2**30
    out = _run(actmem, setting, "plan", "--model", "gpt3", "--explain", "t=8 p=8 m=3 b=1 sp sel")
    lines = out.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.startswith(("fits", "tight", "does not fit"))]
    assert f"{peak_gib:,.2f} of " in lines[at] and "GiB" in lines[at]
    if setting != "terminal of 60":      # the verdict, then its margin beyond the reserve, each one line
        assert re.fullmatch(r"[\d.,]+ GiB (to spare beyond|into|over).*\)", lines[at + 1].strip()), lines[at:at + 3]
        assert lines[at + 2].strip() == "", lines[at:at + 3]
    (run,) = _rows(out, "tp-sp-sel")                              # its '+ params' cell, whole
    assert re.fullmatch(r"\d+\.\d\d", run[-3]) and run[-2:] in (["GiB", "✓"], ["GiB", "~"], ["GiB", "✗"]), run
    assert "model FLOPs utilisation" in out


@pytest.mark.parametrize("setting", SETTINGS)
def test_the_techniques_table_is_whole_where_a_label_is_long(actmem, setting):
    """Block recompute's label, 'tp-sp-full·block 1 ◀', once pushed 530B's per-layer, stage
    and '+ params' cells to 'per lay…' and '684.11 GiB…' at 80 columns."""
    out = _run(actmem, setting, "plan", "--model", "530b", "--explain", "t=8 p=35 m=1 b=1 sp block=1")
    (none,) = _rows(out, "none")
    assert none[:2] == ["none", "3.83"] and none[-3:-1] == ["684.11", "GiB"] and none[-1] in "✓✗"
    assert any(line.split()[:3] == ["tp-sp-full·block", "1", "◀"] for line in out.splitlines())


@pytest.mark.parametrize("setting", SETTINGS)
def test_term_names_are_whole(actmem, setting):
    """Llama 3.1 405B at 128K: its longest term names were cut to 'attention_layernorm_inp…'."""
    out = _run(actmem, setting, "estimate", "--model", "llama-3.1-405b-128k")
    for name in ("attention_layernorm_input", "attention_norm_statistics", "swiglu_input"):
        (row,) = _rows(out, name)
        assert re.fullmatch(r"\d{1,3}(,\d{3})*", row[2]), row           # bytes each, whole


@pytest.mark.parametrize("setting", ["COLUMNS=80", "terminal of 60"])
def test_formulas_name_every_term_whole(actmem, setting):
    from actmem.memory.terms import TERMS

    out = _run(actmem, setting, "formulas")
    words = set(out.split())
    assert all(term.name in words for term in TERMS)
