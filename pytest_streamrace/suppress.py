"""``--streamrace-suppress FILE``: rules that keep known races from failing tests.

One rule a line, ``#`` starts a comment. A rule is one or more ``KEY:GLOB`` terms separated by spaces; a race is
suppressed by the first rule all of whose terms match it:

- ``kind:`` ``raw``, ``war``, ``waw`` or ``free`` (read-after-write, write-after-read, write-after-write,
  free-while-in-use);
- ``file:`` a glob matched against the files of either access's frames, as a whole path or as a trailing part of
  one (``file:deepspeed/runtime/zero/*`` matches ``.../site-packages/deepspeed/runtime/zero/stage3.py``);
- ``function:`` a glob matched against the functions of either access's frames;
- ``tensor:`` a glob matched against the tensor's name.

Globs are ``fnmatch`` globs (``*`` also crosses ``/``), matched case-sensitively. Rules work on the race dicts of
``detector.report.to_dict`` so every process — an xdist worker, a rank process, a torchrun rank — applies them to
its own races; a rule is known everywhere by its ``path:line`` (the path relative to the rootdir).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from fnmatch import fnmatchcase

KINDS = {"raw": "read-after-write", "war": "write-after-read", "waw": "write-after-write",
         "free": "free-while-in-use"}
KEYS = ("kind", "file", "function", "tensor")


class BadInput(Exception):
    """A suppression file or baseline that cannot be used: the message is the one line shown to the user."""


@dataclass(frozen=True)
class Rule:
    where: str  # "path:line", path relative to the rootdir where it lies under it
    text: str  # the rule as written
    terms: tuple[tuple[str, str], ...]  # (key, glob)

    def matches(self, race: dict) -> bool:
        return all(_term(key, glob, race) for key, glob in self.terms)


def _frames(race: dict) -> list[dict]:
    return [f for side in ("earlier", "later") for f in (race.get(side) or {}).get("frames") or ()]


def _path_matches(path: str, glob: str) -> bool:
    path = path.replace(os.sep, "/")
    return fnmatchcase(path, glob) or fnmatchcase(path, "*/" + glob.lstrip("/"))


def _term(key: str, glob: str, race: dict) -> bool:
    if key == "kind":
        return race.get("kind") == KINDS[glob]
    if key == "file":
        return any(_path_matches(str(f.get("file", "")), glob) for f in _frames(race))
    if key == "function":
        return any(fnmatchcase(str(f.get("function", "")), glob) for f in _frames(race))
    return fnmatchcase(str((race.get("tensor") or {}).get("name") or ""), glob)  # tensor


def shown_path(path: str, rootdir: str) -> str:
    rel = os.path.relpath(path, rootdir)
    return path if rel.startswith(os.pardir) else rel


def parse(text: str, shown: str) -> list[Rule]:
    """The rules of one file's text; `shown` names the file in rule locations and errors."""
    rules = []
    for lineno, line in enumerate(text.splitlines(), 1):
        rule = line.split("#", 1)[0].strip()
        if not rule:
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


def load(paths: list[str], rootdir: str) -> list[Rule]:
    """Every rule of the files, in order. An unreadable file or a bad rule raises BadInput."""
    rules = []
    for path in paths:
        shown = shown_path(path, rootdir)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise BadInput(f"cannot read suppression file {shown}: {getattr(exc, 'strerror', None) or exc}") \
                from None
        rules += parse(text, shown)
    return rules


def match(rules: list[Rule], race: dict) -> Rule | None:
    return next((rule for rule in rules if rule.matches(race)), None)
