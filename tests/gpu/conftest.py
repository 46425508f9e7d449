"""GPU validation plumbing for tests/gpu: the `gpu` and `gpu(count=N)` skip, the `validates(N, ...)` rows of
docs/validation.md, and the results file that scripts/render_validation.py turns into that page's table.

An item marked `gpu` is skipped, with one reason, where CUDA is missing or fewer GPUs are visible than it asks. Every
item marked `validates` is recorded (its rows and their claims, outcome, duration, the numbers it attached through the
`gpu_result` fixture), and a session that selected `-m gpu`, `--validates` or `--gpu-results` writes the records with
the machine's facts to `--gpu-results` (default `$OUT/gpu-results.json` where OUT is set, else `gpu-results.json`).
A row's claim lives beside its tests, in the module's `CLAIMS = {row: claim}`, so the page cannot drift from them.
Records travel in the reports' user_properties, so they reach the controlling process under xdist too; with
`-n K --gpus-per-worker N` each worker sees N GPUs of its own, so a host with K*N GPUs runs K lanes of items at once.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re

import pytest

_ROWS = "streamrace_validates"
_NUMBER = "streamrace_gpu_number"


def pytest_addoption(parser):
    group = parser.getgroup("gpu validation (tests/gpu)")
    group.addoption("--gpu-results", metavar="PATH", default=None,
                    help="write the validation results here (default: $OUT/gpu-results.json, else gpu-results.json)")
    group.addoption("--validates", metavar="N", type=int, action="append", default=[],
                    help="run only the items that re-create validation row N (repeatable)")
    group.addoption("--gpu-repeat", metavar="N", type=int, default=3,
                    help="runs per variant for the rows that repeat a run (repros, forcing; default 3)")
    group.addoption("--framework-sites", metavar="DIR", default="/tmp/streamrace-sites",
                    help="where scripts/device/setup.sh installed the carried framework wheels, one folder a version")
    group.addoption("--deepspeed-tests", metavar="DIR", default=".gpu/ds-tests/tests",
                    help="DeepSpeed's own tests folder (from its repository), for the held-out rows")
    group.addoption("--gpus-per-worker", metavar="N", type=int, default=None,
                    help="with -n K (xdist): each worker sees N GPUs of its own (CUDA_VISIBLE_DEVICES), so a host "
                         "with K*N GPUs runs K lanes at once")


def _option(config, name, default=None):
    return config.getoption(name, default=default)  # None where this conftest loaded after the options were parsed


def pytest_configure(config):
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:  # an xdist worker's reports reach the controller, which writes
        _check_lanes(config)
        config.pluginmanager.register(_Recorder(config), "streamrace-gpu-results")
    elif _option(config, "gpus_per_worker"):
        _pin_lane(_option(config, "gpus_per_worker"), int(str(workerinput["workerid"]).removeprefix("gw")))


def _host_gpus() -> list[str]:
    """The GPUs the lanes divide: CUDA_VISIBLE_DEVICES's, else every one the driver lists (no CUDA context made)."""
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is not None:
        return [entry.strip() for entry in mask.split(",") if entry.strip()]
    try:
        return [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        return []


def _check_lanes(config) -> None:
    per, workers = _option(config, "gpus_per_worker"), getattr(config.option, "numprocesses", None)
    if not per:
        return
    if per < 1 or not isinstance(workers, int) or workers < 1:
        raise pytest.UsageError("--gpus-per-worker N needs N >= 1 and -n K (pytest-xdist workers)")
    have = len(_host_gpus())
    if per * workers > have:
        raise pytest.UsageError(f"--gpus-per-worker {per} with -n {workers} needs {per * workers} GPUs, "
                                f"this host has {have}")


def _pin_lane(per: int, index: int) -> None:
    """This worker's GPUs, set before anything in it makes a CUDA context (and before any thread reads the
    environment)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(_host_gpus()[index * per:(index + 1) * per])


def _wants_results(config) -> bool:
    return bool(_option(config, "gpu_results") or _option(config, "validates")
                or re.search(r"\bgpu\b", config.getoption("markexpr", default="") or ""))


def pytest_collection_modifyitems(config, items):
    rows = set(_option(config, "validates") or [])
    if not rows:
        return
    keep, drop = [], []
    for item in items:
        mark = item.get_closest_marker("validates")
        (keep if mark and rows & set(mark.args) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _visible_gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_itemcollected(item):
    """The item's rows ride on its reports from here on, whoever skips it (a skipif mark runs before our setup)."""
    mark = item.get_closest_marker("validates")
    if mark is not None:
        claims = getattr(getattr(item, "module", None), "CLAIMS", {}) or {}
        gpu = item.get_closest_marker("gpu")
        item.user_properties.append((_ROWS, {
            "rows": list(mark.args),
            "claims": {str(row): claims[row] for row in mark.args if row in claims},
            "gpus": (gpu.kwargs.get("count", 1) if gpu else 0),
        }))


def pytest_runtest_setup(item):
    gpu = item.get_closest_marker("gpu")
    if gpu is not None:
        wanted = gpu.kwargs.get("count", 1)
        have = _visible_gpus()
        if have < wanted:
            pytest.skip(f"needs {wanted} CUDA GPU{'s' if wanted > 1 else ''}, this host has {have}")


class GpuResult:
    """What a validation item measured: `record(key, value)` with a JSON value; the results file keeps it."""

    def __init__(self, item):
        self._item = item

    def record(self, key: str, value) -> None:
        json.dumps(value)  # fail here, in the item, rather than when the file is written
        self._item.user_properties.append((_NUMBER, [key, value]))


@pytest.fixture
def gpu_result(request) -> GpuResult:
    return GpuResult(request.node)


@pytest.fixture
def gpu_repeat(request) -> int:
    """Runs per variant for a row that repeats a run (`--gpu-repeat`)."""
    return _option(request.config, "gpu_repeat", 3)


def _reason(report) -> str:
    """One line for the table: an assertion's message where it is one line, its comparison where the message is longer
    (often a session's output), else the exception's first line."""
    crash = getattr(report.longrepr, "reprcrash", None)
    lines = (crash.message if crash is not None else str(report.longrepr)).strip().splitlines() or [""]
    compared = [i for i, line in enumerate(lines) if line.startswith("assert ")]
    if not lines[0].startswith("AssertionError") or not compared:
        return lines[0]
    said = lines[0].removeprefix("AssertionError").removeprefix(":").strip()
    return said if said and compared[0] == 1 else lines[compared[-1]]


class _Recorder:
    """Collects the validation items' reports in the process that writes the file (the xdist controller, or the
    only process)."""

    def __init__(self, config):
        self.config = config
        self.records: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report):
        props = dict((k, v) for k, v in report.user_properties if k == _ROWS)
        if _ROWS not in props:
            return
        record = self.records.setdefault(report.nodeid, {
            "nodeid": report.nodeid, **props[_ROWS], "outcome": "unfinished", "reason": "the session ended before "
            "its test did", "duration_s": 0.0, "numbers": {}})
        record["duration_s"] = round(record["duration_s"] + report.duration, 3)
        for key, value in report.user_properties:
            if key == _NUMBER:
                record["numbers"][value[0]] = value[1]
        if report.failed:
            record["outcome"] = "failed"
            record["reason"] = _reason(report)[:300]
        elif report.when == "call" and report.passed and record["outcome"] == "unfinished":
            record["outcome"], record["reason"] = "passed", ""
        elif report.skipped and record["outcome"] != "failed":
            record["outcome"] = "skipped"
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            record["reason"] = reason.removeprefix("Skipped: ")

    def pytest_sessionfinish(self, session):
        if not self.records or not _wants_results(self.config):
            return
        path = results_path(self.config)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        data = {"machine": machine(self.config), "command": " ".join(["pytest", *self.config.invocation_params.args]),
                "items": sorted(self.records.values(), key=lambda r: (min(r["rows"]), r["nodeid"]))}
        with open(path, "w", encoding="utf-8") as out:
            json.dump(data, out, indent=1)
        rows = sorted({r for rec in self.records.values() for r in rec["rows"]})
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line(f"gpu validation: {len(self.records)} items of rows {rows} written to {path}")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine(config) -> dict:
    """The host's facts for the table: GPUs, torch/CUDA/Triton/Python and framework versions (installed, and carried
    under --framework-sites), date (UTC)."""
    facts = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
             "python": platform.python_version(), "pytest": pytest.__version__}
    try:
        import torch

        facts["torch"] = torch.__version__
        facts["cuda"] = torch.version.cuda
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        facts["gpu_count"] = count
        facts["gpu_name"] = torch.cuda.get_device_name(0) if count else None
    except ImportError:
        facts["torch"] = None
    for dist in ("triton", "deepspeed", "megatron-core"):
        version = _version(dist)
        if version:
            facts[dist] = version
    sites = _option(config, "framework_sites") or ""
    if os.path.isdir(sites):
        facts["framework_sites"] = sorted(name for name in os.listdir(sites) if name != "common")
    return facts


def results_path(config) -> str:
    chosen = _option(config, "gpu_results")
    if chosen:
        return chosen
    return os.path.join(os.environ["OUT"], "gpu-results.json") if os.environ.get("OUT") else "gpu-results.json"
