"""Stream hints: torch's AccumulateGrad stream-mismatch warning (and the virtual model's twin) as a finding."""

from __future__ import annotations

import warnings

import pytest
import torch

from pytest_streamrace.detector.session import Detector
from pytest_streamrace.detector.models.virtual_autograd import MISMATCH

TESTS = '''
import warnings
import torch

def test_hooks_on_a_side_stream():
    p = torch.nn.Parameter(torch.ones(4))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        node = p.expand_as(p).grad_fn.next_functions[0][0]  # kept: the node, and its hooks, run on `side`
    (p * 2).sum().backward()

def test_one_stream():
    p = torch.nn.Parameter(torch.ones(4))
    (p * 2).sum().backward()

def test_torch_warns():
    # what torch >= 2.10's engine issues on a GPU (input_buffer.cpp); on CPU it never runs that path
    warnings.warn("The AccumulateGrad node's stream does not match the stream of the node that produced the "
                  "incoming gradient. This may incur unnecessary synchronization", UserWarning)

def test_unrelated_warning():
    warnings.warn("an unrelated warning", UserWarning)
'''


def _bound_backward(same_stream: bool) -> None:
    p = torch.nn.Parameter(torch.ones(4))
    side = torch.cuda.current_stream() if same_stream else torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        node = p.expand_as(p).grad_fn.next_functions[0][0]
    (p * 2).sum().backward()
    del node


def test_virtual_model_warns_like_torch_when_accumulate_grad_runs_off_its_producers_stream():
    with Detector(backend="virtual"):
        with pytest.warns(UserWarning, match=r"^The AccumulateGrad node's stream does not match .*"
                                             r"\[streamrace virtual model: AccumulateGrad on stream created at "
                                             r"test_hints\.py:\d+, gradient from default stream\]"):
            _bound_backward(same_stream=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _bound_backward(same_stream=True)
    assert MISMATCH.startswith("The AccumulateGrad node's stream does not match")


def test_hints_are_reported_and_warnings_still_reach_pytest(pytester):
    pytester.makepyfile(test_it=TESTS)
    result = pytester.runpytest_subprocess("--streamrace", "-p", "no:cacheprovider", "-rP")
    result.assert_outcomes(passed=4)
    out = result.stdout.str()
    summary = out.split("= streamrace hints =")[-1]
    assert ("test_it.py::test_hooks_on_a_side_stream: AccumulateGrad on stream created at test_it.py:6, "
            "gradient from default stream (streamrace virtual model warning)") in summary
    assert "test_it.py::test_torch_warns: AccumulateGrad node on another stream than its gradient's producer " \
           "(torch warning)" in summary
    assert "test_one_stream" not in summary and "test_unrelated_warning" not in summary
    assert "runs its gradient hooks there" in summary
    # the report section of the passing test (-rP), and pytest's own warnings summary, unchanged
    result.stdout.fnmatch_lines(["*- streamrace hints -*", "AccumulateGrad on stream created at test_it.py:6*"])
    warned = out.split("warnings summary")[1].split("PASSES")[0]
    assert "UserWarning: an unrelated warning" in warned
    assert warned.count("UserWarning: The AccumulateGrad node's stream does not match") == 2


def test_an_ignored_warning_is_still_a_hint(pytester):
    pytester.makepyfile(test_it=TESTS)
    pytester.makeini("[pytest]\nfilterwarnings =\n    ignore:The AccumulateGrad node's stream does not match\n")
    result = pytester.runpytest_subprocess("--streamrace", "-p", "no:cacheprovider", "-k", "side_stream")
    result.assert_outcomes(passed=1)
    out = result.stdout.str()
    assert "warnings summary" not in out
    assert "test_it.py::test_hooks_on_a_side_stream: AccumulateGrad on stream created at" in out


def test_no_hints_without_streamrace(pytester):
    pytester.makepyfile(test_it=TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "torch_warns")
    result.assert_outcomes(passed=1)
    assert "streamrace hints" not in result.stdout.str()


ONCE = """
import torch

def test_first():
    torch.ones(3).T  # torch warns about .T on 1-D tensors once per process (TORCH_WARN_ONCE)

def test_second():
    torch.ones(3).T
"""


@pytest.mark.parametrize("streamrace, failed", [(True, 2), (False, 1)])
def test_torch_once_warnings_reach_every_test_under_streamrace(pytester, streamrace, failed):
    """What lets every test on a GPU get its AccumulateGrad hint; seen here through a once-warning torch has on CPU,
    turned into a failure by -W error."""
    pytester.makepyfile(test_once=ONCE)
    args = ["--streamrace"] if streamrace else []
    result = pytester.runpytest_subprocess(*args, "-p", "no:cacheprovider", "-W", "error::UserWarning")
    result.assert_outcomes(failed=failed, passed=2 - failed)


UNDESCRIBABLE = """
import torch
import pytest_streamrace.detector.tracker as tracker

real = tracker.byte_range


def failing(t):  # stands for any tensor the tracker cannot describe
    if tuple(t.shape) == (7, 3):
        raise RuntimeError("cannot describe this tensor")
    return real(t)


tracker.byte_range = failing
"""

UNMODELLED = UNDESCRIBABLE + """

def test_unmodelled_op_is_skipped(streamrace_device):
    odd = torch.ones(7, 3, device=streamrace_device)
    doubled = odd * 2                   # the tracker fails here: skipped, said once
    doubled = odd * 2
    assert doubled.sum().item() == 42
    side = torch.cuda.Stream()
    x = torch.zeros(4, device=streamrace_device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1)
    x * 2                               # the same op on other tensors is still checked: this read races
"""


def test_an_op_the_tracker_cannot_model_is_skipped_with_one_note(pytester, monkeypatch):
    monkeypatch.setenv("STREAMRACE_NATIVE", "0")  # the fault is injected into the dispatch mode's Python (the C++
    # capture's twin: tests/test_virtual_capture.py)
    pytester.makepyfile(test_odd=UNMODELLED)
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual", "-rA")
    result.assert_outcomes(failed=1)  # the later race, not an exception from the detector
    out = result.stdout.str()
    assert "RuntimeError" not in out.split("stream race")[0]
    assert "read-after-write" in out and "aten::mul" in out.split("streamrace hints")[0]
    notes = [line for line in result.stdout.lines if "is not checked: RuntimeError: cannot describe this tensor" in line]
    assert notes and all("(streamrace note)" in line for line in notes)
    summary = [line.split(": ", 1)[1] for line in notes if line.startswith("test_odd.py")]
    assert sorted(summary) == sorted(set(summary))  # each once, though aten::mul met the odd tensor twice
    assert {line.split(" is not checked")[0] for line in summary} == {"aten::ones", "aten::mul.Tensor", "aten::sum"}
    assert "Ops the detector could not model are skipped" in out
