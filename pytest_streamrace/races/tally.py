"""The printing process's view of the session's races: the tally, the terminal summary, GitHub annotations.

The printing process is the one that writes the session's files (``roles.Role.writes_session_files``: the plain
session, the xdist controller, the launching parent, torchrun rank 0). Records arrive there with the status each
process's ``policy`` gave them; ``Tally`` counts them: per-rule counts, stale rules, baseline races, gone ones, new
ones, the closing line, GitHub Actions annotations, the junit ``streamrace_races`` property, and the rewritten
baseline.
"""

from __future__ import annotations

import os

import pytest

from . import record
from .policy import BASELINE, EXPECTED, NEW, SUPPRESSED, Policy, describe_signature, shown_path, signature, \
    write_baseline

_RANK_ORDER = (NEW, BASELINE, SUPPRESSED, EXPECTED)  # the status a race seen on several ranks gets: the first


class Tally:
    """The printing process's view of the session's races (xdist controller, launching parent, torchrun rank 0)."""

    def __init__(self, policy: Policy, unit: str = "test", failing: str = "failing their tests"):
        self.policy = policy
        self.unit = unit  # what was checked: pytest's tests, or the program streamrace run ran
        self.failing = failing  # what a failing race does to it
        self.checked: list[str] = []
        self.skipped: set[str] = set()
        self.races: dict[tuple, dict] = {}  # (nodeid, record.key) -> {"race", "ranks", "status", "sig"}
        self.written: int | None = None

    def add(self, report: pytest.TestReport, races: list[dict]) -> int:
        """One report's races (any phase; the teardown report closes the test). Returns how many distinct races
        this report adds for its test."""
        if report.skipped and report.when != "teardown" and not hasattr(report, "wasxfail"):
            self.skipped.add(report.nodeid)  # never ran (an xfail ran, and was checked)
        if report.when == "teardown" and report.nodeid not in self.skipped:
            self.checked.append(report.nodeid)
        return self.add_races(report.nodeid, races)

    def add_races(self, nodeid: str, races: list[dict]) -> int:
        """Records of `nodeid` (a test, or the program under ``streamrace run``), merged across ranks. Returns how
        many distinct races they add for it."""
        before = len(self.races)
        for race in races:
            key = (nodeid, record.key(race))
            status = race.get("status", NEW)
            entry = self.races.setdefault(key, {"race": race, "ranks": [], "status": status,
                                                "sig": signature(nodeid, race)})
            if _RANK_ORDER.index(status) < _RANK_ORDER.index(entry["status"]):
                entry.update(race=race, status=status)
            if race.get("rank") is not None and race["rank"] not in entry["ranks"]:
                entry["ranks"].append(race["rank"])
        return len(self.races) - before

    def of(self, status: str, latent: bool = False) -> list[tuple[str, dict]]:
        """The races (or the latent races) of a status."""
        return [(nodeid, e) for (nodeid, _), e in self.races.items()
                if e["status"] == status and bool(e["race"].get("latent")) == latent]

    def counts(self, latent: bool = False) -> dict[str, int]:
        return {s: len(self.of(s, latent)) for s in _RANK_ORDER}

    def gone(self) -> list[tuple]:
        if self.policy.baseline is None:
            return []
        checked = set(self.checked)
        seen = {e["sig"] for e in self.races.values() if e["status"] in (NEW, BASELINE)}
        return sorted(sig for sig in self.policy.baseline if sig[0] in checked and sig not in seen)

    # the baseline file

    def write_baseline(self) -> None:
        policy = self.policy
        checked = set(self.checked)
        kept = {sig for sig in policy.baseline or () if sig[0] not in checked}
        found = {e["sig"] for e in self.races.values() if e["status"] in (NEW, BASELINE)}
        write_baseline(policy.baseline_path, kept | found)
        self.written = len(kept | found)

    # the terminal

    def summary(self) -> list[str]:
        lv = self.policy
        lines: list[str] = []
        per_rule = {}
        for _, e in self.of(SUPPRESSED) + self.of(SUPPRESSED, latent=True):
            where = e["race"].get("suppressed_by", {}).get("rule")
            per_rule[where] = per_rule.get(where, 0) + 1
        used = [r for r in lv.rules if r.where in per_rule]
        if used:
            lines.append("suppressed (races per rule):")
            lines += [f"  {per_rule[r.where]:>4}  {r.where}  {r.text}" for r in used]
        stale = [r for r in lv.rules if r.where not in per_rule]
        if stale:
            lines.append("stale suppressions (matched nothing in this session):")
            lines += [f"  {r.where}  {r.text}" for r in stale]
        known = self.of(BASELINE) + self.of(BASELINE, latent=True)
        if known:
            lines.append("in the baseline (reported, not failing):")
            lines += [f"  {nodeid}: {record.short(e['race'])}{_on(e['ranks'])}" for nodeid, e in known]
        gone = self.gone()
        if gone:
            lines.append("gone from the baseline (fixed? rewrite it with --streamrace-baseline-update):")
            lines += [f"  {describe_signature(sig)}" for sig in gone]
        if self.of(NEW):
            quiet = "report-only, " if lv.report_only else "baseline update, " if lv.update else ""
            lines.append(f"new races ({quiet}{'not failing' if quiet else self.failing}):")
            lines += [f"  {nodeid}: {record.short(e['race'])}{_on(e['ranks'])}" for nodeid, e in self.of(NEW)]
        if self.of(NEW, latent=True):
            failing = lv.fails(NEW, latent=True)
            lines.append(f"latent races (ordered today only by a host sync the program did not ask for; "
                         f"{self.failing if failing else 'not failing'}):")
            lines += [f"  {nodeid}: {record.short(e['race'])}{_on(e['ranks'])}"
                      for nodeid, e in self.of(NEW, latent=True)]
        if self.written is not None:
            lines.append(f"baseline written: {shown_path(lv.baseline_path, lv.rootdir)} "
                         f"({self.written} race{'s' if self.written != 1 else ''})")
        confirmed = self.confirmations()
        if confirmed:
            from .confirmation import describe

            lines.append("confirmations (each race forced into its bad order in a re-run):")
            lines += [f"  {nodeid}: {describe(e['race'], e['race']['confirmation'], self.unit)}"
                      for (nodeid, _), e in self.races.items() if e["race"].get("confirmation")]
            lines.append(confirmed)
        lines.append(self.closing_line())
        return lines

    def confirmations(self) -> str | None:
        """--streamrace-confirm's line: how each distinct race came out, and the time the re-runs took."""
        counts: dict[str, int] = {}
        seconds: dict[str, float] = {}
        for (nodeid, _), entry in self.races.items():
            found = entry["race"].get("confirmation")
            if found:
                counts[found["status"]] = counts.get(found["status"], 0) + 1
                seconds[nodeid] = float(found.get("test_seconds", 0.0))
        if not counts:
            return None
        parts = ", ".join(f"{counts.get(s, 0)} {s.replace('-', ' ')}" for s in ("confirmed", "not-confirmed",
                                                                                   "not-tried"))
        return f"streamrace confirmations: {parts} (re-runs took {sum(seconds.values()):.1f} s)"

    def closing_line(self) -> str:
        c = self.counts()
        n = len(self.checked)
        races = sum(c.values())
        line = (f"streamrace: {n} {self.unit}{'s' if n != 1 else ''} checked, {races} race"
                f"{'s' if races != 1 else ''} found: {c[SUPPRESSED]} suppressed, {c[BASELINE]} in baseline, "
                f"{c[NEW]} new")
        if c[EXPECTED]:
            line += f", {c[EXPECTED]} expected"
        latent = self.counts(latent=True)
        if sum(latent.values()):
            line += (f"; {sum(latent.values())} latent: {latent[SUPPRESSED]} suppressed, {latent[BASELINE]} in "
                     f"baseline, {latent[NEW]} new")
        if self.policy.report_only:
            line += " (report-only)"
        return line

    def annotations(self) -> list[str]:
        """GitHub Actions workflow commands: an error per new race, a warning per race in the baseline and per new
        latent race (an error where ``--streamrace-latent=fail`` fails it)."""
        root = os.environ.get("GITHUB_WORKSPACE") or self.policy.rootdir
        out = []
        for status, command in ((NEW, "error"), (BASELINE, "warning")):
            for nodeid, e in self.of(status):
                out.append(annotation(command, nodeid, e["race"], e["ranks"], root, status))
        command = "error" if self.policy.fails(NEW, latent=True) else "warning"
        for nodeid, e in self.of(NEW, latent=True):
            out.append(annotation(command, nodeid, e["race"], e["ranks"], root, NEW))
        return out


def _on(ranks) -> str:
    return f" (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))})" if ranks else ""


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def annotation(command: str, nodeid: str, race: dict, ranks, root: str, status: str) -> str:
    later, earlier = race.get("later") or {}, race.get("earlier") or {}
    where = record.user_frame(later.get("frames") or [], root)
    props = f" file={_escape_property(where[0])},line={where[1]}," if where else " "
    title = f"streamrace: {record.kind_of(race)}" + (" (in the baseline)" if status == BASELINE else "")
    ef = (earlier.get("frames") or [{}])[0]
    before = f" ({os.path.basename(str(ef['file']))}:{ef['line']})" if ef else ""
    message = (f"{record.short(race, at=False)}: {later.get('op')} on {later.get('stream')} is not ordered after "
               f"{earlier.get('op')}{before} on {earlier.get('stream')}")
    latent = race.get("latent")
    if latent:
        message += (f" except through {latent.get('op')} at {latent.get('at')}, a host sync the program did not ask "
                    "for")
    message += f" [{nodeid}{_on(ranks)}]"
    return f"::{command}{props}title={_escape_property(title)}::{_escape_data(message)}"
