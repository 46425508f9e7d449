"""Watching the ranks of one item until each has finished, failed, died or hung — then leaving none behind.

Polled (every 20 ms) rather than event-driven: the signals to watch are files the ranks append to and exit
reports from the fork server, and a poll keeps the rules in one readable loop:
- every rank finished → release them (they tear the process group down and exit);
- a rank failed, skipped or died while others still run → those get a short grace to finish, then their
  Python stacks are dumped (they are usually blocked in a collective the failed rank never reached) and killed;
- the timeout passed → stacks of the ranks still running, then kill.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field

from .ranks import ForkServer, kill_tree
from .spec import RankSpec

POLL = 0.02
GRACE = 2.5  # seconds the other ranks get after a rank failed, skipped or died
STACK_WAIT = 2.0  # seconds to wait for a rank's faulthandler dump
EXIT_WAIT = 10.0  # seconds a released rank may take to exit before it is killed


@dataclass
class RankRun:
    spec: RankSpec
    pid: int
    output: str
    records: list[dict] = field(default_factory=list)
    exit_status: int | None = None
    stopped: str | None = None  # "blocked" (after a peer's failure) or "timeout"
    stack: str = ""
    _offset: int = 0

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def done(self) -> bool:
        return any(r["kind"] == "done" for r in self.records)

    @property
    def running(self) -> bool:
        return not self.done and self.exit_status is None

    @property
    def in_trouble(self) -> bool:
        """Failed, skipped, xfailed, could not run, or died: its peers will likely never finish a collective."""
        if self.exit_status is not None and not self.done:
            return True
        return any(r["kind"] == "error" or r.get("outcome") in ("failed", "skipped") for r in self.records)

    def read_records(self) -> None:
        try:
            with open(self.spec.result, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        self.records += [json.loads(line) for line in complete.splitlines()]


def supervise(server: ForkServer, runs: list[RankRun], timeout: float) -> float:
    """Run until the item is decided; kill every rank tree before returning. Returns the seconds it took."""
    start = time.monotonic()
    trouble_since = None
    released = False
    try:
        while True:
            _refresh(server, runs, POLL)
            now = time.monotonic()
            running = [r for r in runs if r.running]
            if not running:
                break
            if trouble_since is None and any(r.in_trouble for r in runs):
                trouble_since = now
            if trouble_since is not None and now - trouble_since > GRACE:
                _stop(running, "blocked")
                break
            if now - start > timeout:
                _stop(running, "timeout")
                break
        _release(runs)
        released = True
    finally:  # also on KeyboardInterrupt: then nothing was released, and everything is killed at once
        reap(server, runs, EXIT_WAIT if released else 0.0)
    return time.monotonic() - start


def reap(server: ForkServer, runs: list[RankRun], wait: float = 0.0) -> None:
    """Make sure no rank of the item is left: released ranks get `wait` seconds to exit, then everything is killed."""
    _wait_exits(server, runs, wait)
    for r in runs:
        if r.pid not in server.exits:
            kill_tree(r.pid)
    _wait_exits(server, runs, EXIT_WAIT)
    for r in runs:
        r.read_records()
        if r.exit_status is None:
            r.exit_status = server.exits.get(r.pid, -signal.SIGKILL)


def _refresh(server: ForkServer, runs: list[RankRun], wait: float) -> None:
    exits = server.poll(wait)
    for r in runs:
        if r.exit_status is None and r.pid in exits:
            r.read_records()  # what it wrote before exiting
            r.exit_status = exits[r.pid]
        else:
            r.read_records()


def _stop(runs: list[RankRun], why: str) -> None:
    """Dump each rank's Python stack (faulthandler on SIGUSR1), then kill its tree."""
    for r in runs:
        r.stopped = why
        try:
            os.kill(r.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STACK_WAIT
    sizes: dict[int, int] = {}
    while time.monotonic() < deadline:
        settled = True
        for r in runs:
            size = _size(r.spec.stacks)
            if size == 0 or sizes.get(r.rank) != size:
                settled = False
            sizes[r.rank] = size
        if settled:
            break
        time.sleep(POLL * 2)
    for r in runs:
        kill_tree(r.pid)
        with open(r.spec.stacks, errors="replace") as f:
            r.stack = f.read()


def _release(runs: list[RankRun]) -> None:
    """Let parked ranks destroy their process group and exit on their own."""
    if runs:
        open(runs[0].spec.release, "w").close()


def _wait_exits(server: ForkServer, runs: list[RankRun], timeout: float) -> None:
    """Wait until the fork server reported every rank's exit (it kills each rank's group before reaping it)."""
    deadline = time.monotonic() + timeout
    server.poll()
    while any(r.pid not in server.exits for r in runs) and time.monotonic() < deadline and server.alive():
        server.poll(POLL)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
