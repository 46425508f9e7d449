"""A torchrun rank's output gate and its hang watchdog.

Only rank 0 prints: the other ranks' terminal reporters write into a closed ``Gate``. A ``Watchdog`` thread per
item posts this rank's Python stacks when the item outlives its timeout, and ends the process when it stays stuck
(no rank can leave a collective that every rank is blocked in).
"""

from __future__ import annotations

import faulthandler
import os
import tempfile
import threading
import time

GRACE = 5.0  # seconds past an item's timeout before a stuck rank gives up on the others


class Gate:
    """A text stream that drops everything until opened; non-zero ranks' terminal reporters write into one."""

    def __init__(self, stream, is_open: bool):
        self._stream = stream
        self.is_open = is_open

    def open(self) -> None:
        self.is_open = True

    def write(self, text: str) -> int:
        if self.is_open:
            self._stream.write(text)
        return len(text)

    def flush(self) -> None:
        if self.is_open:
            self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    @property
    def encoding(self) -> str:
        return getattr(self._stream, "encoding", "utf-8")


def stack_dump() -> str:
    """Every other thread's Python stack, as faulthandler prints it (it needs a real file)."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        blocks = f.read().split("\n\n")
    return "\n\n".join(b for b in blocks if not b.startswith("Current thread")).strip("\n") + "\n"


class Watchdog(threading.Thread):
    """Posts this rank's stacks when its item outlives the timeout; ends the process when it stays stuck."""

    def __init__(self, exchange, terminal_fd: int | None, key: str, nodeid: str, start: float, timeout: float):
        super().__init__(name=f"streamrace-watchdog-{key}", daemon=True)
        self.exchange, self.terminal_fd = exchange, terminal_fd
        self.key, self.nodeid, self.start_time, self.timeout = key, nodeid, start, timeout
        self.finished = threading.Event()

    def _wait_until(self, moment: float) -> bool:
        return self.finished.wait(max(0.0, moment - time.monotonic()))

    def run(self) -> None:
        ex = self.exchange
        if self._wait_until(self.start_time + self.timeout):
            return
        mine = stack_dump()
        ex.post_stack(self.key, mine)
        if self._wait_until(self.start_time + self.timeout + GRACE * (1 if ex.rank == 0 else 2)):
            return
        if ex.rank == 0:
            lines = [f"\n{'!' * 20} streamrace: {self.nodeid} still running on rank 0 after {self.timeout:g} s "
                     f"(timeout); stopping the torchrun session {'!' * 20}", "---- rank 0 ----", mine]
            for r in range(1, ex.world_size):
                lines += [f"---- rank {r} ----", ex.stack_of(self.key, r)]
            os.write(self.terminal_fd, "\n".join(lines).encode() + b"\n")
        os._exit(1)
