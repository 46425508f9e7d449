"""How a race is judged, in every process that runs tests: suppressions, a baseline, report-only mode.

``Policy.classify`` gives each race record a ``status``:

- ``expected``: the test is marked ``streamrace(expect='race')``;
- ``suppressed``: a ``--streamrace-suppress`` rule matched (``suppressed_by`` names it);
- ``baseline``: its signature is in ``--streamrace-baseline``;
- ``new``: anything else — the only races that fail a test, and not under ``--streamrace-report-only`` or
  ``--streamrace-baseline-update``.

Because each process judges its own races (the plain session, an xdist worker, a ``distributed`` item's rank
process, a torchrun rank), a suppressed or baselined race fails no rank, so a ``distributed`` item's merged outcome
and a torchrun session's collective one pass with it. The records, status included, travel to the process that
prints, where ``tally.Tally`` counts them.

Suppression rules (``--streamrace-suppress FILE``). One rule a line, ``#`` starts a comment. A rule is one or more
``KEY:GLOB`` terms separated by spaces; a race is suppressed by the first rule all of whose terms match it:

- ``kind:`` ``raw``, ``war``, ``waw`` or ``free`` (read-after-write, write-after-read, write-after-write,
  free-while-in-use), or ``latent``. Latent races (``--streamrace-latent``) are a kind of their own: only a rule
  with ``kind:latent`` matches them, and it matches nothing else (``kind:latent kind:raw``: latent
  read-after-writes);
- ``file:`` a glob matched against the files of either access's frames, as a whole path or as a trailing part of
  one (``file:deepspeed/runtime/zero/*`` matches ``.../site-packages/deepspeed/runtime/zero/stage3.py``);
- ``function:`` a glob matched against the functions of either access's frames;
- ``tensor:`` a glob matched against the tensor's name.

A line ``incidental-sync:GLOB`` (alone on its line) is no suppression: explicit syncs made from the files it names
(any of the sync's user frames; e.g. ``incidental-sync:deepspeed/utils/timer.py``, DeepSpeed's step timers) count as
incidental, as a value read back does, so what only they order is reported as a latent race.

Globs are ``fnmatch`` globs (``*`` also crosses ``/``), matched case-sensitively. A rule is known everywhere by its
``path:line`` (the path relative to the rootdir).

The baseline (``--streamrace-baseline FILE``): the races a suite already had, reported but not failing. A race is
known by a signature that survives unrelated edits: the test id, the kind (a latent race's is "latent <kind>", so a
baseline entry for one never matches a race and vice versa), and each access's function (its innermost
frame's) and op — no line numbers, no ranks. The file is JSON, one signature a line, sorted, so a change to it reads
as a small diff::

    {"version": 1, "generator": "pytest-streamrace --streamrace-baseline-update", "races": [
     {"test": "t.py::test_a", "kind": "read-after-write", "earlier": ["reduce", "aten::add_"], "later": ["step", "aten::mul"]}
    ]}

``--streamrace-baseline-update`` rewrites it from the session: the entries of every test that ran are replaced by
that test's races (suppressed ones left out); entries of tests that did not run (deselected, ``-k``) are kept.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from fnmatch import fnmatchcase

import pytest

from .. import checks, options
from ..detector.host_sync import path_matches

NEW, SUPPRESSED, BASELINE, EXPECTED = "new", "suppressed", "baseline", "expected"
_policy_key = pytest.StashKey["Policy"]()


class Policy:
    def __init__(self, rules, baseline, baseline_path, report_only, update, rootdir, latent="report", incidental=()):
        self.rules: list[Rule] = rules
        self.latent: str = latent  # --streamrace-latent: report | fail | off
        self.incidental: tuple[str, ...] = tuple(incidental)  # the incidental-sync rules' globs
        self.baseline: set | None = baseline
        self.baseline_path: str | None = baseline_path
        self.report_only: bool = report_only
        self.update: bool = update
        self.rootdir: str = rootdir

    def classify(self, nodeid: str, race: dict, expected: bool) -> str:
        """Set (and return) the race record's status."""
        rule = None if expected else matching_rule(self.rules, race)
        if expected:
            status = EXPECTED
        elif rule is not None:
            status = SUPPRESSED
            race["suppressed_by"] = {"rule": rule.where, "text": rule.text}
        elif self.baseline is not None and signature(nodeid, race) in self.baseline:
            status = BASELINE
        else:
            status = NEW
        race["status"] = status
        return status

    def fails(self, status: str, latent: bool = False) -> bool:
        if latent and self.latent != "fail":
            return False
        return status == NEW and not (self.report_only or self.update)


