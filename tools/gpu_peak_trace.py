"""What is live at the allocator's peak of one --mode rank0 run on a GPU, grouped by where it was allocated.

Runs one configuration of `actmem validate`'s grids (named by its label) as rank 0 of t in this
process, with torch.cuda's allocator history recording (torch.cuda.memory._record_memory_history), then replays
the trace (alloc, free_completed) to find the moment of the most bytes allocated and sums the blocks live then by
the innermost frame in actmem_validate (else the innermost Python frame). The peak row of `actmem validate` is the
same measurement; this says what sits above actmem's floor. A GPU tool: it records nothing on a CPU.

    python tools/gpu_peak_trace.py "22b t=8 p=1 m=1 b=4 n=1 tp" [--top 25]
"""

import argparse
from collections import Counter

import torch
import torch.distributed as dist

from actmem_validate.grid import presets_grid, small_grid
from actmem_validate.measure import measure
from actmem_validate.torch_compat import fake_store


def _where(frames) -> str:
    ours = [f for f in frames if "actmem_validate" in f["filename"]]
    frame = (ours or frames or [{"filename": "?", "line": 0, "name": "?"}])[0]
    return f'{frame["filename"].rsplit("/", 1)[-1]}:{frame["line"]} {frame["name"]}'


def live_at_peak(trace) -> tuple[int, Counter]:
    live, total, best, best_live = {}, 0, 0, {}
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > best:
                best, best_live = total, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    groups = Counter()
    for event in best_live.values():
        groups[_where(event.get("frames", []))] += event["size"]
    return best, groups


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("label", help="a configuration's label, as `actmem validate` prints it")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    config = next(c for c in presets_grid() + small_grid() if c.label == args.label)
    torch.cuda.set_device(0)
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=config.spec.run.tensor_parallel)
    rows = measure(config, rank=0, device="cuda:0", fake=False)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = next(row for row in rows if row["term"] == "peak")
    print(config.label)
    print(f'peak above the parameters: floor {peak["formula_bytes"]:,} B, measured {peak["measured_bytes"]:,} B '
          f'(+{peak["measured_bytes"] - peak["formula_bytes"]:,})')
    best, groups = live_at_peak(snapshot["device_traces"][0])
    print(f"most allocated at once in the trace (parameters included): {best:,} B")
    for where, size in groups.most_common(args.top):
        print(f"{size:>16,}  {where}")


if __name__ == "__main__":
    main()
