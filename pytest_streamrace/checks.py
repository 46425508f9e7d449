"""``--streamrace``: every test runs under a race detector and fails when two of its streams race.

The detector is active from the test's setup to the end of its teardown, so fixtures may create streams too (on
CPU-only machines the virtual torch.cuda API is there for them). Races are judged with the call phase; ones that only
appear in teardown fail the teardown. Each report carries its races as JSON in ``user_properties``, which is how they
travel from xdist workers and rank processes to the process that writes ``--streamrace-json`` and
``--streamrace-trace``. Which races fail a test is the adoption levers' call (``levers``: suppressions, a baseline,
report-only), made here in every process that runs tests; the process that writes the files also prints the tally.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from . import env, options

RACES = "streamrace_races"  # user_properties key: [race dicts] (detector.report.to_dict, with rank)
TRACE = "streamrace_trace"  # user_properties key: [chrome trace events] of this test's ops
AFTER = "streamrace_after"  # user_properties key: [race dicts with "test"] of children that outlived their test
EXPECT = ("race", "clean")
MARKER = ("streamrace(expect='race'|'clean'): assert that the test's streams race (or not) when --streamrace "
          "is on; expect='race' turns a detected race into a pass and its absence into a failure")

_detector_key = pytest.StashKey()
_judged_key = pytest.StashKey()
_children_key = pytest.StashKey()  # races of the processes the test started, judged so far
_child_notes_key = pytest.StashKey()  # [(rank, note)]: what the detectors of those processes could not model
_statuses_key = pytest.StashKey[list]()  # levers status of each race judged so far, in detector order


def resolve_backend(config: pytest.Config) -> str:
    """The backend --streamrace uses here: auto picks cuda when a GPU is visible."""
    chosen = options.get(config, "streamrace_backend")
    gpus = env.visible_gpus()
    if chosen == "auto":
        return "cuda" if gpus else "virtual"
    if chosen == "cuda" and not gpus:
        raise pytest.UsageError("--streamrace-backend=cuda needs a GPU, and none is visible; "
                                "use --streamrace-backend=virtual (or auto) on CPU-only machines")
    return chosen


def expected(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("streamrace")
    if marker is None:
        return None
    expect = marker.kwargs.get("expect", marker.args[0] if marker.args else None)
    if expect not in EXPECT:
        raise pytest.UsageError(f"{item.nodeid}: streamrace(expect=...) takes 'race' or 'clean', got {expect!r}")
    return expect


def detector_notes(item: pytest.Item) -> list[tuple[int | None, str]]:
    """(rank, note) for what the test's detector, and those of the processes it started, could not model and
    skipped (once each)."""
    detector = item.stash.get(_detector_key, None)
    tracker = getattr(detector, "tracker", None)
    own = [(process_rank(), note) for note in tracker.notes] if tracker is not None else []
    return own + list(item.stash.get(_child_notes_key, ()))


def process_rank() -> int | None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return None


class RaceChecks:
    """Runs each test under a Detector; judges its races; collects them for the session's files."""

    def __init__(self, config: pytest.Config, backend: str):
        self.config = config
        self.backend = backend
        self.json_path = options.get(config, "streamrace_json")
        self.trace_path = options.get(config, "streamrace_trace")
        self.races: list[tuple[str, dict]] = []  # (nodeid, race dict)
        self.traces: list[tuple[str, list]] = []  # (nodeid, events)
        self.levers = self.tally = None  # at session start (`--help` configures, and starts no session)
        from .children.parent import Children  # the processes each test starts (issue 12)

        self.children = Children(backend, bool(self.trace_path))
        self.after: list[dict] = []  # children's races judged after their test had finished

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        if self.children.problem:
            return [f"streamrace: children started by exec are not followed: {self.children.problem}"]
        return []

    # running

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        from . import levers

        try:
            self.levers = levers.load(self.config)  # checked at the command line already (exit 2 there)
        except levers.BadInput as exc:
            raise pytest.UsageError(f"streamrace: {exc}") from None
        self.tally = levers.Tally(self.levers)
        if self.backend == "cuda":  # build (or load) the op capture once, before any test's clock starts
            from .detector import capture

            capture.load()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item):
        expected(item)  # a bad marker is a usage error before anything runs
        self.children.begin(item.nodeid)
        from .detector.session import Detector

        detector = Detector(backend=self.backend, trace=bool(self.trace_path))
        detector.__enter__()
        item.stash[_detector_key] = detector
        item.stash[_judged_key] = 0
        item.stash[_statuses_key] = []
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem):
        try:
            return (yield)
        finally:
            detector = item.stash.get(_detector_key, None)
            if detector is not None:
                # races are read in makereport of teardown, which pytest calls after this hook returns
                detector.__exit__(None, None, None)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call):
        report = yield
        detector = item.stash.get(_detector_key, None)
        if detector is None or (report.when == "setup" and report.passed):
            return report
        races = detector.races
        judged = item.stash[_judged_key]
        fresh = races[judged:]
        item.stash[_judged_key] = len(races)
        rank = process_rank()
        children, child_traces = self.children.collect(item.nodeid)
        item.stash[_children_key] = item.stash.get(_children_key, 0) + len(children)
        item.stash[_child_notes_key] = list(self.children.notes)
        # Recorded on the item, so the teardown report — the one collected, here and in a launching parent —
        # carries every phase's; the teardown report itself is already built, so it gets its own directly.
        record = report.user_properties if report.when == "teardown" else item.user_properties
        statuses = item.stash[_statuses_key]
        failing = []
        failing_children = []
        if fresh or children:
            from .detector.report import to_dict

            dicts = [to_dict(r, detector.hb.stream_name, rank) for r in fresh]
            for race, data in zip(fresh, dicts):
                status = self.levers.classify(item.nodeid, data, expected(item) == "race")
                statuses.append(status)
                if self.levers.fails(status):
                    failing.append(race)
            for data in children:  # races in processes the test started (issue 12)
                if self.levers.fails(self.levers.classify(item.nodeid, data, expected(item) == "race")):
                    failing_children.append(data)
            record.append((RACES, dicts + children))
        if self.trace_path:
            from .children.parent import child_trace

            record += [(TRACE, child_trace(pid, events)) for pid, events in child_traces]
        if report.when == "teardown" and self.trace_path:
            from .detector.trace import trace_events

            events = trace_events(detector.hb.timeline, races, detector.hb.stream_name, rank, statuses)
            record.append((TRACE, events))
        if report.when == "teardown":
            self.children.end()
            after, self.children.after[:] = list(self.children.after), []
            if after:  # shipped on a report, so an xdist controller or launching parent sees them too
                report.user_properties.append((AFTER, after))
        quiet = len(fresh) - len(failing) + len(children) - len(failing_children)
        self._judge(item, report, failing, rank, quiet, failing_children)
        return report

    @staticmethod
    def _judge(item: pytest.Item, report: pytest.TestReport, fresh: list, rank: int | None, quiet: int = 0,
               children: list[dict] = ()) -> None:
        """`fresh`: this phase's races that fail the test; `children`: those of processes the test started (race
        dicts) that fail it; `quiet`: how many others it had (suppressed, in the baseline, report-only)."""
        expect = expected(item)
        if report.skipped:
            return
        if expect == "race":
            if report.when == "call" and report.passed and not (item.stash[_judged_key] or
                                                                item.stash.get(_children_key, 0)):
                report.outcome = "failed"
                report.longrepr = ("streamrace: expected a stream race (marker streamrace(expect='race')), "
                                   "but none was detected")
            return
        if not fresh and not children:
            return
        from .detector.report import format_races

        text = format_races([(rank, r) for r in fresh], item.stash[_detector_key].hb.stream_name) if fresh else ""
        if children:
            from .children.parent import format_children

            text = "\n\n".join(t for t in (text, format_children(children)) if t)
        if quiet:
            text += (f"\n\n(and {quiet} more race{'s' if quiet > 1 else ''} that fail nothing: suppressed, in the "
                     "baseline — see the streamrace summary)")
        if report.failed:
            report.sections.append(("stream races", text))
        else:
            report.outcome = "failed"
            report.longrepr = text

    # collecting, where the session's files are written

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "teardown":
            self.tally.add(report, [])
            return  # the teardown report carries every phase's records
        races = []
        for key, value in report.user_properties:
            if key == RACES:
                races += value
            elif key == TRACE:
                self.traces.append((report.nodeid, value))
            elif key == AFTER:
                self.after.extend(value)
        self.races.extend((report.nodeid, race) for race in races)
        found = self.tally.add(report, races)
        if writes_session_files(self.config):
            # The end of the records' journey: junit XML (which writes every user property) gets their count.
            report.user_properties[:] = [(k, v) for k, v in report.user_properties if k != RACES]
            report.user_properties.append((RACES, found))

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.children.collect(None)  # what children wrote after the last test: all "after their test"
        self.after += self.children.after
        self.children.close()
        if not writes_session_files(self.config):
            return  # the xdist controller / the launching parent / torchrun rank 0 writes them
        if self.json_path:
            from .detector.report import SCHEMA_VERSION

            doc = {"version": SCHEMA_VERSION, "races": [{"test": nodeid, **race} for nodeid, race in self.races]}
            doc["races"] += [dict(race, after_test=True) for race in self.after]
            with open(self.json_path, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=1)
                f.write("\n")
        if self.trace_path:
            from .detector.trace import write_trace

            write_trace(self.trace_path, _one_process_per_test(self.traces + self.children.after_traces))
        if self.levers.update:
            self.tally.write_baseline()

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.tally is None or not writes_session_files(self.config):
            return
        if os.environ.get("GITHUB_ACTIONS") == "true":
            for line in self.tally.annotations():
                terminalreporter.write_line(line)
        terminalreporter.section("streamrace")
        for line in self.tally.summary():
            terminalreporter.line(line)
        if self.after:
            from .children.parent import format_after

            terminalreporter.write_sep("=", "streamrace: races in processes after their test had finished")
            terminalreporter.write_line(format_after(self.after))


def races_in(reports) -> list[dict]:
    """The race dicts a test's reports carry (the teardown report has every phase's)."""
    return [race for r in reports if r.when == "teardown" for k, v in r.user_properties if k == RACES for race in v]


def add_races(reports, races: list[dict]) -> None:
    """Give the test's teardown report more races (another torchrun rank's, to rank 0)."""
    for r in reports:
        if r.when == "teardown" and races:
            r.user_properties.append((RACES, races))


def writes_session_files(config: pytest.Config) -> bool:
    from .launcher import child

    if hasattr(config, "workerinput") or child.spec_from_env() is not None:
        return False
    run = env.torchrun_env()
    return run is None or run.rank == 0


def _one_process_per_test(traces: list[tuple[str, list]]) -> list[list[dict]]:
    """Give each (test, rank) its own trace process, named after the test, so tests never share tracks."""
    out = []
    for index, (nodeid, events) in enumerate(traces):
        renamed = []
        for event in events:
            event = dict(event, pid=index * 1000 + event.get("pid", 0))
            if event.get("name") == "process_name":
                event["args"] = {"name": f"{nodeid} ({event['args']['name']})"}
            renamed.append(event)
        out.append(renamed)
    return out
