"""What following a test into its subprocesses costs a child that never imports torch.

A trivial child (``multiprocessing`` spawn of a function that returns at once, and ``python -c pass``) is started
R times each, alternately, without and with the environment ``pytest --streamrace`` gives a test's children (the start-up hook runs,
arms its watcher, and nothing else happens because torch is never imported). Prints the median start-to-exit time
of each and the difference; the target is under 50 ms more per child.

    python benchmarks/subprocess_startup.py [--repeat R]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time

from pytest_streamrace.env import SUBPROCESS as ENV
from pytest_streamrace.children.startup_hook import StartupHook


def nothing() -> None:
    pass


def _spawn_once() -> None:
    p = mp.get_context("spawn").Process(target=nothing)
    p.start()
    p.join()


def _exec_once() -> None:
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def _time(start, env: str | None) -> float:
    if env is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = env
    t0 = time.perf_counter()
    start()
    elapsed = time.perf_counter() - t0
    os.environ.pop(ENV, None)
    return elapsed * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    hook = StartupHook()
    problem = hook.install()
    if problem:
        sys.exit(f"the start-up hook is not installed: {problem}")
    folder = tempfile.mkdtemp(prefix="streamrace-bench-")
    env_on = json.dumps({"dir": folder, "backend": "virtual", "trace": False, "test": "bench"})
    rows = []
    for name, start in (("multiprocessing spawn, no torch", _spawn_once), ("python -c pass", _exec_once)):
        _time(start, env_on)  # warm the page cache and the byte-code caches
        offs, ons = [], []
        for _ in range(args.repeat):  # interleaved, so that a busy machine slows both alike
            offs.append(_time(start, None))
            ons.append(_time(start, env_on))
        rows.append((name, statistics.median(offs), statistics.median(ons)))
    print(f"trivial child, median of {args.repeat} starts (ms)")
    print(f"{'child':<34}{'plain':>9}{'--streamrace':>14}{'extra':>9}")
    for name, off, on in rows:
        print(f"{name:<34}{off:>9.1f}{on:>14.1f}{on - off:>+9.1f}")
    worst = max(on - off for _, off, on in rows)
    print(f"extra per child: {worst:+.1f} ms (target < 50 ms): {'ok' if worst < 50 else 'OVER'}")


if __name__ == "__main__":
    main()
