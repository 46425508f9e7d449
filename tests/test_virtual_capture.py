"""The virtual backend takes its ops from the C++ capture (its kernel entry, no dispatch mode) where it
builds, and from the dispatch mode where it does not (``STREAMRACE_NATIVE=0`` stands for a machine without a
compiler): the same program gives the same verdicts either way — streams, autograd on a side stream, a read-back's
host sync, other threads' current streams, and storages freed and their addresses reused between two drains."""

from __future__ import annotations

import json

import pytest

from pytest_streamrace.detector import capture

CASES = """
import os
import threading

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from pytest_streamrace.detector.session import active

N = 1024


def side_stream():
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    return side


def test_ops_come_from_the_expected_source():
    mode = _get_current_dispatch_mode()
    if os.environ.get("STREAMRACE_NATIVE") == "0":
        assert active().op_source == "dispatch mode" and type(mode).__name__ == "AccessTracker"
    else:
        assert active().op_source == "capture" and mode is None, mode
        assert active().tracker._feed is not None  # applied to the C++ core in C++ (capture.cpp's Feed)


def streams(wait):
    x = torch.ones(N)
    side = side_stream()
    with torch.cuda.stream(side):
        x.mul_(2)
    if wait:
        torch.cuda.current_stream().wait_stream(side)
    x.sum()


@pytest.mark.streamrace(expect="race")
def test_streams_racy(): streams(False)


@pytest.mark.streamrace(expect="clean")
def test_streams_clean(): streams(True)


def backward(wait):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    side = side_stream()
    with torch.cuda.stream(side):
        model(torch.randn(4, 16)).sum().backward()
    if wait:
        torch.cuda.current_stream().wait_stream(side)
    for p in model.parameters():
        p.grad.mul_(0.5)


@pytest.mark.streamrace(expect="race")
def test_backward_racy(): backward(False)


@pytest.mark.streamrace(expect="clean")
def test_backward_clean(): backward(True)


def read_back(mask_on_side):
    x = torch.ones(N)
    side = side_stream()
    with torch.cuda.stream(side):
        x.add_(1)
        if mask_on_side:
            x[x > 1]  # boolean-mask indexing: the host waits for the side stream (a latent race, not a race)
    x.sum()


@pytest.mark.streamrace(expect="clean")
def test_read_back_orders_the_host(): read_back(True)


@pytest.mark.streamrace(expect="race")
def test_without_read_back_races(): read_back(False)


def thread(wait):
    x = torch.ones(N)
    side = side_stream()

    def work():
        x.add_(1)  # a new thread starts on the default stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.mul_(2)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()  # orders the host, not the streams
    if wait:
        torch.cuda.current_stream().wait_stream(side)
    x.sum()


@pytest.mark.streamrace(expect="race")
def test_thread_racy(): thread(False)


@pytest.mark.streamrace(expect="clean")
def test_thread_clean(): thread(True)


def reuse(race):
    # Storages die and their addresses are handed out again with no synchronization point (no drain) between. Taken
    # for the old one, a new storage's write on the default stream would race with the old one's on the side stream.
    side = side_stream()
    reused = 0
    for size in (1 << 16, 1 << 23, 1 << 24):  # the large ones are mapped afresh by malloc: at the same address
        with torch.cuda.stream(side):
            known = torch.ones(size)
        torch.cuda.current_stream()  # a drain: `known` is watched from here, its free arrives in order
        with torch.cuda.stream(side):
            known.mul_(2)
            old = known.data_ptr()
            del known
        new = torch.empty(size)
        reused += new.data_ptr() == old
        new.fill_(3)
        with torch.cuda.stream(side):
            unseen = torch.ones(size)  # first seen by ops not drained yet: held by them until then
            unseen.add_(1)
            del unseen
        newer = torch.empty(size)
        newer.fill_(3)
        if race:
            with torch.cuda.stream(side):
                new.add_(1)  # the side stream never waited for the fill
        new.sum()
        newer.sum()
    assert reused, "no address was reused: the case checks nothing here"


@pytest.mark.streamrace(expect="clean")
def test_reused_address_is_a_new_storage(): reuse(False)


@pytest.mark.streamrace(expect="race")
def test_reused_address_still_races_for_real(): reuse(True)
"""

PASSED = 11


