"""Every ATen op as a launch on the current stream plus reads and writes of the bytes it touches.

A TorchDispatchMode sits below autograd, so it sees forward ops, the ops autograd's backward runs and the ops inside
hooks alike. Where the C++ capture builds, the same ops come from it instead (``capture``; drained in order at
every synchronization point), classified by the same plans; the mode is the fallback. Which argument is read or
written comes from the op's schema (alias annotations), not from a list of ops, so new and custom ops are classified
too. Accesses are byte
ranges of storages — the span a view really touches — so overlapping views at other offsets conflict and disjoint
slices of one buffer do not.
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import functools
import operator
import os
import re
import threading
import weakref
from typing import Callable, Hashable

import torch
from torch import Tensor
from torch._C import DisableTorchFunction as _DisableTorchFunction
from torch._C import _current_autograd_node
from torch._C._autograd import _get_sequence_nr
from torch.utils._python_dispatch import TorchDispatchMode

from .. import checks, env
from ..patching import skip_in_dynamo
from . import host_party, host_sync
from .backward_sites import ForwardSites
from .frames import Captured, stack, thread_origin
from .hb import HappensBefore, Race, Site

READ, WRITE = 1, 2  # a launched kernel's argument roles, as bits (Tracker.launch; the capture's record_kernel)

# Factories that read only their inputs' metadata; "empty" ones do not write their output either (no kernel runs).
_METADATA_INPUTS = re.compile(r"^aten::(new_.*|.*_like|empty.*)$")
_NO_KERNEL = re.compile(r"^aten::(empty.*|new_empty.*)$")
_SKIPPED_OPS = {"aten::record_stream"}  # not a kernel: the stream model turns it into hb.record_stream
# Ops on a tensor's metadata only, no bytes read or written: in-place ones, whose schemas mark `self` written
# (Tensor(a!); `set_` points a tensor at other storage, as DCP's stager points a new CPU tensor at the pinned copy it
# just queued), and questions about a tensor (`is_pinned`, which DeepSpeed ZeRO-3 asks of a pinned buffer its copy
# may still be filling; `is_nonzero` reads the value, and is not one)
_METADATA_ONLY = {f"aten::{name}" for name in (
    "set_", "as_strided_", "squeeze_", "unsqueeze_", "t_", "transpose_", "swapdims_", "swapaxes_", "detach_",
    "is_pinned", "is_same_size", "is_set_to", "is_coalesced", "_nnz", "_is_zerotensor", "_has_same_storage_numel",
    "is_complex", "is_floating_point", "is_signed", "is_conj", "is_neg", "is_inference", "is_leaf")}
# modelled by a namespace handler (models.collectives, models.functional_collectives), never as plain ops
_HANDLED_NAMESPACES = {"c10d", "_c10d_functional", "_c10d_functional_autograd"}
_ASYNC_COPIES = host_party.ASYNC_COPIES


def byte_range(t: torch.Tensor) -> tuple[int, int] | None:
    """[start, end) bytes of its storage that a tensor's elements span; None when it has no elements."""
    size = t.itemsize
    start = t.storage_offset() * size
    if t.is_contiguous():
        nbytes = t.nbytes
        return (start, start + nbytes) if nbytes else None
    last = 0  # offset of the last element (a plain loop: a generator costs a microsecond per op here)
    for n, stride in zip(t.shape, t.stride()):
        if n == 0:
            return None
        last += (n - 1) * stride
    return start, start + (last + 1) * size


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_TRACED: tuple = ()


def _traced(cls) -> bool:
    """Whether a tensor class is tracing's own (fake and functional tensors): no real bytes behind it."""
    global _TRACED
    if not _TRACED:
        from torch._subclasses.fake_tensor import FakeTensor
        from torch._subclasses.functional_tensor import FunctionalTensor

        _TRACED = (FakeTensor, FunctionalTensor)
    return issubclass(cls, _TRACED)


def plain_storage(t: torch.Tensor):
    """(data pointer, storage) of the plain storage that holds a tensor's bytes; None where there is none to read —
    subclass wrappers (DTensor, functional and fake tensors), sparse and nested tensors, storages already gone. The one
    guard for every place the tracker touches storages."""
    if t.__class__ not in _PLAIN and _traced(t.__class__):
        return None  # asking a fake storage for its data pointer warns (DTensor's sharding propagation makes them)
    try:
        storage = t.untyped_storage()
        key = storage.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return (key, storage) if key else None


def _traced_tensors(types) -> bool:
    """Whether an op's subclass arguments are tracing's own (fake and functional tensors while compiling): their
    dispatch needs their mode, not ours, and runs no kernel on real memory."""
    return all(_traced(t) for t in types if t not in _PLAIN)


_NO_KWARGS: dict = {}  # shared, never written: ops without keyword arguments (most) allocate none
_HANDLED = "handled"  # plan of ops a namespace handler models (collectives)
_SKIPPED = "skipped"  # plan of ops that touch no bytes on any stream


_PLANS: dict = {}  # OpOverload._op -> _plan(func): a function of the op's schema alone, worked out once per process


def _plan(func):
    """How an op touches its arguments, worked out once per op from its schema: (name, (index, name, is_write) of
    the arguments it reads or writes, per return whether it is a fresh tensor, whether its kernel writes its
    output). Arguments aliased without a write are views (no data moves); the inputs of *_like / new_* / empty*
    factories only lend metadata."""
    if func.namespace in _HANDLED_NAMESPACES:
        return _HANDLED
    schema = func._schema
    name = schema.name
    if name in _SKIPPED_OPS or name in _METADATA_ONLY:
        return _SKIPPED
    metadata_inputs = _METADATA_INPUTS.match(name) is not None
    inputs = []
    for i, arg in enumerate(schema.arguments):
        alias = arg.alias_info
        if alias is not None and alias.is_write:
            inputs.append((i, arg.name, True))
        elif alias is None and not metadata_inputs and "Tensor" in str(arg.type):
            inputs.append((i, arg.name, False))
    fresh = tuple(ret.alias_info is None and "Tensor" in str(ret.type) for ret in schema.returns)
    if not inputs and not any(fresh):
        return _SKIPPED  # views and metadata: no bytes move, nothing is allocated
    return name, tuple(inputs), fresh if any(fresh) else (), _NO_KERNEL.match(name) is None


