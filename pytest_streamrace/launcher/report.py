"""Turning what N ranks did into the item's setup/call/teardown reports.

The failure is laid out for a person: one headline saying what happened to which rank, then one block per rank —
its own traceback, how it died with the tail of its output, or the stack it was blocked in when it was stopped. When
a rank died, the others' failures are usually consequences ("connection closed" from gloo): they are shown after it,
shortened, and marked as such. A failing rank's traceback is its own report's, deserialized (pytest's structured
longrepr, in the session's ``--tb`` style); ``str()`` of the whole is its text, which is what xdist ships.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import pytest
from _pytest._code.code import ReprFileLocation  # the public API offers no crash location type
from _pytest._io import TerminalWriter  # nor a way to render a longrepr to a string

from .ranks import describe_exit, tail
from .supervise import RankRun

PHASES = ("setup", "call", "teardown")
OUTPUT_TAIL = 30  # lines of a dead rank's output shown
FATAL_LINES = 120  # lines of a fatal signal's dump shown, from its start


@dataclass
class RankVerdict:
    rank: int
    kind: str  # passed | failed | error | skipped | xfailed | died | stopped
    when: str  # the phase it concerns
    text: str = ""  # traceback, death cause, stack
    skip: tuple | None = None  # (path, lineno, reason)
    wasxfail: str | None = None
    longrepr: object = None  # a failure's structured longrepr, as the rank's pytest made it


class ItemFailure:
    """The item's failure: text lines, and each failing rank's own longrepr rendered as pytest renders it."""

    def __init__(self, blocks: list, reprcrash: ReprFileLocation):
        self.blocks = blocks  # str (lines) or an object with toterminal
        self.reprcrash = reprcrash

    def toterminal(self, tw) -> None:
        for block in self.blocks:
            if hasattr(block, "toterminal"):
                block.toterminal(tw)
            else:
                tw.line(block)

    def __str__(self) -> str:
        out = io.StringIO()
        tw = TerminalWriter(out)
        tw.hasmarkup = False
        self.toterminal(tw)
        return out.getvalue()


def judge(run: RankRun, config: pytest.Config) -> RankVerdict:
    """What happened to one rank, most important first: a real failure beats being stopped or dying later."""
    reports = {r["when"]: r for r in run.records if r["kind"] == "report"}
    errors = [r["message"] for r in run.records if r["kind"] == "error"]
    in_progress = next((w for w in PHASES if w not in reports), "teardown")
    for when in PHASES:
        r = reports.get(when)
        if r and r["outcome"] == "failed":
            rank_report = _rank_report(config, r)
            return RankVerdict(run.rank, "failed", when, rank_report.longreprtext, longrepr=rank_report.longrepr)
    if errors:
        return RankVerdict(run.rank, "error", "setup", "\n".join(errors))
    for when in ("setup", "call"):
        r = reports.get(when)
        if r and r["outcome"] == "skipped":
            if "wasxfail" in r:
                return RankVerdict(run.rank, "xfailed", when, wasxfail=r["wasxfail"])
            return RankVerdict(run.rank, "skipped", when, skip=tuple(r["longrepr"]))
    if run.stopped:
        return RankVerdict(run.rank, "stopped", in_progress, _clean_stack(run.stack))
    if not run.done:
        output = _read(run.output)
        fatal = _fatal_dump(output)
        text = f"its stacks when it died:\n{fatal}" if fatal else \
            f"last lines of its output:\n{tail(_clean_stack(output), OUTPUT_TAIL)}" if output.strip() else \
            "it printed nothing outside the test's captured output"
        return RankVerdict(run.rank, "died", in_progress, f"{describe_exit(run.exit_status)}; {text}")
    if "teardown" not in reports:
        return RankVerdict(run.rank, "error", "setup", "its pytest session ended without running the test")
    call = reports.get("call", {})
    return RankVerdict(run.rank, "passed", "call", wasxfail=call.get("wasxfail"))


def build(item: pytest.Item, runs: list[RankRun], timeout: float, duration: float) -> list[pytest.TestReport]:
    verdicts = [judge(r, item.config) for r in runs]
    by_kind: dict[str, list[RankVerdict]] = {}
    for v in verdicts:
        by_kind.setdefault(v.kind, []).append(v)
    n = len(runs)
    sections = _sections(runs)
    props = _user_properties(runs)

    if any(k in by_kind for k in ("failed", "error", "died")) or _timed_out(runs) or \
            ("skipped" in by_kind and len(by_kind["skipped"]) < n and "xfailed" not in by_kind):
        # A rank that died is the cause: its peers' failures after it (a setup still connecting to the dead rank)
        # are consequences and do not move the item's failure to an earlier phase.
        culprits = [v for v in verdicts if v.kind == "died"] or \
            [v for v in verdicts if v.kind not in ("passed", "stopped")]
        when = min((v.when for v in culprits), key=PHASES.index, default="call")
        return _reports(item, when, "failed", _failure(item, verdicts, runs, timeout), sections, duration, props)
    if "skipped" in by_kind:  # on every rank
        skips = by_kind["skipped"]
        when = "setup" if all(v.when == "setup" for v in skips) else "call"
        reasons = {v.skip[2] for v in skips}
        path, lineno, reason = skips[0].skip
        if len(reasons) > 1:
            reason = "; ".join(f"rank {v.rank}: {v.skip[2]}" for v in skips)
        return _reports(item, when, "skipped", (path, lineno, reason), sections, duration, props)
    if "xfailed" in by_kind:
        return _reports(item, "call", "skipped", None, sections, duration, props,
                        wasxfail=by_kind["xfailed"][0].wasxfail)
    xpass = [v.wasxfail for v in verdicts if v.wasxfail is not None]
    extra = {"wasxfail": xpass[0]} if len(xpass) == n else {}
    return _reports(item, "call", "passed", None, sections, duration, props, **extra)


def setup_outcome(item: pytest.Item, outcome: str, longrepr) -> list[pytest.TestReport]:
    """Reports for an item decided before any rank started (bad marker, machine cannot serve it)."""
    return _reports(item, "setup", outcome, longrepr, {w: [] for w in PHASES}, 0.0)


def _timed_out(runs: list[RankRun]) -> bool:
    return any(r.stopped == "timeout" for r in runs)


def _failure(item: pytest.Item, verdicts: list[RankVerdict], runs: list[RankRun], timeout: float) -> ItemFailure:
    lines = _failure_lines(verdicts, runs, timeout)
    blocks, text = [], []
    for line in lines:
        if isinstance(line, str):
            text.append(line)
        else:
            blocks += ["\n".join(text)] if text else []
            blocks.append(line)
            text = []
    blocks.append("\n".join(text).rstrip())
    first = next((v for v in verdicts if getattr(v.longrepr, "reprcrash", None) is not None), None)
    if first is not None:
        crash = first.longrepr.reprcrash
        return ItemFailure(blocks, ReprFileLocation(crash.path, crash.lineno, f"rank {first.rank}: {crash.message}"))
    return ItemFailure(blocks, ReprFileLocation(str(item.path), item.location[1] + 1, lines[0]))


def _failure_lines(verdicts: list[RankVerdict], runs: list[RankRun], timeout: float) -> list:
    """The failure's lines; a failing rank's traceback is its longrepr object where it has one."""
    n = len(verdicts)
    died = [v for v in verdicts if v.kind == "died"]
    of = f" of {n}"
    parts = []
    groups = {k: [v.rank for v in verdicts if v.kind == k] for k in ("failed", "error", "skipped", "stopped")}
    if died:
        parts += [f"rank {v.rank}{of} died: {v.text.split(';')[0]}" for v in died]
        if groups["failed"]:
            parts.append(f"then {_ranks(groups['failed'])} failed")
    elif groups["failed"]:
        parts.append(f"failed on {_ranks(groups['failed'])}{of}")
    if groups["error"]:
        parts.append(f"could not run on {_ranks(groups['error'])}{of}")
    if groups["skipped"] and len(groups["skipped"]) < n:
        parts.append(f"skipped on {_ranks(groups['skipped'])}{of} only")
    if _timed_out(runs):
        parts.append(f"timed out after {timeout:g} s with {_ranks(groups['stopped'])} still running")
    elif groups["stopped"]:
        parts.append(f"({_ranks(groups['stopped'])} stopped while blocked)")
    headline = "; ".join(p for p in parts if not p.startswith("("))
    headline += "".join(" " + p for p in parts if p.startswith("("))
    lines = ["distributed test " + headline, ""]

    def block(v: RankVerdict) -> None:
        if v.kind == "failed":
            if died:
                lines.append(f"---- rank {v.rank}: failed in {v.when} after a peer died "
                             "(probably a consequence; the error lines) ----")
                lines.extend([ln for ln in v.text.splitlines() if ln.startswith("E ")][:8] or
                             v.text.splitlines()[-3:])
            else:
                lines.append(f"---- rank {v.rank}: failed in {v.when} ----")
                lines.append(v.longrepr if hasattr(v.longrepr, "toterminal") else v.text)
        elif v.kind == "died":
            cause, _, rest = v.text.partition("; ")
            lines.append(f"---- rank {v.rank} died: {cause} (during {v.when}) ----")
            lines.append(rest)
        elif v.kind == "error":
            lines.append(f"---- rank {v.rank}: could not run the test ----")
            lines.append(v.text)
        elif v.kind == "skipped":
            reason = v.skip[2].removeprefix("Skipped: ")
            lines.append(f"---- rank {v.rank}: skipped in {v.when}: {reason} ({v.skip[0]}:{v.skip[1]}) ----")
        elif v.kind == "stopped":
            how = "still running at the timeout" if _timed_out(runs) else "stopped while blocked"
            lines.append(f"---- rank {v.rank}: {how} (during {v.when}); its Python stack then ----")
            lines.append(v.text or "(no stack: the rank had not started Python code yet)")
        else:
            return
        lines.append("")

    order = ("died", "error", "failed", "skipped", "stopped") if died else ("failed", "error", "died", "skipped",
                                                                            "stopped")
    for kind in order:
        for v in verdicts:
            if v.kind == kind:
                block(v)
    return lines


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _sections(runs: list[RankRun]) -> dict[str, list[tuple[str, str]]]:
    """Each phase's captured output of every rank, titles labelled "(rank N)"."""
    out: dict[str, list[tuple[str, str]]] = {w: [] for w in PHASES}
    for run in runs:
        for r in run.records:
            if r["kind"] == "report":
                out[r["when"]] += [(f"{title} (rank {run.rank})", text) for title, text in r["sections"]]
    return out


