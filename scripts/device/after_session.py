"""What a session leaves on the plain step after it, on one GPU: plain rounds before any session, then after each
kind of session (torch's empty RecordFunction callback, the capture alone, the cuda detector), in that order; then,
paired, the plain step after the session with the allocator's and events' trace calls kept in C++ (the cuda model's
state between sessions) against the same calls handed to torch's Python interpreter (the state before it was kept).

    device run (kind nvidia-h200): . scripts/device/setup.sh after; python3 scripts/device/after_session.py
"""
import contextlib
import statistics
import sys
import time

sys.path.insert(0, "benchmarks")
import torch  # noqa: E402
from paired_overhead import EMPTY_CALLBACK, launch_bound_step  # noqa: E402

from pytest_streamrace.detector import capture  # noqa: E402
from pytest_streamrace.detector.hb import HappensBefore  # noqa: E402
from pytest_streamrace.detector.session import Detector  # noqa: E402
from pytest_streamrace.detector.tracker import AccessTracker  # noqa: E402


def plain_ms(step, rounds=7, steps=20):
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(out)


@contextlib.contextmanager
def empty_callback():
    from torch.utils.cpp_extension import load_inline
    ext = load_inline("streamrace_bench_empty_callback", EMPTY_CALLBACK)
    handle = ext.add(True)
    yield
    ext.remove(handle)


@contextlib.contextmanager
def capture_only():
    ext = capture.load()
    tracker = AccessTracker(HappensBefore(), lambda: 0, "cuda")
    ext.enable(True, tracker._capture_plan)
    yield
    ext.drain()
    ext.disable()


for model in ("launch-bound", "larger"):
    step = launch_bound_step("cuda", model)
    for _ in range(5):
        step()
    before = [plain_ms(step) for _ in range(3)]
    print(f"{model}: plain before any session {' '.join(f'{m:.3f}' for m in before)} ms/step", flush=True)
    for name, context in [("RecordFunction", empty_callback), ("capture", capture_only),
                          ("cuda detector", lambda: Detector(backend="cuda"))]:
        with context():
            for _ in range(20):
                step()
        torch.cuda.synchronize()
        after = [plain_ms(step) for _ in range(3)]
        print(f"{model}: plain after a {name} session {' '.join(f'{m:.3f}' for m in after)} ms/step", flush=True)
    native = capture.load_trace()
    print("trace interpreter installed:", native is not None and native.installed())
    kinds = ("allocation", "free", "event_creation", "event_deletion")
    ratios, times = [], {True: [], False: []}
    for _ in range(9):
        pair = {}
        for here in (False, True):
            for kind in kinds:
                native.route(kind, here)
            pair[here] = plain_ms(step, rounds=1)
            times[here].append(pair[here])
        ratios.append(pair[False] / pair[True])
    print(f"{model}: plain after a session, trace in C++ {statistics.median(times[True]):.3f} ms/step, handed to "
          f"torch's interpreter {statistics.median(times[False]):.3f} ms/step: {statistics.median(ratios):.2f}x",
          flush=True)
