"""Crash counts: runs the same job many times, each in fresh processes, and counts the runs in which a process died
(by a signal, an abort, a fatal error) apart from the runs that merely failed.

Why it exists: a detector that observes every op and thread of a job must never be what kills it. A rare crash shows
only over many runs, and only from fresh processes: one pytest session cannot stand for N runs. Two jobs:

    python scripts/crash_counts.py torchrun --runs 50     # a 2-rank gloo job under `streamrace run -- torchrun`
    python scripts/crash_counts.py stacks --runs 20       # the stock DDP and FSDP2 items, plain and --streamrace

`torchrun`: each run is `streamrace run -- torchrun --standalone --nproc_per_node 2 SCRIPT` (SCRIPT: a racy 2-rank
gloo training loop, or `--script PATH`); a run is right when it exits 3 (its races reported) or 0 (`--expect 0`).
`stacks`: each run is one fresh `pytest` session over tests/stacks/stack_ddp.py and stack_fsdp2.py, once plain and
once with `--streamrace` (`--backend`: the detector's backend, default auto: cuda with 2 GPUs); right when it exits 0.
Prints a table (runs, right, failed, crashed, the crashes' signatures) per job; exits 1 when any run crashed.

`--parallel K` runs K runs at once (fresh processes still; a host with spare GPUs counts faster), and
`--devices "0,1;2,3"` gives the concurrent runs those GPU sets in turn (CUDA_VISIBLE_DEVICES); `--only streamrace`
counts one kind of stacks session. Ctrl-C prints the table of the runs that finished.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import itertools
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STACKS = ["tests/stacks/stack_ddp.py", "tests/stacks/stack_fsdp2.py"]

RACY_RANKS = """
import torch, torch.distributed as dist

dist.init_process_group("gloo")
for _ in range(3):
    side = torch.cuda.Stream()
    x = torch.ones(64)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.mul_(2)
    y = x + 1                                       # reads x with nothing ordering it after the side stream
    torch.cuda.current_stream().wait_stream(side)
    dist.all_reduce(y)
dist.barrier()
dist.destroy_process_group()
"""

# What a dead process leaves in a job's output: the launcher's rank report, torchrun's failure table (a rank killed
# by a signal, and the peers torchrun then stops with SIGTERM), the C++ runtime, CPython, the shell's core-dump words.
SIGNATURES = [
    (re.compile(r"rank \d+(?: of \d+)? died: ([^;\n]+)"), "rank died: {}"),
    (re.compile(r"Signal \d+ \((SIG\w+)\) received by PID"), "a rank got {} (torchrun)"),
    (re.compile(r"exitcode\s*:\s*(-\d+)"), "a rank's exit code {} (torchrun)"),
    (re.compile(r"terminate called after throwing an instance of '([^']+)'"), "C++ terminate: {}"),
    (re.compile(r"Fatal Python error: (\w+)"), "Fatal Python error: {}"),
    (re.compile(r"(Segmentation fault|Aborted|Bus error)(?: \(core dumped\))?"), "{}"),
]


def signatures(returncode: int, output: str) -> list[str]:
    """How the run's processes died, one line each; empty when none did."""
    found = []
    if returncode < 0 or returncode > 128:
        number = -returncode if returncode < 0 else returncode - 128
        try:
            found.append(f"killed by {signal.Signals(number).name}")
        except ValueError:
            found.append(f"exit status {returncode}")
    for pattern, text in SIGNATURES:
        found += sorted({text.format(m.group(1)) for m in pattern.finditer(output)})
    return found


RUNNING: set = set()  # the runs' process groups, ended if the count is interrupted


def run_once(command: list[str], cwd: Path, timeout: float, env: dict) -> tuple[int, str, float]:
    start = time.monotonic()
    with subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as job:
        RUNNING.add(job.pid)
        try:
            output, _ = job.communicate(timeout=timeout)
            return job.returncode, output, time.monotonic() - start
        except subprocess.TimeoutExpired:
            _end(job.pid)
            output, _ = job.communicate()
            return 124, output + f"\n[crash_counts] timed out after {timeout:.0f} s", time.monotonic() - start
        finally:
            RUNNING.discard(job.pid)


