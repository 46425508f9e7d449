"""The overhead benchmark runs on a CPU-only machine and prints its table. Its numbers are for whoever reads them (timed
assertions do not belong in tests). What it does assert is the detector's verdict on its stock training steps: a
race reported on a correct step ends that configuration's process with an error, and the benchmark with exit 1. A
report there would be a false positive."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_overhead_measures_the_launch_bound_and_ddp_rows_without_a_race():
    """A repeat starts its configurations afresh, together (one repeat here: each costs every start again); the DDP
    row's a process a rank."""
    out = subprocess.run([sys.executable, "benchmarks/overhead.py", "--steps", "1", "--repeat", "1", "--model",
                          "launch-bound", "--model", "DDP"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].endswith("1 steps per measurement, 1 repeat(s)"), lines[0]
    header = next(line for line in lines if line.startswith("model"))
    assert re.findall(r"(\S+) ms", header) == ["plain", "empty-mode", "capture-floor", "virtual"]
    for row in ("launch-bound MLP", "DDP MLP (8x512, batch 32, 2 ranks)"):
        line = next(line for line in lines if line.startswith(row))
        assert re.search(r"empty-mode \d+\.\d\dx, capture-floor \d+\.\d\dx, virtual \d+\.\d\dx$", line), line
    assert not any(line.startswith(("larger", "compiled")) for line in lines)
