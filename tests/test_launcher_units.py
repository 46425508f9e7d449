"""The launcher's pure decisions: marker arguments, backend choice, GPU split between xdist workers."""

from __future__ import annotations

import pytest

from pytest_streamrace import hardware
from pytest_streamrace.launcher import marker, placement


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
    monkeypatch.setattr(hardware, "visible_gpus", lambda: ["0", "1", "2", "3"])
    two_workers = {"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "2"}
    assert placement.place(2, None, {}) == placement.Placement("nccl", [0, 1])
    assert placement.place(2, None, two_workers) == placement.Placement("nccl", [2, 3])
    assert placement.place(3, None, two_workers) == placement.Placement("gloo", [None] * 3)
    assert placement.place(2, "gloo", {}) == placement.Placement("gloo", [None, None])
    with pytest.raises(placement.Unservable, match=r"needs 3 CUDA GPUs, this machine has 4 \(2 for xdist worker gw1\)"):
        placement.place(3, "nccl", two_workers)


def test_cpu_machine_cannot_serve_nccl():
    if hardware.visible_gpus():
        pytest.skip("this machine has GPUs")
    assert placement.place(2, None).backend == "gloo"
    with pytest.raises(placement.Unservable, match="backend nccl needs 2 CUDA GPUs, this machine has 0"):
        placement.place(2, "nccl")
