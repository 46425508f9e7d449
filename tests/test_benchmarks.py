"""The overhead benchmark runs on a CPU-only machine and prints its table. Its numbers are for whoever reads them (timed
assertions do not belong in tests). What it does assert is the detector's verdict on its stock training steps: a
race reported on a correct step ends that configuration's process with an error, and the benchmark with exit 1. A
report there would be a false positive. And a worker that stops answering is killed and named, not waited on forever."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_overhead_measures_the_launch_bound_and_ddp_rows_without_a_race():
    """A repeat starts its configurations afresh, together (one repeat here: each costs every start again); the DDP
    row's a process a rank. `--under run` adds plain's workers started by `streamrace run` (a process a rank too),
    whose slowdown is printed beside the in-process detector's and compared with it."""
    out = subprocess.run([sys.executable, "benchmarks/overhead.py", "--steps", "1", "--repeat", "1", "--cycles", "2",
                          "--model", "launch-bound", "--model", "DDP", "--under", "run"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].endswith("1 repeat(s) of 2 cycles, a round of 1 steps each"), lines[0]
    header = next(line for line in lines if line.startswith("model"))
    assert re.findall(r"(\S+) ms", header) == ["plain", "empty-mode", "capture-floor", "virtual", "run"]
    for row in ("launch-bound MLP", "DDP MLP (8x512, batch 32, 2 ranks)"):
        line = next(line for line in lines if line.startswith(row))
        assert re.search(r"empty-mode \d+\.\d\dx, capture-floor \d+\.\d\dx, virtual \d+\.\d\dx, run \d+\.\d\dx; "
                         r"run vs in-process \d+\.\d\dx \(\d+ s\)$", line), line
    assert not any(line.startswith(("larger", "compiled")) for line in lines)


def test_a_worker_that_gives_no_answer_in_time_is_killed_and_named_with_its_stacks(monkeypatch, tmp_path):
    """The watchdog: a measurement that takes longer than `answer_within` (here five 200-step rounds, 0.6 s or more,
    given 0.2 s; a single round once finished in time) ends in a failure naming the configuration, its rank and where
    its threads stood, and no worker is left running."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from overhead import Configuration

    configuration = Configuration("launch-bound MLP (8x64, batch 8)", "plain", 200, False, str(tmp_path))
    try:
        configuration.ready()
        configuration.answer_within = 0.2
        with pytest.raises(RuntimeError) as failure:
            configuration.measure(5)
    finally:
        configuration.close()
    text = str(failure.value)
    assert text.startswith("plain failed (rank 0: no answer in 0.2 s)"), text[:300]
    assert re.search(r'File ".*overhead\.py", line \d+ in serve', text), text
    assert all(proc.poll() is not None for proc in configuration.procs)


def test_run_memory_prints_its_table_with_the_verdicts_right():
    """``benchmarks/run_memory.py``, a few steps: the clean job under ``streamrace run`` has no race (a report there
    would be a false positive on a correct loop), the racy one exits 3, and the table has a row per measurement."""
    out = subprocess.run([sys.executable, "benchmarks/run_memory.py", "--steps", "20", "--every", "10", "--warmup",
                          "10", "--slack-mb", "1000"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "20 steps: RSS of the job's process (MiB)"
    assert [line.split()[0] for line in lines[2:4]] == ["10", "20"]
    status = next(line for line in lines if line.startswith("exit status:"))
    assert status.split()[2:] == ["0", "0", "3"]


def test_suite_cost_prints_the_fixed_cost_per_test():
    """``benchmarks/suite_cost.py``, a tiny suite: every test passes plain and under --streamrace (a race on a
    trivial test would be a false positive; a failed run exits with its output), and the table has its row."""
    out = subprocess.run([sys.executable, "benchmarks/suite_cost.py", "--files", "2", "--tests", "3", "--repeat", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("6 trivial tests (2 files), median of 1 runs each"), lines[0]
    assert lines[1].split() == ["plain", "s", "streamrace", "s", "ratio", "fixed", "cost", "per", "test", "ms"]
    assert re.fullmatch(r"\s*\d+\.\d\d\s+\d+\.\d\d\s+\d+\.\d\dx\s+-?\d+\.\d{3}", lines[2]), lines[2]
    assert lines[-1].startswith("fixed cost per test: "), lines[-1]


PARTS = ("capture", "frames", "intake", "hb core", "models")


def test_profile_step_breaks_the_detectors_work_down_by_part():
    """``benchmarks/profile_step.py``, a few steps on the virtual backend: the table has every part, none negative, and
    the parts every op passes through (capture, intake, hb core) are above zero, so an instrument that stopped counting
    cannot pass as a detector that costs nothing."""
    out = subprocess.run([sys.executable, "benchmarks/profile_step.py", "--steps", "3", "--rounds", "2"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("launch-bound MLP (8x64, batch 8), virtual backend: best of 2 rounds of 3 steps"), \
        lines[0]
    assert re.fullmatch(r"plain step \d+\.\d{3} ms \(rounds up to \d+\.\d{3}\); detector step \d+\.\d{3} ms .*",
                        lines[1]), lines[1]
    ops = float(re.fullmatch(r"ops a step: (\d+\.\d)", lines[2]).group(1))
    assert ops > 0
    assert lines[3].split() == ["part", "µs", "a", "step", "µs", "an", "op", "share"]
    rows = {}
    for part in PARTS:
        row = next(line for line in lines if line.startswith(part + " "))
        found = re.fullmatch(rf"{part}\s+(\d+\.\d)\s+(\d+\.\d{{3}})\s+(\d+\.\d%|n/a)", row)
        assert found, row
        rows[part] = float(found.group(1))
    assert all(rows[part] > 0 for part in ("capture", "intake", "hb core")), rows
    assert any(line.startswith("kernel entry ") for line in lines)
    # the virtual model applies the records at the end of each backward: one drain a step, named by its caller
    drains = next(line for line in lines if line.startswith("drains a step: "))
    assert re.fullmatch(r"drains a step: 1\.00; 1\.00 from detector/models/virtual_autograd\.py:\d+\(_after_backward\)",
                        drains), drains


def test_profile_step_breaks_a_two_rank_ddp_step_down_on_rank_0():
    """``--model ddp``: rank 0's table for a DDP step over two gloo ranks, rank 1 a second process running the same
    rounds (their collectives pair up, or the run would hang and time out here). The capture and the collectives'
    records reach the core (capture, intake, hb core above zero), and rank 1's process is gone when it returns."""
    out = subprocess.run([sys.executable, "benchmarks/profile_step.py", "--model", "ddp", "--steps", "2", "--rounds",
                          "1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("DDP MLP (8x512, batch 32, 2 ranks), virtual backend, gloo, rank 0 of 2: best of 1 "
                               "rounds of 2 steps"), lines[0]
    assert len([line for line in lines if line.startswith("plain step ")]) == 1  # rank 1 prints no table
    rows = {part: float(next(line for line in lines if line.startswith(part + " ")).split()[-3]) for part in PARTS}
    assert all(rows[part] > 0 for part in ("capture", "intake", "hb core")), rows
    rank1 = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if b"benchmarks/profile_step.py" in args and b"--rank" in args:
            rank1.append(cmdline.parent.name)
    assert rank1 == []


def test_the_detectors_timers_count_nothing_while_off(monkeypatch):
    """The timers behind that breakdown (``timers.cpp``) are off unless turned on: a session's steps then leave every
    counter at zero. Turned on, the same steps count (so zero here is the switch, not a broken counter)."""
    from pytest_streamrace.detector import capture
    from pytest_streamrace.detector.session import Detector

    extension = capture.load()
    if extension is None:
        pytest.skip(f"the capture extension does not build here: {capture.failure()}")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from paired_overhead import launch_bound_step

    step = launch_bound_step("cpu")

    def session() -> dict:
        with Detector(backend="virtual") as detector:
            for _ in range(2):
                step()
            detector.tracker.drain()
        assert not detector.races
        return extension.profile_counters(reset=True)

    extension.profile(False)
    extension.profile_counters(reset=True)
    assert set(session().values()) == {(0, 0)}
    extension.profile(True)
    try:
        counted = session()
    finally:
        extension.profile(False)
    assert all(counted[part][0] > 0 and counted[part][1] > 0 for part in ("capture", "frames", "intake", "hb core"))
    assert counted["ops"][1] > 0
