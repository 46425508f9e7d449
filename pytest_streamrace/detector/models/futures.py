"""torch.futures as a CUDA future orders streams: the completion of the work behind a future, its callbacks, and its
consumers.

A ``Work``'s future completes when the collective does; ``wait()`` / ``value()`` order the caller's current stream
after it; a ``then()`` callback runs after it, and the future ``then()`` returns completes after the callback's work.
DDP's communication hooks hand their future to the reducer, which waits on it in C++ (``Future::wait``: nothing a
patch sees, and on CPU no event either) before it reads the bucket again — so the stream that ran the hook is ordered
after the hook's future when the hook returns, the same rule as for collectives torch's C++ issues and waits itself.

Each future maps to the hb event of its completion (the Work's, or a token recorded when its callback finished);
futures nothing is known about complete at once, as waiting on a never-recorded CUDA event does.

In the virtual model a callback runs inline, after its future completed: gloo would otherwise run it on its own
thread, where no op is tracked, at whatever moment the collective happens to finish.
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable, Hashable

from ...patching import AttrPatch


class _Completion:
    """The hb event of a callback's end: weakly referenced by hb, kept alive by the future it completes."""

    __slots__ = ("__weakref__",)


class Futures:
    """A patch (install/uninstall) over torch._C.Future, Work.get_future and DDP's comm-hook registration."""

    def __init__(self, hb, tracker, current_stream: Callable[[], Hashable], inline_callbacks: bool):
        self.hb = hb
        self.tracker = tracker
        self.current_stream = current_stream
        self.inline_callbacks = inline_callbacks
        self._events: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # future -> its completion's event
        self._originals: dict = {}

    def rebind(self, hb, tracker, current_stream: Callable[[], Hashable], inline_callbacks: bool) -> None:
        """A fresh model for the next session, in this object: its patches are built once per process (``session``)
        and read the model's state per call; the originals they wrap stay."""
        originals = self._originals
        self.__init__(hb, tracker, current_stream, inline_callbacks)
        self._originals = originals

    def event(self, future):
        try:
            return self._events.get(future)
        except TypeError:  # not weakly referable: nothing is known about it
            return None

    def bind(self, future, event) -> None:
        """`future` completes when `event` does (an hb event: a Work, a callback's completion)."""
        try:
            self._events[future] = event
        except TypeError:
            pass

    def consumed(self, future) -> None:
        """The current stream is ordered after the future's completion (a wait, a value read, a C++ consumer)."""
        event = self.event(future)
        if event is not None:
            self.tracker.drain()
            self.hb.wait_event(self.current_stream(), event)

    # the patched methods

    def _get_future(self, original):
        @functools.wraps(original)
        def get_future(work, *args, **kwargs):
            future = original(work, *args, **kwargs)
            self.bind(future, work)
            return future
        return get_future

    def _consuming(self, original):
        @functools.wraps(original)
        def consume(future, *args, **kwargs):
            result = original(future, *args, **kwargs)
            self.consumed(future)
            return result
        return consume

    def _then(self, original):
        futures = self

        @functools.wraps(original)
        def then(future, callback, *args, **kwargs):
            parent = futures.event(future)
            done = _Completion()
            if parent is not None and futures.inline_callbacks:
                futures._originals["wait"](future)  # complete first, so the callback runs here, now

            def run(fut):
                if parent is not None:
                    futures.tracker.drain()
                    futures.hb.wait_event(futures.current_stream(), parent)
                try:
                    return callback(fut)
                finally:
                    futures.tracker.drain()
                    futures.hb.record_event(done, futures.current_stream())

            child = original(future, run, *args, **kwargs)
            if parent is not None:
                futures.bind(child, done)  # hb holds `done` weakly; the child future keeps it
            return child
        return then

    def _register_comm_hook(self, original):
        futures = self

        @functools.wraps(original)
        def register(reducer, state, hook, *args, **kwargs):
            @functools.wraps(hook)
            def hook_for_the_reducer(state, bucket):
                future = hook(state, bucket)
                futures.consumed(future)  # the reducer waits on it before it reads the bucket again
                return future
            return original(reducer, state, hook_for_the_reducer, *args, **kwargs)
        return register

    # patch protocol

    def patches(self) -> list:
        import torch

        future = torch._C.Future
        self._originals = {"wait": future.wait}
        out = [AttrPatch(future, "wait", self._consuming(future.wait)),
               AttrPatch(future, "value", self._consuming(future.value)),
               AttrPatch(future, "then", self._then(future.then))]
        import torch.distributed as dist

        if dist.is_available():
            from torch._C._distributed_c10d import Work

            out.append(AttrPatch(Work, "get_future", self._get_future(Work.get_future)))
            if hasattr(dist, "_register_comm_hook"):
                out.append(AttrPatch(dist, "_register_comm_hook", self._register_comm_hook(dist._register_comm_hook)))
        return out
