"""The side of a ``--streamrace-confirm`` re-run (``STREAMRACE_CONFIRM`` set: this process is one, or one of its
processes): seeds the generators, arms the planned race's forced order (``detector/forced_order.py``), and writes what
it saw to a file of its own in the folder the parent reads. A plain test's re-run runs its passes in this one process
(``run_passes``); a distributed item's ranks and the processes a test or a program under ``streamrace run --confirm``
started each force their own rank's plan (``ForRank``). pytest only for annotations: a followed process of a user's
program must not pay for it.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import TYPE_CHECKING

from .confirmation import plan_for, rank_key

if TYPE_CHECKING:
    import pytest


def seed_everything(seed: int = 0) -> None:
    """The same generators' states in every re-run of a test."""
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)


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
            self.plan = plan_for(key, [located])
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
                                        float(plan.get("delay_ms", 200.0)), incidental)
                       for key, plan in plans.items()}
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
        for order in self.orders.values():
            order.install(capture)  # each learns the capture, and where a task of its race starts
        capture.set_forcing(self.reached, sorted({n for order in self.orders.values() for n in order.ordinals()}))
        from ..detector.models import host_handoffs

        host_handoffs.task_watch = self._task_started

    def _task_started(self, task: str, base: int) -> None:
        for order in ([self.orders[self.key]] if self.key is not None else self.orders.values()):
            order.task_started(task, base)

    def reached(self, *args) -> None:
        if self.key is None and rank_key(self.rank_of()) in self.orders:
            self.key = rank_key(self.rank_of())
        if self.key is not None:
            self.orders[self.key].reached(*args)

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

