"""The threaded process group of ``MultiThreadedTestCase`` (``multi_threaded_pg.ProcessLocalGroup``), modelled like gloo.

Its ranks are threads of one process, each with its own ``ProcessLocalGroup``, and the group does not dispatch c10d
ops: each collective is a Python method in which the last rank to arrive runs the whole collective — copies into
*every* rank's tensors — on its own thread and current stream, while the others wait on a condition. Seen as plain
ops, one rank's writes would land on another rank's stream. So the methods are patched: each rank's call is paused
(ops inside are the collective's, not the caller's) and modelled as that rank's part of a gloo/NCCL collective on a
communication stream of its own — keyed by group name *and rank*, since all ranks share one hb and one group name —
which first waits on the rank's current stream, reads the rank's inputs and writes its outputs. The ``Work`` it
returns is the hb event the rank's ``wait()`` orders its current stream after (``collectives``' Work.wait patch).
Only collectives issued by ``torch.distributed``'s Python API wait for ``wait()``; a call from elsewhere (C++ — the
functional collectives — or a direct call) is ordered into the caller's stream at once, which can hide a race but
never invents one.
"""

from __future__ import annotations

import sys
import threading
from typing import Callable, Hashable

import torch

from ...patching import AttrPatch, WhenImported

MODULE = "torch.testing._internal.distributed.multi_threaded_pg"
_C10D = "torch.distributed.distributed_c10d"
_OUT, _IN, _ROOTED = "out", "in", "rooted"  # written, read, read by the root and written by the others

# method -> (user-facing name, access of each positional tensor argument)
METHODS = {
    "allreduce": ("all_reduce", (_OUT,)),
    "allreduce_coalesced": ("all_reduce (coalesced)", (_OUT,)),
    "barrier": ("barrier", ()),
    "allgather": ("all_gather", (_OUT, _IN)),
    "all_gather_single": ("all_gather_into_tensor", (_OUT, _IN)),
    "all_gather_single_coalesced": ("all_gather_into_tensor (coalesced)", (_OUT, _IN)),
    "broadcast": ("broadcast", (_ROOTED,)),
    "scatter": ("scatter", (_OUT, _IN)),
    "gather": ("gather", (_OUT, _IN)),
    "reduce_scatter": ("reduce_scatter", (_OUT, _IN)),
    "reduce_scatter_single": ("reduce_scatter_tensor", (_OUT, _IN)),
    "reduce_scatter_single_coalesced": ("reduce_scatter_tensor (coalesced)", (_OUT, _IN)),
    "all_to_all_single": ("all_to_all_single", (_OUT, _IN)),
    "alltoall": ("all_to_all", (_OUT, _IN)),
}


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class ThreadedGroup:
    """The patches of ProcessLocalGroup's collectives, applied when its module is imported during a session."""

    def __init__(self, hb, tracker, current_stream: Callable[[], Hashable]):
        self.hb = hb
        self.tracker = tracker
        self.current_stream = current_stream
        self._tls = threading.local()  # .depth: inside a modelled call; .work: the last Work, kept alive (below)
        self._streams: set = set()

    def patches(self) -> list:
        """This model is the patch: it patches the group's methods when its module is imported (now, if it is),
        and restores them at uninstall."""
        self._applied: list = []
        self._when = None
        return [self]

    def install(self) -> None:
        self._when = WhenImported(MODULE, self._patch)
        self._when.install()

    def uninstall(self) -> None:
        # the finder holds this model's bound method: let go, no cycle is left for the collector to find
        when, self._when = self._when, None
        if when is not None:
            when.uninstall()
        while self._applied:
            self._applied.pop().uninstall()

    def _patch(self, module) -> None:
        group = getattr(module, "ProcessLocalGroup", None)
        for name in METHODS if group is not None else ():
            if name in vars(group):
                patch = AttrPatch(group, name, self._modelled(name, vars(group)[name]))
                patch.install()
                self._applied.append(patch)

    def _modelled(self, method: str, original):
        model = self

        def collective(pg, *args, **kwargs):
            tls = model._tls
            depth = getattr(tls, "depth", 0)
            if depth:  # a collective the group builds from others: modelled once, as the outer one
                return original(pg, *args, **kwargs)
            issued_by_api = sys._getframe(1).f_globals.get("__name__") == _C10D
            try:
                comm, current = model._before(pg)
            except Exception as exc:  # never in the user's thread: the call runs unmodelled
                model.tracker.note(f"threaded process group {method} is not checked: {type(exc).__name__}: {exc}")
                return original(pg, *args, **kwargs)
            tls.depth = 1
            tracker = model.tracker
            previous, tracker.enabled = tracker.enabled, False
            try:
                work = original(pg, *args, **kwargs)
            finally:
                tracker.enabled = previous
                tls.depth = 0
            try:
                model._after(method, pg, args, kwargs, comm, current, work, issued_by_api)
            except Exception as exc:
                model.tracker.note(f"threaded process group {method} is not checked: {type(exc).__name__}: {exc}")
            return work

        collective.__name__ = getattr(original, "__name__", method)
        collective.__doc__ = getattr(original, "__doc__", None)
        return collective

    def _before(self, pg) -> tuple[Hashable, Hashable]:
        rank = pg.rank()
        name = getattr(pg, "group_name", "?")
        comm = ("communication", "threaded", name, rank)
        if comm not in self._streams:
            self._streams.add(comm)
            self.hb.add_stream(comm, f"communication stream of rank {rank} in threaded process group {name}")
        self.tracker.drain()
        current = self.current_stream()
        self.hb.wait_stream(comm, current)
        return comm, current

    def _after(self, method, pg, args, kwargs, comm, current, work, issued_by_api: bool) -> None:
        from torch._C._distributed_c10d import Work

        name, accesses = METHODS[method]
        opts = args[len(accesses)] if len(args) > len(accesses) else kwargs.get("opts")
        is_root = getattr(opts, "rootRank", None) == pg.rank()
        reads: list[torch.Tensor] = []
        writes: list[torch.Tensor] = []
        for i, access in enumerate(accesses):
            value = args[i] if i < len(args) else None
            if access == _ROOTED:
                access = _IN if is_root else _OUT
            (reads if access == _IN else writes).extend(_tensors(value))
        self.tracker.run(name, comm, reads, writes)
        if issued_by_api and isinstance(work, Work):
            self._tls.work = work  # the caller must get this very object back to wait on it (see collectives)
            self.hb.record_event(work, comm)
        else:
            self.hb.wait_stream(current, comm)