def _user_properties(runs: list[RankRun]) -> list[tuple[str, object]]:
    """What the ranks recorded (`record_property`, plugins), rank 0's first, names unchanged so that plugins
    reading their own keys in the parent find them; each rank's list is its last report's, which holds them all."""
    props = []
    for run in runs:
        reports = [r for r in run.records if r["kind"] == "report"]
        if reports:
            props += [(name, value) for name, value in reports[-1]["user_properties"]]
    return props


def _reports(item, when, outcome, longrepr, sections, duration, props=(), **extra) -> list[pytest.TestReport]:
    """setup/call/teardown reports with `outcome` at phase `when` (earlier phases passed)."""
    keywords = {k: 1 for k in item.keywords}
    reports = []
    for phase in PHASES:
        if phase == "teardown":
            rep_outcome, rep_longrepr, rep_extra = ("passed", None, {}) if when != "teardown" else \
                (outcome, longrepr, extra)
        elif PHASES.index(phase) < PHASES.index(when):
            rep_outcome, rep_longrepr, rep_extra = "passed", None, {}
        elif phase == when:
            rep_outcome, rep_longrepr, rep_extra = outcome, longrepr, extra
        else:
            continue  # no call phase after a setup that did not pass
        # output of phases that have no report of their own goes with this one
        secs = list(sections[phase])
        if phase == when and when == "setup":
            secs += sections["call"]
        reports.append(pytest.TestReport(item.nodeid, item.location, keywords, rep_outcome, rep_longrepr, phase,
                                         sections=secs, duration=duration if phase == "call" else 0.0,
                                         user_properties=[*item.user_properties,
                                                          *(props if phase == "teardown" else ())],
                                         **rep_extra))
    return reports