def load(config: pytest.Config) -> Policy:
    """This session's policy, read once per process. Bad input raises BadInput (one line)."""
    policy = config.stash.get(_policy_key, None)
    if policy is not None:
        return policy
    policy = config.stash[_policy_key] = build(
        options.get(config, "streamrace_suppressions"), options.get(config, "streamrace_baseline"),
        options.get(config, "streamrace_baseline_update"), options.get(config, "streamrace_report_only"),
        options.get(config, "streamrace_latent"), str(config.rootpath))
    return policy


def build(suppress: list[str], baseline: str | None, update: bool, report_only: bool, latent: str, rootdir: str,
          flag: str = "--streamrace-") -> Policy:
    """A policy from its settings (pytest's, or ``streamrace run``'s, whose flags have the `flag` prefix "--"). Bad
    input raises BadInput (one line)."""
    rules, incidental = load_rules(suppress, rootdir)
    if update and not baseline:
        raise BadInput(f"{flag}baseline-update needs {flag}baseline FILE (the file to write)")
    known = load_baseline(baseline, rootdir, missing_ok=update, flag=flag) if baseline else None
    return Policy(rules, known, baseline, report_only, update, rootdir, latent, incidental)


# suppression rules

KINDS = {"raw": "read-after-write", "war": "write-after-read", "waw": "write-after-write",
         "free": "free-while-in-use", "latent": "latent"}
INCIDENTAL = "incidental-sync"  # a line of its own: explicit syncs from these files count as incidental
KEYS = ("kind", "file", "function", "tensor")


class BadInput(checks.BadInput):
    """A suppression file or baseline that cannot be used: the message is the one line shown to the user."""


@dataclass(frozen=True)
class Rule:
    where: str  # "path:line", path relative to the rootdir where it lies under it
    text: str  # the rule as written
    terms: tuple[tuple[str, str], ...]  # (key, glob)

    def matches(self, race: dict) -> bool:
        if race.get("latent") and ("kind", "latent") not in self.terms:
            return False  # latent races are a kind of their own
        return all(_term(key, glob, race) for key, glob in self.terms)


def _frames(race: dict) -> list[dict]:
    return [f for side in ("earlier", "later") for f in (race.get(side) or {}).get("frames") or ()]


def _term(key: str, glob: str, race: dict) -> bool:
    if key == "kind":
        return bool(race.get("latent")) if glob == "latent" else race.get("kind") == KINDS[glob]
    if key == "file":
        return any(path_matches(str(f.get("file", "")), glob) for f in _frames(race))
    if key == "function":
        return any(fnmatchcase(str(f.get("function", "")), glob) for f in _frames(race))
    return fnmatchcase(str((race.get("tensor") or {}).get("name") or ""), glob)  # tensor


def shown_path(path: str, rootdir: str) -> str:
    rel = os.path.relpath(path, rootdir)
    return path if rel.startswith(os.pardir) else rel


def parse_rules(text: str, shown: str, incidental: list | None = None) -> list[Rule]:
    """The rules of one file's text; `shown` names the file in rule locations and errors. `incidental` gets the
    globs of its incidental-sync lines."""
    incidental = [] if incidental is None else incidental
    rules = []
    for lineno, line in enumerate(text.splitlines(), 1):
        rule = line.split("#", 1)[0].strip()
        if not rule:
            continue
        if rule.startswith(INCIDENTAL + ":"):
            glob = rule.partition(":")[2]
            if not glob or len(rule.split()) != 1:
                raise BadInput(f"{shown}:{lineno}: bad rule {rule!r}: expected {INCIDENTAL}:GLOB alone on its line")
            incidental.append(glob)
            continue
        terms = []
        for term in rule.split():
            key, colon, glob = term.partition(":")
            if not colon or key not in KEYS:
                raise BadInput(f"{shown}:{lineno}: bad suppression term {term!r}: expected KEY:GLOB with KEY one "
                               f"of {', '.join(KEYS)}")
            if not glob:
                raise BadInput(f"{shown}:{lineno}: bad suppression term {term!r}: the glob after '{key}:' is empty")
            if key == "kind" and glob not in KINDS:
                raise BadInput(f"{shown}:{lineno}: bad suppression term {term!r}: kind is one of "
                               f"{', '.join(KINDS)}")
            terms.append((key, glob))
        rules.append(Rule(f"{shown}:{lineno}", rule, tuple(terms)))
    return rules


