"""Crash counts on 2 GPUs: the stock DDP and FSDP2 items of tests/stacks, N fresh pytest sessions plain and N with
--streamrace (cuda backend), no process dying in any (scripts/crash_counts.py counts; CRASH_RUNS=N, default 3;
CRASH_PARALLEL=K runs K sessions at once, spread over the host's GPU pairs)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


CLAIMS = {
    41: 'Crash counts on NCCL: the stock DDP and FSDP2 items (`tests/stacks/`), N fresh pytest sessions plain'
        ' and N with `--streamrace`: no rank dies (signal, abort, fatal error)',
}

pytestmark = [pytest.mark.gpu(count=2), pytest.mark.validates(41)]

ROOT = Path(__file__).resolve().parents[2]


def test_stock_ddp_and_fsdp2_runs_plain_and_under_streamrace_never_crash(tmp_path, gpu_result):
    import torch

    runs, parallel = int(os.environ.get("CRASH_RUNS", "3")), int(os.environ.get("CRASH_PARALLEL", "1"))
    pairs = ";".join(f"{i},{i + 1}" for i in range(0, torch.cuda.device_count() - 1, 2))
    out = subprocess.run([sys.executable, "scripts/crash_counts.py", "stacks", "--runs", str(runs), "--backend", "cuda",
                          "--parallel", str(parallel), "--devices", pairs, "--logs", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=runs * 2 * 660)
    print(out.stdout[-4000:])
    table = {}
    for label in ("stacks, plain", "stacks, --streamrace"):
        line = next(line for line in out.stdout.splitlines() if line.startswith(label + " "))
        count, right, failed, crashed, median, causes = line.removeprefix(label).split(maxsplit=5)
        table[label] = {"runs": int(count), "right": int(right), "failed": int(failed), "crashed": int(crashed),
                        "median_s": float(median), "signatures": causes}
        gpu_result.record(label, table[label])
    gpu_result.record("sessions at once", parallel)
    assert out.returncode == 0 and all(row["crashed"] == 0 for row in table.values()), out.stdout[-4000:]
    assert all(row["runs"] == row["right"] == runs for row in table.values()), table
