"""The pytest side of following each test into the Python processes it starts (the child side is
``children.child``; the data folder, the start-up hook and reading the records are ``following.Following``'s, which
``streamrace run`` uses as well), modelled on coverage.py's subprocess measurement: a start-up hook gated by an
environment variable, one data file per process, combined here.

While a test runs (from the start of its setup to the end of its teardown) this process's environment's
``STREAMRACE_SUBPROCESS`` and the live file ``<dir>/current`` name the test (the variable is there for the whole
session, naming no test between tests). At each judging point of the test
(its call and teardown reports) the children's files are read on from where they were left: races of this test fail
it like its own ones, and their notes (what they could not model) join the test's hints; races of a test that
already finished (a child that outlived it) go to the "after their test" section of the terminal summary and to
``--streamrace-json`` with ``"after_test": true``.

The start-up hook is a ``.pth`` file in this interpreter's site-packages for as long as the session runs
(``startup_hook``; one line that checks the variable, so it costs nothing otherwise). Where that folder is not
writable, children started by exec are not followed and the header says so; forked children are.

Limits: a child started with another interpreter (a different venv), with an environment that drops the variable, or
with ``python -S`` is not followed. Under xdist, races a worker's children judge after that worker's last test cannot
travel to the controller (no report is left to carry them) and are dropped. A child's trace is written when it exits
(``os._exit`` and interpreter exit included, not SIGKILL) and goes with the test it belongs to then.
"""

from __future__ import annotations

import os

from .. import env
from . import child
from .following import Following


class Children(Following):
    """The children of one pytest process: their data folder, the live test, what they reported."""

    def __init__(self, backend: str, trace: bool):
        super().__init__(backend, trace)
        # The variable is added once, as the session is configured (no thread of the session's yet), and only its
        # value changes while the session runs: adding or removing a variable can move the environment's array while
        # another thread reads it (glibc's getenv takes no lock, and threads a session starts read it: NCCL's
        # heartbeat monitor, as it starts), while a new value of a present one is one pointer stored in place.
        os.environ[env.SUBPROCESS] = self.variable("")  # owned by no test: a process started now is not followed
        self.current = ""
        self.finished: set[str] = set()
        self.after: list[dict] = []  # race dicts with "test": races of tests that had finished
        self.after_traces: list[tuple[str, list]] = []
        self.notes: list[tuple[int | None, str]] = []  # (rank, note) the running test's children's detectors said
        self._forks_armed = False

    # the test that runs

    def begin(self, nodeid: str) -> None:
        self.current = nodeid
        self.notes = []
        self.follow(nodeid)
        os.environ[env.SUBPROCESS] = self.variable(nodeid)
        if not self._forks_armed:
            self._forks_armed = True
            os.register_at_fork(after_in_child=self._forked)

    def end(self) -> None:
        self.finished.add(self.current)
        self.current = ""
        self.unfollow()
        os.environ[env.SUBPROCESS] = self.variable("")

    def close(self) -> None:
        os.environ.pop(env.SUBPROCESS, None)
        super().close()

    def _forked(self) -> None:
        """A child forked from this pytest process while a test runs: it reports the test's detector's races."""
        if not self.current or os.environ.get(env.SUBPROCESS) is None:
            return
        from ..detector import session

        detector = session.active()
        if detector is not None:
            config = {"dir": self.dir, "backend": self.backend, "trace": self.trace}
            child.adopt(detector, config, self.current)

    # what the children said

    def collect(self, nodeid: str | None) -> tuple[list[dict], list[tuple[int, list]]]:
        """Races (dicts with rank and pid) and traces ((pid, events)) the children wrote for test `nodeid` since the
        last call; records of finished tests go to `after`. Their notes (what they could not model) go to `notes`."""
        races, traces = [], []
        for record in self.read():
            test = record.get("test", "")
            if record.get("kind") == "race" and isinstance(record.get("race"), dict):
                race = dict(record["race"], pid=record.get("pid"))
                if test == nodeid and test not in self.finished:
                    races.append(race)
                else:
                    self.after.append(dict(race, test=test or "<between tests>"))
            elif record.get("kind") == "note" and isinstance(record.get("text"), str):
                note = (record.get("rank"), record["text"])
                if test == nodeid and test not in self.finished and note not in self.notes:
                    self.notes.append(note)
            elif record.get("kind") == "trace" and isinstance(record.get("events"), list):
                if test == nodeid and test not in self.finished:
                    traces.append((record.get("pid"), record["events"]))
                else:
                    self.after_traces.append((test or "<between tests>", record["events"]))
        return races, traces
