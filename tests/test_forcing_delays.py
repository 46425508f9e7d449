"""injected_delays and --streamrace-schedules: sleeps land on the scheduled streams, in order, as the detector sees
them; a test that fails under some schedules says which."""

import json

VIRTUAL = ("--streamrace", "--streamrace-backend=virtual", "-p", "no:cacheprovider")

DELAYED = """
import os, tempfile
import pytest, torch
import torch.distributed as dist

def test_accumulate(stream_bound_accumulators, injected_delays, streamrace_device, streamrace_schedule):
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)).to(streamrace_device)
    binding = stream_bound_accumulators(m, streams=2)
    injected_delays.before_accumulate(binding)
    m(torch.ones(2, 4, device=streamrace_device)).sum().backward()
    assert streamrace_schedule != 1, "fails under schedule 1 only"

class Work:
    def step(self, x):
        return x * 2

def test_collectives_and_functions(injected_delays, streamrace_device, stream_bound_accumulators):
    side = stream_bound_accumulators([torch.zeros(1, requires_grad=True)], streams=1).streams[0]
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    injected_delays.before_collectives()
    injected_delays.around(Work, "step", before=False, after=True)
    x = torch.ones(4, device=streamrace_device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dist.all_reduce(x)
        Work().step(x)
    torch.cuda.current_stream().wait_stream(side)
    dist.all_reduce(x)
    assert [(d.where, d.stream) for d in injected_delays.log if d.ms] == [
        ("before all_reduce", "side 0"), ("after Work.step", "side 0")] or injected_delays.schedule.seed is not None
"""


def _sleeps(trace_path):
    """test id -> the streams of its torch.cuda._sleep ops, in launch order."""
    events = json.loads(open(trace_path).read())
    events = events["traceEvents"] if isinstance(events, dict) else events
    tests = {e["pid"]: e["args"]["name"].split(" (")[0] for e in events if e.get("name") == "process_name"}
    out = {}
    for e in sorted((e for e in events if e.get("name") == "torch.cuda._sleep"), key=lambda e: e["args"]["seq"]):
        out.setdefault(tests[e["pid"]].split("::")[-1], []).append(e["args"]["stream"])
    return out


def test_schedules_put_sleeps_on_the_scheduled_streams(pytester):
    pytester.makepyfile(test_delayed=DELAYED)
    trace = pytester.path / "trace.json"
    result = pytester.runpytest_subprocess(*VIRTUAL, "--streamrace-schedules", "3", "--streamrace-trace", str(trace))
    result.assert_outcomes(passed=5, failed=1)
    sleeps = _sleeps(trace)
    # backward runs the second Linear's nodes first: bias, weight of layer 1 (bound to side 1, side 0), then layer 0
    assert sleeps["test_accumulate[schedule0]"] == ["side 0 (streamrace forcing)"] * 2
    assert sleeps["test_accumulate[schedule1]"] == ["side 1 (streamrace forcing)"] * 2
    assert sleeps["test_accumulate[schedule2]"] == [f"side {i} (streamrace forcing)" for i in (1, 0, 1, 0)]
    assert sleeps["test_collectives_and_functions[schedule0]"] == ["side 0 (streamrace forcing)"] * 2
    # one side stream there: schedule 1 is already a seeded random one, which delays every stream
    assert sleeps["test_collectives_and_functions[schedule1]"] == [
        "side 0 (streamrace forcing)", "side 0 (streamrace forcing)", "default stream"]
    result.stdout.fnmatch_lines([
        "*- injected delays -*",
        "schedule: side 1 slow (2 ms); 2 delays injected",
        "  2 ms on side 1 AccumulateGrad of 1.bias",
        "*= streamrace delay schedules =*",
        "test_delayed.py::test_accumulate: failed under 1 of 3 schedules: schedule1 (side 1 slow (2 ms))",
    ])


def test_schedules_under_xdist_report_the_same(pytester):
    pytester.makepyfile(test_delayed=DELAYED)
    result = pytester.runpytest_subprocess(*VIRTUAL, "--streamrace-schedules", "2", "-n", "2")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines([
        "test_delayed.py::test_accumulate: failed under 1 of 2 schedules: schedule1 (side 1 slow (2 ms))"])


def test_bad_schedule_count_is_a_usage_error(pytester):
    pytester.makepyfile("def test_ok(): pass")
    result = pytester.runpytest_subprocess("--streamrace-schedules", "0", "-p", "no:cacheprovider")
    assert result.ret == 4
    result.stderr.fnmatch_lines(["ERROR: streamrace: --streamrace-schedules = '0': expected a positive whole number"])
