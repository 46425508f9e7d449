"""``--streamrace-confirm``: each race a test reports, forced into its bad order in a re-run, with what it changed.

A test with races is re-run in fresh processes (``python -m pytest NODEID`` with the session's own options and
``STREAMRACE_CONFIRM`` set): first once as it is, to find where each race's accesses fall in a fresh process (the ops'
places on their threads: ``Site.ordinal``), then once per distinct race with that race's earlier access held back
(``detector/forced_order.py``). Both re-runs seed Python's, NumPy's and torch's generators the same way, so the
second takes the path the first did. Each process of a re-run (rank processes too, which inherit the variable)
writes what it saw to a file of its own in a folder the parent reads. A plain test's re-run runs its passes in one
process (``run_passes``) unless its races were in processes it started: those get their plans by rank from the
variable (``plans``; ``ForRank``), as the processes of a program under ``streamrace run --confirm`` do.

A race's confirmation is a dict on its record (``confirmation``): ``status`` "confirmed" (the bytes it touched change
under the forced order, or the test's outcome does), "not-confirmed" (the same values in the forced run: the race
cannot change what this test computes), or "not-tried" with the ``reason``; the numbers; and how long it took.

``streamrace run --confirm`` shares the re-run's side (``ConfirmRun``, armed in each followed process by
``children.child``) and the verdict (``plan_of``, ``verdict``, ``describe``); so this module imports pytest only for
its annotations: a followed process of a user's program must not pay for it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING

from .. import env
from . import record as records_

if TYPE_CHECKING:
    import pytest

# Variables a re-run must not inherit: it is no xdist worker, and no child of the test being confirmed; a repro's
# progress lines are the original run's.
_NOT_INHERITED = (env.SUBPROCESS, env.RANK_SPEC, env.PROGRESS, "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT",
                  "PYTEST_XDIST_TESTRUNUID", "PYTEST_CURRENT_TEST")
_FORCED = {"read-after-write", "write-after-read", "write-after-write"}
CONFIRMED, NOT_CONFIRMED, NOT_TRIED = "confirmed", "not-confirmed", "not-tried"


def forcing_environ(environ: dict, backend: str) -> dict:
    """A forced re-run's environment, where it has no warm-up pass (a distributed item's ranks, a program's processes).
    CUDA loads a kernel's module at the kernel's first launch (torch asks for lazy loading), and a load may synchronize
    the context: the first launch of the later access's kernel then blocks the host until the held stream's sleep is
    over, and the later access can never go first. On GPUs such a re-run loads every module as its context is made.
    NCCL (2.22 on) connects a communicator's peers at its first collective, not as it is made: where that first
    collective is the later access, its setup is work of the same kind, so the re-run's communicators connect as they
    are made (unless the user set otherwise)."""
    if backend == "cuda":
        environ["CUDA_MODULE_LOADING"] = "EAGER"
        environ.setdefault("NCCL_RUNTIME_CONNECT", "0")
    return environ


def seed_everything(seed: int = 0) -> None:
    """The same generators' states in every re-run of a test."""
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)


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

    def confirm(self, item: pytest.Item, records: list[dict], outcome: str, backend: str) -> list[str]:
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
            forcing = _forcing(k, located)
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
                before, forcing = [result], _held_longer(forcing, longer)
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
            longer = _longer_hold(results[k])
            if longer is not None:
                retry[k] = longer
        if retry:  # once more, those races with the longest hold any of them needs
            self._in_one_process(item, {k: tryable[k] for k in retry}, outcome, backend, results, max(retry.values()))


MAX_HOLD_MS = 10_000.0


def _longer_hold(result: dict) -> float | None:
    """The hold to try next where a GPU hold was too short to invert the order, else None: the host took longer
    between the two accesses than the held stream slept (a communicator's first use, a kernel's first launch), so
    the held access ran first anyway. Twice what it took, up to MAX_HOLD_MS."""
    delay, gap = result.get("delay_ms"), result.get("host_gap_ms", 0.0)
    if delay is None or delay >= MAX_HOLD_MS or result.get("host_waited"):
        return None
    short = (result["status"] == NOT_TRIED and "did not invert" in str(result.get("reason"))) or \
        (result["status"] == NOT_CONFIRMED and result.get("held_by") and gap > delay / 2)
    return min(MAX_HOLD_MS, 2 * (gap + delay)) if short else None


