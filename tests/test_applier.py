"""The capture's applier thread (``applier.cpp``): a session's records applied beside the program, with the same
verdicts as when the program's threads apply them as they drain. On the virtual backend here (``STREAMRACE_APPLIER``
chooses it; by itself it runs on the cuda backend only, where four cores are free), through the C++ capture and core."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from pytest_streamrace.detector import capture, tracker
from pytest_streamrace.detector.session import Detector

pytestmark = pytest.mark.skipif(capture.load() is None, reason="the C++ capture does not build here")


def _until(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)
    return condition()


def _session(monkeypatch, applier: str, wait: bool):
    """Ops on a side stream, then a write on the default stream ordered after them or not (a write-after-read race).
    With the applier, the ops between the drains are its; the write is taken alone (its millisecond's wake): its
    candidates are found on the applier thread and judged at the drain that reads the races."""
    monkeypatch.setenv("STREAMRACE_APPLIER", applier)
    with Detector(backend="virtual") as detector:
        feed = detector.tracker._feed
        side = torch.cuda.Stream()
        x = torch.ones(256)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(50):
                x.mul(2)
        if wait:
            torch.cuda.current_stream().wait_stream(side)
        # the side stream's first op waited for a drain (the stream not named in C++ yet): this one, or one the
        # stepping thread makes sooner once the applier waits
        detector.tracker.drain()
        for _ in range(50):
            torch.ones(8).add_(1)
        if applier == "thread":
            assert _until(lambda: feed.applier_applied >= 100)
        detector.tracker.drain()
        before = feed.applier_applied
        x.add_(1)
        if applier == "thread":
            assert _until(lambda: feed.applier_applied > before), "the applier applied the write"
        applied = feed.applier_applied
        races = [(r.kind, r.earlier.op.site.op, r.later.op.site.op, r.key()) for r in detector.races]
    return races, applied, detector.tracker.notes


@pytest.mark.parametrize("wait", [False, True], ids=["racy", "clean"])
def test_the_applier_applies_the_records_with_the_same_verdicts(monkeypatch, wait):
    inline, applied_inline, _ = _session(monkeypatch, "inline", wait)
    threaded, applied, notes = _session(monkeypatch, "thread", wait)
    assert applied_inline == 0 and applied > 1
    assert threaded == inline and notes == []
    assert bool(inline) is not wait  # the racy twin races (write-after-read), the clean one does not
    if not wait:
        assert inline[0][0] == "write-after-read"


def test_the_applier_runs_on_the_cuda_backend_where_cores_are_free(monkeypatch):
    monkeypatch.delenv("STREAMRACE_APPLIER", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert tracker.applier_wanted(True) and not tracker.applier_wanted(False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert not tracker.applier_wanted(True)
    monkeypatch.setenv("STREAMRACE_APPLIER", "thread")
    assert tracker.applier_wanted(False)
    monkeypatch.setenv("STREAMRACE_APPLIER", "inline")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert not tracker.applier_wanted(True)


FORKED = textwrap.dedent("""
    import os, sys, time
    import torch
    from pytest_streamrace.detector.session import Detector

    torch.set_num_threads(1)
    with Detector(backend="virtual") as detector:
        side = torch.cuda.Stream()
        x = torch.ones(64)
        for _ in range(300):  # the applier busy as the process forks
            torch.ones(8).add_(1)
        pid = os.fork()
        if pid == 0:  # the child: no applier thread, its drains apply everything
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                x.mul(2)
            x.add_(1)
            kinds = [race.kind for race in detector.races]
            os._exit(0 if kinds == ["write-after-read"] else 3)
        for _ in range(300):
            torch.ones(8).add_(1)
        _, status = os.waitpid(pid, 0)
        assert detector.tracker._feed.applier_applied > 0
    assert not detector.races, detector.races
    sys.exit(os.waitstatus_to_exitcode(status))
""")


def test_a_fork_leaves_the_child_applying_inline(tmp_path):
    script = tmp_path / "forked.py"
    script.write_text(FORKED)
    environ = dict(os.environ, STREAMRACE_APPLIER="thread")
    out = subprocess.run([sys.executable, str(script)], env=environ, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
