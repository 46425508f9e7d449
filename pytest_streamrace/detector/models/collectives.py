"""torch.distributed collectives as NCCL runs them: on a communication stream of their process group.

NCCL launches a collective on an internal stream of its process group, which first waits on the caller's current
stream; the caller's stream is ordered after the collective only when ``work.wait()`` runs (a synchronous
collective calls it itself). So with ``async_op=True``, touching the tensors before ``wait()`` races — on the GPU and,
modelled here, in the virtual model on gloo. NCCL's stream is not visible to the cuda model's trace callbacks
either, so under both stream models this model is what the detector knows about collectives.

Every collective reaches the dispatch mode as one ``c10d`` op (the ops of a ``_coalescing_manager`` block as one
coalesced op at its exit). Their schemas carry no alias annotations, so which tensors are written is decided here
from argument names (``output*`` written, ``input*`` read, in-place ``tensors`` written — a write conflicts with all
that a read does, so one report per location pair) with the root-dependent and point-to-point cases spelled out. The ``Work`` the op returns is the Python object the caller later waits on (pybind keeps one
wrapper per C++ work while one is alive), so it is the hb event that ``wait()`` waits on.

Collectives that torch's C++ issues itself — DDP's reducer, ``_broadcast_coalesced``, ``_verify_params_across_processes``
— are waited in C++ (``Work::wait``, ``Future::wait``), which no Python patch sees, and on CPU there is no event to see
either. Those callers wait before they touch the tensors again, so such a collective is ordered into its issuing stream
at once, like a synchronous one; what that hides is work on the issuing stream between the issue and the C++ wait,
which in those callers is none. A collective counts as Python's when it comes through a ProcessGroup method that
Python calls (what ``torch.distributed`` does); only those wait for a ``wait()``. The others' model is a fixed rule
(``capture_rule``), which the C++ capture's feed applies without entering Python.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable, Hashable

import torch

from ...patching import WrapPatch

READ, WRITE = "r", "w"

# user-facing names of the c10d ops (what the report's op column shows)
NAMES = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce (coalesced)",
    "_allgather_base_": "all_gather_into_tensor",
    "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather (coalesced)",
    "allgather_into_tensor_coalesced_": "all_gather_into_tensor (coalesced)",
    "_reduce_scatter_base_": "reduce_scatter_tensor",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter_tensor (coalesced)",
    "broadcast_": "broadcast",
    "reduce_": "reduce",
    "alltoall_base_": "all_to_all_single",
    "alltoall_": "all_to_all",
    "gather_": "gather",
    "scatter_": "scatter",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
    "barrier": "barrier",
    "monitored_barrier_": "monitored_barrier",
}
# The ProcessGroup / Backend methods through which Python issues collectives (what torch.distributed calls).
_PY_ENTRIES = ("allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "allgather_coalesced",
               "allgather_into_tensor_coalesced", "all_gather_single", "all_gather_single_coalesced", "reduce_scatter",
               "_reduce_scatter_base", "reduce_scatter_single", "reduce_scatter_single_coalesced",
               "reduce_scatter_tensor_coalesced", "broadcast", "reduce", "alltoall", "alltoall_base",
               "all_to_all_single", "gather", "scatter", "send", "recv", "recv_anysource", "barrier",
               "monitored_barrier", "_end_coalescing")
_BARRIERS = {"barrier", "monitored_barrier_"}  # their tensor is an internal dummy; their wait blocks the host
_P2P = {"send", "recv_", "recv_any_source_"}  # NCCL runs these on a stream per peer, not the group's


class _Plan:
    """How one c10d op touches its arguments, worked out once from its schema."""

    def __init__(self, func):
        schema = func._schema
        self.op = func._overloadpacket.__name__
        self.name = NAMES.get(self.op, f"c10d::{self.op}")
        self.group = self.root = self.peer = None
        self.tensors: list[tuple[int, str]] = []  # (argument index, READ | WRITE)
        for i, arg in enumerate(schema.arguments):
            kind = str(arg.type)
            if "ProcessGroup" in kind:
                self.group = i
            elif arg.name in ("root_rank", "dstRank", "srcRank"):
                self.root = self.peer = i
            elif "Tensor" in kind and self.op not in _BARRIERS:
                access = READ if "input" in arg.name or self.op == "send" else WRITE
                self.tensors.append((i, access))
        self.work = next((i for i, ret in enumerate(schema.returns) if "Work" in str(ret.type)), None)
        self.async_op = next((i for i, arg in enumerate(schema.arguments) if arg.name == "async_op"), None)

    def synchronous(self, args) -> bool:
        """Issued with async_op=False: the backend orders the caller's stream after it by itself (ProcessGroupNCCL
        runs it on the current stream and returns no Work to wait on), so the model must not wait for a wait()."""
        return self.async_op is not None and self.async_op < len(args) and args[self.async_op] is False

    def accesses(self, args, group_rank: int | None):
        """(reads, writes): the tensors the collective reads and writes on this rank."""
        reads: list[torch.Tensor] = []
        writes: list[torch.Tensor] = []
        is_root = self.root is not None and group_rank is not None and _arg(args, self.root) == group_rank
        for i, access in self.tensors:
            if self.op == "broadcast_":  # the root sends its tensor, the others receive into theirs
                access = READ if is_root else WRITE
            elif self.op == "reduce_":  # every rank sends; only the root receives
                access = WRITE if is_root else READ
            (writes if access == WRITE else reads).extend(_flatten(_arg(args, i)))
        return reads, writes


def _arg(args, i: int):
    """A positional argument of a c10d op (tensors, the group and ranks always come positionally)."""
    return args[i] if i < len(args) else None


def _flatten(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flatten(v)]
    return []


class Collectives:
    """The model, installed as patches: c10d ops from the tracker come here, and ``Work.wait`` (also
    ``synchronize`` / ``block_current_stream``) orders the caller's current stream after the collective."""

    def __init__(self, hb, tracker, current_stream: Callable[[], Hashable]):
        self.hb = hb
        self.tracker = tracker
        self.current_stream = current_stream
        self._plans: dict = {}
        self._streams: set = set()
        self._barriers: weakref.WeakSet = weakref.WeakSet()  # barrier works: their wait also blocks the host
        # The Work wrapper created at dispatch, kept alive until the caller surely holds it (it waits on it, or the
        # thread issues its next collective), so pybind hands the caller this very object. One per thread: a Work
        # keeps its tensors alive, and holding more would delay their frees.
        self._held = threading.local()
        self._python = threading.local()  # depth: > 0 while Python is issuing a collective on this thread
        self.returned = None  # a forced run's (``forced_order``): called with what each collective Python issued returned

    def rebind(self, hb, tracker, current_stream: Callable[[], Hashable]) -> None:
        """A fresh model for the next session, in this object: its patches are built once per process (``session``)
        and read the model's state per call."""
        self.__init__(hb, tracker, current_stream)

    # what happens at dispatch

    def on_op(self, func, args, kwargs, out, phase: str = "once", stream: Hashable | None = None,
              frames=None) -> None:
        """One c10d op: model it on its communication stream.

        A collective torch's C++ issues is modelled as of before it ran ("start": the C++ capture queues it then, in
        order with the ops, with the issuing thread's `stream` and `frames`): the events the backend records inside
        it (ProcessGroupNCCL's stream waiting on the issuing one, the work's future completed on its stream) then
        carry it to whatever stream waits on them — a C++ then-callback's stream, say. Python's are modelled as they
        return ("end": queued then, `out` holding the Work its wait() will name). The dispatch mode hands each op over
        once, after it ran, on the issuing thread ("once")."""
        from torch._C._distributed_c10d import ProcessGroup, Work

        python = phase == "end" or (phase == "once" and getattr(self._python, "depth", 0) > 0)
        plan = self._plan(func)
        group = None
        if plan.group is not None:
            try:
                group = ProcessGroup.unbox(_arg(args, plan.group))
            except (RuntimeError, TypeError):
                group = None
        group_rank = group.rank() if group is not None else None
        current = self.current_stream() if stream is None else stream
        comm = self._comm_stream(plan, group, args)
        self.hb.wait_stream(comm, current)
        reads, writes = plan.accesses(args, group_rank)
        self.tracker.run(plan.name, comm, reads, writes, frames)
        if plan.synchronous(args) or not python:
            self.hb.wait_stream(current, comm)
        work = None
        if plan.work is not None and out is not None:  # none before the op ran (C++'s): unbox would raise, 0.1 ms
            boxed = out[plan.work] if isinstance(out, (tuple, list)) else out
            try:
                work = Work.unbox(boxed)
            except (RuntimeError, TypeError):
                work = None
        if work is not None:
            self._held.work = work
            self.hb.record_event(work, comm)
            if plan.op in _BARRIERS:
                self._barriers.add(work)

    def _plan(self, func) -> _Plan:
        plan = self._plans.get(func)
        if plan is None:
            plan = self._plans[func] = _Plan(func)
        return plan

    # the capture's feed, for a collective torch's C++ issued: this model's rules without Python per op

    def capture_rule(self, func):
        """`on_op` for a collective torch's C++ issued ("start": no Work for Python to wait on, the issuing stream
        ordered after it at once), as a fixed rule the capture's feed applies in C++: (name, the group's argument,
        the root's or -1, [(argument, "r" | "w" | "root reads" | "root writes")]), the stream from `rule_stream`.
        None (the model in Python) for point-to-point ops, whose stream is per peer, and ops without a group."""
        plan = self._plan(func)
        if plan.group is None or plan.op in _P2P:
            return None
        by_root = {"broadcast_": "root reads", "reduce_": "root writes"}  # as `_Plan.accesses` decides
        return (plan.name, plan.group, -1 if plan.root is None else plan.root,
                [(i, by_root.get(plan.op, access)) for i, access in plan.tensors])

    def rule_stream(self, value):
        """(the communication stream's key, this rank in the group) for a group argument of a fixed rule; None
        (`on_op` takes it) where it is no group."""
        from torch._C._distributed_c10d import ProcessGroup

        try:
            group = ProcessGroup.unbox(value)
        except (RuntimeError, TypeError):
            return None
        return self._group_stream(group, None), group.rank()

    def _comm_stream(self, plan: _Plan, group, args) -> Hashable:
        peer = _arg(args, plan.peer) if plan.op in _P2P and plan.peer is not None else None
        return self._group_stream(group, peer)

    def _group_stream(self, group, peer) -> Hashable:
        group_id = group.group_name if group is not None else "?"
        key = ("communication", group_id, peer)
        if key not in self._streams:
            self._streams.add(key)
            self.hb.add_stream(key, _stream_name(group, peer))
        return key

    # what happens at wait

    def waited(self, work) -> None:
        """The caller waited on `work`: its current stream is ordered after the collective. A barrier's wait
        also blocks the host until the current stream is done (ProcessGroupNCCL synchronizes it)."""
        self.tracker.drain()  # the collective itself first, if it is still queued
        if getattr(self._held, "work", None) is work:
            self._held.work = None
        current = self.current_stream()
        self.hb.wait_event(current, work)
        if work in self._barriers:
            self.hb.synchronize_stream(current, implicit=self.tracker.explicit_sync("Work.wait()"))

    def _wrap(self, original):
        collectives = self

        def wait(work, *args, **kwargs):
            # Ops a backend runs inside wait() (gloo copying results out) are the collective's, not the caller's.
            with collectives.tracker.paused(), collectives.tracker.explicitly("Work.wait()"):
                result = original(work, *args, **kwargs)
            collectives.waited(work)
            return result

        wait.__name__ = getattr(original, "__name__", "wait")
        wait.__doc__ = getattr(original, "__doc__", None)
        return wait

    def _issuing(self, original):
        """A ProcessGroup method Python issues collectives through: marks them as Python's while it runs (for the
        dispatch mode here, for the capture in C++)."""
        collectives = self

        def issue(*args, **kwargs):
            python, issuing = collectives._python, collectives.tracker.issuing
            python.depth = getattr(python, "depth", 0) + 1
            issuing(True)
            try:
                result = original(*args, **kwargs)
            finally:
                python.depth -= 1
                issuing(False)
            listener = self.returned
            if listener is not None:
                with self.tracker.paused():
                    listener(result)
            return result

        issue.__name__ = getattr(original, "__name__", "collective")
        issue.__doc__ = getattr(original, "__doc__", None)
        return issue

    # patch protocol

    def patches(self) -> list:
        from torch._C._distributed_c10d import Backend, ProcessGroup, Work

        methods = [name for name in ("wait", "synchronize", "block_current_stream") if hasattr(Work, name)]
        out = [self] + [WrapPatch(Work, name, self._wrap) for name in methods]
        for cls in (ProcessGroup, Backend):
            out += [WrapPatch(cls, name, self._issuing) for name in _PY_ENTRIES if hasattr(cls, name)]
        return out

    def install(self) -> None:
        self.tracker.namespace_handlers["c10d"] = self.on_op
        self.tracker.queued_at_issue.add("c10d")
        self.tracker.fixed_rules["c10d"] = self

    def uninstall(self) -> None:
        self.tracker.namespace_handlers.pop("c10d", None)
        self.tracker.queued_at_issue.discard("c10d")
        self.tracker.fixed_rules.pop("c10d", None)
        self._held = threading.local()


def _stream_name(group, peer) -> str:
    if group is None:
        where = "an unknown process group"
    elif getattr(group, "group_desc", "") == "default_pg":
        where = "the default process group"
    else:
        desc = getattr(group, "group_desc", "undefined")
        label = f" '{desc}'" if desc and desc != "undefined" else ""
        where = f"process group {group.group_name}{label} ({group.size()} ranks)"
    if peer is not None:
        return f"communication stream of send/recv with rank {peer} in {where}"
    return f"communication stream of {where}"


def available() -> bool:
    """Whether this torch build has torch.distributed (and so c10d ops to model)."""
    import torch.distributed as dist

    return dist.is_available()