def next_hold(before: list[dict] | None, results: list[dict]) -> float | None:
    """The hold for another forced run of a race whose last one gave `results` (one per record of it: a rank's; in
    `before`, the run before it, in the same order), or None where there is to be none: none once a host waited for
    the held stream, else the longest any asks. Each harness's re-runs of a race follow this."""
    marked = [_grew_with_hold(b, r) for b, r in zip(before or [None] * len(results), results)]
    if any(r.get("host_waited") for r in marked):
        return None
    asked = [hold for hold in map(_longer_hold, marked) if hold is not None]
    return max(asked) if asked else None


def _grew_with_hold(before: dict | None, result: dict) -> dict:
    """`result`, marked `host_waited` where the host's gap between the two accesses grew by about as much as the hold
    did since the try `before`: something between them waits for the held stream, every time, so a longer hold only
    makes it wait longer. Said as the reason, with both tries' numbers."""
    if before is None or result.get("status") != NOT_TRIED or result.get("host_waited"):
        return result
    try:
        added = result["delay_ms"] - before["delay_ms"]
        grew = result["host_gap_ms"] - before["host_gap_ms"]
    except (KeyError, TypeError):
        return result
    if added <= 0 or grew < 0.8 * added:
        return result
    result.update(host_waited=True, reason=(
        f"the host's gap between the two accesses grew with the hold ({before['host_gap_ms']:.0f} ms at a "
        f"{before['delay_ms']:g} ms hold, {result['host_gap_ms']:.0f} ms at {result['delay_ms']:g} ms): something "
        f"between the two waits for the held stream, so no hold inverts them ({result.get('reason')})"))
    return result


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


def read_files(folder: str) -> list[dict]:
    """What a re-run's processes wrote into `folder`, a JSON file each (one cut short by a crash is left out)."""
    found = []
    for name in sorted(os.listdir(folder)):
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                found.append(json.load(f))
        except (OSError, ValueError):
            continue
    return found


def _gist(output: bytes) -> str:
    """What a re-run that wrote nothing printed: a crash's first lines and innermost frames, else its last lines."""
    lines = output.decode(errors="replace").strip().splitlines()
    for index, line in enumerate(lines):
        if line.startswith("Fatal Python error"):
            frames = [f.strip() for f in lines[index + 1:] if f.strip().startswith("File ")][:4]
            return " | ".join([line.strip(), *frames])
    return " | ".join(line.strip() for line in lines[-3:])


INCIDENTAL = " (incidental)"  # the end of a latent race's sync op where an incidental-sync rule made it one


def why_not(data: dict) -> str | None:
    """Why a race record cannot be forced (None: it can), wherever its process is."""
    if data.get("latent") and not str(data["latent"].get("op", "")).endswith(INCIDENTAL):
        return "a latent race: its order is kept today by a host sync at {} that the program needs".format(
            data["latent"].get("at") or data["latent"].get("op"))
    if data.get("kind") not in _FORCED:
        return "a free's reuse is not forced"
    if not data.get("earlier", {}).get("ordinal") or not data.get("later", {}).get("ordinal"):
        return "its ops were not captured (the C++ capture is off, or a model made them)"
    return None


def _plan(k: tuple, located: list[dict] | None) -> dict | None:
    for found in located or ():
        for data in found.get("races", ()):
            if records_.key(data) == k and data["earlier"].get("ordinal") and data["later"].get("ordinal"):
                return plan_of(data)
    return None


def _forcing(k: tuple, located: list[dict] | None) -> dict | None:
    """A forced re-run's plans for race `k` as the locating re-run placed it: ``plan`` for the test's own process
    (each rank's, for a distributed item), and ``plans`` by rank (``rank_key``) for the processes the test started,
    which pick theirs when the capture first reaches one of its ops (``ForRank``). None: it did not show."""
    own, plans = None, {}
    for found in located or ():
        for data in found.get("races", ()):
            if records_.key(data) != k or not (data["earlier"].get("ordinal") and data["later"].get("ordinal")):
                continue
            if data.get("pid") is None:
                own = own or plan_of(data)
            else:
                plans.setdefault(rank_key(data.get("rank")), plan_of(data))
    if own is None and not plans:
        return None
    return {"plan": own, "plans": plans} if plans else {"plan": own}