def _onto_itself(args) -> bool:
    """``dst.copy_(src)`` where both are views of the same bytes (``p.data.copy_(p.data)``)."""
    if len(args) < 2:
        return False
    dst, src = args[0], args[1]
    return (isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor) and dst.is_set_to(src)
            and dst.dtype == src.dtype and dst.is_conj() == src.is_conj() and dst.is_neg() == src.is_neg())


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


try:  # what torch's dynamo-disable wrapper around __torch_dispatch__ does, without the wrapper's per-call cost
    from torch._C._dynamo.eval_frame import set_eval_frame as _set_eval_frame
    _OWN_DYNAMO_GUARD = True
except ImportError:  # no such hook in this build: torch's own wrapper stays
    _OWN_DYNAMO_GUARD = False

    def _set_eval_frame(callback):
        return None


def _called_from_cpp(method):
    """A method the C++ capture calls from inside ops, compiled regions included: neither its frame nor any below it
    may become one dynamo tries to compile (the dispatch mode's own guard, for the capture's entry points)."""

    @functools.wraps(method)
    def call(*args, **kwargs):
        prior = _set_eval_frame(None)
        try:
            return method(*args, **kwargs)
        finally:
            _set_eval_frame(prior)
    return call


def applier_wanted(cuda: bool) -> bool:
    """Whether a session's captured records are applied by the capture's applier thread (capture's applier.cpp)
    rather than by the program's threads as they drain: ``STREAMRACE_APPLIER`` (thread, inline) where set; else on
    the cuda backend where the process may run on four cores or more (a step there is host-bound, and the thread takes
    the records' application off it). The virtual backend runs its Python models on every stream call, whose drains
    leave the thread little to do."""
    chosen = os.environ.get(env.APPLIER) or None
    if chosen is not None:
        return checks.applier(chosen) == "thread"
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return cuda and cores >= 4


