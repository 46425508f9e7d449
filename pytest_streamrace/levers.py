"""The adoption levers of ``--streamrace``: suppressions, a baseline, report-only mode — and the session's tally.

Judging (in every process that runs tests: the plain session, an xdist worker, a ``distributed`` item's rank
process, a torchrun rank) — ``Levers.classify`` gives each race dict a ``status``:

- ``expected``: the test is marked ``streamrace(expect='race')``;
- ``suppressed``: a ``--streamrace-suppress`` rule matched (``suppressed_by`` names it);
- ``baseline``: its signature is in ``--streamrace-baseline``;
- ``new``: anything else — the only races that fail a test, and not under ``--streamrace-report-only`` or
  ``--streamrace-baseline-update``.

Because each process judges its own races, a suppressed or baselined race fails no rank, so a ``distributed``
item's merged outcome and a torchrun session's collective one pass with it. The race dicts (status included) travel
to the process that prints, where ``Tally`` counts them: per-rule counts, stale rules, baseline races, gone ones,
new ones, the closing line, GitHub Actions annotations, the junit ``streamrace_races`` property, and the rewritten
baseline.
"""

from __future__ import annotations

import os

import pytest

from . import baseline as baseline_mod
from . import options, suppress
from .suppress import BadInput

NEW, SUPPRESSED, BASELINE, EXPECTED = "new", "suppressed", "baseline", "expected"
_RANK_ORDER = (NEW, BASELINE, SUPPRESSED, EXPECTED)  # the status a race seen on several ranks gets: the first
_levers_key = pytest.StashKey["Levers"]()


class Levers:
    def __init__(self, rules, baseline, baseline_path, report_only, update, rootdir):
        self.rules: list[suppress.Rule] = rules
        self.baseline: set | None = baseline
        self.baseline_path: str | None = baseline_path
        self.report_only: bool = report_only
        self.update: bool = update
        self.rootdir: str = rootdir

    def classify(self, nodeid: str, race: dict, expected: bool) -> str:
        """Set (and return) the race dict's status."""
        rule = None if expected else suppress.match(self.rules, race)
        if expected:
            status = EXPECTED
        elif rule is not None:
            status = SUPPRESSED
            race["suppressed_by"] = {"rule": rule.where, "text": rule.text}
        elif self.baseline is not None and baseline_mod.signature(nodeid, race) in self.baseline:
            status = BASELINE
        else:
            status = NEW
        race["status"] = status
        return status

    def fails(self, status: str) -> bool:
        return status == NEW and not (self.report_only or self.update)


def load(config: pytest.Config) -> Levers:
    """This session's levers, read once per process. Bad input raises BadInput (one line)."""
    levers = config.stash.get(_levers_key, None)
    if levers is not None:
        return levers
    rootdir = str(config.rootpath)
    rules = suppress.load(options.get(config, "streamrace_suppressions"), rootdir)
    path = options.get(config, "streamrace_baseline")
    update = options.get(config, "streamrace_baseline_update")
    if update and not path:
        raise BadInput("--streamrace-baseline-update needs --streamrace-baseline FILE (the file to write)")
    known = baseline_mod.load(path, rootdir, missing_ok=update) if path else None
    levers = config.stash[_levers_key] = Levers(rules, known, path, options.get(config, "streamrace_report_only"),
                                                update, rootdir)
    return levers


def validate(config: pytest.Config) -> int | None:
    """At the command line (before configuration): bad suppressions or baseline → one line on stderr, exit 2."""
    if not options.get(config, "streamrace") or getattr(config.option, "help", False) or \
            getattr(config.option, "version", False):
        return None
    try:
        load(config)
    except BadInput as exc:
        from . import env

        run = env.torchrun_env()
        if run is None or run.rank == 0:  # every torchrun rank stops; one says why
            import sys

            sys.stderr.write(f"ERROR: streamrace: {exc}\n")
            sys.stderr.flush()
        return 2
    return None


def race_key(race: dict) -> tuple:
    """Races are the same report when kind and both user locations are (as ``Race.key``): merges ranks."""
    def where(side):
        access = race.get(side) or {}
        frames = access.get("frames") or []
        return f"{frames[0]['file']}:{frames[0]['line']}" if frames else f"<unknown>:{access.get('op')}"

    return race.get("kind"), where("earlier"), where("later")


def short(race: dict, at: bool = True) -> str:
    """One line: kind, tensor, the later access's location."""
    from .detector.report import short_path

    name = (race.get("tensor") or {}).get("name")
    frames = (race.get("later") or {}).get("frames") or []
    where = f" at {short_path(frames[0]['file'])}:{frames[0]['line']}" if frames and at else ""
    return f"{race.get('kind')} on {'tensor ' + repr(name) if name else 'a tensor'}{where}"


