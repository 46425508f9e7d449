"""scripts/crash_counts.py, as its users run it: a job that runs right is counted right, a rank that aborts is counted
as a crash with its signal, and bad arguments get one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ABORTING = """
import os, torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 1:
    os.abort()
dist.barrier()
"""


def _crash_counts(*args, cwd=ROOT):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "crash_counts.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def _row(stdout: str) -> list[str]:
    line = next(line for line in stdout.splitlines() if line.startswith("streamrace run -- torchrun "))
    return line.removeprefix("streamrace run -- torchrun").split(maxsplit=5)


def test_racy_torchrun_jobs_that_report_their_races_are_right_run_one_by_one_or_at_once(tmp_path):
    out = _crash_counts("torchrun", "--runs", "1", "--logs", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    runs, right, failed, crashed, _, causes = _row(out.stdout)
    assert (runs, right, failed, crashed, causes) == ("1", "1", "0", "0", "-")
    out = _crash_counts("torchrun", "--runs", "2", "--parallel", "2", "--devices", "0;1", "--logs", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert _row(out.stdout)[:4] + _row(out.stdout)[5:] == ["2", "2", "0", "0", "-"]
    assert sorted(line.split(": ")[0] for line in out.stdout.splitlines() if " on GPUs " in line) == [
        "  streamrace run -- torchrun 1/2 on GPUs 0", "  streamrace run -- torchrun 2/2 on GPUs 1"]


def test_a_rank_that_aborts_is_counted_as_a_crash_with_its_signal(tmp_path):
    script = tmp_path / "aborting.py"
    script.write_text(ABORTING)
    out = _crash_counts("torchrun", "--runs", "1", "--script", str(script), "--expect", "0", "--logs",
                        str(tmp_path / "logs"))
    assert out.returncode == 1, out.stdout + out.stderr
    runs, right, failed, crashed, _, causes = _row(out.stdout)
    assert (runs, right, failed, crashed) == ("1", "0", "0", "1")
    assert "SIGABRT" in causes or "exit code -6" in causes, causes
    assert list((tmp_path / "logs").glob("*.log")), "the crashed run's output is kept"


def test_bad_arguments_get_one_line_and_exit_2(tmp_path):
    for args, said in ((["--runs", "0"], "--runs and --parallel must be at least 1"),
                       (["--parallel", "0"], "--runs and --parallel must be at least 1"),
                       (["--script", str(tmp_path / "missing.py")], "no such file")):
        out = _crash_counts("torchrun", *args)
        assert out.returncode == 2 and said in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
