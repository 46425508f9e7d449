"""Runs one variant of a repro: its shipped pytest item, through the plugin's launcher, and returns the verdict.

Going through pytest (in this process, its terminal output off) means a repro's ranks get everything a user's
distributed test gets: fresh rank processes, crash and hang reports with rank stacks, the race detector per rank.
The evidence comes back on the item's report (``user_properties``), merged over the ranks by the launcher.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .. import env
from ..races.record import EVIDENCE, RACES
from ..races.record import key as race_key
from .evidence import judge, per_run


def _test_module() -> Path:
    import pytest_streamrace.repros as shipped  # a mapped folder in editable installs: ask the package

    return Path(shipped.__file__).resolve().parent / "test_repros.py"


@dataclass
class Outcome:
    repro: str
    variant: str
    expect: str
    backend: str
    verdict: str  # reproduced | clean | inconclusive | error
    reason: str
    seconds: float
    races: list = field(default_factory=list)
    numeric: list = field(default_factory=list)
    failure: str = ""  # the item's report when the run itself failed (crash, hang, exception in a rank)
    confirmations: list = field(default_factory=list)  # --confirm: per distinct race, its confirmation and line
    confirmed: dict | None = None  # --confirm: {confirmed, races, agrees, summary, seconds}

    @property
    def expected(self) -> bool:
        return self.verdict == self.expect


class _Collector:
    """Catches the item's reports inside pytest.main."""

    def __init__(self):
        self.evidence: list[dict] = []
        self.races: list[dict] = []  # the detector's records, merged over the ranks (with their confirmations)
        self.failures: list[str] = []
        self.skipped = ""

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_logreport(self, report):
        """Around the plugin's own: it turns the teardown report's race records into their count for junit XML."""
        for key, value in report.user_properties:
            if key == EVIDENCE:
                self.evidence.append(value)
            elif key == RACES and report.when == "teardown" and isinstance(value, list):
                self.races += value
        if report.failed:
            self.failures.append(f"[{report.when}] {report.longreprtext}")
        elif report.skipped and isinstance(report.longrepr, tuple):
            self.skipped = report.longrepr[2]
        return (yield)

    def pytest_collectreport(self, report):
        if report.failed:
            self.failures.append(f"[collect] {report.longreprtext}")


def _tail_progress(path: str, stop: threading.Event, prefix: str) -> None:
    with open(path, "a+", encoding="utf-8") as f:
        f.seek(0)
        while not stop.is_set():
            line = f.readline()
            if line:
                print(f"{prefix}{line.rstrip()}", flush=True)
            else:
                time.sleep(0.05)
        for line in f.readlines():
            print(f"{prefix}{line.rstrip()}", flush=True)


def run_variant(repro, variant: str, backend: str, world_size: int, steps: int, repeat: int = 1,
                trace: str | None = None, timeout: float = 600.0, confirm: bool = False) -> list[Outcome]:
    """Run `repeat` runs of one variant in one launch of its ranks; one Outcome per run. With `confirm`, the
    launcher re-runs the item with each race forced (``--streamrace-confirm``) and each outcome says what that
    found beside the referee's verdict."""

    expect = repro.variant(variant).expect
    collector = _Collector()
    with tempfile.TemporaryDirectory(prefix="streamrace-repro-") as tmp:
        ini = os.path.join(tmp, "pytest.ini")
        Path(ini).write_text("[pytest]\n")  # the user's own pytest configuration must not leak into the run
        progress = os.path.join(tmp, "progress")
        args = [f"{_test_module()}::test_repro[{repro.name}-{variant}]", "-c", ini, "--rootdir", tmp,
                "-p", "no:terminal", "-p", "no:cacheprovider", "--streamrace", f"--streamrace-backend={backend}",
                f"--streamrace-timeout={timeout}"]
        if trace:
            args.append(f"--streamrace-trace={trace}")
        if confirm:
            args.append("--streamrace-confirm")
        settings = {env.PROGRESS: progress,
                    env.REPRO: json.dumps({"world_size": world_size, "steps": steps, "repeat": repeat})}
        saved = {k: os.environ.get(k) for k in settings}
        os.environ.update(settings)
        stop = threading.Event()
        tail = threading.Thread(target=_tail_progress, args=(progress, stop, f"  [{variant}] "), daemon=True)
        tail.start()
        start = time.perf_counter()
        try:
            pytest.main(args, plugins=[collector])
        finally:
            stop.set()
            tail.join()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        seconds = time.perf_counter() - start
    failed = Outcome(repro.name, variant, expect, backend, "error", "", seconds)
    if collector.skipped:
        failed.reason = f"skipped: {collector.skipped}"
        return [failed]
    runs = min((len(ev["runs"]) for ev in collector.evidence), default=0)
    if not runs:
        failed.reason = "the ranks reported no evidence (the run failed; see below)"
        failed.failure = "\n".join(collector.failures) or "no report came back"
        return [failed]
    outcomes = []
    for i in range(runs):
        verdict = judge(per_run(collector.evidence, i), repro.relevant)
        outcome = Outcome(repro.name, variant, expect, backend, verdict.verdict, verdict.reason, seconds / runs,
                          verdict.races, verdict.numeric)
        if confirm:
            outcome.confirmations, outcome.confirmed = confirmations(verdict.verdict, verdict.races, collector.races,
                                                                     races_are_evidence=repro.relevant is not None)
            outcome.seconds = max(0.0, outcome.seconds - outcome.confirmed["seconds"] / runs)  # the run's own time
        outcomes.append(outcome)
    return outcomes


def confirmations(verdict: str, races: list[dict], confirmed: list[dict],
                  races_are_evidence: bool = True) -> tuple[list[dict], dict]:
    """The confirmation of each distinct race the verdict rests on (from the launcher's records, matched by
    kind and both locations), and whether they agree with the referee's verdict: a reproduced bug agrees when at
    least one of its races is confirmed, a clean variant when it has none to confirm. A bug whose evidence is not a
    race (a buffer kept past its phase, which the referee measures directly) has nothing to force."""
    from ..races.confirmation import CONFIRMED, describe

    by_key = {race_key(r): r for r in confirmed if r.get("confirmation")}
    out, seen = [], set()
    for race in races:
        k = race_key(race)
        if k in seen:
            continue
        seen.add(k)
        found = by_key.get(k)
        result = dict(found["confirmation"]) if found else {"status": "not-tried",
                                                            "reason": "the forced re-runs did not report this race"}
        out.append(dict(result, line=describe(race, result)))
    n = sum(1 for c in out if c["status"] == CONFIRMED)
    agrees = {"reproduced": n > 0, "clean": not out}.get(verdict)
    if not races_are_evidence:
        agrees = None
        summary = f"nothing to force: this bug's evidence is not a race; its referee's verdict stands ({verdict})"
    elif agrees is None:
        summary = f"confirmed {n} of {len(out)}; the referee gave no verdict ({verdict})"
    else:
        summary = f"confirmed {n} of {len(out)}; {'agrees' if agrees else 'disagrees'} with the referee ({verdict})"
    seconds = max((float(c.get("test_seconds", 0.0)) for c in out), default=0.0)
    return out, {"confirmed": n, "races": len(out), "agrees": agrees, "summary": summary, "seconds": seconds}
