"""``streamrace run --confirm``: after the program ends with races, the program again once per distinct race, with
that race forced into its bad order, and each race record's ``confirmation`` from what the forced run changed.

The first run is already a fresh process tree whose records carry their ops' places on their threads (``ordinal``):
no locating run is needed. Each re-run gets ``STREAMRACE_CONFIRM`` with one plan per rank (the race's two ops as that
rank's record names them; "none" for a process with no rank); every followed process whose rank has a plan arms it
when its detector starts and writes what it saw when it ends (``children.child``). A record's confirmation is read
from the files of processes of its own rank. Nothing seeds the program: a re-run is as deterministic as the program
makes itself. The exit status of ``streamrace run`` is the first run's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time

from .. import env
from ..races import confirmation as confirming
from ..races import record
from . import job

KILL_GRACE = 10.0  # seconds between the SIGTERM that ends a re-run past its time and the SIGKILL


def confirm(program: list[str], backend: str, variable: str, races: list[dict], status: int, seconds: float,
            mask: set, out=sys.stderr) -> None:
    """Give each race record its ``confirmation``, re-running `program` (first run: `status`, `seconds` long) once
    per distinct race; `variable` is ``STREAMRACE_SUBPROCESS`` as the first run had it."""
    started = time.perf_counter()
    groups: dict[tuple, list[dict]] = {}
    for data in races:
        groups.setdefault(record.key(data), []).append(data)
    tryable = [group for group in groups.values() if confirming.why_not(group[0]) is None]
    if tryable:
        out.write(f"streamrace: confirming {len(tryable)} race{'s' if len(tryable) != 1 else ''}: the program runs "
                  f"again once for each, with the race forced\n")
        out.flush()
    stopped = None
    for group in groups.values():
        problem = confirming.why_not(group[0])
        if problem is None and stopped is not None:
            problem = f"confirmation stopped by {stopped}"
        if problem is not None:
            for data in group:
                data["confirmation"] = {"status": confirming.NOT_TRIED, "reason": problem}
            continue
        one = time.perf_counter()
        plans = {confirming.rank_key(data.get("rank")): confirming.plan_of(data) for data in group}
        before = None
        while True:  # on GPUs, again with a longer hold where the hold was too short (as for a test)
            files, forced_status, signo, problem = _rerun(program, backend, variable, plans, max(60.0, 5 * seconds),
                                                          mask)
            if signo is not None:
                stopped = signal.Signals(signo).name
            results = []
            for data in group:
                own = [dict(f, outcome=_exit(forced_status)) for f in files if f.get("rank") == data.get("rank")]
                results.append(confirming.verdict(confirming.plan_of(data), own, problem or (
                    None if own else "no process of this rank forced it in the re-run"), _exit(status)))
            longer = None if stopped else confirming.next_hold(before, results)
            if longer is None:
                break
            before, plans = results, {k: confirming.held_longer(p, longer) for k, p in plans.items()}
        for data, result in zip(group, results):
            result["seconds"] = round(time.perf_counter() - one, 3)
            data["confirmation"] = result
    total = round(time.perf_counter() - started, 3)
    for data in races:
        data["confirmation"]["test_seconds"] = total  # (the tally adds up each program's re-runs)


def _exit(status: int | None) -> str:
    return "ended without an exit status" if status is None else f"exited with status {status}"


def _rerun(program: list[str], backend: str, variable: str, plans: dict, limit: float,
           mask: set) -> tuple[list[dict], int | None, int | None, str | None]:
    """One forced run of the program: (the files its processes wrote, its exit status, a terminating signal this
    process got meanwhile, why there is no result)."""
    folder = tempfile.mkdtemp(prefix="streamrace-confirm-")
    data_dir = tempfile.mkdtemp(prefix="streamrace-confirm-sub-")  # its races are not the program's report
    try:
        following = dict(json.loads(variable), dir=data_dir)
        environ = confirming.forcing_environ({
            **os.environ, env.SUBPROCESS: json.dumps(following),
            env.CONFIRM: json.dumps({"mode": "force", "out": folder, "plans": plans, "backend": backend, "seed": False})},
            backend)
        try:
            pid = job.spawn(program, environ, mask, quiet=True)
        except job.NotFound as exc:
            return [], None, None, str(exc)
        deadline = time.monotonic() + limit
        sent: list[float] = []

        def tick() -> None:
            now = time.monotonic()
            if now > deadline and not sent:
                sent.append(now)
                _signal(pid, signal.SIGTERM)
            elif sent and now > sent[0] + KILL_GRACE:
                _signal(pid, signal.SIGKILL)

        status, signo = job.watch(pid, tick)
        found = confirming.read_files(folder)
        if sent:
            return found, status, signo, f"the re-run ran past {limit:g} s"
        return found, status, signo, None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(data_dir, ignore_errors=True)


def _signal(pid: int, signo: int) -> None:
    try:
        os.kill(pid, signo)
    except ProcessLookupError:
        pass