def held_longer(plan: dict, delay_ms: float) -> dict:
    """A forced run's plan with a longer hold."""
    return dict(plan, delay_ms=delay_ms)


def _held_longer(forcing: dict, delay_ms: float) -> dict:
    out = {"plan": held_longer(forcing["plan"], delay_ms) if forcing.get("plan") else None}
    if "plans" in forcing:
        out["plans"] = {rank: held_longer(plan, delay_ms) for rank, plan in forcing["plans"].items()}
    return out


def rank_key(rank) -> str:
    """A plan's key in ``plans``: the rank its process reported ("none": a process without one)."""
    return "none" if rank is None else str(rank)


def plan_of(data: dict) -> dict:
    """What a forced run needs of a race record (one with both ordinals): its kind and its two ops' places; for a
    latent race (only an incidental sync orders it today), that sync, which the forced run skips."""
    plan = {"kind": data["kind"], "earlier": _side(data["earlier"]), "later": _side(data["later"]),
            "dtype": _dtype(data)}
    if data.get("latent"):
        plan["skipped"] = data["latent"].get("at")
    return plan


def _dtype(data: dict) -> str:
    """The dtype the race's bytes are compared in: the later access's, unless it sees them as raw bytes (a copy of
    untyped storage, as DCP's stager makes) and the earlier one knows better."""
    later, earlier = data["later"]["tensor"]["dtype"], data["earlier"]["tensor"]["dtype"]
    return earlier if later == "uint8" and earlier != "uint8" else later


def _side(access: dict) -> dict:
    thread = access.get("thread")
    return {"thread_key": thread["name"] if thread else None, "ordinal": access["ordinal"], "op": access["op"],
            "rw": access["rw"], "start": access["start"], "end": access["end"],
            "at": _at(access)}


def _at(access: dict) -> str:
    return records_.location(access.get("frames") or ())


def verdict(plan: dict, forced: list[dict], problem: str | None, outcome: str) -> dict:
    """A race's confirmation from the files a forced run's processes wrote (or why there are none), against the
    outcome of the run that reported it."""
    if problem:
        return {"status": NOT_TRIED, "reason": problem}
    results = [f.get("forced") for f in forced if f.get("forced")]
    done = [r for r in results if r.get("status") == "forced"]
    outcomes = [f.get("outcome") for f in forced if f.get("outcome")]
    forced_outcome = next((o for o in outcomes if o != "passed"), outcomes[0] if outcomes else None)
    if not done:
        tried = [r for r in results if r.get("reason")]
        if not tried:
            return {"status": NOT_TRIED, "reason": "the re-run never reached the race"}
        # the hold's numbers; `host_waited` also tells `_longer_hold` that a longer hold would only be waited out
        numbers = {k: tried[0][k] for k in ("delay_ms", "host_gap_ms", "lead_ms", "slept_ms", "later_call_ms",
                                           "host_waited", "held_by") if k in tried[0]}
        return {"status": NOT_TRIED, "reason": tried[0]["reason"], **numbers}
    best = max(done, key=lambda r: (r.get("differing", 0), r.get("max_abs_diff", 0.0)))
    out = {k: v for k, v in best.items() if k != "status"}
    out["held"] = plan["earlier"]["at"]
    if plan.get("skipped"):
        out["skipped_sync"] = plan["skipped"]
    out["observed"] = plan["later"]["at"]
    out["runs"] = 1
    out["outcome"] = {"ordered": outcome, "forced": forced_outcome}
    changed = best.get("differing", 0) > 0 or (forced_outcome is not None and forced_outcome != outcome)
    out["status"] = CONFIRMED if changed else NOT_CONFIRMED
    return out


