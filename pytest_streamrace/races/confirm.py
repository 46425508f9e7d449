"""``--streamrace-confirm``: each race a test reports, forced into its bad order in a re-run, with what it changed.

A test with races is re-run in fresh processes (a pytest of its own, ``python -m pytest NODEID`` with the session's
options; a ``distributed`` item's ranks forked again from the session's fork server), with ``STREAMRACE_CONFIRM``
set: first once as it is, to find where each race's accesses fall in a fresh process (the ops'
places on their threads: ``Site.ordinal``), then once per distinct race with that race's earlier access held back
(``detector/forced_order.py``). Both re-runs seed Python's, NumPy's and torch's generators the same way, so the
second takes the path the first did. Each process of a re-run (rank processes too, which inherit the variable)
writes what it saw to a file of its own in a folder the parent reads. A plain test's re-run runs its passes in one
process (``run_passes``) unless its races were in processes it started: those get their plans by rank from the
variable (``plans``; ``ForRank``), as the processes of a program under ``streamrace run --confirm`` do.

A race's confirmation is a dict on its record (``confirmation``): ``status`` "confirmed" (the bytes it touched change
under the forced order, or the test's outcome does), "not-confirmed" (the same values in the forced run: the race
cannot change what this test computes), or "not-tried" with the ``reason``; the numbers; and how long it took.

This module is the parent's side; the re-run's is ``races.confirm_run``, and what both harnesses share (the plans,
the holds, the verdict) ``races.confirmation``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING

from .. import env
from . import record as records_
from .confirmation import (NOT_TRIED, describe, forcing_environ, forcing_for, forcing_held_longer, next_hold,
                           read_files, verdict, why_not)

if TYPE_CHECKING:
    import pytest

# Variables a re-run must not inherit: it is no xdist worker, and no child of the test being confirmed; a repro's
# progress lines are the original run's.
_NOT_INHERITED = (env.SUBPROCESS, env.RANK_SPEC, env.PROGRESS, "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT",
                  "PYTEST_XDIST_TESTRUNUID", "PYTEST_CURRENT_TEST")



# ---- the parent: re-running a test


class Confirmer:
    """Confirms the races of the tests of one session (in the process that ran each test)."""

    def __init__(self, config: pytest.Config, torchrun: bool = False, launch=None):
        self.config = config
        self.torchrun = torchrun  # one rank of a torchrun session: its peers are not re-run with it
        self.timeout = 600.0
        # a distributed item's fresh ranks from this session's fork server, each rank's environment also given the
        # variables passed (its reports back): no new pytest session, torch import and fork server per re-run
        self.launch = launch

    def command(self, item: pytest.Item) -> list[str]:
        """``python -m pytest`` for this one test, with the session's options but not its test paths."""
        config = self.config
        paths = set(config.args)
        carried = [a for a in config.invocation_params.args if a not in paths]
        name = item.nodeid.split("::", 1)[1] if "::" in item.nodeid else ""
        target = f"{item.path}::{name}" if name else str(item.path)
        extra = ["-p", "no:cacheprovider", "-q", "--rootdir", str(config.rootpath)]
        if config.inipath:
            extra += ["-c", str(config.inipath)]
        if config.pluginmanager.hasplugin("xdist"):
            extra += ["-n", "0"]
        if config.pluginmanager.hasplugin("junitxml"):
            extra += ["--junitxml", os.devnull]
        return [sys.executable, "-m", "pytest", *_without_cache_options(carried), *extra, target]

    def _run(self, item: pytest.Item, instruction: dict) -> tuple[list[dict], str | None]:
        """One re-run: the files its processes wrote, or why there are none. A distributed item's ranks are forked again
        from this session's server (`launch`); any other test runs in a pytest process of its own."""
        folder = tempfile.mkdtemp(prefix="streamrace-confirm-")
        try:
            told = dict(instruction, out=folder, nodeid=item.nodeid)
            found, problem = self._relaunch(told) if self.launch is not None else self._in_new_pytest(item, told)
            return (found, None) if found else ([], problem)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _in_new_pytest(self, item: pytest.Item, instruction: dict) -> tuple[list[dict], str]:
        environ = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
        environ[env.CONFIRM] = json.dumps(instruction)
        environ.setdefault("PYTHONHASHSEED", "0")
        if instruction["mode"] == "force":
            forcing_environ(environ, instruction.get("backend", "virtual"))
        try:
            done = subprocess.run(self.command(item), cwd=str(self.config.invocation_params.dir), env=environ,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=self.timeout,
                                  start_new_session=True)
        except subprocess.TimeoutExpired:
            return [], f"the re-run ran past {self.timeout:g} s"
        return read_files(instruction["out"]), f"the re-run reported nothing (exit {done.returncode}): " \
                                               f"{_gist(done.stdout)}"

    def _relaunch(self, instruction: dict) -> tuple[list[dict], str]:
        """The ranks told the instruction through their environment; on GPUs a forced one's environment as
        ``forcing_environ`` makes it. Progress lines are the first run's."""
        extra = {env.CONFIRM: json.dumps(instruction), env.PROGRESS: None}
        if instruction["mode"] == "force":
            forced = forcing_environ(dict(os.environ), instruction.get("backend", "virtual"))
            extra.update((k, v) for k, v in forced.items() if os.environ.get(k) != v)
        reports = self.launch(extra)
        said = [str(r.longrepr) for r in reports if r.failed and r.longrepr is not None]
        return read_files(instruction["out"]), \
            f"the re-run reported nothing: {_gist(said[0].encode()) if said else 'its ranks passed'}"

    def confirm(self, item: pytest.Item, records: list[dict], outcome: str, backend: str) -> tuple[list[str], float]:
        """Give each of the test's race records its ``confirmation``; the report's lines about them."""
        started = time.perf_counter()
        todo: dict[tuple, list[dict]] = {}
        for data in records:
            todo.setdefault(records_.key(data), []).append(data)
        results: dict[tuple, dict] = {}
        unforced = (lambda data: "a test of a torchrun session is not re-run (its peers would have to be): run it "
                    "under @pytest.mark.distributed") if self.torchrun else why_not
        tryable = {k: group[0] for k, group in todo.items() if unforced(group[0]) is None}
        for k, group in todo.items():
            if k not in tryable:
                results[k] = {"status": NOT_TRIED, "reason": unforced(group[0])}
        in_children = any(data.get("pid") is not None for k in tryable for data in todo[k])
        if tryable and item.get_closest_marker("distributed") is None and not in_children:
            self._in_one_process(item, tryable, outcome, backend, results)
            tryable = {}
        located = None
        if tryable:  # a distributed item's ranks, and the processes a test starts, are new in each run, and a pass's
            # plan lives in the re-run's own process: a re-run to find the races, one to force each, each process told
            # its plan by the variable
            located, problem = self._run(item, {"mode": "locate"})
            if problem:
                for k in tryable:
                    results[k] = {"status": NOT_TRIED, "reason": problem}
                tryable = {}
        for k, data in tryable.items():
            one = time.perf_counter()
            forcing = forcing_for(k, located)
            if forcing is None:
                results[k] = {"status": NOT_TRIED, "reason": "the race did not show in a fresh process with the same "
                                                              "seeds"}
                continue
            before = None
            while True:
                forced, problem = self._run(item, dict(forcing, mode="force", backend=backend))
                result = verdict(forcing.get("plan") or next(iter(forcing["plans"].values())), forced, problem,
                                 outcome)
                longer = next_hold(before, [result])
                if longer is None:
                    break
                before, forcing = [result], forcing_held_longer(forcing, longer)
            result["seconds"] = round(time.perf_counter() - one, 3)
            results[k] = result
        total = round(time.perf_counter() - started, 3)
        for k, group in todo.items():
            for data in group:
                data["confirmation"] = dict(results[k], test_seconds=total)
        return [describe(todo[k][0], results[k]) for k in todo], total

    def _in_one_process(self, item, tryable: dict, outcome: str, backend: str, results: dict,
                        delay_ms: float | None = None) -> None:
        instruction = {"mode": "passes", "keys": [list(k) for k in tryable], "backend": backend}
        if delay_ms is not None:
            instruction["delay_ms"] = delay_ms
        found, problem = self._run(item, instruction)
        passes = {tuple(k): seen for f in found for k, seen in f.get("results", ())}
        retry: dict = {}
        for k in tryable:
            seen = passes.get(k)
            if problem or seen is None or "problem" in seen:
                reason = problem or (seen or {}).get("problem") or "the re-run never reached the race"
                results[k] = {"status": NOT_TRIED, "reason": reason}
                continue
            results[k] = dict(verdict(seen["plan"], [seen], None, outcome), seconds=seen.get("seconds", 0.0))
            longer = next_hold(None, [results[k]])
            if longer is not None:
                retry[k] = longer
        if retry:  # once more, those races with the longest hold any of them needs
            self._in_one_process(item, {k: tryable[k] for k in retry}, outcome, backend, results, max(retry.values()))


