"""Whether a long cuda session's step gets slower as it goes: ms/step of successive rounds of 30 steps, plain, then
inside one Detector session, on one GPU.

    device run (kind nvidia-h200): . scripts/device/setup.sh growth; python3 scripts/device/session_growth.py
"""
import sys
import time

sys.path.insert(0, "benchmarks")
import torch  # noqa: E402
from paired_overhead import launch_bound_step  # noqa: E402

from pytest_streamrace.detector.session import Detector  # noqa: E402


def rounds(step, n):
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(30):
            step()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - start) / 30 * 1e3)
    return " ".join(f"{m:.2f}" for m in out)


for model in ("launch-bound", "larger"):
    step = launch_bound_step("cuda", model)
    for _ in range(5):
        step()
    print(f"{model} plain:    {rounds(step, 8)}", flush=True)
    with Detector(backend="cuda"):
        print(f"{model} detector: {rounds(step, 30)}", flush=True)
    print(f"{model} plain:    {rounds(step, 8)}", flush=True)