def describe(data: dict, result: dict, unit: str = "test") -> str:
    """One line (or two) a person reads: what was forced and what changed (`unit`: what ran, "test" or "program")."""
    kind = records_.kind_of(data)
    where = f"{kind} {_at(data.get('earlier', {}))} -> {_at(data.get('later', {}))}"
    status = result["status"]
    if status == NOT_TRIED:
        return f"not tried: {where}: {result.get('reason')}"
    rw = data["earlier"]["rw"]
    seen = "left behind" if data["kind"] == "write-after-write" and not result.get("read_modify_write") else "read"
    skipped = f" and the incidental sync at {result['skipped_sync']} skipped" if result.get("skipped_sync") else ""
    what = (f"with the {rw} at {result['held']} held back{skipped}, the values {seen} at "
            f"{result['observed'] if data['kind'] != 'write-after-read' else result['held']}")
    if status == NOT_CONFIRMED:
        why = " (the later write leaves what it reads unchanged here)" if result.get("identity") else ""
        return f"not confirmed: {where}: {what} were identical in {result.get('runs', 1)} forced run{why}"
    line = f"confirmed: {where}: {what} differed"
    if "max_abs_diff" in result:
        line += f" by max |Δ| = {result['max_abs_diff']:.6g}"
    line += f" in {result.get('differing', 0):,} of {result.get('elements', 0):,} elements"
    if result.get("unwritten"):
        line += " (the read saw bytes the write had not written yet)"
    if result.get("forced_nonfinite"):
        line += f"; {result['forced_nonfinite']:,} not finite"
    forced = (result.get("outcome") or {}).get("forced")
    if forced and forced != (result.get("outcome") or {}).get("ordered"):
        line += f"; the {unit} then {forced}"
    return line


# ---- the re-run: this session is one


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


