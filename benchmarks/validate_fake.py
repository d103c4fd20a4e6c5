"""Benchmark: `actmem validate --model 530b --mode fake`, every technique, whole process. A
report, not a test: it never fails on time. Target (issue 26): under a minute on 2 cores.

The fake runs are torch's FakeTensorMode dispatching every op of 530B's first stage (rank 0
of t = 8, its whole schedule); each technique is one core's work, so they run in as many
processes as there are cores (launch.run_fake).
Usage: python benchmarks/validate_fake.py [--model NAME]
"""

import argparse
import os
import subprocess
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="530b")
    model = parser.parse_args().model
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "actmem_validate", "--model", model, "--mode", "fake"], check=True,
                   capture_output=True)
    seconds = time.perf_counter() - start
    print(f"actmem validate --model {model} --mode fake (every technique) on {os.cpu_count()} cores: {seconds:.1f} s")


if __name__ == "__main__":
    main()
