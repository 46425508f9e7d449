"""Held-out false-positive check: PyTorch's thread-rank tests, run with and without ``--streamrace``, outcome by outcome.

Why it exists: ranks run as threads (``MultiThreadedTestCase``, ``spawn_threads_and_init_comms``, the threaded process
group) are observed by the detector; a report on PyTorch's own tests of that machinery is a false
positive to triage (or a real race upstream). The test files are not in the torch wheel: give their paths, e.g.
``test/distributed/test_multi_threaded_pg.py`` from a PyTorch checkout at the tag of the installed torch. Any test
file works (a DTensor file whose classes run threaded, say). Run from the repository root::

    python scripts/stock/torch_multi_threaded_pg.py [--latent-fail] [--backend cuda] /tmp/held/test_x.py \
        [-- extra pytest args]

On a GPU host ``--backend cuda`` checks real streams, e.g. torch's own pinned-memory and ``non_blocking`` tests
(``test/test_cuda.py``, ``test/test_dataloader.py`` from the PyTorch tag of the installed torch)::

    python scripts/stock/torch_multi_threaded_pg.py --backend cuda test_cuda.py test_dataloader.py \
        -- -k "pin_memory or pinned or non_blocking or host_alloc or record_stream"

It runs pytest in subprocesses (plain, then ``--streamrace --streamrace-backend=virtual`` (or the ``--backend``
given), and with ``--latent-fail``
a third time adding ``--streamrace-latent=fail``, under which a race ordered only by an incidental sync fails its
test), reads each run's JUnit XML, prints every test whose outcome differs from the plain run's, the totals of each
run and the races (latent ones marked) the detector recorded, and exits 1 when an outcome differs or a race was
reported.
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


def runs(backend: str) -> dict[str, list[str]]:
    """Each run's name -> its options."""
    on = ["--streamrace", f"--streamrace-backend={backend}"]
    return {"plain": [], "--streamrace": on, "latent=fail": [*on, "--streamrace-latent=fail"]}


def run(paths: list[str], extra: list[str], name: str, folder: Path,
        backend: str = "virtual") -> tuple[dict[str, str], float, list]:
    """One pytest run in a subprocess: its outcomes, its wall time and the races its JSON holds."""
    stem = name.strip("-").replace("=", "-")
    junit, races = folder / f"{stem}.xml", folder / f"{stem}-races.json"
    options = runs(backend)[name]
    streamrace = bool(options)
    args = [sys.executable, "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
            f"--junitxml={junit}", *extra, *options]
    if streamrace:
        args.append(f"--streamrace-json={races}")
    start = time.monotonic()
    subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    took = time.monotonic() - start
    found = json.loads(races.read_text()).get("races", []) if streamrace and races.exists() else []
    return outcomes(junit), took, found


def _where(access: dict | None) -> str:
    frames = (access or {}).get("frames") or [{}]
    return f"{access.get('op') if access else '?'} at {frames[0].get('file')}:{frames[0].get('line')}"


def main(argv: list[str]) -> int:
    names, backend = ["plain", "--streamrace"], "virtual"
    while argv[:1] in (["--latent-fail"], ["--backend"]):
        if argv[0] == "--latent-fail":
            argv, names = argv[1:], [*names, "latent=fail"]
        elif len(argv) > 1 and argv[1] in ("virtual", "cuda"):
            argv, backend = argv[2:], argv[1]
        else:
            print("--backend takes virtual or cuda", file=sys.stderr)
            return 2
    if "--" in argv:
        cut = argv.index("--")
        paths, extra = argv[:cut], argv[cut + 1:]
    else:
        paths, extra = argv, []
    if not paths:
        print(__doc__)
        return 2
    with tempfile.TemporaryDirectory(prefix="streamrace-held-") as tmp:
        results = {name: run(paths, extra, name, Path(tmp), backend) for name in names}
    plain = results["plain"][0]
    differ, races = False, []
    for name, (found, took, recorded) in results.items():
        counts = collections.Counter(found.values())
        print(f"{name:>13}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + f" ({took:.0f} s)")
        if name == "plain":
            continue
        changed = sorted(t for t in plain.keys() | found.keys() if plain.get(t) != found.get(t))
        for test in changed:
            print(f"DIFFERS {test}: plain {plain.get(test, 'absent')}, {name} {found.get(test, 'absent')}")
        print(f"{'':>13}  same outcome as plain: {len(plain.keys() & found.keys()) - len(changed)} of "
              f"{len(plain.keys() | found.keys())} tests; races reported: {len(recorded)} "
              f"({sum(1 for r in recorded if r.get('latent'))} latent)")
        differ = differ or bool(changed)
        races += [(name, race) for race in recorded]
    for name, race in races:
        print(f"RACE [{name}] {race.get('test')}: {'latent ' if race.get('latent') else ''}{race.get('kind')} "
              f"{_where(race.get('earlier'))} -> {_where(race.get('later'))}")
    return 1 if differ or races else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