class ConfirmRun:
    """In a re-run (``STREAMRACE_CONFIRM`` set): seeds, forces the planned race, writes what it saw.

    The test's own process (or a distributed item's rank) forces ``plan``; a process the test (or a program under
    ``streamrace run``) started is given `rank_of` and forces its rank's plan of ``plans`` (``ForRank``)."""

    def __init__(self, instruction: dict, rank_of=None):
        self.mode = instruction["mode"]  # "passes" (a plain test), or "locate" / "force" (one re-run each)
        self.out = instruction["out"]
        self.plan = instruction.get("plan")
        self.plans = (instruction.get("plans") or {}) if rank_of is not None else {}
        self.rank_of = rank_of
        self.keys = [tuple(k) for k in instruction.get("keys", ())]
        self.delay_ms = instruction.get("delay_ms")  # a GPU hold's length, where a first one was too short
        self.backend = instruction.get("backend", "virtual")
        self.seed = instruction.get("seed", True)  # a program under ``streamrace run`` seeds itself
        self.rank = instruction.get("rank")  # said in the file, where the re-run's processes have ranks
        self.order = None  # what the capture calls: a ForcedOrder, or a ForRank of them
        self.orders: dict = {}  # plan key ("own", or a rank_key) -> its ForcedOrder
        self.unskip = None  # puts back the syncs a forced pass skipped
        self.phase = self.mode  # what the pass running now is for: "warm", "locate" or "force"
        self.passes_seen: list[dict] = []  # what each pass of "passes" left: its races or its forced order, outcome

    def run_passes(self, item: pytest.Item) -> None:
        """A plain test's whole confirmation in this one process, its reports not logged: a warm-up pass (a fresh
        process loads kernels, builds caches and makes lazy state on first use, which moves ops' places and, on a
        GPU, can block the host while a held stream sleeps: a kernel's first launch loads its module), a pass that
        finds the races' places, then a pass per race forcing its bad order."""
        from _pytest.runner import runtestprotocol

        def one(phase: str) -> dict:
            self.phase = phase
            started = time.perf_counter()
            try:
                runtestprotocol(item, nextitem=item.parent, log=False)  # its own fixtures torn down, wider ones kept
            finally:
                if hasattr(item, "_initrequest"):  # a function item's fixtures, set up afresh for the next pass
                    item._initrequest()
            seen = self.passes_seen.pop() if self.passes_seen else {}
            return dict(seen, seconds=round(time.perf_counter() - started, 3))

        one("warm")
        located = one("locate")
        results = []
        for key in self.keys:
            self.plan = _plan(key, [located])
            if self.plan is not None and self.delay_ms is not None:
                self.plan["delay_ms"] = self.delay_ms
            if self.plan is None:
                results.append([list(key), {"problem": "the race did not show in a fresh process with the same "
                                                       "seeds"}])
                continue
            results.append([list(key), dict(one("force"), plan=self.plan)])
        self._write({"pid": os.getpid(), "outcome": located.get("outcome"), "results": results})

    def _plans(self) -> dict:
        if self.rank_of is not None:
            return self.plans
        return {"own": self.plan} if self.plan else {}

    def start(self, detector, incidental=()) -> None:
        if self.seed:
            seed_everything()
        plans = self._plans()
        if self.phase != "force" or not plans:
            return  # (a test whose race is in a process it started forces nothing itself)
        if any(plan.get("skipped") for plan in plans.values()):
            from ..detector.forced_order import skip_syncs

            self.unskip = skip_syncs(incidental)
        from ..detector.forced_order import ForcedOrder

        self.orders = {key: ForcedOrder(plan["kind"], plan["earlier"], plan["later"], self.backend,
                                        float(plan.get("delay_ms", 200.0))) for key, plan in plans.items()}
        self.order = self.orders["own"] if self.rank_of is None else ForRank(self.orders, self.rank_of)
        problem = detector.force(self.order)
        for order in self.orders.values():
            order.problem = order.problem or problem

    def picked(self) -> bool:
        """Whether this followed process has reached its rank's race (its forced order is in use)."""
        return isinstance(self.order, ForRank) and self.order.key is not None

    def finish(self, detector, races: list[dict], outcome: str) -> None:
        if self.phase == "warm":
            return
        rank = self.rank if self.rank_of is None else self.rank_of()
        data: dict = {"pid": os.getpid(), "outcome": outcome, "rank": rank}
        if self.phase == "locate":
            data["races"] = races
        elif self.order is not None:
            detector.force(None)
            if self.unskip is not None:
                self.unskip()
                self.unskip = None
            key = "own" if self.rank_of is None else self.order.key or rank_key(rank)
            self.order = None
            if key not in self.orders:
                return  # a process of a rank with no plan: it ran as it is, and has nothing to say
            data["forced"] = self.orders[key].result(self._plans()[key].get("dtype"))
        if self.mode == "passes":
            self.passes_seen.append(data)
        else:
            self._write(data)

    def _write(self, data: dict) -> None:
        path = os.path.join(self.out, f"{os.getpid()}-{time.monotonic_ns()}.json")
        try:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(data, f)
        except OSError:
            pass


class ForRank:
    """The forced orders of a process a test or program started, one per rank that reported the race; the process
    uses its own rank's, picked when the capture first reaches one of their ops, not when it starts: a harness's rank
    process learns its rank later (``init_process_group``, ``RANK`` set by the harness in the child)."""

    def __init__(self, orders: dict, rank_of):
        self.orders, self.rank_of = orders, rank_of
        self.key: str | None = None  # the rank_key of the order in use, once picked

    def install(self, capture) -> None:
        capture.set_forcing(self._called, sorted({side.ordinal for order in self.orders.values()
                                                  for side in (order.earlier, order.later)}))

    def _called(self, *args) -> None:
        if self.key is None and rank_key(self.rank_of()) in self.orders:
            self.key = rank_key(self.rank_of())
        if self.key is not None:
            self.orders[self.key]._called(*args)

    def collective_returned(self, result) -> None:
        if self.key is not None:
            self.orders[self.key].collective_returned(result)


def outcome_of(excinfo) -> str:
    """A test body's own outcome, as a confirmation compares it: "passed", or "failed with <Error>: <message>"."""
    if excinfo is None:
        return "passed"
    value = excinfo.value
    message = str(value).strip().splitlines()[0][:160] if str(value).strip() else ""
    return f"failed with {type(value).__name__}" + (f": {message}" if message else "")
