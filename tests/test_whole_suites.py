"""Whole suites with the plugin installed: many files, any order, every fixture scope — nothing breaks.

A `distributed` item runs in rank processes; the session's own process still holds the module, class and session
fixtures its plain neighbours set up, and must tear them down as pytest's runner would. Each test here runs one real
multi-file suite (pytester subprocesses) and a reference session of the same files with the plugin off, where each
distributed item is a plain test in its place, and compares what every test reported and the order in which the
session's process tore its fixtures down. A distributed item's own fixtures are its ranks' (they are not compared),
so the suite's class fixtures are asked for by plain tests only: an autouse one would also be set up, in the
reference, by the plain test standing in for a distributed item.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from test_torchrun import torchrun

CONFTEST = '''
import json, os, random
import pytest

EVENTS = os.environ["SUITE_EVENTS"]


def _in_session_process():
    return os.environ.get("RANK") is None  # a rank's copy of a fixture is its own


def record(event):
    if _in_session_process():
        with open(EVENTS, "a") as f:
            f.write(json.dumps(["event", os.environ.get("PYTEST_XDIST_WORKER", "main"), event]) + "\\n")


def pytest_configure(config):
    config.addinivalue_line("markers", "distributed(world_size): runs on ranks (a plain test without the plugin)")


def pytest_runtest_logreport(report):
    if _in_session_process() and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(EVENTS, "a") as f:
            f.write(json.dumps(["report", report.nodeid, report.when, report.outcome]) + "\\n")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """With SUITE_SEED, a shuffled order that keeps each module's tests together (as pytest-randomly does)."""
    seed = os.environ.get("SUITE_SEED")
    if not seed:
        return
    rng = random.Random(int(seed))
    modules = {}
    for item in items:
        modules.setdefault(item.path, []).append(item)
    groups = list(modules.values())
    rng.shuffle(groups)
    for group in groups:
        rng.shuffle(group)
    items[:] = [item for group in groups for item in group]


@pytest.fixture(scope="session", autouse=True)
def session_fixture():
    record("setup session")
    yield
    record("teardown session")
'''

RANK_WORK = '''
import pytest, torch, torch.distributed as dist
from conftest import record


def rank_work():
    """A distributed item's body; without the plugin (the reference session) it runs as a plain test."""
    if dist.is_initialized():
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t[0] == dist.get_world_size()
'''

FILES = {
    # distributed first, in the middle and last of a module; parametrization, xfail, skip
    "test_m1": RANK_WORK + '''

@pytest.fixture(scope="module", autouse=True)
def m1_module():
    record("setup m1")
    yield
    record("teardown m1")


@pytest.mark.distributed(world_size=2)
def test_dist_first():
    rank_work()


def test_plain():
    pass


@pytest.mark.parametrize("n", [1, 2])
def test_param(n):
    assert n > 0


@pytest.mark.distributed(world_size=2)
def test_dist_middle():
    rank_work()


@pytest.mark.xfail(reason="known", strict=True)
def test_xfail():
    assert False


@pytest.mark.skip(reason="not here")
def test_skip():
    pass


@pytest.mark.distributed(world_size=2)
def test_dist_last():
    rank_work()
''',
    # distributed last and first of classes with class fixtures; a failing test beside a distributed one
    "test_m2": RANK_WORK + '''

@pytest.fixture(scope="module")
def m2_module():
    record("setup m2")
    yield
    record("teardown m2")


@pytest.fixture(scope="class")
def m2_class_a():
    record("setup m2.TestLastInClass")
    yield
    record("teardown m2.TestLastInClass")


@pytest.fixture(scope="class")
def m2_class_b():
    record("setup m2.TestFirstInClass")
    yield
    record("teardown m2.TestFirstInClass")


class TestLastInClass:
    def test_plain(self, m2_class_a, m2_module):
        pass

    @pytest.mark.distributed(world_size=2)
    def test_dist(self):
        rank_work()


class TestFirstInClass:
    @pytest.mark.distributed(world_size=2)
    def test_dist(self):
        rank_work()

    def test_plain(self, m2_class_b, m2_module):
        pass


@pytest.mark.skipif(True, reason="never")
def test_skipif():
    pass


def test_fails(m2_module):
    assert 1 == 2


