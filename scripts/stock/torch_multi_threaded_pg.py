"""Held-out false-positive check: PyTorch's thread-rank tests, run with and without ``--streamrace``, outcome by outcome.

Why it exists: ranks run as threads (``MultiThreadedTestCase``, ``spawn_threads_and_init_comms``, the threaded process
group) are observed by the detector; a report on PyTorch's own tests of that machinery is a false
positive to triage (or a real race upstream). The test files are not in the torch wheel: give their paths, e.g.
``test/distributed/test_multi_threaded_pg.py`` from a PyTorch checkout at the tag of the installed torch. Any test
file works (a DTensor file whose classes run threaded, say). Run from the repository root::

    python scripts/stock/torch_multi_threaded_pg.py /tmp/held/test_multi_threaded_pg.py [-- extra pytest args]

It runs pytest twice in subprocesses (plain, then ``--streamrace --streamrace-backend=virtual``), reads each run's
JUnit XML, prints every test whose outcome differs, the totals of both runs and the races the detector recorded, and
exits 1 when an outcome differs or a race was reported.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path


def outcomes(junit: Path) -> dict[str, str]:
    """test id -> passed / failed / error / skipped, from a JUnit XML file."""
    found = {}
    for case in ET.parse(junit).iter("testcase"):
        kind = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        found[f"{case.get('classname')}::{case.get('name')}"] = {"failure": "failed"}.get(kind, kind)
    return found


def run(paths: list[str], extra: list[str], streamrace: bool, folder: Path) -> tuple[dict[str, str], float, list]:
    junit = folder / ("streamrace.xml" if streamrace else "plain.xml")
    races = folder / "races.json"
    args = [sys.executable, "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
            f"--junitxml={junit}", *extra]
    if streamrace:
        args += ["--streamrace", "--streamrace-backend=virtual", f"--streamrace-json={races}"]
    start = time.monotonic()
    subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    took = time.monotonic() - start
    found = json.loads(races.read_text()).get("races", []) if streamrace and races.exists() else []
    return outcomes(junit), took, found


def _where(access: dict | None) -> str:
    frames = (access or {}).get("frames") or [{}]
    return f"{access.get('op') if access else '?'} at {frames[0].get('file')}:{frames[0].get('line')}"


def main(argv: list[str]) -> int:
    if "--" in argv:
        cut = argv.index("--")
        paths, extra = argv[:cut], argv[cut + 1:]
    else:
        paths, extra = argv, []
    if not paths:
        print(__doc__)
        return 2
    with tempfile.TemporaryDirectory(prefix="streamrace-held-") as tmp:
        plain, plain_s, _ = run(paths, extra, False, Path(tmp))
        checked, checked_s, races = run(paths, extra, True, Path(tmp))
    differ = sorted(t for t in plain.keys() | checked.keys() if plain.get(t) != checked.get(t))
    for test in differ:
        print(f"DIFFERS {test}: plain {plain.get(test, 'absent')}, --streamrace {checked.get(test, 'absent')}")
    for name, found, took in (("plain", plain, plain_s), ("--streamrace", checked, checked_s)):
        counts = collections.Counter(found.values())
        print(f"{name:>13}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + f" ({took:.0f} s)")
    print(f"same outcome: {len(plain.keys() & checked.keys()) - len(differ)} of {len(plain.keys() | checked.keys())}"
          f" tests; races reported: {len(races)}")
    for race in races:
        print(f"RACE {race.get('test')}: {race.get('kind')} {_where(race.get('earlier'))} -> "
              f"{_where(race.get('later'))}")
    return 1 if differ or races else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
