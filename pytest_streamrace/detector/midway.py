"""Where every thread of the process is halfway through a forced run's hold. When the host waits a hold out (some
call between the two accesses synchronizes with the held stream), the confirmation says which call that was: the
thread blocked in it is found there, mid-hold, in the call that waits.

Two samplers take the places at the same moment. A bare Python thread names each thread's frames as the reports do;
it needs the GIL, which a C call that waits without releasing it keeps from every Python thread. faulthandler's
watchdog needs none: its dump is what is said when the Python sampler could not run in time, and that lateness is
itself said, since it tells the waiting call holds the GIL. (faulthandler has one timer a process: a
``faulthandler_timeout`` armed for the test is off from the hold to the test's end, in a forced re-run only.)"""

from __future__ import annotations

import _thread
import faulthandler
import os
import re
import sys
import tempfile
import threading
import time

from .frames import _OURS, _in_stdlib, _walk


def _place(frames) -> str:
    """A thread's innermost frame outside this package and the standard library (where a blocked call was made), and
    the standard library's innermost function it is in, if any ("... in wait, threading.py"). `frames`: (file, line,
    function), innermost first."""
    inner = None
    for filename, line, function in frames:
        if filename.startswith(_OURS):
            continue
        if _in_stdlib(filename):
            inner = inner or f"{function}, {os.path.basename(filename)}"
            continue
        return f"{filename}:{line} in {function}" + (f" (in {inner})" if inner else "")
    return inner or "no Python frame"


def _names() -> dict:
    return {t.ident: t.name for t in threading.enumerate()}


def _lines(stacks: dict, skip: int | None, limit: int, names: dict | None = None) -> list[str]:
    """One line per thread of `stacks` (ident -> frames), the main thread first, then by name; `names`: the threads'
    names as they were when the stacks were taken, where some may have ended since."""
    names = {**_names(), **(names or {})}
    main = threading.main_thread().ident
    order = sorted((ident for ident in stacks if ident != skip), key=lambda i: (i != main, names.get(i, "")))
    return [f"thread '{names.get(ident, 'native')}' at {_place(stacks[ident])}" for ident in order[:limit]]


def thread_places(skip: int | None = None, limit: int = 6) -> list[str]:
    """One line per Python thread of this process ("thread 'MainThread' at f.py:12 in step"), the main thread
    first; `skip`: a thread to leave out (the sampler's own)."""
    return _lines({ident: _walk(frame) for ident, frame in sys._current_frames().items()}, skip, limit)


_LATE_S = 0.02  # a new thread waits a switch interval (5 ms) for the GIL: this much past its time is lateness
_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.+)$')


def parse_dump(text: str) -> dict:
    """faulthandler's dump of every thread, as ident -> [(file, line, function)], innermost first."""
    stacks: dict = {}
    frames = None
    for line in text.splitlines():
        thread = _THREAD.match(line)
        if thread:
            frames = stacks.setdefault(int(thread.group(1), 16), [])
            continue
        frame = _FRAME.match(line)
        if frame and frames is not None:
            frames.append((frame.group(1), int(frame.group(2)), frame.group(3).strip()))
    return stacks


_armed: "MidwaySample | None" = None  # the sample whose faulthandler timer is set in this process
_hooked = False


def _arm(sample: "MidwaySample", seconds: float) -> None:
    global _armed, _hooked
    if not _hooked:
        os.register_at_fork(before=_pause, after_in_parent=_resume, after_in_child=_forget)
        _hooked = True
    faulthandler.dump_traceback_later(seconds, file=sample._dump)
    _armed = sample


# A fork copies the timer's state but not its thread: the child, cancelling or setting a timer (a test's
# faulthandler_timeout does), would wait forever for that thread. So the timer is off while the process forks.

def _pause() -> None:
    if _armed is not None and _armed._left() > 0:
        faulthandler.cancel_dump_traceback_later()


def _resume() -> None:
    if _armed is not None and _armed._left() > 0:
        faulthandler.dump_traceback_later(_armed._left(), file=_armed._dump)


def _forget() -> None:
    global _armed
    _armed = None


class MidwaySample:
    """Takes `thread_places` once, `after_s` seconds from now, unless cancelled first; faulthandler dumps every
    thread then too. The Python sampler's thread is a bare one (``_thread``): the session's thread model does not
    follow it, and it issues no work."""

    def __init__(self, after_s: float):
        self.places: list[str] | None = None
        self.stacks: dict = {}  # ident -> frames, innermost first, as sampled (or as faulthandler's dump gives them)
        self.gil_held_ms: float | None = None  # how far past its time the Python sampler first ran, where it was late
        self._after = after_s
        self._started = time.perf_counter()
        self._ident: int | None = None
        self._names: dict = {}  # the threads' names just after the dump (they may end before it is read)
        self._cancel = _thread.allocate_lock()
        self._cancel.acquire()
        self._dump = None
        try:
            self._dump = tempfile.TemporaryFile()
            _arm(self, after_s)
        except (OSError, RuntimeError, ValueError):  # no file or no watchdog: the Python sampler alone
            self._dump = None
        try:
            _thread.start_new_thread(self._run, (after_s,))
        except RuntimeError:  # no thread to be had: the forced run goes on without the diagnostic
            pass

    def _run(self, after_s: float) -> None:
        self._ident = _thread.get_ident()
        left = after_s - (time.perf_counter() - self._started)
        if left < -_LATE_S:  # it could not start before its time: a thread held the GIL meanwhile; the dump says where
            self.gil_held_ms = round(-left * 1000, 1)
            self._names = _names()
            return
        if not self._cancel.acquire(timeout=max(left, 0.0)):
            try:
                self.stacks = {ident: list(_walk(frame)) for ident, frame in sys._current_frames().items()}
                self.places = _lines(self.stacks, _thread.get_ident(), 6)
            except Exception:  # a diagnostic only: never into the program
                self.places = None

    def cancel(self) -> None:
        """The later access came: nothing more to sample (a dump already taken is kept)."""
        self._disarm()
        try:
            self._cancel.release()
        except RuntimeError:  # released already
            pass

    def _left(self) -> float:
        return self._after - (time.perf_counter() - self._started)

    def _disarm(self) -> None:
        global _armed
        if _armed is self:
            _armed = None
            if self._left() > 0:
                faulthandler.cancel_dump_traceback_later()

    def where(self) -> list[str] | None:
        """The threads' places halfway through the hold: the Python sampler's, else faulthandler's dump's."""
        self.cancel()
        if self.places or self._dump is None:
            return self.places
        try:
            self._dump.seek(0)
            self.stacks = parse_dump(self._dump.read().decode("utf-8", "replace"))
            return _lines(self.stacks, self._ident, 6, self._names) or None
        except (OSError, ValueError):
            return None

    def call_of(self, ident: int | None) -> tuple[str, list] | None:
        """Where thread `ident` was halfway through the hold: its place (as `where` says it) and its frames, innermost
        first; None where it was not sampled."""
        self.where()
        frames = self.stacks.get(ident) if ident is not None else None
        return (_place(frames), frames) if frames else None
