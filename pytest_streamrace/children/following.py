"""Following every Python process started under a variable: the one interface both ``pytest --streamrace`` (per test,
``children.parent``) and ``streamrace run`` (per program, ``run``) use, modelled on coverage.py's subprocess
measurement: a start-up hook gated by an environment variable, one data file per process, read back here.

``Following`` owns the data folder and this interpreter's ``.pth`` hook (``startup_hook``), says what the variable
holds (``variable``), names the owner (a test's nodeid, a program) that processes started now work for
(``follow``), and reads what the followed processes wrote since the last call (``read``). The records are those
``children.child`` writes: ``race`` (a race record), ``recount`` (a race's count when its process ended), ``note``,
``trace`` and ``process`` (a detector started in that process).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from . import child
from .startup_hook import StartupHook


class Following:
    """A data folder, the start-up hook, and the records the followed processes wrote."""

    def __init__(self, backend: str, trace: bool, latent: bool = True, incidental=()):
        self.backend = backend
        self.trace = trace
        self.latent, self.incidental = latent, tuple(incidental)  # --streamrace-latent != off, incidental-sync globs
        self.dir = tempfile.mkdtemp(prefix="streamrace-sub-")
        self.hook = StartupHook()
        self.problem = self.hook.install()  # None, or why processes started by exec cannot be followed
        self._offsets: dict[str, int] = {}
        self._pending: dict[str, bytes] = {}
        self._current_fd: int | None = None
        self._listed: tuple = (None, False, [])  # the folder's mtime when listed, whether it had settled, the files
        self._head: tuple = (None, "")  # the variable's fields, and its text up to the owner (set twice a test)
        self._write_current("")

    def variable(self, owner: str) -> str:
        """The value of ``STREAMRACE_SUBPROCESS`` for processes that work for `owner` ("": none, not followed)."""
        fields = (self.dir, self.backend, self.trace, self.latent, tuple(self.incidental))
        if self._head[0] != fields:
            whole = json.dumps({"dir": self.dir, "backend": self.backend, "trace": self.trace, "latent": self.latent,
                                "incidental": list(self.incidental)})
            self._head = (fields, whole[:-1] + ', "test": ')
        return self._head[1] + json.dumps(owner) + "}"

    def follow(self, owner: str) -> None:
        """Processes started from now on (by exec, or forked from a followed one) work for `owner`."""
        self._write_current(owner)

    def unfollow(self) -> None:
        self._write_current("")

    def close(self) -> None:
        if self._current_fd is not None:
            os.close(self._current_fd)
            self._current_fd = None
        self.hook.remove()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _write_current(self, owner: str) -> None:
        """The live file rewritten in place, twice a test: a new file renamed over it cost ~1 ms on ext4, which
        flushes a file renamed over another. A reader that catches the write half done sees a bad checksum and
        reads again (``child.live_test``). A shorter record is not cut to its length: the header says where it
        ends, and what an earlier, longer one left after it is never read (a truncation was a third of the write's
        cost)."""
        if self._current_fd is None:
            self._current_fd = os.open(os.path.join(self.dir, child.CURRENT), os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(self._current_fd, child.live_record(owner), 0)

    def _files(self) -> list[str]:
        """The followed processes' data files, sorted: listed again only when the folder changed since (a file
        created moves its mtime), a stat in place of a listing at each of a test's judging points."""
        mtime = os.stat(self.dir).st_mtime_ns
        if mtime == self._listed[0] and self._listed[1]:
            return self._listed[2]
        # Settled: the folder changed before the live file's last write, so a file created from now on gets a later
        # mtime from the same clock, however coarse its steps (the same step could leave the folder's mtime as seen).
        settled = self._current_fd is not None and mtime < os.fstat(self._current_fd).st_mtime_ns
        names = sorted(n for n in os.listdir(self.dir) if n.startswith("child-") and n.endswith(".jsonl"))
        self._listed = (mtime, settled, names)
        return names

    def read(self) -> list[dict]:
        """The records written since the last call, in file order per process (a line still being written waits for
        the next call)."""
        records = []
        try:
            names = self._files()
        except OSError:
            return records
        for name in names:
            path = os.path.join(self.dir, name)
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets.get(name, 0))
                    chunk = f.read()
            except OSError:
                continue
            self._offsets[name] = self._offsets.get(name, 0) + len(chunk)
            data = self._pending.pop(name, b"") + chunk
            *lines, rest = data.split(b"\n")
            if rest:
                self._pending[name] = rest  # a line being written: read with the rest next time
            for line in lines:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    records.append(record)
        return records
