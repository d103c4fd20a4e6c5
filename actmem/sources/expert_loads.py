"""A per-expert load histogram (--moe-load-histogram FILE): the tokens each expert received, one row of E
counts a layer, as Megatron's router counts them (tokens_per_expert).

JSON: a list of E counts (one layer), a list of such lists (one a layer), or an object whose
"tokens_per_expert" is either. Text or CSV: one layer a line, counts separated by commas or spaces, '#'
starting a comment. Counts are whole numbers >= 0. Or a directory: what Megatron-LM's
--save-tokens-per-expert-interval writes (its main branch, activation_logging.py: save_tpe), one
rank<R>.jsonl a rank, each line a layer's rows its local experts received, a list a microbatch; read once
the experts are known (MegatronLogs.rows), each (EP group, iteration, layer, microbatch) a row of E.
Read here, checked against the model in actmem.model.experts.check_routing, and turned into the busiest
rank's imbalance by busiest_rank.
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path

from actmem.errors import SpecError


@dataclass(frozen=True)
class MegatronLogs:
    """Megatron-LM's tokens_per_expert/ directory, read into rows once E is known (rows)."""

    path: Path

    def rows(self, experts: int) -> tuple:
        """One row of E counts for each EP group's (iteration, block, layer, microbatch): the rank files joined
        in Megatron's expert layout (parallel_state.py, the expert mesh: ETP fastest, then EP), each rank
        holding E/EP consecutive experts (moe_layer.py, local_expert_indices); ETP inferred as the ranks that
        log alike (the expert-tensor-parallel ranks all receive the gathered rows)."""
        logs = _rank_logs(self.path)
        widths = {len(counts) for log in logs.values() for *_, counts in log}
        if len(widths) != 1 or experts % next(iter(widths)):
            raise SpecError(f"{self.path}: each rank logs {', '.join(map(str, sorted(widths)))} experts' rows; with "
                            f"{experts} experts each must log the same E/EP")
        ep = experts // widths.pop()
        world = -(-(max(logs) + 1) // ep) * ep         # ranks a stage of dense layers only leaves without a file
        etp = max(d for d in range(1, world // ep + 1) if world % (d * ep) == 0 and all(
            logs[r] == logs[r - r % d] for r in logs if r - r % d in logs))
        rows = []
        for group in range(-(-world // (etp * ep))):
            ranks = [group * etp * ep + j * etp for j in range(ep)]
            if not any(rank in logs for rank in ranks):
                continue                       # a stage without MoE layers logs nothing
            missing = [rank for rank in ranks if rank not in logs]
            if missing:
                raise SpecError(f"{self.path}: rank files missing from expert-parallel group {group} (EP·ETP = "
                                f"{ep}·{etp}): {', '.join(f'rank{r}.jsonl' for r in missing[:5])}")
            members = [logs[rank] for rank in ranks]
            if any([key for *key, _ in log] != [key for *key, _ in members[0]] for log in members):
                raise SpecError(f"{self.path}: the ranks of expert-parallel group {group} log different layers or "
                                "iterations; give the files of one run")
            rows += [tuple(count for log in members for count in log[i][-1]) for i in range(len(members[0]))]
        return tuple(rows)


def loads_for(loads, experts):
    """The histogram's rows: as read, or Megatron's logs joined for E experts (None: a dense model)."""
    if not isinstance(loads, MegatronLogs):
        return loads
    if not experts:
        raise SpecError("--moe-load-histogram shapes a mixture-of-experts layer: give --num-experts")
    return loads.rows(experts)


def _rank_logs(path: Path) -> dict:
    """{rank: [(iteration, block, mtp index, layer, microbatch, counts), ...]} of each rank that wrote a file (a
    rank whose stage holds no MoE layer writes none)."""
    files = {}
    for file in path.glob("rank*.jsonl"):
        match = re.fullmatch(r"rank(\d+)\.jsonl", file.name)
        if match:
            files[int(match.group(1))] = file
    if not files:
        raise SpecError(f"{path}: no rank<R>.jsonl files (Megatron-LM's --save-tokens-per-expert-interval writes "
                        "them under <save>/tokens_per_expert)")
    return {rank: _rank_log(files[rank]) for rank in sorted(files)}


def _rank_log(file: Path) -> list:
    log = []
    for number, line in enumerate(_read(file).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            key = (record["iter"], record["block"], record.get("mtp_idx"), record["layer"])
            microbatches = record["tpe"]
        except (json.JSONDecodeError, RecursionError, ValueError, KeyError, TypeError) as error:
            raise SpecError(f"{file}:{number}: not a tokens-per-expert record ({str(error)[:60]})") from None
        if not isinstance(microbatches, list) or not all(isinstance(row, list) and row for row in microbatches):
            raise SpecError(f"{file}:{number}: its \"tpe\" must be a list of each microbatch's per-expert rows")
        log += [(*key, mb, tuple(_count(value, file) for value in row)) for mb, row in enumerate(microbatches)]
    if not log:
        raise SpecError(f"{file}: no tokens-per-expert records")
    return log


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise SpecError(f"{path}: cannot read the expert load histogram ({getattr(error, 'strerror', error)})")


def read_loads(path):
    """((count, ...), ...): one tuple a layer; for a directory of Megatron's logs, MegatronLogs."""
    path = Path(path)
    if path.is_dir():
        return MegatronLogs(path / "tokens_per_expert" if (path / "tokens_per_expert").is_dir() else path)
    text = _read(path)
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
