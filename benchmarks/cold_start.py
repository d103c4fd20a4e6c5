"""Benchmark: a cold `actmem estimate --model 530b` beside llm-analysis's CLI on the same
model, median of paired runs, each tool in a virtual environment of its own. A report, not a
test. Target (issue 26): actmem no slower.

Set up once (PyPI):
    python -m venv /tmp/amvenv && /tmp/amvenv/bin/pip install .
    python -m venv /tmp/llmavenv && /tmp/llmavenv/bin/pip install llm-analysis==0.2.2
Usage: python benchmarks/cold_start.py --actmem /tmp/amvenv/bin/python --llm-analysis /tmp/llmavenv/bin/python
"""

import argparse
import statistics
import subprocess
import tempfile
import time

#: the same run: MT-NLG 530B, t = 8, p = 35, SP, selective recompute, b = 1, A100 80GB
ACTMEM = ["-m", "actmem", "estimate", "--model", "530b"]
LLM_ANALYSIS = ["-m", "llm_analysis.analysis", "train", "--model_name", "megatron-lm-530b", "--gpu_name",
                "a100-sxm-80gb", "--tp_size", "8", "--pp_size", "35", "--sp_size", "8", "--activation_recomputation",
                "1", "-b", "1", "--total_num_tokens", "1e9", "--log_level", "ERROR"]


def seconds(command: list[str]) -> float:
    """Wall seconds of a command run outside the checkout: `python -m actmem` there would import the checkout's
    sources (compiled afresh each run where PYTHONDONTWRITEBYTECODE is set), not the venv's install."""
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, cwd=tempfile.gettempdir())
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--actmem", required=True, help="the python of a venv with actmem installed")
    parser.add_argument("--llm-analysis", required=True, help="the python of a venv with llm-analysis installed")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    pairs = [(seconds([args.actmem, *ACTMEM]), seconds([args.llm_analysis, *LLM_ANALYSIS])) for _ in range(args.runs)]
    ours, theirs = (statistics.median(side) for side in zip(*pairs))
    print(f"median of {args.runs} paired cold runs: actmem {ours:.3f} s, llm-analysis {theirs:.3f} s "
          f"({ours / theirs:.2f}x)")


if __name__ == "__main__":
    main()
