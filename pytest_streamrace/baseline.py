"""``--streamrace-baseline FILE``: the races a suite already had, which are reported but do not fail.

A race is known by a signature that survives unrelated edits: the test id, the kind, and each access's function
(its innermost frame's) and op — no line numbers, no ranks. The file is JSON, one signature a line, sorted, so a
change to it reads as a small diff::

    {"version": 1, "generator": "pytest-streamrace --streamrace-baseline-update", "races": [
     {"test": "t.py::test_a", "kind": "read-after-write", "earlier": ["reduce", "aten::add_"], "later": ["step", "aten::mul"]}
    ]}

``--streamrace-baseline-update`` rewrites it from the session: the entries of every test that ran are replaced by
that test's races (suppressed ones left out); entries of tests that did not run (deselected, ``-k``) are kept.
"""

from __future__ import annotations

import json
import os

from .suppress import BadInput, shown_path

VERSION = 1
GENERATOR = "pytest-streamrace --streamrace-baseline-update"

Signature = tuple[str, str, str, str, str, str]  # test, kind, earlier function, earlier op, later function, later op


def _side(race: dict, side: str) -> tuple[str, str]:
    access = race.get(side) or {}
    frames = access.get("frames") or [{}]
    return str(frames[0].get("function", "")), str(access.get("op", ""))


def signature(nodeid: str, race: dict) -> Signature:
    return (nodeid, str(race.get("kind", "")), *_side(race, "earlier"), *_side(race, "later"))


def describe(sig: Signature) -> str:
    test, kind, ef, eo, lf, lo = sig
    return f"{test}: {kind}, {eo} in {ef or '?'} then {lo} in {lf or '?'}"


def load(path: str, rootdir: str, missing_ok: bool = False) -> set[Signature]:
    """The signatures in the file. Unreadable, malformed, or written by a newer schema: BadInput."""
    shown = shown_path(path, rootdir)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        if missing_ok:
            return set()
        raise BadInput(f"cannot read baseline {shown}: no such file (write it with --streamrace-baseline-update)") \
            from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"cannot read baseline {shown}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise BadInput(f"cannot read baseline {shown}: not JSON ({exc})") from None
    version = doc.get("version") if isinstance(doc, dict) else None
    if isinstance(version, int) and version > VERSION:
        raise BadInput(f"baseline {shown} was written by a newer pytest-streamrace (schema version {version}; "
                       f"this one reads version {VERSION}): upgrade pytest-streamrace or rewrite it with "
                       f"--streamrace-baseline-update")
    if version != VERSION or not isinstance(doc.get("races"), list):
        raise BadInput(f"cannot read baseline {shown}: not a streamrace baseline of schema version {VERSION}")
    out = set()
    for entry in doc["races"]:
        try:
            (ef, eo), (lf, lo) = entry["earlier"], entry["later"]
            out.add(tuple(str(v) for v in (entry["test"], entry["kind"], ef, eo, lf, lo)))
        except (KeyError, TypeError, ValueError):
            raise BadInput(f"cannot read baseline {shown}: malformed entry {json.dumps(entry)[:120]}") from None
    return out


def write(path: str, signatures: set[Signature]) -> None:
    lines = [json.dumps({"test": t, "kind": k, "earlier": [ef, eo], "later": [lf, lo]})
             for t, k, ef, eo, lf, lo in sorted(signatures)]
    body = ",\n".join(" " + line for line in lines)
    text = (f'{{"version": {VERSION}, "generator": "{GENERATOR}", "races": [\n' + body + ("\n" if lines else "") +
            "]}\n")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
