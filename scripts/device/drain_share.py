"""How much of the cuda detector's step is spent applying the captured records (the tracker's drain: the C++ feed and
core), and how often it runs: inside one session, 100 steps of each MLP row, on one GPU.

    device run (kind nvidia-h200): . scripts/device/setup.sh drain; python3 scripts/device/drain_share.py
"""
import statistics
import sys
import time

sys.path.insert(0, "benchmarks")
import torch  # noqa: E402
from paired_overhead import launch_bound_step  # noqa: E402

from pytest_streamrace.detector.session import Detector  # noqa: E402


def timed(step, steps):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


for model in ("launch-bound", "larger"):
    step = launch_bound_step("cuda", model)
    for _ in range(5):
        step()
    rows = []
    for _ in range(5):
        plain = timed(step, 50)
        with Detector(backend="cuda") as detector:
            tracker = detector.tracker
            drain, spent, calls = tracker.drain, [0.0], [0]

            def counted():
                start = time.perf_counter()
                drain()
                spent[0] += time.perf_counter() - start
                calls[0] += 1
            for _ in range(3):
                step()
            tracker.drain = counted
            ms = timed(step, 50)
            del tracker.drain
        rows.append((plain, ms, spent[0] / 50 * 1e3, calls[0] / 50))
    plain, ms, in_drain, drains = (statistics.median(r[i] for r in rows) for i in range(4))
    print(f"{model}: plain {plain:.3f} ms/step, detector {ms:.3f} ms/step ({ms / plain:.2f}x), of which in the drain "
          f"{in_drain:.3f} ms ({drains:.2f} drains a step)", flush=True)