def _verdicts(pytester, monkeypatch, native: str) -> list[tuple]:
    monkeypatch.setenv("STREAMRACE_NATIVE", native)
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual", "-p", "no:cacheprovider",
                                           "--streamrace-json=races.json")
    result.assert_outcomes(passed=PASSED)
    races = json.loads((pytester.path / "races.json").read_text())["races"]

    def access(a):
        return (a["op"], a["stream"], a["rw"], a["frames"][0]["line"] if a["frames"] else None)

    return sorted((r["test"], r["kind"], access(r["earlier"]), access(r["later"]), (r.get("latent") or {}).get("op"))
                  for r in races)


def test_the_capture_and_its_fallback_give_the_same_verdicts(pytester, monkeypatch):
    if capture.load() is None:
        pytest.skip(f"the capture does not build here: {capture.failure()}")
    pytester.makepyfile(test_cases=CASES)
    captured = _verdicts(pytester, monkeypatch, "1")
    fallback = _verdicts(pytester, monkeypatch, "0")
    assert captured == fallback
    racy = {test.split("::")[-1] for test, *_ in captured}
    assert racy == {"test_streams_racy", "test_backward_racy", "test_without_read_back_races", "test_thread_racy",
                    "test_reused_address_still_races_for_real", "test_read_back_orders_the_host"}
    latent = {test.split("::")[-1] for test, *rest in captured if rest[-1] is not None}
    assert latent == {"test_read_back_orders_the_host"}  # kept apart: the host sync of t[mask] orders it today


FAULTY = """
import torch
from pytest_streamrace.detector.tracker import AccessTracker


def failing(self, *args, **kwargs):  # stands for anything the tracker cannot model in a captured op
    raise RuntimeError("cannot model this op")


AccessTracker.host_synced = failing


def test_faulty_op_is_skipped():
    side = torch.cuda.Stream()
    x = torch.zeros(4)
    assert x.sum().item() == 0  # the tracker fails on this op's host sync: skipped, said once
    assert x.sum().item() == 0
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1)
    x * 2  # the ops after it are still checked: this read races
"""


def test_a_captured_op_the_tracker_cannot_model_is_skipped_with_one_note(pytester):
    if capture.load() is None:
        pytest.skip(f"the capture does not build here: {capture.failure()}")
    pytester.makepyfile(test_faulty=FAULTY)
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual", "-rA", "-p",
                                           "no:cacheprovider")
    result.assert_outcomes(failed=1)  # the later race, not an exception from the detector
    out = result.stdout.str()
    assert "read-after-write" in out and "aten::mul" in out
    notes = [line for line in result.stdout.lines if "is not checked: RuntimeError: cannot model this op" in line]
    summary = [line.split(": ", 1)[1] for line in notes if line.startswith("test_faulty.py")]
    assert summary == ["aten::_local_scalar_dense is not checked: RuntimeError: cannot model this op (streamrace note)"]


WARNS_IN_BACKWARD = """
import torch


def test_a_full_backward_hook_warns_from_this_module():
    layer = torch.nn.Linear(4, 4)
    layer.register_full_backward_hook(lambda module, grad_in, grad_out: None)
    layer(torch.ones(2, 4)).sum().backward()  # no input requires grad: torch warns, attributed to this line
"""


@pytest.mark.parametrize("streamrace", [False, True], ids=["plain", "streamrace"])
def test_a_warning_raised_inside_a_backward_points_where_it_would_without_the_detector(pytester, streamrace):
    """torch warns from a module's full backward hook with a `stacklevel` that counts the frames above the engine: a
    frame of ours there would move the warning to torch's autograd module, and a filter on the test's own module would
    stop matching (here: the warning, made an error, fails the test)."""
    if streamrace and capture.load() is None:
        pytest.skip(f"the capture does not build here: {capture.failure()}")  # the fallback's frames stay: README
    pytester.makepyfile(test_warns=WARNS_IN_BACKWARD)
    args = ["-p", "no:cacheprovider", "-W", "error::UserWarning"]
    if streamrace:
        args += ["--streamrace", "--streamrace-backend=virtual"]
    pytester.runpytest_subprocess(*args, "-W", "ignore::UserWarning:test_warns").assert_outcomes(passed=1)
    pytester.runpytest_subprocess(*args).assert_outcomes(failed=1)  # the warning is raised: the filter is what passes
