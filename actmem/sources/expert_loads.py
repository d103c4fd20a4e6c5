"""A per-expert load histogram (--moe-load-histogram FILE): the tokens each expert received, one row of E
counts a layer, as Megatron's router counts them (tokens_per_expert; Megatron-LM's main branch writes each
rank's local counts with --save-tokens-per-expert-interval, which joined in EP order make a row).

JSON: a list of E counts (one layer), a list of such lists (one a layer), or an object whose
"tokens_per_expert" is either. Text or CSV: one layer a line, counts separated by commas or spaces, '#'
starting a comment. Counts are whole numbers >= 0. Read here, checked against the model in
actmem.model.experts.check_routing, and turned into the busiest rank's imbalance by busiest_rank.
"""

import json
from pathlib import Path

from actmem.errors import SpecError


def read_loads(path) -> tuple:
    """((count, ...), ...): one tuple a layer."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise SpecError(f"{path}: cannot read the expert load histogram ({getattr(error, 'strerror', error)})")
    rows = _json_rows(text, path) if path.suffix == ".json" else _text_rows(text, path)
    if not rows:
        raise SpecError(f"{path}: the expert load histogram holds no counts")
    return tuple(tuple(_count(value, path) for value in row) for row in rows)


def _json_rows(text: str, path: Path) -> list:
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError, ValueError) as error:
        raise SpecError(f"{path}: not JSON ({str(error)[:80]})") from None
    if isinstance(data, dict):
        data = data.get("tokens_per_expert")
    if isinstance(data, list) and data and all(isinstance(row, list) for row in data):
        return data
    if isinstance(data, list):
        return [data]
    raise SpecError(f"{path}: give a list of per-expert counts, a list of them a layer, or "
                    "{\"tokens_per_expert\": ...}")


def _text_rows(text: str, path: Path) -> list:
    rows = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].replace(",", " ").split()
        if line:
            rows.append(line)
    return rows


def _count(value, path: Path) -> int:
    """A whole number of tokens >= 0 ('12' or 12, or 12.0 as JSON may write it), exact however large."""
    number = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and value.strip().isdigit():
        number = int(value)
    elif isinstance(value, (str, float)) and not isinstance(value, bool):
        try:
            as_float = float(value)
            number = int(as_float) if as_float.is_integer() else None
        except (ValueError, OverflowError):
            number = None
    if number is None or number < 0:
        raise SpecError(f"{path}: {repr(value)[:40]} is not a whole number of tokens")
    return number