def attach(report: pytest.TestReport, confirmed: tuple[list[str], float]) -> None:
    """The confirmations' lines on a test's call report: in its failure text, else a section of their own."""
    lines, seconds = confirmed
    block = f"confirmations (each race forced into its bad order in a re-run; {seconds:.1f} s):\n" + "\n".join(
        "  " + line for line in lines)
    if report.failed and isinstance(report.longrepr, str):
        report.longrepr += "\n\n" + block
    else:
        report.sections.append(("stream race confirmations", block))


def _without_cache_options(args: list[str]) -> list[str]:
    """The carried options less those the re-run cannot take (the cache is off in it: --lf, --ff, --sw ...; it
    passes -q, which needs the terminal plugin an in-process caller such as the repro CLI turns off)."""
    dropped = {"--lf", "--last-failed", "--ff", "--failed-first", "--nf", "--new-first", "--sw", "--stepwise",
               "--sw-skip", "--stepwise-skip", "--cache-clear", "-pno:terminal"}
    out = []
    for a in args:
        if a == "no:terminal" and out and out[-1] == "-p":
            out.pop()
        elif a not in dropped:
            out.append(a)
    return out


def _gist(output: bytes) -> str:
    """What a re-run that wrote nothing printed: a crash's first lines and innermost frames, else its last lines."""
    lines = output.decode(errors="replace").strip().splitlines()
    for index, line in enumerate(lines):
        if line.startswith("Fatal Python error"):
            frames = [f.strip() for f in lines[index + 1:] if f.strip().startswith("File ")][:4]
            return " | ".join([line.strip(), *frames])
    return " | ".join(line.strip() for line in lines[-3:])


def confirm_distributed(item: pytest.Item, reports: list, backend: str, launch=None) -> None:
    """A ``distributed`` item's races (every rank's, on its teardown report), confirmed by re-running the item with
    fresh ranks (`launch`: from this session's fork server, as ``Confirmer`` takes it); the lines go on its call
    report."""
    teardown = next((r for r in reports if r.when == "teardown"), None)
    call = next((r for r in reports if r.when == "call"), None)
    if teardown is None or call is None:
        return
    found = [r for key, value in teardown.user_properties if key == records_.RACES for r in value]
    if not found:
        return
    outcomes = [value for key, value in teardown.user_properties if key == records_.OUTCOME]
    outcome = next((o for o in outcomes if o != "passed"), "passed")
    attach(call, Confirmer(item.config, launch=launch).confirm(item, found, outcome, backend))

