"""What ``--streamrace-confirm`` costs on the race corpus (``tests/corpus/corpus_cases.py``), per racy case.

For each racy case: its own run (the test alone, ``python -m pytest --streamrace NODEID``, wall time of the fresh
process; and the test's call phase inside a session), its confirmation's time (``test_seconds`` in the JSON: every
re-run of it) and its verdict. Then the clean twins alone, with and without ``--streamrace-confirm``: a suite with no
race re-runs nothing. Prints a table and the medians; ``--json`` writes them.

    python benchmarks/confirm_cost.py [--backend virtual] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "corpus" / "corpus_cases.py"


def pytest(folder: str, *args: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args], cwd=folder,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="virtual")
    parser.add_argument("--json")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="streamrace-confirm-cost-")
    shutil.copy(CORPUS, os.path.join(folder, "corpus_cases.py"))
    on = ["--streamrace", f"--streamrace-backend={args.backend}"]
    pytest(folder, *on, "--streamrace-confirm", "--streamrace-json=races.json", "--junitxml=junit.xml",
           "corpus_cases.py")
    races = json.loads(Path(folder, "races.json").read_text())["races"]
    calls = {case.get("name"): float(case.get("time", 0.0))
             for case in ET.parse(os.path.join(folder, "junit.xml")).iter("testcase")}
    rows = {}
    for race in races:
        name = race["test"].rsplit("::", 1)[1]
        confirmation = race["confirmation"]
        row = rows.setdefault(name, {"verdicts": set(), "confirm_s": confirmation.get("test_seconds", 0.0)})
        row["verdicts"].add(confirmation["status"])
    for name, row in rows.items():
        row["alone_s"] = pytest(folder, *on, f"corpus_cases.py::{name}")
        row["in_session_s"] = calls.get(name, 0.0)
    clean = [case for case in calls if case not in rows]
    selection = " or ".join(clean)
    without = pytest(folder, *on, "-k", selection, "corpus_cases.py")
    with_confirm = pytest(folder, *on, "--streamrace-confirm", "-k", selection, "corpus_cases.py")
    print(f"{'racy case':64} {'verdict':14} {'in session s':>12} {'alone s':>8} {'confirm s':>9} {'x alone':>8}")
    for name, row in sorted(rows.items()):
        row["verdicts"] = sorted(row["verdicts"])
        row["ratio_alone"] = row["confirm_s"] / row["alone_s"]
        print(f"{name:64} {'/'.join(row['verdicts']):14} {row['in_session_s']:12.3f} {row['alone_s']:8.2f} "
              f"{row['confirm_s']:9.2f} "
              f"{row['ratio_alone']:8.2f}")
    median = statistics.median(r["ratio_alone"] for r in rows.values())
    print(f"median confirmation / the test run alone: {median:.2f}x")
    print(f"clean twins ({len(clean)}): {without:.1f} s without --streamrace-confirm, {with_confirm:.1f} s with it")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "median_ratio_alone": median,
                                               "clean_without_s": without, "clean_with_s": with_confirm}, indent=1))
    shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
