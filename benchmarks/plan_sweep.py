"""Benchmark: the planner's sweep, in configurations evaluated per second. A report, not a test.

The targets: a full sweep for the 1T model on 3072 GPUs, for Llama 3.1 405B on 16,384 GPUs and
for DeepSeek-V3 on 2,048 (EP and ETP swept too), each finishes in about a second.
Usage: python benchmarks/plan_sweep.py
"""

import subprocess
import sys
import time

from actmem.model.architecture import Architecture
from actmem.model.hardware import GPUS
from actmem.planner.plan import PlanRequest, plan
from actmem.sources.presets import load_preset
from actmem.model.spec import Model
from estimate_latency import compile_actmem     # benchmarks/, the script's own folder


def timed_plan(model: Model, gpus: int, global_batch: int, **options) -> tuple[int, float]:
    request = PlanRequest(model=model, gpus=gpus, global_batch=global_batch, gpu=GPUS["a100"],
                          gpu_memory_bytes=80 * 2**30, **options)
    return timed(request)


def timed(request: PlanRequest) -> tuple[int, float]:
    start = time.perf_counter()
    evaluated = len(plan(request).evaluated)
    return evaluated, time.perf_counter() - start


def main() -> None:
    one_t = Model(**load_preset("1t").model)
    for label, model, gpus, batch, options in (
        ("1T on 3072 GPUs, global batch 3072 (first call: lambdify)", one_t, 3072, 3072, {}),
        ("1T on 3072 GPUs, global batch 3072", one_t, 3072, 3072, {}),
        ("1T on 3072 GPUs, global batch 3072, b up to 256", one_t, 3072, 3072, {"max_micro_batch": 256}),
        ("L=96 on 6144 GPUs, global batch 12288, b up to 64",
         Model(96, 12288, 96, 51200, 2048), 6144, 12288, {"max_micro_batch": 64}),
    ):
        count, seconds = timed_plan(model, gpus, batch, **options)
        print(f"{label:58s} {count:7,d} configs {seconds:6.3f} s {count / seconds:10,.0f} configs/s")
    for label, name, gpus, batch in (
            ("Llama 3.1 405B on 16384 H100s, global batch 2048", "llama-3.1-405b", 16384, 2048),
            ("Llama 3.1 405B at 128K on 16384 H100s, c swept, batch 128", "llama-3.1-405b-128k", 16384, 128),
            ("DeepSeek-V3 on 2048 H100s, EP and ETP swept, batch 8192", "deepseek-v3", 2048, 8192)):
        preset = load_preset(name)
        request = PlanRequest(model=Model(**preset.model), gpus=gpus, global_batch=batch, gpu=GPUS["h100"],
                              gpu_memory_bytes=80 * 2**30, architecture=Architecture(**preset.architecture))
        timed(request)                               # lambdify the layer's formulas once
        count, seconds = timed(request)
        print(f"{label:58s} {count:7,d} configs {seconds:6.3f} s {count / seconds:10,.0f} configs/s")
    compile_actmem()
    for command in (["--model", "1t", "--gpus", "3072", "--global-batch", "3072"],
                    ["--model", "llama-3.1-405b", "--gpus", "16384", "--global-batch", "2048", "--gpu", "h100"],
                    ["--model", "deepseek-v3", "--gpus", "2048", "--global-batch", "8192", "--gpu", "h100"]):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "actmem", "plan", *command], check=True, capture_output=True)
        print(f"{'whole command: actmem plan ' + ' '.join(command[:2]):58s} {time.perf_counter() - start:23.3f} s")


if __name__ == "__main__":
    main()