def _rank_report(config: pytest.Config, record: dict) -> pytest.TestReport:
    data = {k: v for k, v in record.items() if k != "kind"}
    return config.hook.pytest_report_from_serializable(config=config, data=data)


def _clean_stack(stack: str) -> str:
    """Drop pytest's, pluggy's and the launcher's own frames: what is left is the test's code and torch's."""
    noise = ("/_pytest/", "/pluggy/", "/pytest_streamrace/launcher/", "forkserver.py", "<frozen runpy>",
             "/pytest/__main__.py")
    kept = [ln for ln in stack.splitlines() if not (ln.lstrip().startswith("File ") and any(s in ln for s in noise))]
    return "\n".join(kept).strip()


NATIVE_STACK = "streamrace: native stack of the thread that got signal"


def _fatal_dump(output: str) -> str:
    """faulthandler's dump of a fatal signal, from its first line: every thread's stack, the crashing one marked
    "Current thread" wherever it falls (innermost frames first, so a tail would keep the outermost ones and, of a
    native thread's crash, only other threads' stacks), after the crashing thread's native frames where the capture
    wrote them (a fatal signal under the detector). Without the list of extension modules; "" if none."""
    start = output.rfind("Fatal Python error:")
    native = output.rfind(NATIVE_STACK, 0, start if start >= 0 else len(output))
    if native >= 0:  # the crashing thread's native frames (detector/fatal_signals.cpp), written just before
        start = native
    if start < 0:
        return ""
    kept = [ln for ln in _clean_stack(output[start:]).splitlines() if not ln.startswith("Extension modules:")]
    if len(kept) > FATAL_LINES:
        kept = kept[:FATAL_LINES] + [f"... ({len(kept) - FATAL_LINES} more lines)"]
    return "\n".join(kept).strip()


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""
