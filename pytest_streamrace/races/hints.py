"""Stream hints under ``--streamrace``: warnings that point at a cross-stream bug class, reported as findings.

torch >= 2.10 warns "The AccumulateGrad node's stream does not match the stream of the node that produced the
incoming gradient" when a parameter's AccumulateGrad node — and so every gradient hook on it — runs on another
stream than the backward that feeds it. That is exactly the setup of the hook-stream races (Megatron's DDP built on a
side stream, Megatron-LM #3670; ZeRO's hooks under torch.compile, DeepSpeed #8061), and it costs nothing to notice. The
virtual backend's autograd model raises the same warning on CPU (``detector.models.virtual_autograd``). A hint is not a
failure: it says where to look; the detector's races say what is wrong.

Each test runs inside one ``warnings.catch_warnings`` (inside pytest's own, which spans the test's whole run
protocol too); a phase's report takes the hints among the warnings caught so far, and every warning caught is re-issued
after the test, so pytest's own warning summary and the user's filters are unchanged (an ignored warning is still a
hint). torch issues its warning once per process, so while a test runs ``torch.set_warn_always(True)`` is on: every
test that triggers it gets its hint — and torch's other once-per-process warnings show in every test that triggers
them, too.
"""

from __future__ import annotations

import re
import sys
import warnings

import pytest

from .. import roles
from .plugin import detector_notes, process_rank
from .record import HINTS

SECTION = "streamrace hints"
_PATTERN = r"The AccumulateGrad node's stream does not match"
NOT_MODELLED = "not-modelled"  # something the detector skipped (an op it could not model): said, never raised
ADVICE = ("An AccumulateGrad node on another stream than the backward that feeds it runs its gradient hooks there: "
          "whatever they write (gradient buckets, main_grad) needs a wait before another stream reads it.")
_hints_key = pytest.StashKey[list]()
_caught_key = pytest.StashKey[list]()  # [the test's warnings caught so far, how many of them were looked at]


def hint_from(warning: warnings.WarningMessage, rank: int | None) -> dict | None:
    """The hint a caught warning gives, or None."""
    text = str(warning.message)
    if not re.match(_PATTERN, text):
        return None
    detail = re.search(r"\[streamrace virtual model: (.*)\]", text)
    return {"kind": "accumulate-grad-stream-mismatch", "rank": rank,
            "source": "streamrace virtual model" if detail else "torch",
            "detail": detail.group(1) if detail else "",
            "where": f"{warning.filename}:{warning.lineno}"}


def advice(hints) -> list[str]:
    """The advice lines for the kinds of hints given."""
    kinds = {hint["kind"] for hint in hints}
    out = [ADVICE] if kinds - {NOT_MODELLED} else []
    if NOT_MODELLED in kinds:
        out.append("Ops the detector could not model are skipped, not failed: races through them go unseen.")
    return out


def note_hint(note: str, rank: int | None) -> dict:
    return {"kind": NOT_MODELLED, "rank": rank, "source": "streamrace", "detail": note, "where": ""}


def describe(hint: dict, ranks: list | None = None) -> str:
    """One line per hint; `ranks`: the ranks that reported it (default: the hint's own)."""
    ranks = ranks if ranks is not None else [hint["rank"]] if hint.get("rank") is not None else []
    on = f", rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else ""
    what = hint["detail"] or "AccumulateGrad node on another stream than its gradient's producer"
    return f"{what} ({hint['source']} {'note' if hint['kind'] == NOT_MODELLED else 'warning'}{on})"


def merged(hints: list[tuple[str, dict]]) -> list[tuple[str, str]]:
    """(nodeid, line) per distinct hint of each test, the ranks that reported it merged into the line."""
    ranks: dict[tuple, list] = {}
    first: dict[tuple, dict] = {}
    for nodeid, hint in hints:
        key = (nodeid, hint["kind"], hint["source"], hint["detail"])
        first.setdefault(key, hint)
        if hint.get("rank") is not None and hint["rank"] not in ranks.setdefault(key, []):
            ranks[key].append(hint["rank"])
    return [(key[0], describe(hint, sorted(ranks.get(key, [])))) for key, hint in first.items()]


class StreamHints:
    """Captures hint warnings per test phase and reports them: a report section, the teardown report's
    user_properties (how they travel from xdist workers and rank processes), a terminal summary."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.seen: list[tuple[str, dict]] = []  # (nodeid, hint), where the summary is written

    @pytest.hookimpl(wrapper=True)  # inside pytest's own capture (tryfirst), which sees what is re-issued
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem):
        torch = sys.modules.get("torch")  # not imported yet: no torch warning can fire
        warn_always = torch.is_warn_always_enabled() if torch is not None else None
        try:
            if torch is not None:
                torch.set_warn_always(True)  # torch's once-per-process warnings, once per test
            with warnings.catch_warnings(record=True) as caught:
                warnings.filterwarnings("always", message=_PATTERN)
                item.stash[_caught_key] = [caught, 0]
                return (yield)
        finally:
            if torch is not None:
                torch.set_warn_always(warn_always)
            if _caught_key in item.stash:
                del item.stash[_caught_key]
            # outside the capture: pytest and the user's filters see every warning as if we were not here
            for w in caught:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)

    @staticmethod
    def _hints_caught(item: pytest.Item, found: list) -> None:
        """The hints among the warnings caught since the last look, added to `found`."""
        state = item.stash.get(_caught_key, None)
        if state is None:
            return
        caught, seen = state
        for w in caught[seen:]:
            hint = hint_from(w, process_rank())
            if hint is not None and hint not in found:
                found.append(hint)
        state[1] = len(caught)

    @pytest.hookimpl(wrapper=True, tryfirst=True)  # outermost: after the race checks read the children's notes
    def pytest_runtest_makereport(self, item: pytest.Item, call):
        report = yield
        found = item.stash.setdefault(_hints_key, [])
        self._hints_caught(item, found)
        for rank, note in detector_notes(item):
            hint = note_hint(note, rank)
            if hint not in found:
                found.append(hint)
        if found and report.when == "call":
            report.sections.append((SECTION, "\n".join([*(line for _, line in merged([("", h) for h in found])),
                                                         *advice(found)])))
        if report.when == "teardown":
            if found:
                report.user_properties.append((HINTS, list(found)))
            del item.stash[_hints_key]  # the report has them
        return report

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "teardown":
            return
        for key, value in report.user_properties:
            if key == HINTS:
                self.seen.extend((report.nodeid, hint) for hint in value)

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.seen or not roles.of(self.config).writes_session_files:
            return
        terminalreporter.section(SECTION)
        for nodeid, line in merged(self.seen):
            terminalreporter.line(f"{nodeid}: {line}")
        for line in advice(hint for _, hint in self.seen):
            terminalreporter.line(line)

