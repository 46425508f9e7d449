"""Where every thread of the process is halfway through a forced run's hold. When the host waits a hold out (some
call between the two accesses synchronizes with the held stream), the confirmation says which call that was: the
thread blocked in it is found there, mid-hold, in the call that waits."""

from __future__ import annotations

import _thread
import os
import sys
import threading

from .frames import _OURS, _in_stdlib, _walk


def _place(frame) -> str:
    """A thread's innermost frame outside this package and the standard library (where a blocked call was made), and
    the standard library's innermost function it is in, if any ("... in wait, threading.py")."""
    inner = None
    for filename, line, function in _walk(frame):
        if filename.startswith(_OURS):
            continue
        if _in_stdlib(filename):
            inner = inner or f"{function}, {os.path.basename(filename)}"
            continue
        return f"{filename}:{line} in {function}" + (f" (in {inner})" if inner else "")
    return inner or "no Python frame"


def thread_places(skip: int | None = None, limit: int = 6) -> list[str]:
    """One line per Python thread of this process ("thread 'MainThread' at f.py:12 in step"), the main thread
    first; `skip`: a thread to leave out (the sampler's own)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    frames = sorted(((ident, frame) for ident, frame in sys._current_frames().items() if ident != skip),
                    key=lambda pair: (pair[0] != main, names.get(pair[0], "")))
    return [f"thread '{names.get(ident, 'native')}' at {_place(frame)}" for ident, frame in frames[:limit]]


class MidwaySample:
    """Takes `thread_places` once, `after_s` seconds from now, unless cancelled first. Its thread is a bare one
    (``_thread``): the session's thread model does not follow it, and it issues no work."""

    def __init__(self, after_s: float):
        self.places: list[str] | None = None
        self._cancel = _thread.allocate_lock()
        self._cancel.acquire()
        try:
            _thread.start_new_thread(self._run, (after_s,))
        except RuntimeError:  # no thread to be had: the forced run goes on without the diagnostic
            pass

    def _run(self, after_s: float) -> None:
        if not self._cancel.acquire(timeout=after_s):
            try:
                self.places = thread_places(skip=_thread.get_ident())
            except Exception:  # a diagnostic only: never into the program
                self.places = None

    def cancel(self) -> None:
        try:
            self._cancel.release()
        except RuntimeError:  # released already
            pass
