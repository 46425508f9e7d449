"""Work the compiler does for itself: while it runs, a host synchronize is not the program's ordering.

Compiling (dynamo, Inductor, max-autotune's template benchmarks), the Triton autotuner's benchmarking at a kernel's
first launch and CUDA-graph recording all synchronize the device. Counted as ordering, those syncs order everything
the program enqueued before a compiled function's *first* call, so a race there would show only from the second call
on — and a test that calls the function once would pass. Stream models skip host syncs inside `scope()`.
Torch-free: a thread-local depth, entered by the compiled-code model's patches.
"""

from __future__ import annotations

import contextlib
import threading

_local = threading.local()


@contextlib.contextmanager
def scope():
    """The calling thread is doing the compiler's work until the block ends (nests)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def active() -> bool:
    """Whether this thread is inside the compiler's own work."""
    return getattr(_local, "depth", 0) > 0


def wrap(original):
    """`original` run inside `scope()` (a method or function patched in the compiler)."""

    def run(*args, **kwargs):
        with scope():
            return original(*args, **kwargs)
    run.__wrapped__ = original
    return run
