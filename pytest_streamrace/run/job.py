"""Starting the program and watching it until it ends, signals included.

The program is spawned (``os.posix_spawnp``: PATH is searched as a shell does) in this process's process group, so
a terminal's Ctrl-C reaches it directly. This process blocks SIGINT, SIGTERM, SIGHUP and SIGCHLD from the start (the
program gets the signal mask this process had) and takes them with ``sigtimedwait`` between polls of the followed
processes' records, so no signal interrupts it midway and the report is always written:

- a signal another process sent to this one (a launcher, ``kill``, a scheduler) is passed on to the program; one the
  kernel sent (the terminal's Ctrl-C, which the program's process group got as well) is not;
- the program's end (SIGCHLD, or a poll) ends the watch; after the third terminating signal the program is killed.
"""

from __future__ import annotations

import os
import signal
from typing import Callable

from ..launcher import nccl_conf

TERMINATING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
WATCHED = (*TERMINATING, signal.SIGCHLD)
POLL = 0.5  # seconds between reads of the followed processes' records while the program runs
KILL_AFTER = 3  # terminating signals: the third kills the program


class NotFound(Exception):
    """The program cannot be started: the message is the one line shown; `status` is the shell's (127, 126)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def block_signals() -> set:
    """Hold the watched signals for ``watch`` (call first: threads started later inherit the mask). Returns the
    mask before, which the program gets."""
    return signal.pthread_sigmask(signal.SIG_BLOCK, WATCHED)


def pending_interrupt() -> int | None:
    """A terminating signal that arrived before the program started (it is taken)."""
    pending = signal.sigpending() & set(TERMINATING)
    if not pending:
        return None
    info = signal.sigtimedwait(pending, 0)
    return info.si_signo if info is not None else None


def spawn(argv: list[str], environ: dict, mask: set, quiet: bool = False) -> int:
    """Start the program; its pid. NotFound where it cannot be executed. `quiet`: its output goes nowhere (a re-run's
    for ``--confirm``: the program's output is the first run's)."""
    actions = [(os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0), (os.POSIX_SPAWN_DUP2, 1, 2)] if quiet else []
    try:
        return os.posix_spawnp(argv[0], argv, nccl_conf.preset(environ), setsigmask=mask, file_actions=actions)
    except FileNotFoundError:
        raise NotFound(f"streamrace run: {argv[0]}: command not found", 127) from None
    except PermissionError:
        raise NotFound(f"streamrace run: {argv[0]}: permission denied (not an executable)", 126) from None
    except OSError as exc:
        raise NotFound(f"streamrace run: {argv[0]}: cannot execute ({exc.strerror or exc})", 126) from None


def watch(pid: int, tick: Callable[[], None]) -> tuple[int, int | None]:
    """Wait for the program, calling `tick` between polls. Returns (its exit status as a shell gives it: 128 + N
    for a signal N, the first terminating signal this process got or None)."""
    received = []
    while True:
        info = signal.sigtimedwait(WATCHED, POLL)
        if info is not None and info.si_signo in TERMINATING:
            received.append(info.si_signo)
            if len(received) >= KILL_AFTER:
                _send(pid, signal.SIGKILL)
            elif info.si_code <= 0 and info.si_pid != pid:  # sent by a process (SI_USER, SI_QUEUE, SI_TKILL)
                _send(pid, info.si_signo)
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            return (128 - code if code < 0 else code), (received[0] if received else None)
        tick()


def _send(pid: int, signo: int) -> None:
    try:
        os.kill(pid, signo)
    except ProcessLookupError:
        pass
