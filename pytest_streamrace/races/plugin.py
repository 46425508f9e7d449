"""``--streamrace``: every test runs under a race detector and fails when two of its streams race.

The detector is active from the test's setup to the end of its teardown, so fixtures may create streams too (on
CPU-only machines the virtual torch.cuda API is there for them). Races are judged with the call phase; ones that only
appear in teardown fail the teardown. A phase's failing races are raised as ``StreamRaceError`` from that phase, so
pytest's own outcome handling applies: ``xfail`` (strict or not, ``raises=``) and ``skip`` treat a race as any other
failure. Each report carries its races as records (``record``) in ``user_properties``, which is how they travel from
xdist workers and rank processes to the process that writes ``--streamrace-json`` and ``--streamrace-trace``. Which
races fail a test is the ``policy``'s call (suppressions, a baseline, report-only), made here in every process that
runs tests; the process that writes the files (``roles``) also prints the tally.
"""

from __future__ import annotations

import os
import sys

import pytest

from .. import StreamRaceError, checks, env, options, roles
from .record import AFTER, OUTCOME, RACES, TRACE

EXPECT = ("race", "clean")
MARKER = ("streamrace(expect='race'|'clean'): assert that the test's streams race (or not) when --streamrace "
          "is on; expect='race' turns a detected race into a pass and its absence into a failure")

_test_key = pytest.StashKey["_Test"]()  # the test's detector and judging state, from its setup to its teardown report
_child_notes_key = pytest.StashKey()  # [(rank, note)]: what the detectors of those processes could not model
_notes_key = pytest.StashKey[list]()  # the detector's notes, kept once the detector is let go (teardown's report)


class _Test:
    """One test's detector and what its judging has read so far: one object on the item, from the test's setup to its
    teardown report, where it is let go (kept by every item to the suite's end, it would keep every session alive)."""

    __slots__ = ("detector", "judged", "children", "statuses", "latent_judged", "latent_statuses", "pending",
                 "outcome")

    def __init__(self, detector):
        self.detector = detector
        self.judged = 0  # the detector's races judged so far
        self.children = 0  # races of the processes the test started, judged so far (latent ones aside)
        self.statuses: list = []  # policy status of each race judged so far, in detector order
        self.latent_judged = 0  # the detector's latent races judged so far
        self.latent_statuses: list = []  # their statuses, in detector order
        self.pending: tuple = ([], None)  # (user_properties, section text) of the phase judged in its own hook
        self.outcome: str | None = None  # the test body's own outcome, for --streamrace-confirm

    def own_outcome(self) -> str:
        """The test body's own outcome ("passed" where its call phase did not say otherwise)."""
        return "passed" if self.outcome is None else self.outcome


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
    """What the item's ``streamrace`` marker expects (None: no marker, or a bad one, which fails its setup)."""
    try:
        return check_marker(item.get_closest_marker("streamrace"))
    except checks.BadInput:
        return None


def _bad_marker(item: pytest.Item) -> bool:
    try:
        check_marker(item.get_closest_marker("streamrace"))
    except checks.BadInput:
        return True
    return False


def check_marker(mark) -> str | None:
    """The ``streamrace(expect=...)`` marker's value (None without a marker); ``checks.BadInput`` for bad
    arguments."""
    if mark is None:
        return None
    what = "@pytest.mark.streamrace"
    if len(mark.args) > 1 or (mark.args and "expect" in mark.kwargs):
        raise checks.BadInput(f"{what} takes one argument (expect), got {len(mark.args) + len(mark.kwargs)}")
    unknown = sorted(set(mark.kwargs) - {"expect"})
    if unknown:
        raise checks.BadInput(f"{what}: unknown argument {unknown[0]!r} (expected expect='race' or 'clean')")
    if not mark.args and "expect" not in mark.kwargs:
        raise checks.BadInput(f"{what}: expect is required: streamrace(expect='race') or streamrace(expect='clean')")
    expect = mark.kwargs.get("expect", mark.args[0] if mark.args else None)
    if expect not in EXPECT:
        raise checks.BadInput(f"{what}: expect must be 'race' or 'clean', got {expect!r}")
    return expect


def detector_notes(item: pytest.Item) -> list[tuple[int | None, str]]:
    """(rank, note) for what the test's detector, and those of the processes it started, could not model and
    skipped (once each)."""
    test = item.stash.get(_test_key, None)
    notes = test.detector.notes if test is not None else item.stash.get(_notes_key, [])
    own = [(process_rank(), note) for note in notes]
    return own + list(item.stash.get(_child_notes_key, ()))


