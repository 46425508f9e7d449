"""The launcher's pure decisions: marker arguments, backend choice, GPU split between xdist workers, the item's
outcome from its ranks' records."""

from __future__ import annotations

import pytest

from pytest_streamrace import env
from pytest_streamrace.launcher import marker, placement, report
from pytest_streamrace.launcher.spec import RankSpec
from pytest_streamrace.launcher.supervise import RankRun


def mark(*args, **kwargs):
    return pytest.mark.distributed(*args, **kwargs).mark


@pytest.mark.parametrize("m, expected", [
    (mark(world_size=2), marker.Request(2, None, None)),
    (mark(3), marker.Request(3, None, None)),
    (mark(world_size=1, backend="auto", timeout=5), marker.Request(1, None, 5.0)),
    (mark(world_size=4, backend="nccl", timeout=0.5), marker.Request(4, "nccl", 0.5)),
])
def test_marker_arguments(m, expected):
    assert marker.parse(m) == expected


@pytest.mark.parametrize("m, message", [
    (mark(), "world_size is required"),
    (mark(world_size=0), "world_size must be a positive integer, got 0"),
    (mark(world_size=True), "world_size must be a positive integer, got True"),
    (mark(world_size="2"), "world_size must be a positive integer, got '2'"),
    (mark(2, world_size=2), "world_size given twice"),
    (mark(2, 3), "takes one positional argument"),
    (mark(world_size=2, backend="mpi"), "unknown backend 'mpi'"),
    (mark(world_size=2, timeout=0), "timeout must be a positive number of seconds, got 0"),
    (mark(world_size=2, nprocs=2), "unknown argument 'nprocs'"),
])
def test_bad_marker_arguments(m, message):
    with pytest.raises(marker.MarkerError, match=message):
        marker.parse(m)


@pytest.mark.parametrize("gpus, environ, share", [
    (4, {}, [0, 1, 2, 3]),
    (4, {"PYTEST_XDIST_WORKER": "gw0", "PYTEST_XDIST_WORKER_COUNT": "2"}, [0, 1]),
    (4, {"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "2"}, [2, 3]),
    (5, {"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "2"}, [2, 3]),
    (2, {"PYTEST_XDIST_WORKER": "gw2", "PYTEST_XDIST_WORKER_COUNT": "3"}, [0]),
    (0, {"PYTEST_XDIST_WORKER": "gw0", "PYTEST_XDIST_WORKER_COUNT": "2"}, []),
])
def test_gpus_are_split_between_xdist_workers(gpus, environ, share):
    assert placement.worker_share(gpus, environ) == share


def test_backend_choice(monkeypatch):
    # No GPU here: the GPU count is the only thing stood in for.
    monkeypatch.setattr(env, "visible_gpus", lambda: ["0", "1", "2", "3"])
    two_workers = {"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "2"}
    assert placement.place(2, None, {}) == placement.Placement("nccl", [0, 1])
    assert placement.place(2, None, two_workers) == placement.Placement("nccl", [2, 3])
    assert placement.place(3, None, two_workers) == placement.Placement("gloo", [None] * 3)
    assert placement.place(2, "gloo", {}) == placement.Placement("gloo", [None, None])
    with pytest.raises(placement.Unservable, match=r"needs 3 CUDA GPUs, this machine has 4 \(2 for xdist worker gw1\)"):
        placement.place(3, "nccl", two_workers)


def test_cpu_machine_cannot_serve_nccl():
    if env.visible_gpus():
        pytest.skip("this machine has GPUs")
    assert placement.place(2, None).backend == "gloo"
    with pytest.raises(placement.Unservable, match="backend nccl needs 2 CUDA GPUs, this machine has 0"):
        placement.place(2, "nccl")


def _phase(when, outcome="passed", longrepr=""):
    """A rank's report record, as pytest serializes a report."""
    return {"kind": "report", "$report_type": "TestReport", "nodeid": "test_x.py::test", "location": ["test_x.py", 0,
            "test"], "keywords": {}, "when": when, "outcome": outcome, "longrepr": longrepr or None, "sections": [],
            "user_properties": [], "duration": 0.0}


def _run(rank, records, exit_status=None, tmp_path=None):
    spec = RankSpec(rank, 2, "gloo", "store", "result", "stacks", "release", 30.0)
    return RankRun(spec, 100 + rank, str(tmp_path / f"out{rank}"), records, exit_status)


def test_a_peer_failing_in_setup_after_a_rank_died_in_call_fails_the_call(request, tmp_path):
    """Rank 1 finished joining the group, ran ahead and exited in its call while rank 0 was still connecting (its
    setup then fails): the item failed in call because rank 1 died, not with a setup error (seen under load)."""
    died = _run(1, [_phase("setup")], exit_status=3, tmp_path=tmp_path)
    consequence = _run(0, [_phase("setup", "failed", "E   RuntimeError: Connection closed by peer")], tmp_path=tmp_path)
    reports = report.build(request.node, [consequence, died], timeout=30.0, duration=1.0)
    outcomes = {r.when: r.outcome for r in reports}
    assert outcomes == {"setup": "passed", "call": "failed", "teardown": "passed"}
    text = next(r for r in reports if r.when == "call").longreprtext
    assert "rank 1 of 2 died: exit code 3" in text and "rank 0: failed in setup after a peer died" in text


def test_without_a_death_the_earliest_failure_decides_the_phase(request, tmp_path):
    setup_error = _run(0, [_phase("setup", "failed", "E   fixture broke")], tmp_path=tmp_path)
    call_failure = _run(1, [_phase("setup"), _phase("call", "failed", "E   assert 0")], tmp_path=tmp_path)
    reports = report.build(request.node, [setup_error, call_failure], timeout=30.0, duration=1.0)
    assert {r.when: r.outcome for r in reports}["setup"] == "failed"
