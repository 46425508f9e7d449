"""The parent's handle on its fork server: start rank processes, learn how they exited, kill their trees.

One fork server per process (so one per xdist worker), started at the first distributed item and stopped when the
process exits, not at the end of a session: a process that runs several sessions (the repro CLI runs one per variant)
keeps it, and its later ranks find what earlier ones imported. The fork server dies with this process even if it is
SIGKILLed.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .. import env
from . import forkserver

_SCRIPT = Path(forkserver.__file__)


class LaunchError(Exception):
    """The rank processes could not be started; the message says why in one line plus the server's output."""


class ForkServer:
    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._log = None
        self._pending = b""
        self.exits: dict[int, int] = {}  # pid -> exit code, or -signal

    def start(self, cwd: str) -> None:
        """Start the server now (it imports torch in the background); `spawn` waits until it is ready."""
        if self._proc is not None and self._proc.poll() is None:
            return
        self._log = tempfile.TemporaryFile()
        environ = dict(os.environ)
        environ.pop(env.SUBPROCESS, None)  # its ranks are pytest sessions that check for themselves
        self._proc = subprocess.Popen(
            [sys.executable, str(_SCRIPT)], cwd=cwd, env=environ, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, start_new_session=True, preexec_fn=forkserver.die_with_parent)
        self._ready = False

    def _wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready:
            for message in self._read(min(0.1, max(0.0, deadline - time.monotonic()))):
                if "ready" in message:
                    self._ready = True
            if not self._ready and (self._proc.poll() is not None or time.monotonic() > deadline):
                self.stop()
                raise LaunchError(f"the rank fork server ({sys.executable} {_SCRIPT.name}) did not start:\n"
                                  + self._log_tail())

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str, output: str) -> int:
        """Fork one rank running ``pytest *argv``; its stdout and stderr go to `output`. Returns its pid."""
        self._wait_ready()
        request = json.dumps({"argv": argv, "env": env, "cwd": cwd, "output": output}) + "\n"
        try:
            self._proc.stdin.write(request.encode())
            self._proc.stdin.flush()
        except BrokenPipeError:
            raise LaunchError("the rank fork server died:\n" + self._log_tail()) from None
        while True:
            for message in self._read(0.1):
                if "pid" in message:
                    return message["pid"]
                if "refused" in message:
                    raise LaunchError(f"the rank fork server refused: {message['refused']}")
            if self._proc.poll() is not None:
                raise LaunchError("the rank fork server died:\n" + self._log_tail())

    def poll(self, timeout: float = 0.0) -> dict[int, int]:
        """Collect exit reports that arrived (waiting at most `timeout`); returns all exits known so far."""
        self._read(timeout)
        return self.exits

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _read(self, timeout: float) -> list[dict]:
        out = self._proc.stdout.fileno()
        messages = []
        while select.select([out], [], [], timeout)[0]:
            chunk = os.read(out, 1 << 16)
            if not chunk:
                break
            self._pending += chunk
            timeout = 0.0
        *lines, self._pending = self._pending.split(b"\n")
        for line in lines:
            message = json.loads(line)
            if "exit" in message:
                self.exits[message["exit"]] = message["status"]
            else:
                if "pid" in message:  # a new rank: an exit recorded under its pid was an earlier process's
                    self.exits.pop(message["pid"], None)
                messages.append(message)
        return messages

    def _log_tail(self) -> str:
        self._log.seek(0)
        return tail(self._log.read().decode(errors="replace"), 20)

    def stop(self) -> None:
        """Close the server's stdin and terminate it (it kills its ranks and exits, even in the middle of a warm-up
        import), then make sure it is gone."""
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        try:
            proc.stdin.close()
        except OSError:
            pass
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()


_shared: ForkServer | None = None


def shared() -> ForkServer:
    """This process's fork server."""
    global _shared
    if _shared is None:
        _shared = ForkServer()
        atexit.register(_shared.stop)
    return _shared


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a rank and everything it started (each rank leads its own process group)."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def describe_exit(status: int) -> str:
    if status < 0:
        try:
            return f"killed by signal {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit code {status}"


def tail(text: str, lines: int) -> str:
    kept = text.rstrip("\n").splitlines()[-lines:]
    return "\n".join(kept)
