"""Every Python thread's torch work, observed: torch's modes are per thread, so the session's stay on the thread that
entered them unless each new thread enters them too.

While a session is active, ``Thread._bootstrap_inner`` (where every Python thread, a pool's workers included, starts
running Python) pushes forwarding modes onto the new thread's mode stacks for the thread's whole life — a dispatch
mode for the tracker, the virtual autograd model's function mode (the fallback's), only those the session uses — and a
thread-pool work item run on a worker started before the session pushes them around that item. The forwarding modes
hand each op to the session active *now* (none: the op just runs), so a thread that outlives its test neither reports
into a finished session nor misses the next one. Where the C++ capture replaces the dispatch mode, the virtual
backend's captures only the threads marked for it, and such a thread is marked instead (``tracker.observe_thread``),
so it sees the threads a dispatch mode would (not a backend's own worker threads: gloo copying a result out); the cuda
backend's sees every thread already.

Streams: the current stream is per thread (the virtual model keeps it thread-local; CUDA does too), and a new thread
starts on the default stream. ``start`` / ``join`` / ``Future.result`` order the host, never the device: nothing here
orders a stream, so a side stream's work enqueued by a worker is ordered with the joining thread's later work only by
a stream wait, an event or a synchronize, as on a GPU. What a thread's synchronize taught it reaches another thread
only through a handoff (``models.host_handoffs``: each followed thread has a host clock of its own in hb).
"""

from __future__ import annotations

import threading

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..patching import WrapPatch

_dispatch = None  # the active session's __torch_dispatch__, when a dispatch mode observes ops


def _never() -> bool:
    return False


_capturing = _never  # whether the active session's ops come from the C++ capture (then no dispatch mode)
_observe = None  # the active session's tracker.observe_thread (the capture, on threads it does not see yet)
_function = None  # the active session's __torch_function__ (virtual autograd), when it has one
_observed = threading.local()  # .depth > 0 while this thread has the forwarding modes pushed


class _ForwardDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        target = _dispatch
        if target is None or _capturing():  # no session, or one whose C++ capture sees this op already
            return func(*args, **(kwargs or {}))
        return target(func, types, args, kwargs)


class _ForwardFunction(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        target = _function
        if target is None:
            return func(*args, **(kwargs or {}))
        return target(func, types, args, kwargs)


_DISPATCH = _ForwardDispatch()
_FUNCTION = _ForwardFunction()


def _enter() -> tuple:
    """Push the forwarding modes this thread needs (none when already pushed, or with no session); the stacks pushed.
    Only what the session uses: a function mode on a thread changes how dynamo traces there."""
    depth = getattr(_observed, "depth", 0)
    _observed.depth = depth + 1
    if depth or (_dispatch is None and _function is None):
        return ()
    pushed = []
    try:
        if _dispatch is not None and not _capturing():
            torch._C._push_on_torch_dispatch_stack(_DISPATCH)
            pushed.append(torch._C._pop_torch_dispatch_stack)
        elif _dispatch is not None:
            undo = _observe()
            if undo is not None:
                pushed.append(undo)
        if _function is not None:
            torch._C._push_on_torch_function_stack(_FUNCTION)
            pushed.append(torch._C._pop_torch_function_stack)
    except Exception:  # never in the user's thread: it runs unobserved
        pass
    return tuple(reversed(pushed))


def _leave(pushed: tuple) -> None:
    _observed.depth = max(getattr(_observed, "depth", 1) - 1, 0)
    for pop in pushed:
        try:
            pop()
        except Exception:
            pass


def _observing(original):
    def observed(self, *args, **kwargs):
        pushed = _enter()
        try:
            return original(self, *args, **kwargs)
        finally:
            _leave(pushed)

    observed.__name__ = getattr(original, "__name__", "run")
    observed.__doc__ = getattr(original, "__doc__", None)
    return observed


class Threads:
    """The patch: new threads (and pool work items) carry the session's modes: the tracker's dispatch (or the C++
    capture's thread mark, where it replaces the mode) and `function()`, the virtual autograd model's function mode, if
    any (read at install: it exists only once that model is installed)."""

    def __init__(self, tracker, function=None):
        self.tracker = tracker
        self.function = function

    def patches(self) -> list:
        from concurrent.futures import thread as pool

        out = [WrapPatch(threading.Thread, "_bootstrap_inner", _observing)]
        if hasattr(pool, "_WorkItem"):
            out.append(WrapPatch(pool._WorkItem, "run", _observing))
        return out + [self]

    def install(self) -> None:
        global _dispatch, _function, _capturing, _observe
        mode = self.function() if self.function is not None else None
        _function = mode.__torch_function__ if mode is not None else None
        _dispatch = self.tracker.__torch_dispatch__
        _capturing = lambda: self.tracker.capturing  # noqa: E731 (the capture is installed after this patch)
        _observe = self.tracker.observe_thread

    def uninstall(self) -> None:
        global _dispatch, _function, _capturing, _observe
        _dispatch = _function = _observe = None
        _capturing = _never
