"""The rank side of a ``distributed`` item: a pytest session that runs that one item as one rank.

The rank joins the item's process group, runs the item the normal way (so every fixture is set up in the rank),
and streams each phase's report to its parent as JSON lines, serialized as pytest serializes them for xdist. After
its last phase it does not tear the process group down: a rank that failed early and closed its connections would
make its peers fail with "connection closed" errors that hide the real one. It parks until the parent releases it
(all ranks finished) or kills it.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import time

import pytest

from .. import env
from . import spec as spec_mod
from .spec import RankSpec

_stack_file = None  # kept open for faulthandler, which writes to its fd from a signal handler


def spec_from_env() -> RankSpec | None:
    return spec_mod.from_env()


def arm_stack_dump(spec: RankSpec) -> None:
    """SIGUSR1 → this process's Python stacks, all threads, into the spec's stack file (the parent reads them)."""
    global _stack_file
    if _stack_file is None:
        _stack_file = open(spec.stacks, "a")
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)


def install(config: pytest.Config) -> None:
    spec = spec_from_env()
    arm_stack_dump(spec)
    # The parent shows what the test printed (from the reports); pytest's own progress lines are noise there.
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    if terminal is not None:
        config.pluginmanager.unregister(terminal)
    config.pluginmanager.register(RankPlugin(spec, config), "streamrace-rank")


class RankPlugin:
    def __init__(self, spec: RankSpec, config: pytest.Config):
        self.spec = spec
        self.config = config
        self._fd = os.open(spec.result, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def _write(self, record: dict) -> None:
        os.write(self._fd, (json.dumps(record, default=repr) + "\n").encode())

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self._write({"kind": "error", "message": f"collecting {report.nodeid} failed:\n{report.longreprtext}"})

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if len(session.items) != 1:
            found = ", ".join(item.nodeid for item in session.items) or "nothing"
            self._write({"kind": "error", "message": f"expected to collect one item, collected {found}"})

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        # Not tryfirst: skip/skipif marks (tryfirst) decide first; the fixtures (set up after this) see the group.
        _join_process_group(self.spec)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """The report as pytest serializes it (as xdist ships its workers'), so the parent gets the structured
        traceback, rendered in the session's ``--tb`` style, not just its text."""
        data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
        data["user_properties"] = [[str(k), _jsonable(v)] for k, v in report.user_properties]
        self._write({"kind": "report", **data})

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self) -> None:
        self._write({"kind": "done"})
        while not os.path.exists(self.spec.release):
            time.sleep(0.01)
        _leave_process_group()


def _join_process_group(spec: RankSpec) -> None:
    import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        return
    eager = {}
    if spec.device is not None:
        import torch

        torch.cuda.set_device(spec.device)
        if os.environ.get(env.CONFIRM):
            # a confirmation's re-run makes the communicator now, not at the first collective: a communicator's setup
            # may wait for the work queued on the device, and there it would wait out a held stream's sleep and keep
            # the race in its ordered order
            eager["device_id"] = torch.device("cuda", spec.device)
    store = dist.FileStore(spec.store, spec.world_size)
    dist.init_process_group(spec.backend, store=store, rank=spec.rank, world_size=spec.world_size,
                            timeout=datetime.timedelta(seconds=spec.timeout + 60), **eager)
    if eager and "nccl" in spec.backend:
        # and runs the communicator's first collective now, then waits for it: with the communicator made and its
        # peers connected, a rank's first all-reduce still blocked its host for a held stream's whole sleep (2×H200)
        import torch

        dist.all_reduce(torch.zeros(1, device=eager["device_id"]))
        torch.cuda.synchronize()


def _leave_process_group() -> None:
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_initialized():
        dist.destroy_process_group()


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)