@pytest.mark.distributed(world_size=2)
def test_dist_after_failure():
    rank_work()
''',
    # setup and teardown errors; the module's teardown error falls on its last item, a distributed one
    "test_m3": RANK_WORK + '''

@pytest.fixture(scope="module")
def m3_breaks_in_teardown():
    record("setup m3")
    yield
    record("teardown m3")
    raise RuntimeError("module teardown failed")


@pytest.fixture
def breaks_in_setup():
    raise RuntimeError("setup failed")


def test_module_fixture(m3_breaks_in_teardown):
    pass


def test_setup_error(breaks_in_setup):
    pass


@pytest.mark.distributed(world_size=2)
def test_dist_last():
    rank_work()
''',
    # a module of one distributed item, and plain modules after the others
    "test_m4": RANK_WORK + '''

@pytest.mark.distributed(world_size=2)
def test_dist_alone():
    rank_work()
''',
    "test_m5": '''
import pytest
from conftest import record


@pytest.fixture(scope="module", autouse=True)
def m5_module():
    record("setup m5")
    yield
    record("teardown m5")


def test_first():
    pass


def test_second():
    pass
''',
    "test_m6": '''
def test_only():
    pass
''',
}


def _suite(pytester: pytest.Pytester) -> list[str]:
    pytester.makeconftest(CONFTEST)
    for name, text in FILES.items():
        pytester.makepyfile(**{name: text})
    return [f"{name}.py" for name in FILES]


def _session(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tag: str, args: list[str], seed: int | None,
             plugin: bool) -> dict:
    """One session's reports ({nodeid: {phase: outcome}}) and the session process's fixture teardowns, by
    process (an xdist worker's, or the session's), in order."""
    events = pytester.path / f"events-{tag}.jsonl"
    monkeypatch.setenv("SUITE_EVENTS", str(events))
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "RANK"):  # this test's own xdist worker's
        monkeypatch.delenv(name, raising=False)
    if seed is None:
        monkeypatch.delenv("SUITE_SEED", raising=False)
    else:
        monkeypatch.setenv("SUITE_SEED", str(seed))
    files = _suite(pytester)
    if seed is not None:
        random.Random(seed).shuffle(files)
    result = pytester.runpytest_subprocess(*files, "-p", "no:cacheprovider", "-p", "no:randomly",
                                           *([] if plugin else ["-p", "no:streamrace"]), *args)
    assert "previous item was not torn down properly" not in result.stdout.str(), result.stdout.str()
    assert result.ret in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED), result.stdout.str()
    reports: dict[str, dict[str, str]] = {}
    teardowns: dict[str, list[str]] = {}
    for line in events.read_text().splitlines():
        kind, *rest = json.loads(line)
        if kind == "report":
            nodeid, when, outcome = rest
            assert when not in reports.setdefault(nodeid, {}), f"{nodeid} reported its {when} twice"
            reports[nodeid][when] = outcome
        elif rest[1].startswith("teardown"):
            teardowns.setdefault(rest[0], []).append(rest[1])
    return {"reports": reports, "teardowns": teardowns, "stdout": result.stdout.str()}


def _same_as_reference(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, args: list[str],
                       seed: int | None = None, by_module: bool = False) -> dict:
    """Run the suite with the plugin (and `args`), then without it: every report and teardown order the same.
    `by_module`: compare each module's teardowns apart (xdist sends modules to workers as it likes)."""
    ours = _session(pytester, monkeypatch, "plugin", args, seed, plugin=True)
    ref_args = [a for a in args if not a.startswith("--streamrace")]
    reference = _session(pytester, monkeypatch, "reference", ref_args, seed, plugin=False)
    assert ours["reports"] == reference["reports"], (ours["stdout"], reference["stdout"])
    if by_module:
        def modules(teardowns):
            out: dict[str, list[str]] = {}
            for events in teardowns.values():
                assert events[-1] == "teardown session", events  # a process's session fixture goes last
                for event in events[:-1]:
                    out.setdefault(event.split()[1].split(".")[0], []).append(event)
            return out

        assert modules(ours["teardowns"]) == modules(reference["teardowns"])
        assert len(ours["teardowns"]) >= 1
    else:
        assert ours["teardowns"] == reference["teardowns"], (ours["stdout"], reference["stdout"])
    return ours


def test_suite_plain(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    ours = _same_as_reference(pytester, monkeypatch, [])
    reports = ours["reports"]
    # the suite says what it means to: the distributed items ran, and the planted failures are where they were put
    assert reports["test_m1.py::test_dist_last"] == {"setup": "passed", "call": "passed", "teardown": "passed"}
    assert reports["test_m2.py::test_fails"]["call"] == "failed"
    assert reports["test_m3.py::test_setup_error"]["setup"] == "failed"
    assert reports["test_m3.py::test_dist_last"]["teardown"] == "failed"  # m3's module fixture, torn down there
    assert "RuntimeError: module teardown failed" in ours["stdout"]
    assert ours["teardowns"]["main"] == ["teardown m1", "teardown m2.TestLastInClass", "teardown m2.TestFirstInClass",
                                         "teardown m2", "teardown m3", "teardown m5", "teardown session"]


def test_suite_under_streamrace(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    ours = _same_as_reference(pytester, monkeypatch, ["--streamrace"])
    assert "0 races found" in ours["stdout"]


@pytest.mark.parametrize("seed", [3, 11])
def test_suite_shuffled(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    _same_as_reference(pytester, monkeypatch, ["--streamrace"], seed=seed)


def test_suite_stops_at_first_failure(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    ours = _same_as_reference(pytester, monkeypatch, ["-x"])
    assert "test_m2.py::test_fails" in ours["reports"]
    assert not any(nodeid.startswith(("test_m3", "test_m4", "test_m5", "test_m6")) for nodeid in ours["reports"])


@pytest.mark.parametrize("workers,dist", [(2, "loadfile"), (2, "load"), (4, "load")])
def test_suite_under_xdist(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, workers: int, dist: str) -> None:
    """With whole files per worker, each module's teardowns are compared in order. With tests dealt one by one, a
    module's fixtures may live on several workers and end with whichever of its tests a worker runs last, which the
    dealing decides: each test's setup and call outcomes are compared, and the module fixture's teardown error is
    reported once, on a test of its module."""
    args = ["-n", str(workers), "--dist", dist]
    if dist == "loadfile":
        _same_as_reference(pytester, monkeypatch, args, seed=5, by_module=True)
        return
    ours = _session(pytester, monkeypatch, "plugin", args, 5, plugin=True)
    reference = _session(pytester, monkeypatch, "reference", args, 5, plugin=False)

    def before_teardown(reports):
        return {test: {when: outcome for when, outcome in phases.items() if when != "teardown"}
                for test, phases in reports.items()}

    def teardown_errors(reports):
        return sorted(test.split("::")[0] for test, phases in reports.items() if phases.get("teardown") == "failed")

    assert before_teardown(ours["reports"]) == before_teardown(reference["reports"]), (ours["stdout"],
                                                                                        reference["stdout"])
    assert teardown_errors(ours["reports"]) == teardown_errors(reference["reports"]) == ["test_m3.py"]


TWO_FILES = {
    "test_a": '''
import pytest, torch, torch.distributed as dist

def test_plain():
    pass

@pytest.mark.distributed(world_size=2)
def test_dist(rank):
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t[0] == 2
''',
    "test_b": '''
def test_b():
    pass
''',
}


@pytest.mark.parametrize("mode", [[], ["--streamrace"], ["-n", "2"]], ids=["plain", "streamrace", "xdist"])
def test_module_ending_in_a_distributed_item(pytester: pytest.Pytester, mode: list[str]) -> None:
    pytester.makepyfile(**TWO_FILES)
    result = pytester.runpytest_subprocess("test_a.py", "test_b.py", "-p", "no:cacheprovider", *mode)
    result.assert_outcomes(passed=3)


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun sessions are tested on Linux")
def test_module_ending_in_a_distributed_item_under_torchrun(tmp_path: Path) -> None:
    for name, text in TWO_FILES.items():
        (tmp_path / f"{name}.py").write_text(text)
    result = torchrun(tmp_path, "test_a.py", "test_b.py", "-q")
    assert result.returncode == 0, result.stdout
    assert "3 passed" in result.stdout, result.stdout
    assert "error" not in result.stdout.split("short test summary")[-1].lower(), result.stdout