def load_rules(paths: list[str], rootdir: str) -> tuple[list[Rule], list[str]]:
    """Every rule of the files, in order, and the incidental-sync globs. An unreadable file or a bad rule raises
    BadInput."""
    rules, incidental = [], []
    for path in paths:
        shown = shown_path(path, rootdir)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise BadInput(f"cannot read suppression file {shown}: {getattr(exc, 'strerror', None) or exc}") \
                from None
        rules += parse_rules(text, shown, incidental)
    return rules, incidental


def matching_rule(rules: list[Rule], race: dict) -> Rule | None:
    return next((rule for rule in rules if rule.matches(race)), None)


# the baseline

BASELINE_VERSION = 1
GENERATOR = "pytest-streamrace --streamrace-baseline-update"

Signature = tuple[str, str, str, str, str, str]  # test, kind, earlier function, earlier op, later function, later op


def _side(race: dict, side: str) -> tuple[str, str]:
    access = race.get(side) or {}
    frames = access.get("frames") or [{}]
    return str(frames[0].get("function", "")), str(access.get("op", ""))


def signature(nodeid: str, race: dict) -> Signature:
    kind = str(race.get("kind", ""))
    return (nodeid, f"latent {kind}" if race.get("latent") else kind, *_side(race, "earlier"), *_side(race, "later"))


def describe_signature(sig: Signature) -> str:
    test, kind, ef, eo, lf, lo = sig
    return f"{test}: {kind}, {eo} in {ef or '?'} then {lo} in {lf or '?'}"


def load_baseline(path: str, rootdir: str, missing_ok: bool = False, flag: str = "--streamrace-") -> set[Signature]:
    """The signatures in the file. Unreadable, malformed, or written by a newer schema: BadInput."""
    shown = shown_path(path, rootdir)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        if missing_ok:
            return set()
        raise BadInput(f"cannot read baseline {shown}: no such file (write it with {flag}baseline-update)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"cannot read baseline {shown}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise BadInput(f"cannot read baseline {shown}: not JSON ({exc})") from None
    version = doc.get("version") if isinstance(doc, dict) else None
    if isinstance(version, int) and version > BASELINE_VERSION:
        raise BadInput(f"baseline {shown} was written by a newer pytest-streamrace (schema version {version}; "
                       f"this one reads version {BASELINE_VERSION}): upgrade pytest-streamrace or rewrite it with "
                       f"{flag}baseline-update")
    if version != BASELINE_VERSION or not isinstance(doc.get("races"), list):
        raise BadInput(f"cannot read baseline {shown}: not a streamrace baseline of schema version {BASELINE_VERSION}")
    out = set()
    for entry in doc["races"]:
        try:
            (ef, eo), (lf, lo) = entry["earlier"], entry["later"]
            out.add(tuple(str(v) for v in (entry["test"], entry["kind"], ef, eo, lf, lo)))
        except (KeyError, TypeError, ValueError):
            raise BadInput(f"cannot read baseline {shown}: malformed entry {json.dumps(entry)[:120]}") from None
    return out


def write_baseline(path: str, signatures: set[Signature]) -> None:
    lines = [json.dumps({"test": t, "kind": k, "earlier": [ef, eo], "later": [lf, lo]})
             for t, k, ef, eo, lf, lo in sorted(signatures)]
    body = ",\n".join(" " + line for line in lines)
    text = (f'{{"version": {BASELINE_VERSION}, "generator": "{GENERATOR}", "races": [\n' + body + ("\n" if lines else "") +
            "]}\n")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