def _end(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


class Tally:
    """One job's runs: right, failed (a wrong exit status, nothing died), crashed (something died)."""

    def __init__(self, name: str, right: set[int]):
        self.name, self.right = name, right
        self.runs = self.ok = self.failed = self.crashed = 0
        self.seconds: list[float] = []
        self.causes: collections.Counter = collections.Counter()
        self.first_bad = ""

    def add(self, returncode: int, output: str, seconds: float, log: Path | None) -> str:
        self.runs += 1
        self.seconds.append(seconds)
        died = signatures(returncode, output)
        if died:
            self.crashed += 1
            self.causes.update(died)
            verdict = "CRASHED: " + "; ".join(died)
        elif returncode in self.right:
            self.ok += 1
            verdict = "ok"
        else:
            self.failed += 1
            self.causes[f"exit {returncode}" + (" (timeout)" if returncode == 124 else "")] += 1
            verdict = f"failed: exit {returncode}"
        if verdict != "ok" and log is not None:
            log.write_text(output)
            self.first_bad = self.first_bad or str(log)
        return verdict

    def row(self) -> str:
        median = sorted(self.seconds)[len(self.seconds) // 2] if self.seconds else 0.0
        causes = ", ".join(f"{cause} ×{n}" for cause, n in self.causes.most_common()) or "-"
        return f"{self.name:<28} {self.runs:>4} {self.ok:>5} {self.failed:>6} {self.crashed:>7} {median:>8.1f}  {causes}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("job", choices=["torchrun", "stacks"])
    parser.add_argument("--runs", type=int, default=50, help="runs of each job (default 50)")
    parser.add_argument("--script", help="torchrun: the rank script (default: a racy 2-rank gloo loop)")
    parser.add_argument("--expect", type=int, default=3, help="torchrun: the right exit status (default 3: races)")
    parser.add_argument("--backend", default="auto", help="the detector's backend (default auto)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a run may take (default 600)")
    parser.add_argument("--logs", help="keep the output of every run that was not right here")
    parser.add_argument("--only", choices=["plain", "streamrace"], help="stacks: only the plain or only the "
                        "--streamrace sessions")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (default 1)")
    parser.add_argument("--devices", help='GPU sets the concurrent runs take in turn, e.g. "0,1;2,3"')
    args = parser.parse_args(argv)
    if args.runs < 1 or args.parallel < 1:
        print("crash_counts: --runs and --parallel must be at least 1", file=sys.stderr)
        return 2
    if args.script and not Path(args.script).is_file():
        print(f"crash_counts: --script {args.script}: no such file", file=sys.stderr)
        return 2
    logs = Path(args.logs or tempfile.mkdtemp(prefix="crash-counts-"))
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    streamrace = [sys.executable, "-m", "pytest_streamrace", "run", f"--backend={args.backend}"]
    pytest = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-o", "addopts=", *STACKS]
    work = Path(tempfile.mkdtemp(prefix="crash-counts-job-"))
    if args.job == "torchrun":
        script = Path(args.script).resolve() if args.script else work / "ranks.py"
        if not args.script:
            script.write_text(textwrap.dedent(RACY_RANKS).lstrip())
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
        jobs = [(Tally("streamrace run -- torchrun", {args.expect}), [*streamrace, "--", *torchrun], work)]
    else:
        jobs = [(Tally("stacks, plain", {0}), pytest, ROOT),
                (Tally("stacks, --streamrace", {0}), [*pytest, "--streamrace", f"--streamrace-backend={args.backend}"],
                 ROOT)]
        jobs = [job for job in jobs if args.only is None or job[0].name.endswith(args.only)]
    print(f"crash_counts: {args.job}, {args.runs} run(s) a job; logs of runs that were not right: {logs}", flush=True)
    devices = itertools.cycle(args.devices.split(";") if args.devices else [None])
    runs = [(i, tally, command, cwd, next(devices)) for i in range(args.runs) for tally, command, cwd in jobs]

    def one(run):
        i, tally, command, cwd, gpus = run
        mine = env if gpus is None else {**env, "CUDA_VISIBLE_DEVICES": gpus}
        return run, run_once(command, cwd, args.timeout, mine)

    pool = concurrent.futures.ThreadPoolExecutor(args.parallel)
    interrupted = False
    try:
        for (i, tally, _, _, gpus), (code, output, seconds) in pool.map(one, runs):
            label = re.sub(r"\W+", "-", tally.name).strip("-")
            verdict = tally.add(code, output, seconds, logs / f"{label}-{i + 1}.log")
            where = f" on GPUs {gpus}" if gpus else ""
            print(f"  {tally.name} {i + 1}/{args.runs}{where}: {verdict} [{seconds:.1f} s]", flush=True)
    except KeyboardInterrupt:  # the counts so far still print; the runs under way are ended, not counted
        interrupted = True
        pool.shutdown(wait=False, cancel_futures=True)
        for pid in list(RUNNING):
            _end(pid)
        print("\ncrash_counts: interrupted; the table counts the runs that finished", flush=True)
    pool.shutdown(wait=True)
    print(f"\n{'job':<28} {'runs':>4} {'right':>5} {'failed':>6} {'crashed':>7} {'median s':>8}  signatures")
    for tally, _, _ in jobs:
        print(tally.row())
    return 1 if any(tally.crashed for tally, _, _ in jobs) else 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
