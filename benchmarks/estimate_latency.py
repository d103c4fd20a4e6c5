"""Benchmark: how fast `actmem estimate` answers. A report, not a test: it never fails on time.

Prints the wall time of the whole command (process start, imports, estimate, rendering)
for each preset, median of several runs, and the in-process estimates per second.
Usage: python benchmarks/estimate_latency.py [--runs N]
"""

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path


def compile_actmem() -> None:
    """Compile actmem's sources once, as pip does on install: where PYTHONDONTWRITEBYTECODE is set (these machines
    and their CI), `python -m actmem` from the checkout would compile them afresh at every run (about 0.3 s), a cost
    no installed user pays."""
    import actmem

    subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(actmem.__file__).parent)], check=True)


def command_seconds(args: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "actmem", *args], check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def estimates_per_second(seconds: float = 2.0) -> float:
    from actmem.memory.estimate import estimate
    from actmem.sources.presets import load_preset
    from actmem.model.spec import build_spec

    preset = load_preset("530b")
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        estimate(build_spec(preset.model, preset.run, name=preset.name))
        count += 1
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    runs = parser.parse_args().runs
    compile_actmem()
    print(f"actmem estimate latency, median of {runs} runs (whole process):")
    for args in (["--help"], ["estimate", "--model", "530b"], ["estimate", "--model", "1t"],
                 ["estimate", "--model", "gpt3", "--format", "json"],
                 ["estimate", "--model", "gpt3", "--format", "csv"]):
        print(f"  actmem {' '.join(args):45s} {command_seconds(args, runs):6.3f} s")
    print(f"in-process estimates per second (530b): {estimates_per_second():,.0f}")


if __name__ == "__main__":
    main()