def process_rank() -> int | None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return None


class RaceChecks:
    """Runs each test under a Detector; judges its races; collects them for the session's files."""

    def __init__(self, config: pytest.Config, backend: str, children):
        """`children`: the collector of the races of processes each test starts (``children.parent.Children``, issue
        12), handed in by the entry point so this package does not depend on the part that follows children."""
        self.config = config
        self.backend = backend
        self.role = roles.of(config)
        self.json_path = options.get(config, "streamrace_json")
        self.trace_path = options.get(config, "streamrace_trace")
        self.races: list[tuple[str, dict]] = []  # (nodeid, record)
        self.traces: list[tuple[str, list]] = []  # (nodeid, events)
        self.policy = self.tally = None  # at session start (`--help` configures, and starts no session)
        self.children = children
        self.after: list[dict] = []  # children's races judged after their test had finished
        self.unwritten: list[str] = []  # warning lines: session files that could not be written
        # --streamrace-confirm: this session re-runs tests with races (confirmer), or is such a re-run (rerun)
        self.confirmer = self.rerun = None
        self.resident = None  # the patches kept installed from one test's detector to the next (session start)
        instruction = os.environ.get(env.CONFIRM)
        if instruction:
            from .confirm_run import ConfirmRun

            self.rerun = ConfirmRun(checks.confirm_run(instruction))
            self.json_path = self.trace_path = None  # the session being confirmed writes its files
        elif options.get(config, "streamrace_confirm") and self.role.kind != roles.RANK_CHILD:
            from .confirm import Confirmer  # (a distributed item's ranks are re-run by the launching parent)

            self.confirmer = Confirmer(config, self.role.kind == roles.TORCHRUN_RANK)

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        if self.children.problem:
            return [f"streamrace: children started by exec are not followed: {self.children.problem}"]
        return []

    # running

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        from . import policy, tally

        try:
            self.policy = policy.load(self.config)  # checked at the command line already (exit 4 there)
        except policy.BadInput as exc:
            raise pytest.UsageError(f"streamrace: {exc}") from None
        self.tally = tally.Tally(self.policy)
        self.children.latent, self.children.incidental = self.policy.latent != "off", self.policy.incidental
        # build (or load) the C++ extensions once, before any test's clock starts: the op capture and the
        # happens-before core (both backends), the GPU trace's interpreter (cuda); and import the modules a
        # session builds from (the first test's start would, a tenth of a second on its clock)
        from ..detector import capture
        from ..detector.session import Resident, prepare

        capture.load()
        if self.backend == "cuda":
            capture.load_trace()
        prepare(self.backend)
        self.resident = Resident()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtestloop(self, session: pytest.Session):
        try:
            return (yield)
        finally:
            self._close_resident()  # torch as it was, for what runs after the last test

    def _close_resident(self) -> None:
        if self.resident is not None:
            self.resident.close()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem) -> bool | None:
        if self.rerun is not None and self.rerun.mode == "passes":
            self.rerun.run_passes(item)  # a plain test's confirmation: its passes, none logged
            return True
        return None

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item):
        if _bad_marker(item):  # its setup fails with one line (``plugin.marker_problem``): nothing to check
            return (yield)
        self.children.begin(item.nodeid)
        from ..detector.session import Detector

        detector = Detector(backend=self.backend, trace=bool(self.trace_path), latent=self.policy.latent != "off",
                            incidental=self.policy.incidental, resident=self.resident)
        detector.__enter__()
        item.stash[_test_key] = _Test(detector)
        if self.rerun is not None:
            self.rerun.start(detector, self.policy.incidental)
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        try:
            result = yield
        except BaseException as exc:
            test = item.stash.get(_test_key, None)
            if test is not None:
                test.outcome = _own_outcome(exc)
                self._judge_in_phase(item, test, "call", failed=True)  # the test's own failure (or skip) stands
            raise
        test = item.stash.get(_test_key, None)
        if test is not None:
            test.outcome = "passed"
            self._judge_in_phase(item, test, "call", failed=False)
        return result

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem):
        try:
            result = yield
        except BaseException:
            test = item.stash.get(_test_key, None)
            if test is not None:
                test.detector.__exit__(None, None, None)
                self._judge_in_phase(item, test, "teardown", failed=True)
            raise
        test = item.stash.get(_test_key, None)
        if test is not None:
            test.detector.__exit__(None, None, None)
            self._judge_in_phase(item, test, "teardown", failed=False)
        return result

    def _judge_in_phase(self, item: pytest.Item, test: _Test, when: str, failed: bool) -> None:
        """Judge the phase's races before its report exists: raised as a StreamRaceError when the phase itself
        passed, kept as a report section when it failed on its own."""
        props, text = self._judge(item, test, when)
        test.pending = (props, text if failed else None)
        if failed:
            return
        if text is not None:
            raise StreamRaceError(text)
        if when == "call" and not (test.judged or test.children) and expected(item) == "race":
            raise StreamRaceError("streamrace: expected a stream race (marker streamrace(expect='race')), "
                                  "but none was detected")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call):
        report = yield
        test = item.stash.get(_test_key, None)
        if test is None or (report.when == "setup" and report.passed):
            return report
        detector = test.detector
        if report.when == "setup":  # setup failed or skipped: no call phase will judge what it saw
            props, text = self._judge(item, test, "setup")
        else:
            props, text = test.pending
            test.pending = ([], None)
        # Recorded on the item, so the teardown report — the one collected, here and in a launching parent —
        # carries every phase's; the teardown report itself is already built, so it gets its own directly.
        (report.user_properties if report.when == "teardown" else item.user_properties).extend(props)
        if report.when == "teardown" and self.rerun is not None:
            found = [r for key, value in item.user_properties + report.user_properties if key == RACES for r in value]
            self.rerun.finish(detector, found, test.own_outcome())
        if report.when == "teardown" and test.outcome is not None and self.role.kind == roles.RANK_CHILD:
            report.user_properties.append((OUTCOME, test.outcome))  # for the parent's confirmations
        if report.when == "teardown":
            # Let the session go (its core, tracker and models; held by the item, a suite's sessions would all stay
            # alive to its end, and every collection of the oldest objects would walk them): its notes stay.
            notes = detector.notes
            if notes:  # (read by the hints' report hook, which runs after this one)
                item.stash[_notes_key] = notes
            del item.stash[_test_key]  # with what only the test's own judging read
            self.children.end()
            after, self.children.after[:] = list(self.children.after), []
            if after:  # shipped on a report, so an xdist controller or launching parent sees them too
                report.user_properties.append((AFTER, after))
        if call.excinfo is not None and isinstance(call.excinfo.value, StreamRaceError) and report.failed:
            report.longrepr = str(call.excinfo.value)  # the races' text, not a traceback through this plugin
        elif text is not None and report.failed:
            report.sections.append(("stream races", text))
        if report.when == "call" and self.confirmer is not None:
            self._confirm(item, test, props, report)
        return report

    def _confirm(self, item: pytest.Item, test: _Test, props: list, report: pytest.TestReport) -> None:
        """--streamrace-confirm: the call phase's races, each forced in a re-run; their lines join the report."""
        found = [r for key, value in props if key == RACES for r in value]
        if not found:
            return
        from .confirm import attach

        attach(report, self.confirmer.confirm(item, found, test.own_outcome(), self.backend))

    def _judge(self, item: pytest.Item, test: _Test, when: str) -> tuple[list, str | None]:
        """The phase's fresh races and those of the processes the test started, classified by the policy: the
        user_properties to record, and the failure text of those that fail the test (None: none do)."""
        detector = test.detector
        races = detector.races
        fresh = races[test.judged:]
        test.judged = len(races)
        children, child_traces = self.children.collect(item.nodeid)
        if children:
            test.children += len([c for c in children if not c.get("latent")])
        if self.children.notes:
            item.stash[_child_notes_key] = list(self.children.notes)
        statuses = test.statuses
        latent = detector.latent_races
        fresh_latent, test.latent_judged = latent[test.latent_judged:], len(latent)
        props: list = []
        failing = []
        failing_children = []
        found = bool(fresh or children or fresh_latent)
        # what only races need, asked only where there are some (or a trace to write)
        rank = process_rank() if found or self.trace_path else None
        race_expected = found and expected(item) == "race"
        if found:
            from .record import from_race

            records = [from_race(r, detector.stream_name, rank) for r in fresh]
            latent_records = [from_race(r, detector.stream_name, rank) for r in fresh_latent]
            for race, data in zip(fresh_latent, latent_records):  # a kind of their own: never "expected"
                status = self.policy.classify(item.nodeid, data, False)
                test.latent_statuses.append(status)
                if self.policy.fails(status, latent=True):
                    failing.append(race)
            for race, data in zip(fresh, records):
                status = self.policy.classify(item.nodeid, data, race_expected)
                statuses.append(status)
                if self.policy.fails(status):
                    failing.append(race)
            for data in children:  # races in processes the test started
                child_latent = bool(data.get("latent"))
                if self.policy.fails(self.policy.classify(item.nodeid, data, race_expected and not child_latent),
                                     child_latent):
                    failing_children.append(data)
            props.append((RACES, records + latent_records + children))
        if self.trace_path:
            from .trace import child_trace

            props += [(TRACE, child_trace(pid, events)) for pid, events in child_traces]
        if when == "teardown" and self.trace_path:
            from .trace import trace_events

            events = trace_events(detector.timeline, races + latent, detector.stream_name, rank,
                                  statuses + test.latent_statuses, _confirmations(item))
            props.append((TRACE, events))
        quiet = len(fresh) - len([r for r in failing if not r.latent]) + len(children) - len(failing_children)
        if race_expected or not (failing or failing_children):
            return props, None
        return props, self._failure_text(detector, failing, rank, quiet, failing_children)

    @staticmethod
    def _failure_text(detector, fresh: list, rank: int | None, quiet: int, children: list[dict]) -> str:
        """`fresh`: this phase's races that fail the test; `children`: records of processes the test started
        that fail it; `quiet`: how many others it had (suppressed, in the baseline, report-only)."""
        from . import record

        text = record.format_races([(rank, r) for r in fresh], detector.stream_name) if fresh else ""
        if children:
            text = "\n\n".join(t for t in (text, record.format_children(children)) if t)
        if quiet:
            text += (f"\n\n(and {quiet} more race{'s' if quiet > 1 else ''} that fail nothing: suppressed, in the "
                     "baseline — see the streamrace summary)")
        return text

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
        if self.role.writes_session_files:
            # The end of the records' journey: junit XML (which writes every user property) gets their count.
            report.user_properties[:] = [(k, v) for k, v in report.user_properties if k != RACES]
            report.user_properties.append((RACES, found))

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self._close_resident()  # a session that ended before its test loop (or without one)
        self.children.collect(None)  # what children wrote after the last test: all "after their test"
        self.after += self.children.after
        self.children.close()
        if not self.role.writes_session_files:
            return  # the xdist controller / the launching parent / torchrun rank 0 writes them
        if self.json_path:
            from .record import write_document

            records = ([{"test": nodeid, **race} for nodeid, race in self.races] +
                       [dict(race, after_test=True) for race in self.after])
            self._write("--streamrace-json", self.json_path, lambda: write_document(self.json_path, records))
        if self.trace_path:
            from .trace import write_trace

            events = _one_process_per_test(self.traces + self.children.after_traces)
            self._write("--streamrace-trace", self.trace_path, lambda: write_trace(self.trace_path, events))
        if self.policy.update:
            self._write("--streamrace-baseline", self.policy.baseline_path, self.tally.write_baseline)

    def _write(self, option: str, path: str, write) -> None:
        """Write a session file; one that cannot be written at the end (a full disk, a folder removed during the
        run) is one warning line, and pytest's report and exit status stay as they are."""
        try:
            write()
        except OSError as exc:
            line = f"streamrace: WARNING: could not write {option} {path}: {exc.strerror or exc}"
            if self.config.pluginmanager.get_plugin("terminalreporter") is None:
                sys.stderr.write(line + "\n")
            else:
                self.unwritten.append(line)

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.tally is None or not self.role.writes_session_files:
            return
        if os.environ.get("GITHUB_ACTIONS") == "true":
            for line in self.tally.annotations():
                terminalreporter.write_line(line)
        terminalreporter.section("streamrace")
        for line in self.tally.summary():
            terminalreporter.line(line)
        for line in self.unwritten:
            terminalreporter.line(line, yellow=True)
        if self.after:
            from .record import format_after

            terminalreporter.write_sep("=", "streamrace: races in processes after their test had finished")
            terminalreporter.write_line(format_after(self.after))


def _confirmations(item: pytest.Item) -> dict:
    """The test's races' --streamrace-confirm verdicts by race identity (``hb.Race.key``), for the trace."""
    from .confirmation import describe
    from .record import key

    out = {}
    for name, value in item.user_properties:
        for race in value if name == RACES else ():
            if "confirmation" in race:
                status, _, details = describe(race, race["confirmation"]).split(": ", 2)  # less the race itself
                out[key(race)] = f"{status}: {details}"
    return out


def _own_outcome(exc: BaseException) -> str:
    """What the test body did on its own (a race's StreamRaceError is raised after this): for confirmations."""
    from .confirm_run import outcome_of

    if isinstance(exc, pytest.skip.Exception):
        return "skipped"

    class _Info:
        value = exc

    return outcome_of(_Info)


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