class Tally:
    """The printing process's view of the session's races (xdist controller, launching parent, torchrun rank 0)."""

    def __init__(self, levers: Levers):
        self.levers = levers
        self.checked: list[str] = []
        self.skipped: set[str] = set()
        self.races: dict[tuple, dict] = {}  # (nodeid, race_key) -> {"race", "ranks", "status", "sig"}
        self.written: int | None = None

    def add(self, report: pytest.TestReport, races: list[dict]) -> int:
        """One report's races (any phase; the teardown report closes the test). Returns how many distinct races
        this report adds for its test."""
        if report.skipped and report.when != "teardown":
            self.skipped.add(report.nodeid)
        if report.when == "teardown" and report.nodeid not in self.skipped:
            self.checked.append(report.nodeid)
        before = len(self.races)
        for race in races:
            key = (report.nodeid, race_key(race))
            status = race.get("status", NEW)
            entry = self.races.setdefault(key, {"race": race, "ranks": [], "status": status,
                                                "sig": baseline_mod.signature(report.nodeid, race)})
            if _RANK_ORDER.index(status) < _RANK_ORDER.index(entry["status"]):
                entry.update(race=race, status=status)
            if race.get("rank") is not None and race["rank"] not in entry["ranks"]:
                entry["ranks"].append(race["rank"])
        return len(self.races) - before

    def of(self, status: str) -> list[tuple[str, dict]]:
        return [(nodeid, e) for (nodeid, _), e in self.races.items() if e["status"] == status]

    def counts(self) -> dict[str, int]:
        return {s: len(self.of(s)) for s in _RANK_ORDER}

    def gone(self) -> list[tuple]:
        if self.levers.baseline is None:
            return []
        checked = set(self.checked)
        seen = {e["sig"] for e in self.races.values() if e["status"] in (NEW, BASELINE)}
        return sorted(sig for sig in self.levers.baseline if sig[0] in checked and sig not in seen)

    # the baseline file

    def write_baseline(self) -> None:
        levers = self.levers
        checked = set(self.checked)
        kept = {sig for sig in levers.baseline or () if sig[0] not in checked}
        found = {e["sig"] for e in self.races.values() if e["status"] in (NEW, BASELINE)}
        baseline_mod.write(levers.baseline_path, kept | found)
        self.written = len(kept | found)

    # the terminal

    def summary(self) -> list[str]:
        lv = self.levers
        lines: list[str] = []
        per_rule = {}
        for _, e in self.of(SUPPRESSED):
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
        if self.of(BASELINE):
            lines.append("in the baseline (reported, not failing):")
            lines += [f"  {nodeid}: {short(e['race'])}{_on(e['ranks'])}" for nodeid, e in self.of(BASELINE)]
        gone = self.gone()
        if gone:
            lines.append("gone from the baseline (fixed? rewrite it with --streamrace-baseline-update):")
            lines += [f"  {baseline_mod.describe(sig)}" for sig in gone]
        if self.of(NEW):
            quiet = "report-only, " if lv.report_only else "baseline update, " if lv.update else ""
            lines.append(f"new races ({quiet}{'not failing' if quiet else 'failing their tests'}):")
            lines += [f"  {nodeid}: {short(e['race'])}{_on(e['ranks'])}" for nodeid, e in self.of(NEW)]
        if self.written is not None:
            from .suppress import shown_path

            lines.append(f"baseline written: {shown_path(lv.baseline_path, lv.rootdir)} "
                         f"({self.written} race{'s' if self.written != 1 else ''})")
        lines.append(self.closing_line())
        return lines

    def closing_line(self) -> str:
        c = self.counts()
        n = len(self.checked)
        line = (f"streamrace: {n} test{'s' if n != 1 else ''} checked, {len(self.races)} race"
                f"{'s' if len(self.races) != 1 else ''} found: {c[SUPPRESSED]} suppressed, {c[BASELINE]} in baseline, "
                f"{c[NEW]} new")
        if c[EXPECTED]:
            line += f", {c[EXPECTED]} expected"
        if self.levers.report_only:
            line += " (report-only)"
        return line

    def annotations(self) -> list[str]:
        """GitHub Actions workflow commands: an error per new race, a warning per race in the baseline."""
        root = os.environ.get("GITHUB_WORKSPACE") or self.levers.rootdir
        out = []
        for status, command in ((NEW, "error"), (BASELINE, "warning")):
            for nodeid, e in self.of(status):
                out.append(annotation(command, nodeid, e["race"], e["ranks"], root, status))
        return out


def _on(ranks) -> str:
    return f" (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))})" if ranks else ""


def user_frame(frames: list[dict], root: str) -> tuple[str, int] | None:
    """(path relative to root, line) of the innermost frame in the repository's own code, else the innermost."""
    root = os.path.abspath(root) + os.sep
    for f in frames:
        path = str(f.get("file", ""))
        if path.startswith(root) and "site-packages" not in path and "dist-packages" not in path:
            return path[len(root):].replace(os.sep, "/"), int(f.get("line", 0))
    if frames:
        path = str(frames[0].get("file", ""))
        return (path[len(root):] if path.startswith(root) else path).replace(os.sep, "/"), int(frames[0]["line"])
    return None


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def annotation(command: str, nodeid: str, race: dict, ranks, root: str, status: str) -> str:
    later, earlier = race.get("later") or {}, race.get("earlier") or {}
    where = user_frame(later.get("frames") or [], root)
    props = f" file={_escape_property(where[0])},line={where[1]}," if where else " "
    title = f"streamrace: {race.get('kind')}" + (" (in the baseline)" if status == BASELINE else "")
    ef = (earlier.get("frames") or [{}])[0]
    before = f" ({os.path.basename(str(ef['file']))}:{ef['line']})" if ef else ""
    message = (f"{short(race, at=False)}: {later.get('op')} on {later.get('stream')} is not ordered after "
               f"{earlier.get('op')}{before} on {earlier.get('stream')} [{nodeid}{_on(ranks)}]")
    return f"::{command}{props}title={_escape_property(title)}::{_escape_data(message)}"
