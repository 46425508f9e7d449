"""Where the cuda detector's Python time goes on each step of overhead.py's 2-rank DDP row, by thread: rank 0 wraps
the detector's Python entry points (the c10d hand-over by phase, the drain, the collectives model, host syncs) and
the tracker's lock with wall-clock timers, keyed by the thread that ran them (a drain also by who called it). cProfile sees one thread only and
counts a lock or GIL wait as the caller's own time; this tells waits from work.

    device run (kind nvidia-h200-x2): . scripts/device/setup.sh ddp; python3 scripts/device/ddp_thread_times.py [MODE]
"""
import collections
import os
import subprocess
import sys
import tempfile
import threading
import time

MODEL = "DDP MLP (8x512, batch 32, 2 ranks)"
STEPS = int(os.environ.get("STEPS", "100"))
times = collections.defaultdict(lambda: [0, 0.0])  # (what, thread) -> [calls, seconds]


def caller(depth=2):
    """`name<-caller<-its caller` of the wrapped call, for drains: who makes a thread drain."""
    names, frame = [], sys._getframe(depth)
    while frame is not None and len(names) < 3:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return "<-".join(names) or "C++"


def timed(owner, name, key=None):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        what = key(args) if key is not None else name
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            entry = times[(what, threading.current_thread().name)]
            entry[0] += 1
            entry[1] += time.perf_counter() - start
    setattr(owner, name, wrapper)


class TimedLock:
    """The tracker's RLock, its waits counted."""

    def __init__(self, lock):
        self.lock = lock

    def __enter__(self):
        start = time.perf_counter()
        self.lock.acquire()
        entry = times[("tracker lock wait", threading.current_thread().name)]
        entry[0] += 1
        entry[1] += time.perf_counter() - start
        return self

    def __exit__(self, *exc):
        self.lock.release()


def instrument():
    from pytest_streamrace.detector.models.collectives import Collectives
    from pytest_streamrace.detector.models.cuda import CudaStreams
    from pytest_streamrace.detector.tracker import AccessTracker

    timed(AccessTracker, "_queued", lambda a: f"_queued {a[5]}")
    timed(AccessTracker, "drain", lambda a: f"drain from {caller(3)}")
    timed(AccessTracker, "run")
    timed(Collectives, "on_op", lambda a: f"on_op {a[5] if len(a) > 5 else 'once'}")
    for name in ("_event_sync", "_stream_sync", "_device_sync", "_event_record", "_event_wait"):
        timed(CudaStreams, name)
    init = AccessTracker.__init__

    def tracker_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._lock = TimedLock(self._lock)
    AccessTracker.__init__ = tracker_init


if len(sys.argv) > 2 and sys.argv[1] == "--rank":
    rank, store, mode = int(sys.argv[2]), sys.argv[3], sys.argv[4]
    sys.path.insert(0, "benchmarks")
    from overhead import step_time

    if rank == 0:
        instrument()
    ms = step_time(MODEL, mode, STEPS, rank, store)
    if rank == 0:
        calls = 6 + 5 * STEPS  # overhead.py's warm-ups and rounds
        print(f"{mode}: {ms:.3f} ms a step (timers on)")
        for (what, thread), (n, s) in sorted(times.items(), key=lambda item: -item[1][1]):
            print(f"  {what:60} {thread[:12]:12} {n / calls:6.1f}/step {s / calls * 1e3:8.4f} ms/step "
                  f"{s / n * 1e6:8.1f} us each")
    sys.exit(0)

mode = sys.argv[1] if len(sys.argv) > 1 else "cuda"
with tempfile.TemporaryDirectory() as tmp:
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), f"{tmp}/store", mode]) for r in range(2)]
    sys.exit(max(p.wait(timeout=500) for p in procs))
