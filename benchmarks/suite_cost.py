"""What ``--streamrace`` costs a test whatever the test does: its fixed cost per test.

Writes a suite of trivial tests (F files of T tests, each ``a = torch.ones(64, 64); (a @ a).sum()``) to a temporary
folder and runs it with pytest in fresh processes, alternately plain and under ``--streamrace`` (the backend the
machine picks: virtual on CPU), R times each; a conftest imports torch, so that neither clock holds its import.
Prints pytest's own "passed in" time of each (the median), and the
difference per test: the detector's fixed cost per test (a session's start and end, judging, following children),
the target being 0.5 ms or less. Interleaved, so that a busy machine slows both alike; the spread of the runs is
printed too.

    python benchmarks/suite_cost.py [--files F] [--tests T] [--repeat R]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TARGET_MS = 0.5


def write_suite(folder: Path, files: int, tests: int) -> None:
    # torch imported before pytest's clock starts in both runs: plain would import it while collecting (inside the
    # clock), --streamrace as the session starts (outside it), and its second and a half is no test's
    (folder / "conftest.py").write_text("import torch  # noqa: F401\n")
    for f in range(files):
        lines = ["import torch", ""]
        for t in range(tests):
            lines += [f"def test_{t}():", "    a = torch.ones(64, 64); (a @ a).sum()", ""]
        (folder / f"test_f{f}.py").write_text("\n".join(lines))


def run(folder: Path, streamrace: bool, expected: int) -> float:
    """pytest's own time for the session (its "passed in"), in seconds."""
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(["--streamrace"] if streamrace else []),
            str(folder)]
    out = subprocess.run(args, cwd=folder, capture_output=True, text=True, timeout=3600)
    found = re.search(r"(\d+) passed in ([\d.]+)s", out.stdout)
    if out.returncode != 0 or found is None or int(found.group(1)) != expected:
        sys.exit(f"{' '.join(args[3:])} did not pass all {expected} tests:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return float(found.group(2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=10)
    parser.add_argument("--tests", type=int, default=100, help="tests per file")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    count = args.files * args.tests
    with tempfile.TemporaryDirectory(prefix="streamrace-suite-") as name:
        folder = Path(name)
        write_suite(folder, args.files, args.tests)
        env_note = os.environ.get("OMP_NUM_THREADS")
        run(folder, True, count)  # builds (or loads) the C++ capture, warms the page cache
        plain, under = [], []
        for _ in range(args.repeat):
            plain.append(run(folder, False, count))
            under.append(run(folder, True, count))
    p, u = statistics.median(plain), statistics.median(under)
    per_test = (u - p) / count * 1000
    print(f"{count} trivial tests ({args.files} files), median of {args.repeat} runs each (pytest's own time)"
          + (f", OMP_NUM_THREADS={env_note}" if env_note else ""))
    print(f"{'plain s':>9}{'streamrace s':>14}{'ratio':>8}{'fixed cost per test ms':>24}")
    print(f"{p:>9.2f}{u:>14.2f}{u / p:>7.2f}x{per_test:>24.3f}")
    print(f"runs: plain {min(plain):.2f}-{max(plain):.2f} s, streamrace {min(under):.2f}-{max(under):.2f} s")
    print(f"fixed cost per test: {per_test:.3f} ms (target <= {TARGET_MS} ms): {'ok' if per_test <= TARGET_MS else 'OVER'}")


if __name__ == "__main__":
    main()