class AccessTracker(TorchDispatchMode):
    """Turns ATen ops into hb launches and accesses on the stream `current_stream()` names.

    device_type: the tensors that live on the modelled device ("cpu" under virtual streams, "cuda" on GPUs); others
    are host memory and ignored. track_frees: on CPU a storage's death is seen through a weak reference, or, where the
    C++ capture runs, through its deleter (a default-allocator storage's free is queued by the capture as it happens);
    on CUDA the allocator's deallocation callback calls `note_free` instead.

    Every op passes through here, so the per-op path is kept lean: one plan per op from its schema, tensors
    described as raw tuples (hb builds TensorInfo only for races), one hb call per op.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return not _OWN_DYNAMO_GUARD  # else __torch_dispatch__ keeps dynamo out itself, more cheaply

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile compiles under this mode (else dynamo skips every frame and the program runs eagerly); its
        tracing is not tracked, the compiled code's ops and kernels are (``compiled``)."""
        return True

    def __init__(self, hb: HappensBefore, current_stream: Callable[[], Hashable], device_type: str,
                 track_frees: bool = True, on_race: Callable[[list[Race]], None] | None = None):
        super().__init__()
        self.hb = hb
        self.current_stream = current_stream
        self.device_type = device_type
        self.on_device: Callable[[torch.Tensor], bool] = operator.attrgetter(f"is_{device_type}")
        self.track_frees = track_frees
        self.on_race = on_race
        self.names: dict[Hashable, str] = {}  # storage key -> human name ("model.0.weight")
        self.last_writer: dict[Hashable, Hashable] = {}  # storage key -> stream of its latest write
        # op namespace -> handler(func, args, kwargs, out) that models those ops itself (collectives: "c10d"). Under
        # the capture their ops come from its records (`_queued`), as they returned; those of `queued_at_issue`
        # (c10d: torch's C++ issues them) before they ran where torch's C++ issued them.
        self.namespace_handlers: dict[str, Callable] = {}
        self.queued_at_issue: set[str] = set()
        # Models whose ops queued at issue the capture's feed applies in C++ by a fixed rule (``capture_rule(func)``,
        # the stream named by ``rule_stream(value)``): no Python per op. models.collectives says which.
        self.fixed_rules: dict[str, object] = {}
        self._applying = False  # the capture's records are being applied (under the lock)
        self.redirect: dict[Hashable, Hashable] = {}  # storage key -> stream of the next op reading it (autograd)
        self.watched: dict[Hashable, weakref.ref | None] = {}  # storages alive and known -> their weak reference
        self._ref_keys: dict[weakref.ref, Hashable] = {}
        self._on_dead = self._dead  # one bound method for every weak reference, not one each
        self._frees: collections.deque = collections.deque()
        self._lock = _thread.RLock()  # not threading's: it may be a modelled one by now (hb.py)
        self._paused = threading.local()  # per thread: one thread modelling work by hand pauses only itself
        self._capture = None  # the C++ capture, when it replaces this dispatch mode
        self._plans_at_enable = ""  # `_plans_key` as the capture was enabled
        self._feed = None  # the capture's records applied straight to the C++ core (capture.cpp's Feed), when it is one
        self.applier = False  # and by the capture's applier thread (applier.cpp), not only as the program drains
        self.forcing = None  # a forced run's call at each op's place (`session.force`), for host accesses no op makes
        self._ordinal = 0  # the captured op whose queued model runs now (`_queued`): its ordinal names what it launches
        self._issuer: int | None = None  # and the thread that issued it (its ordinal counts that thread's ops)
        # the virtual model's streams by the small int the capture records for each (``VirtualStreams.keys``)
        self.capture_streams: list | None = None
        self._plans = _PLANS  # OpOverload._op -> _plan(...)
        self.notes: list[str] = []  # what could not be modelled and was skipped, once each
        self.on_note: Callable[[str], None] | None = None  # told each new note (a child process passes it on)
        # Real autograd (cuda model): the engine record_stream()s a gradient produced on one stream for the stream
        # of the node that consumes it — in C++, where no hook sees it. The virtual model does this in its hooks.
        self.engine_records_streams = False
        # Ops after which the host has waited for the stream that ran them (reading a value back: .item(), nonzero's
        # size, a copy to the host), one table for both backends (``host_sync``).
        self.host_syncs: dict[str, host_sync.HostSync] = host_sync.OPS
        # The latent view (hb): read-backs order the host only in the normal view. Off: every sync counts (no cost).
        self.latent = True
        self.incidental: tuple[str, ...] = ()  # globs of files whose explicit syncs count as read-backs
        # the cuda model's latest implicit sync per thread, named by the op of that thread that made it
        self._unnamed_syncs: dict[int, Site] = {}
        self._explicit = threading.local()  # .name: the explicit sync API running on this thread (cuda model)
        self.forward_sites = ForwardSites()  # the sites of forward ops by the autograd number of their node
        self._forward_seq = threading.local()  # .seq: the autograd number this thread's last forward op saw
        # host storages by key (``host_party``): pinned memory, the host side of async copies; and each thread's
        # host timeline, made as the thread's host first touches one
        self.hosts: set[Hashable] = set()
        self._timelines: dict[int, host_party.HostTimeline] = {}

    @property
    def enabled(self) -> bool:
        """Whether ops on this thread are tracked (paused while work is modelled by hand, e.g. inside Work.wait)."""
        return not getattr(self._paused, "on", False)

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._paused.on = not value
        if self._capture is not None:
            self._capture.set_recording(value)

    @contextlib.contextmanager
    def paused(self):
        """Ops are not tracked inside (work modelled by hand, or launching nothing), as they were after."""
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous

    # the C++ capture

    @property
    def capturing(self) -> bool:
        return self._capture is not None

    def capture_with(self, extension, every_thread: bool | None = None) -> None:
        """Take ops from the C++ capture instead of this dispatch mode (which then stays uninstalled). The capture
        asks for a drain every few hundred records (`_drain_forced`), so its buffer stays bounded in a loop that never
        syncs; on host memory its records hold the storages they saw first until then, unless their deleter reports
        their free as it happens (the default CPU allocator's storages, with `track_frees`). It sees the threads the
        dispatch mode would see (`observe_thread`), unless `every_thread` (the default on cuda). Its ops come from its
        kernel entry below autograd (kernel_entry.cpp)."""
        self._capture = extension
        core = getattr(self.hb, "core", None)  # hb_native's C++ core: the records go straight into it
        self._feed = extension.Feed(core, self) if isinstance(core, extension.hb.Core) else None
        if self._feed is not None:  # its tables in C++, with a dict's face for the paths here that read them
            self._swap_tables(self._feed.tables)
        cuda = self.device_type == "cuda"
        self._plans_at_enable = self._plans_key()
        extension.enable(cuda, self._capture_plan, self._drain_forced,
                         cuda if every_thread is None else every_thread, host_frees=self.track_frees and not cuda,
                         plans_key=self._plans_at_enable)
        self.applier = self._feed is not None and applier_wanted(cuda)
        if self.applier:
            self._feed.use_applier(True)

    def stop_applier(self) -> None:
        """Apply the records on the threads that drain from now on (the session ends, or a confirmation forces an
        order): the applier thread lets this session's feed go."""
        if self._feed is not None:
            self._feed.use_applier(False)
        self.applier = False

    def busy_here(self) -> bool:
        """Whether this thread is inside the tracker's own work (an op being recorded, a drain): what runs there is the
        detector's, not the program's (a lock a module it imports takes)."""
        return self._lock._is_owned()

    def observe_thread(self):
        """Capture this thread's ops from now on, where the capture does not see every thread: the undo (None when
        there is nothing to undo)."""
        if self._capture is not None and self._capture.observe():
            return self._capture.unobserve
        return None

    def capture_stream(self, index: int) -> None:
        """This thread's current stream, for the capture: the virtual model's small int for it."""
        if self._capture is not None:
            self._capture.set_stream(index)

    @_called_from_cpp
    def _drain_forced(self) -> None:
        """The capture's records, applied every few hundred records on the thread that recorded the last one (they
        hold memory, and on host memory the storages they saw first)."""
        try:
            self.drain()
        except Exception as exc:  # never inside the user's test
            self.note(f"captured ops are not checked: {type(exc).__name__}: {exc}")

    def sync_inside_op(self, stream) -> bool:
        """Whether a host sync the GPU trace reports now happens inside a captured op on this thread; if so it is
        applied right after that op (the op's own work is what the host waited for)."""
        return self._capture is not None and self._capture.sync_inside_op(stream)

    def stop_capture(self) -> None:
        if self._capture is not None:
            self.stop_applier()
            self.drain()
            # the capture keeps its plans for the next session only where nothing they were made from changed here
            self._capture.disable(keep_plans=self._plans_key() == self._plans_at_enable)
            if self._feed is not None:  # the tables back in Python dicts, with what they hold
                self.watched, self.last_writer, self.redirect, self.names = (
                    dict(table.items()) for table in self._tables())
            self._capture = self._feed = None  # the feed holds the tracker's methods: no cycle is left

    def _tables(self) -> tuple:
        return self.watched, self.last_writer, self.redirect, self.names

    def _swap_tables(self, tables) -> None:
        """The storage tables replaced by `tables` (same order as `_tables`), with what they held."""
        old = self._tables()
        self.watched, self.last_writer, self.redirect, self.names = tables
        for table, before in zip(tables, old):
            for key, value in before.items():
                table[key] = value

    def note_free_captured(self, key: Hashable) -> None:
        """A free seen by the allocator while ops are captured: queued in the capture's buffer, so it lands
        between the ops it came between. Its stack only where a free may yet race or be traced (as `_dead`)."""
        self._capture.mark_free(key, self.hb.frees_can_race)

    def _plans_key(self) -> str:
        """Everything `_capture_plan`'s answers depend on beside the op, as one string: the capture keeps its plans
        from one session to the next while it stays the same (the plan function itself, the modelled device, the
        namespaces models handle and how, the host-sync table)."""
        if "_capture_plan" in vars(self):  # replaced on this tracker: its answers are its own
            return ""
        return repr((id(type(self)._capture_plan), id(self._plans), self.device_type,
                     sorted(self.namespace_handlers), sorted(self.queued_at_issue),
                     sorted((namespace, id(model)) for namespace, model in self.fixed_rules.items()),
                     id(self.host_syncs), len(self.host_syncs)))

    @_called_from_cpp
    def _capture_plan(self, name: str, overload: str):
        namespace, op = name.split("::", 1)
        try:
            func = getattr(getattr(getattr(torch.ops, namespace), op), overload or "default")
        except AttributeError:
            return None
        plan = self._plans.get(func._op)
        if plan is None:
            plan = self._plans[func._op] = _plan(func)
        if plan is _HANDLED:
            if namespace not in self.namespace_handlers:
                return None
            if namespace not in self.queued_at_issue:
                return "queued"
            model = self.fixed_rules.get(namespace)
            try:
                rule = model.capture_rule(func) if model is not None else None
            except Exception:  # an op the rule cannot describe: its model takes it in Python
                rule = None
            return "queued at issue" if rule is None else ("queued at issue", rule)
        if plan is _SKIPPED:
            return None
        _, inputs, fresh, writes_output = plan
        # Host memory: a host sync with a rule on the arguments (t[mask], histc without a range) is judged on them,
        # as the dispatch mode does; the capture keeps them for the drain. On a GPU such a sync is the GPU trace's,
        # reported from inside the op (the record's `synced`): only an unconditional one (.item()) is the tracker's
        # to judge, and the other ops (a device-to-device copy_: DDP's buckets) need no Python when applied.
        sync = self.host_syncs.get(name)
        keep_args = self.device_type != "cuda" and sync is not None and sync.rule is not None
        judged = sync is not None and (sync.rule is None or keep_args)
        return [(i, write) for i, _, write in inputs], bool(fresh), writes_output, keep_args, judged

    def _queued(self, name: str, overload: str, args: tuple, out, phase: str, stream: Hashable, captured,
                ordinal: int = 0, thread: int | None = None) -> None:
        """An op of a handled namespace (``namespace_handlers``), from the records in their order: "start" for a c10d
        op torch's C++ issued (before it ran), "end" for any other (as it returned, `out` its outputs), with the
        issuing thread's `stream` and stack. The drain applying it holds the lock; the handler must not drain."""
        namespace, op = name.split("::", 1)
        handler = self.namespace_handlers.get(namespace)
        if handler is not None:
            func = getattr(getattr(getattr(torch.ops, namespace), op), overload or "default")
            # the ops its model launches (`run`) are named by the captured op's place on the thread that issued it
            self._ordinal, self._issuer = ordinal, thread
            try:
                handler(func, args, {}, out, phase, stream=stream, frames=Captured(captured))
            finally:
                self._ordinal, self._issuer = 0, None

    @_called_from_cpp
    def _rule_stream(self, name: str, value):
        """The stream a fixed rule's op runs on, named by one of its arguments (``fixed_rules``), and this rank in
        it: (stream key, rank or None); None: the op goes to its model in Python."""
        model = self.fixed_rules.get(name.split("::", 1)[0])
        return None if model is None else model.rule_stream(value)

    def issuing(self, value: bool) -> None:
        """Python starts (True) or ends (False) issuing a collective on this thread: the capture queues its c10d op as
        it returns, with its Work, rather than before it runs."""
        if self._capture is not None:
            self._capture.set_issuing(value)

    def _apply_captured(self, records: list) -> None:
        """The capture's records applied to hb.py's core (capture.cpp's Feed applies them to the C++ core, by these
        rules): the reference the C++ feed is tested against (tests/test_capture.py runs both)."""
        watched, names, last_writer = self.watched, self.names, self.last_writer
        streams, redirect = self.capture_streams, self.redirect
        for record in records:
            if record[0] == "watch":  # a storage first seen by the op before (host memory): its free is learnt from now
                if watched.get(record[1]) is None:
                    self._watch(record[1], record[2])
                continue
            with self.hb.acting_for(record[-1]):  # the recording thread's host clock (capture.cpp's Feed does too)
                self._apply_record(record, watched, names, last_writer, streams, redirect)

    def _apply_record(self, record: tuple, watched, names, last_writer, streams, redirect) -> None:
        """One drained record (not a "watch"), for the thread that recorded it."""
        try:
            kind = record[0]
            if kind == "free":
                self._freed(record[1], Site("free", Captured(record[2]) if record[2] is not None else ()))
                return
            if kind == "event_record":  # the GPU trace's, taken in C++ (models.cuda, TraceShortcut)
                self.hb.record_event(record[1], record[2])
                return
            if kind == "event_wait":
                self.hb.wait_event(record[2], record[1])
                return
            if kind == "queued":
                name, overload, args, out, phase, stream, captured, ordinal = record[1]
                self._queued(name, overload, args, out, phase, streams[stream] if streams is not None else stream,
                             captured, ordinal, record[2])
                return
            _, name, stream, in_node, spans, fresh, captured, seq, node, synced, arguments, ordinal, _ = record
            host = stream == host_party.HOST_STREAM  # the host's own op (capture.cpp's host_op)
            if host:
                stream = self.host_timeline(record[-1])
            elif streams is not None:
                stream = streams[stream]
            if redirect:  # a gradient's add the engine runs on its consumer's stream (virtual autograd)
                for span in spans:
                    if span[0] in redirect:
                        stream = redirect.pop(span[0])
                        break
            accesses: list[tuple] = []
            for key, start, end, write, shape, dtype in spans:
                if key not in watched:
                    watched[key] = None
                if write:
                    last_writer[key] = stream
                elif self.engine_records_streams and in_node and last_writer.get(key, stream) != stream:
                    self.hb.record_stream(key, stream)  # read inside a node: one of its incoming gradients
                accesses.append((key, start, end, write, (shape, dtype, names.get(key))))
            allocs: list[tuple] = []
            for key, start, end, write, shape, dtype, nbytes in fresh:
                desc = (shape, dtype, None)
                if key not in watched:
                    watched[key] = None
                    allocs.append((key, nbytes, desc))
                if write:
                    last_writer[key] = stream
                    accesses.append((key, start, end, True, desc))
            if self._unnamed_syncs:
                self._name_sync(name, record[-1])
            thread = thread_origin(record[-1])
            if in_node:  # the engine's threads have no frames of the program's: name the node's forward op
                site = Site(name, self.forward_sites.backward(Captured(captured), seq, node), thread, ordinal)
            else:
                site = Site(name, Captured(captured), thread, ordinal)
                if seq >= 0:
                    self.forward_sites.forward(seq, site)
            _, races = self.hb.record(stream, site, accesses, allocs)
            if host:
                self.host_did(stream)
            if races:
                self._report(races)
            if not host:
                self._captured_sync(name, stream, synced, captured, arguments, bool(spans) or streams is not None)
        except Exception as exc:  # never inside the user's test: this op goes unchecked, said once
            self.note(f"{record[1] if record[0] == 'op' else record[0]} is not checked: "
                      f"{type(exc).__name__}: {exc}")

    def _captured_sync(self, name: str, stream, synced: int | None, captured, arguments, touched: bool) -> None:
        """The host sync a captured op made, if any. On a GPU no arguments come along: a conditional sync (a copy to
        the host, t[mask]) is the GPU trace's sync from inside the op (`synced`: its stream, else None); an
        unconditional one counts only for an op that touched the device (`touched`). On host memory every record
        touched it, and a conditional sync's arguments came along."""
        sync = self.host_syncs.get(name)
        if synced is not None:  # not `if synced`: 0 is a stream (the legacy default stream's handle)
            self.host_synced(sync or host_sync.HostSync(name), synced, Captured(captured))
        elif sync is not None:
            if arguments is not None:
                applies = sync.applies(arguments[0], arguments[1], self.device_type)
            else:
                applies = sync.rule is None and touched
            if applies:
                self.host_synced(sync, stream, Captured(captured))

    # storages

    def storage_key(self, t: torch.Tensor) -> Hashable | None:
        """The key of a tensor's storage (its data pointer, unique while it lives); registers its free."""
        found = plain_storage(t)
        if found is None:
            return None
        key, storage = found
        if key not in self.watched:
            self._watch(key, storage)
        return key

    def _watch(self, key: Hashable, storage) -> None:
        ref = None
        if self.track_frees:
            ref = weakref.ref(storage, self._on_dead)
            self._ref_keys[ref] = key
        self.watched[key] = ref

    def _dead(self, ref: weakref.ref) -> None:
        key = self._ref_keys.pop(ref, None)
        if key is not None and self.hosts:
            self.hosts.discard(key)  # at once: the allocator may hand the address out before the free is applied
        if key is not None and self.watched.get(key) is ref:
            # a free's site is read only by a free-while-in-use race or a trace: neither exists while every access
            # so far ran on one stream, so the stack (a third of a free's cost) is taken only where they can
            capture = self._capture
            if capture is not None:  # in order with the captured ops, before the address can be handed out again
                capture.mark_free(key, self.hb.frees_can_race)
            else:
                self.note_free(key, Site("free", stack() if self.hb.frees_can_race else ()))

    def note_free(self, key: Hashable, site: Site) -> None:
        """The storage's memory went back to the allocator. Queued, not applied: this may run inside a garbage
        collection or an allocator callback at any point, even while hb holds its lock; `drain` applies it."""
        self._frees.append((key, site))

    def drain(self) -> None:
        """Apply the frees seen since the last call: report uses not ordered before them, forget the storages.
        Every entry point (an op, a stream call, reading races) drains first, so a freed address is forgotten
        before it can be handed out again."""
        if self._capture is not None:
            with self._lock:
                if self._applying:  # a queued collective's model, inside this drain: later records wait their turn
                    return
                self._applying = True
                try:
                    self._apply_capture()
                finally:
                    self._applying = False
        while self._frees:
            self._freed(*self._frees.popleft())

    def _apply_capture(self) -> None:
        if self._feed is not None:
            firsts = self._feed.apply(self.capture_streams, self.engine_records_streams,
                                      set(self._unnamed_syncs) if self._unnamed_syncs else None)
            for thread, first in firsts.items():
                self._name_sync(first, thread)
            return
        records = self._capture.drain()
        while records:
            self._apply_captured(records)
            if not self.track_frees:
                break
            records = None  # releases the storages they held (host memory): the frees that follow land now
            records = self._capture.drain()

    def _freed(self, key: Hashable, site: Site) -> None:
        if self.hosts:
            self._forget_host(key)
        if self.watched.pop(key, False) is False:
            return  # never touched by a tracked op
        if self.names:
            self.names.pop(key, None)
        self.last_writer.pop(key, None)
        races = self.hb.free(key, site)
        if races:
            self._report(races)

    def detach(self) -> None:
        """Stop watching storages (the session ends): no callback fires into a finished detector."""
        self.watched.clear()
        self._ref_keys.clear()
        # the session's one bound method is a cycle through this tracker: let go, so the session is freed as its last
        # reference goes, not by the collector (a storage watched from now on gets a bound method of its own)
        self.__dict__.pop("_on_dead", None)

    _on_dead = _dead

    # the host as a party (host_party)

    def mark_host(self, t: torch.Tensor) -> None:
        """`t`'s storage is a host storage: pinned memory, or the host side of an async copy. Its free is watched
        (pinned memory comes from an allocator of its own), so that its address is forgotten as host memory then."""
        found = plain_storage(t)
        if found is None:
            return
        key, storage = found
        with self._lock:
            self.drain()  # a free of an earlier storage at this address lands first
            self._mark_host(key, storage)

    def _mark_host(self, key: Hashable, storage=None) -> None:
        """`key` a host storage; with `storage`, its free is watched (without: the caller says when it ends)."""
        if key in self.hosts:
            return
        if storage is not None and self.watched.get(key) is None:
            ref = weakref.ref(storage, self._on_dead)
            self._ref_keys[ref] = key
            self.watched[key] = ref
        self.hosts.add(key)
        if self._capture is not None:
            self._capture.mark_host(key)

    def mark_host_address(self, key: int) -> None:
        """The storage that starts at `key` was pinned in place (registered): a host storage until
        `forget_host_address` (its unregistering, as it dies)."""
        with self._lock:
            self.drain()
            self._mark_host(key)

    def forget_host_address(self, key: int) -> None:
        with self._lock:
            self.drain()
            self._forget_host(key)

    def is_host(self, t: torch.Tensor) -> bool:
        if not self.hosts:
            return False
        found = plain_storage(t)
        if found is None:
            return False
        with self._lock:
            self.drain()  # frees not yet applied (the capture's deleter reports them in C++) forget their addresses
            return found[0] in self.hosts

    def _forget_host(self, key: Hashable) -> None:
        self.hosts.discard(key)
        if self._capture is not None:
            self._capture.unmark_host(key)

    def host_timeline(self, ident: int) -> host_party.HostTimeline:
        """Thread `ident`'s host, as a stream's key (named in reports after the thread)."""
        timeline = self._timelines.get(ident)
        if timeline is None:
            timeline = self._timelines[ident] = host_party.HostTimeline(ident, host_party.name_of(ident))
            self.hb.add_stream(timeline, timeline.name)
        return timeline

    def host_did(self, timeline: host_party.HostTimeline) -> None:
        """The host has done what it just launched on its timeline before it issues anything else: its clock learns
        it (explicitly: the host's own program order, in both views)."""
        self.hb.synchronize_stream(timeline)

    def host_access(self, name: str, reads=(), writes=(), frames=None):
        """A host access no op reports (``.numpy()``, ``.tolist()``, the buffer protocol) to host storages. Where the
        capture runs it takes the next place on its thread, as an op would, so a forced run finds it (`forcing`): then
        it returns what to call once the access is over, else None."""
        with self._lock:
            self.drain()
            touched = [(t, False) for t in reads if self.is_host(t)] + [(t, True) for t in writes if self.is_host(t)]
            if not touched:
                return None
            ident = threading.get_ident()
            ordinal = self._capture.next_ordinal() if self._capture is not None else 0
            self._host_op(Site(name, frames if frames is not None else stack(), thread_origin(ident), ordinal), touched)
        forcing = self.forcing
        if forcing is None or not ordinal:
            return None
        tensors = [t for t, _ in touched]
        forcing("before", ordinal, ident, name, 0, tensors, [])
        return lambda: forcing("after", ordinal, ident, name, 0, tensors, [])

    def copied_to_host(self, t: torch.Tensor, name: str) -> None:
        """A non_blocking copy from the device wrote host storage `t` on the current stream, in an op recorded before
        `t` was known as host memory (the capture's; the dispatch mode learns it in the op: `_async_copy_hosts`)."""
        if not self.capturing:
            return
        with self._lock:
            self.drain()
            stream = self.current_stream()
            ident = threading.get_ident()
            _, races = self.hb.record(stream, Site(name, stack(), thread_origin(ident)),
                                      self._accesses([(t, True)], stream, []))
            self._report(races)

    def _async_copy_hosts(self, name: str, args, kwargs, out) -> None:
        """On a GPU: a non_blocking copy between the device and pinned memory makes its host side a host storage."""
        if not host_party.non_blocking(name, args, kwargs):
            return
        if name == "aten::copy_":
            dst, src = args[0], args[1]
            host = src if dst.is_cuda and src.is_cpu else dst if src.is_cuda and dst.is_cpu else None
        elif isinstance(out, Tensor):
            src = args[0]
            host = out if out.is_cpu and src.is_cuda else src if src.is_cpu and out.is_cuda else None
        else:
            return
        if host is not None and host.is_pinned():
            self.mark_host(host)

    def _host_side(self, plan, args, kwargs, out):
        """`_record`'s look at an op while host storages exist: None where it touches none; True where it is the
        host's own op, applied here on the thread's host timeline; else it is a copy between the device and host
        memory, the current stream's, and the host storages it touches are returned, as (tensor, write), for the op's
        accesses (on the virtual backend they are among them already)."""
        name, inputs, fresh_returns, _ = plan
        hosts, on_device = self.hosts, self.on_device
        host: list[tuple[torch.Tensor, bool]] = []
        device = False
        nargs = len(args)
        for i, arg_name, write in inputs:
            value = args[i] if i < nargs else kwargs.get(arg_name)
            for v in (value,) if isinstance(value, Tensor) else value if isinstance(value, (list, tuple)) else ():
                if not isinstance(v, Tensor):
                    continue
                found = plain_storage(v)
                if found is not None and found[0] in hosts:
                    host.append((v, write))
                elif on_device(v):
                    device = True
        outs = [(t, True) for t in _tensors(out) if (f := plain_storage(t)) is not None and f[0] in hosts] \
            if fresh_returns else []
        if not host and not outs:
            return None
        cuda = self.device_type == "cuda"
        if cuda and (device or any(on_device(t) for t in _tensors(out))) or \
                not cuda and device and self._copies_with_device(name, args, kwargs):
            return host + outs if cuda else []
        self._host_op(self._site(name), host + outs)  # what it touches besides host memory is the host's
        return True

    def _host_op(self, site: Site, touched: list[tuple[torch.Tensor, bool]]) -> None:
        """The calling thread's host accesses `touched` (host storages), on its host timeline, done at once."""
        timeline = self.host_timeline(threading.get_ident())
        _, races = self.hb.record(timeline, site, self._accesses(touched, timeline, []))
        self.host_did(timeline)
        self._report(races)

    def _copies_with_device(self, name: str, args, kwargs) -> bool:
        """On the virtual backend, where device memory is CPU memory too: whether a copy that touches a host storage
        is one between the device and the host (a stream's), not the host's own write into its memory. A copy into
        device memory from a host storage is; one into a host storage only where non_blocking asks for a copy from
        the device (a blocking copy into pinned memory from other CPU memory is taken as the host staging data)."""
        if name != "aten::copy_":
            return False
        if not self.is_host(args[0]):
            return True
        return host_party.non_blocking(name, args, kwargs) and not self.is_host(args[1])

    # accesses

    def run(self, op_name: str, stream: Hashable, reads=(), writes=(), frames=None):
        """Launch one op on `stream` that reads and writes the given tensors: the public way for collectives and
        other work the dispatch mode does not see. Returns the hb Op."""
        with self._lock:
            self.drain()  # what ran before it (frees, captured ops) lands before it
            touched = [(t, False) for t in reads if self.on_device(t)]
            touched += [(t, True) for t in writes if self.on_device(t)]
            # named by the thread that issued it, whose ops its ordinal counts (a backward hook's collective: the
            # autograd engine's thread on a GPU), not by the thread applying the records
            issuer = self._issuer if self._issuer is not None else threading.get_ident()
            site = Site(op_name, frames if frames is not None else stack(), thread_origin(issuer), self._ordinal)
            op, races = self.hb.record(stream, site, self._accesses(touched, stream, []))
            self._report(races)
            return op

    def launch(self, name: str, stream: Hashable | None, args, roles) -> None:
        """A kernel launch that no op reports (compiled code's kernels) on `stream` (None: the current one): each
        tensor among `args` is read where its role (`roles`, one per argument) has READ, written where it has WRITE.
        Where the capture runs it is queued in order with the captured ops, without Python: a compiled step launches
        dozens."""
        capture = self._capture
        if capture is not None and (stream is None or self.device_type == "cuda") and capture.record_kernel(
                name, stream, args, roles):
            return
        if not self.enabled:  # (the capture checks it itself)
            return
        reads = [arg for arg, role in zip(args, roles) if role & READ and isinstance(arg, torch.Tensor)]
        writes = [arg for arg, role in zip(args, roles) if role & WRITE and isinstance(arg, torch.Tensor)]
        if reads or writes:
            self.run(name, self.current_stream() if stream is None else stream, reads, writes)

    def _report(self, races: list[Race]) -> None:
        if races and self.on_race is not None:
            self.on_race(races)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        prior = _set_eval_frame(None)  # first: nothing below may become a frame dynamo tries to compile
        try:
            for cls in types:  # any subclass? (plain tensors can carry the Python key too) A loop, no generator
                if cls not in _PLAIN:
                    if not _traced_tensors(types):
                        # A wrapper subclass (DTensor, FSDP2's sharded parameters, float8): its own dispatch runs
                        # the op on the plain tensors that hold the bytes, and those ops come back here.
                        return NotImplemented
                    return func._op(*args, **(kwargs or {}))  # fake/functional tensors while tracing: no memory
            op = func._op  # the C++ callable: OpOverload.__call__ is one frame more, its __hash__ a Python call
            out = op(*args, **kwargs) if kwargs else op(*args)
            if getattr(self._paused, "on", False):  # not `enabled`: a property costs a call per op
                return out
            plan = self._plans.get(op)
            if plan is None:
                plan = self._plans[op] = _plan(func)
            if plan is _SKIPPED:
                return out
            # Reading tensors' metadata must not go through torch function modes (torch.device("cuda") as a
            # context is one, the virtual autograd model another): they would run per attribute read.
            with self._lock, _DisableTorchFunction():
                try:
                    if self._frees:
                        self.drain()
                    if plan is _HANDLED:
                        handler = self.namespace_handlers.get(func.namespace)
                        if handler is not None:
                            handler(func, args, kwargs or {}, out)
                    else:
                        self._record(plan, args, kwargs or _NO_KWARGS, out)
                except Exception as exc:  # never inside the user's test: this call goes unchecked, said once
                    self.note(f"{func.name()} is not checked: {type(exc).__name__}: {exc}")
            return out
        finally:
            _set_eval_frame(prior)

    def note(self, text: str) -> None:
        """Something the detector could not model and skipped: said once per session (``notes``)."""
        if text not in self.notes:
            self.notes.append(text)
            if self.on_note is not None:
                try:
                    self.on_note(text)
                except Exception:
                    pass

    def _accesses(self, touched: list[tuple[torch.Tensor, bool]], stream, accesses: list) -> list[tuple]:
        """Append (tensor, write) pairs as hb takes them: (storage, start, end, write, (shape, dtype, name)), for
        the bytes each tensor's elements span. Notes writers, and the engine's record_stream of incoming gradients.
        """
        seen, names, last_writer = self.watched, self.names, self.last_writer
        records = self.engine_records_streams
        for t, write in touched:
            span = byte_range(t)
            if span is None:
                continue
            found = plain_storage(t)
            if found is None:
                continue
            key = found[0]
            if key not in seen:
                self._watch(key, found[1])
            if write:
                last_writer[key] = stream
            elif records and last_writer.get(key, stream) != stream and _current_autograd_node() is not None:
                self.hb.record_stream(key, stream)  # read inside a node: taken as one of its incoming gradients
            accesses.append((key, span[0], span[1], write, (t.shape, t.dtype, names.get(key) if names else None)))
        return accesses

    def _record(self, plan, args, kwargs, out) -> None:
        # The hottest code of the detector: every op that touches memory passes here. Kept flat on purpose: a helper
        # call or a list per tensor shows in a launch-bound step (benchmarks/instructions.py).
        name, inputs, fresh_returns, writes_output = plan
        if name == "aten::copy_" and _onto_itself(args):
            return  # ATen returns before launching anything: no access
        if name in _ASYNC_COPIES and self.device_type == "cuda":
            self._async_copy_hosts(name, args, kwargs, out)
        extra = self._host_side(plan, args, kwargs, out) if self.hosts else None
        if extra is True:
            return
        on_device = self.on_device
        touched: list[tuple[torch.Tensor, bool]] = []
        nargs = len(args)
        for i, arg_name, write in inputs:
            value = args[i] if i < nargs else kwargs.get(arg_name)
            if isinstance(value, Tensor):
                if on_device(value):
                    touched.append((value, write))
            elif isinstance(value, (list, tuple)):
                touched.extend((v, write) for v in value if isinstance(v, Tensor) and on_device(v))
        fresh = None
        if fresh_returns:
            if len(fresh_returns) == 1 and isinstance(out, Tensor):
                fresh = (out,) if fresh_returns[0] and on_device(out) else None
            else:
                results = out if isinstance(out, (tuple, list)) and len(fresh_returns) == len(out) else (out,)
                fresh = [t for is_fresh, value in zip(fresh_returns, results) if is_fresh
                         for t in _tensors(value) if on_device(t)]
        if extra:
            touched += extra
        if not touched and not fresh:
            return
        if self._unnamed_syncs:
            self._name_sync(name, threading.get_ident())
        stream = self.current_stream()
        if self.redirect:
            for t, _ in touched:
                key = self.storage_key(t)
                if key in self.redirect:
                    stream = self.redirect.pop(key)
                    break
        accesses = self._accesses(touched, stream, []) if touched else []
        allocs: list[tuple] = []
        if fresh:
            watched = self.watched
            for t in fresh:
                # a fresh output: its storage is allocated by this op (unless already known), and written by it
                # unless the op runs no kernel (empty*)
                span = byte_range(t)
                if span is None:
                    continue
                found = plain_storage(t)
                if found is None:
                    continue
                key, storage = found
                desc = (t.shape, t.dtype, None)
                if key not in watched:
                    self._watch(key, storage)
                    allocs.append((key, storage.nbytes(), desc))
                elif self.names:
                    desc = (desc[0], desc[1], self.names.get(key))
                if writes_output:
                    self.last_writer[key] = stream
                    accesses.append((key, span[0], span[1], True, desc))
        _, races = self.hb.record(stream, self._site(name), accesses, allocs)
        if races:
            self._report(races)
        sync = self.host_syncs.get(name)
        if sync is not None and sync.applies(args, kwargs, self.device_type):
            self.host_synced(sync, stream)

    def _site(self, name: str) -> Site:
        """The op's site; inside an autograd node, one that falls back on the forward op that created the node (a
        node's autograd kernel numbers it just before its op reaches this mode: the first op to see a new number
        created the node before it)."""
        node = _current_autograd_node()
        thread = thread_origin(threading.get_ident())
        if node is not None:
            return Site(name, self.forward_sites.backward(stack(), node._sequence_nr(), node.name()), thread)
        site = Site(name, stack(), thread)
        seq, seen = _get_sequence_nr(), self._forward_seq  # autograd numbers nodes per thread
        last = getattr(seen, "seq", -1)
        if seq != last:
            if seq > 0 and last >= 0:  # not this thread's first op: its number may be older than the session
                self.forward_sites.forward(seq - 1, site)
            seen.seq = seq
        return site

    def host_synced(self, sync: host_sync.HostSync, stream: Hashable, frames=None) -> None:
        """The host waited for `stream` inside a read-back (`sync`: the ``host_sync`` entry that names it): an
        implicit sync, named after the entry, at the read-back's user frames (`frames`, else the caller's)."""
        implicit = Site(sync.name, frames if frames is not None else stack()) if self.latent else None
        self.hb.synchronize_stream(stream, implicit=implicit)

    def explicit_sync(self, name: str) -> Site | None:
        """What an explicit synchronize (`name`, e.g. "torch.cuda.synchronize()") passes hb as `implicit`: None, or
        an implicit sync's Site when it was made from a file of the ``incidental`` rule (a framework's timer)."""
        if not (self.incidental and self.latent):
            return None
        frames = stack()
        frames = frames.resolve() if hasattr(frames, "resolve") else frames
        if host_sync.incidental(frames, self.incidental):
            return Site(f"{name} (incidental)", frames)
        return None

    @contextlib.contextmanager
    def explicitly(self, name: str):
        """Inside, this thread's syncs are the explicit sync `name` (torch.cuda.synchronize(), Work.wait(), ...)."""
        outer = getattr(self._explicit, "name", None)
        self._explicit.name = outer or name
        try:
            yield
        finally:
            self._explicit.name = outer

    def sync_callback_site(self) -> Site | None:
        """What the cuda model's sync callbacks pass hb as `implicit`. Inside an explicit API (``explicitly``), or
        outside every captured op: None, or its Site when made from an incidental file. Else the program did not ask
        for it by name (a read-back's copy, a data-dependent size): an implicit sync, named after this thread's op
        that made it once that op lands."""
        name = getattr(self._explicit, "name", None)
        if name is None and self._capture is not None and not self._capture.in_op():
            # outside every captured op: an API the program called (torch.Stream's and torch.Event's synchronize,
            # which cannot be patched to say so); a read-back's sync comes from inside its op
            name = "a host synchronize"
        if name is not None:
            return self.explicit_sync(name)
        if not self.latent:
            return None
        site = self._unnamed_syncs[threading.get_ident()] = Site(host_sync.IMPLICIT, stack())
        return site

    def _name_sync(self, op: str, thread: int) -> None:
        """The op of `thread` that ends after an unnamed implicit sync it made (a read-back ends after its wait): the
        sync is named after that op's host-sync entry, else after the op. Another thread's op never names it."""
        site = self._unnamed_syncs.pop(thread, None)
        if site is None:
            return
        sync = self.host_syncs.get(op)
        site.op = sync.name if sync is not None else op


# called from C++ inside compiled regions (_drain_forced stands for every @_called_from_cpp: one wrapper's code)
skip_in_dynamo(AccessTracker.__torch_dispatch__, AccessTracker._dead, AccessTracker._drain_forced)
