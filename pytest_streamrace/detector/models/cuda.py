"""Real CUDA streams: what the program does to streams and events, observed through torch's GPU trace callbacks.

torch fires ``torch.cuda._gpu_trace`` callbacks for stream and event creation, event record/wait/synchronize,
stream/device synchronize and caching-allocator (de)allocation, with raw ``cudaStream_t`` / ``cudaEvent_t`` handles.
Those handles are the hb keys. Streams are named where Python constructs them: CUDA's stream pool creates all its
streams (and fires the creation callbacks) at the first request on a device, often inside ``init_process_group``, and
hands them out round-robin later without a callback. The engine applies autograd's stream rules itself on a GPU, so
nothing about autograd is modelled here: its ops and the events it records reach hb like everyone else's. Callbacks
that order streams or the host first drain the ops captured so far (``capture``), so both land in the order they
happened.

A stream or device sync callback is an explicit sync only while one of the explicit Python APIs runs (``EXPLICIT``,
patched to say so per thread, and ``Work.wait``, which the collectives model marks); any other — a read-back's copy, a
data-dependent size — is an implicit one for the latent view (``hb``), named after the op that made it. A stream or
event ``query()`` that returns True orders the host as explicitly, though no callback reports it (``_query_patches``).
torch's device-generic ``torch.Stream`` / ``torch.Event`` reach the same callbacks (their CUDA implementation reports
records, waits and synchronizes); torch does not let their methods be patched, so while the session runs those names
are subclasses that mark their synchronizes explicit, learn from a query that returns True and name a new stream where
Python made it (``device_generic``). Streams and events torch hands out itself (``torch.accelerator.current_stream()``)
are the plain types: their synchronize counts as an implicit sync, their query orders nothing.
Allocations, frees and event creation and deletion, a hundred a launch-bound step, stay out of Python while nobody
else listens to them (``TraceShortcut``; the trace's own interpreter in C++, ``native_trace``, where it builds), and
between sessions too: torch cannot switch its trace off once on.
"""

from __future__ import annotations

import torch

from ...patching import AttrPatch, CallPatch
from .. import compile_time
from ..frames import created_at, stack
from ..hb import Site


NAMES: dict[int, str] = {}  # stream handle -> its name, for the process's life: a stream outlives its session


def EXPLICIT() -> list[tuple[object, str, str]]:  # noqa: N802 (a table, built once torch.cuda is there)
    """(owner, attribute, name) of the APIs that synchronize because the program asked to: their syncs order the
    host in both views (``wait_stream`` and ``wait_event`` order streams, not the host: no callback to classify)."""
    out = [(torch.cuda, "synchronize", "torch.cuda.synchronize()"),
           (torch.cuda.Stream, "synchronize", "Stream.synchronize()"),
           (torch.cuda.Event, "synchronize", "Event.synchronize()"),
           (torch.cuda.Event, "elapsed_time", "Event.elapsed_time()")]
    # torch.accelerator's, where this torch has it (a torch.Stream or torch.Event torch made itself, whose C methods
    # cannot be patched: a sync outside every captured op counts as explicit, tracker.sync_callback_site)
    accelerator = getattr(torch, "accelerator", None)
    if hasattr(accelerator, "synchronize"):
        out.append((accelerator, "synchronize", "torch.accelerator.synchronize()"))
    return out  # Work.wait(): the collectives model marks it (it wraps Work.wait itself)


class CudaStreams:
    """The cuda model: a patch (install/uninstall) registering the trace callbacks, and the current-stream key."""

    def __init__(self, hb, tracker):
        if not torch.cuda.is_available():
            raise RuntimeError("streamrace: backend 'cuda' needs a CUDA device; use backend 'virtual' on CPU")
        self.hb = hb
        self.tracker = tracker
        self._registered: list[tuple[object, object]] = []

    # the stream key of the current stream, per op: two C calls, no Stream object

    @staticmethod
    def current() -> int:
        return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())

    def key(self, stream) -> int:
        """The hb key of a torch.cuda.Stream or torch.Stream."""
        if isinstance(stream, torch.cuda.Stream):
            return stream.cuda_stream
        return torch.cuda.Stream(stream_id=stream.stream_id, device_index=stream.device_index,
                                 device_type=stream.device_type).cuda_stream

    # callbacks (they run inside torch calls: keep them small; hb serializes itself)

    def _stream_created(self, handle: int) -> None:
        self._name(handle, f"pooled CUDA stream (pool created at {created_at()})")

    def _name(self, handle: int, name: str) -> None:
        NAMES[handle] = name
        self.hb.add_stream(handle, name)

    @staticmethod
    def name_of(handle) -> str:
        """A stream's name where this session's core never saw it named: the name it got when made, in an earlier
        session of this process (torch never destroys a CUDA stream), else its handle."""
        known = NAMES.get(handle)
        if known is not None:
            return known
        return f"CUDA stream {handle:#x}" if isinstance(handle, int) else str(handle)

    def _event_record(self, event: int, stream: int) -> None:
        self.tracker.drain()
        self.hb.record_event(event, stream)

    def _event_wait(self, event: int, stream: int) -> None:
        self.tracker.drain()
        self.hb.wait_event(stream, event)

    def _event_sync(self, event: int) -> None:
        self.tracker.drain()  # ops captured before the host waits are ordered before what it learns
        if not compile_time.active():  # the compiler's syncs are not the program's ordering
            self.hb.synchronize_event(event, implicit=self._intent())

    def _stream_sync(self, stream: int) -> None:
        if compile_time.active():  # the compiler's syncs are not the program's ordering
            self.tracker.drain()
            return
        if self.tracker.sync_inside_op(stream):  # a read-back inside an op: lands right after the op's record
            return
        self.tracker.drain()
        self.hb.synchronize_stream(stream, implicit=self._intent())

    def _device_sync(self) -> None:
        self.tracker.drain()
        if not compile_time.active():  # the compiler's syncs are not the program's ordering
            self.hb.synchronize_device(implicit=self._intent())

    def _intent(self) -> Site | None:
        return self.tracker.sync_callback_site()

    def _explicitly(self, name: str, original):
        """`original`, marked on this thread as the explicit sync `name` while it runs (its sync callbacks)."""
        explicitly = self.tracker.explicitly

        def call(*args, **kwargs):
            with explicitly(name):
                return original(*args, **kwargs)
        return call

    def _dealloc(self, ptr: int) -> None:
        if self.tracker.capturing:
            self.tracker.note_free_captured(ptr)  # in order with the captured ops (they may not be applied yet)
        elif ptr in self.tracker.watched:  # blocks no op touched (workspaces, never-used tensors) need no free
            self.tracker.note_free(ptr, Site("free", stack()))

    # patch protocol

    def patches(self) -> list:
        original_sleep = torch.cuda._sleep
        original_record_stream = torch.Tensor.record_stream
        original_new = torch.cuda.Stream.__new__

        def stream_new(cls, *args, **kwargs):
            stream = original_new(cls, *args, **kwargs)
            if "stream_id" not in kwargs and "stream_ptr" not in kwargs:  # a new stream, not a view of a known one
                self._name(stream.cuda_stream, f"stream created at {created_at()}")
            return stream

        def _sleep(cycles):
            self.tracker.run("torch.cuda._sleep", self.current())
            original_sleep(cycles)

        def record_stream(tensor, stream):
            original_record_stream(tensor, stream)
            if tensor.is_cuda:
                self.tracker.drain()
                key = self.tracker.storage_key(tensor)
                if key is not None:
                    self.hb.record_stream(key, self.key(stream))

        return [AttrPatch(torch.cuda, "_sleep", _sleep), AttrPatch(torch.Tensor, "record_stream", record_stream),
                AttrPatch(torch.cuda.Stream, "__new__", staticmethod(stream_new)),
                *self._explicit_patches(), *self._query_patches(), *self._device_generic_patches(), self,
                *self._shortcuts()]

    def _learnt(self, name: str, learn, obj) -> None:
        """A query returned True: the host has seen that work finish; `learn(obj)` tells hb, marked explicit."""
        try:
            with self.tracker.explicitly(name):
                learn(obj)
        except Exception as exc:  # never inside the user's test
            self.tracker.note(f"{name} is not modelled: {type(exc).__name__}: {exc}")

    def _query(self, original, name: str, learn):
        """`original` (a query), handing a True answer to the sync callbacks, marked explicit (`_query_patches`)."""
        def patched(obj):
            done = original(obj)
            if done:
                self._learnt(name, learn, obj)
            return done
        return patched

    def _query_patches(self) -> list:
        """``Event.query()`` / ``Stream.query()`` returning True: the host has seen that work finish, an ordering as
        deliberate as a synchronize (DeepSpeed pools buffers whose event queries done). torch's GPU trace reports
        no sync for a query, so the patch hands it to the sync callbacks itself, marked explicit."""
        return [AttrPatch(torch.cuda.Event, "query", self._query(torch.cuda.Event.query, "Event.query()",
                                                                 self._event_done)),
                AttrPatch(torch.cuda.Stream, "query", self._query(torch.cuda.Stream.query, "Stream.query()",
                                                                  self._stream_done))]

    def _event_done(self, event) -> None:
        handle = event.cuda_event if isinstance(event, torch.cuda.Event) else event.event_id
        if handle:  # a never-recorded event is done without ordering anything
            self._event_sync(handle)

    def _stream_done(self, stream) -> None:
        self._stream_sync(self.key(stream))

    def _device_generic_patches(self) -> list:
        """``torch.Stream`` / ``torch.Event`` as `device_generic` subclasses while the session runs."""
        stream, event = device_generic(self)
        return [AttrPatch(torch, "Stream", stream), AttrPatch(torch, "Event", event)]

    def _shortcuts(self) -> list:
        """The allocator's frees (`_dealloc`), event records and waits (`_event_record`, `_event_wait`: a dozen a
        DDP step, each a drain in Python) and the trace events the model ignores, without Python where the capture's
        extension is built (`TraceShortcut`): taken in C++ by the trace's own interpreter (``gpu_trace.cpp``), which
        queues frees and events in order with the captured ops, where it builds; else frees and the ignored events by
        C functions in place of the registries' Python method, and events in Python."""
        import torch.cuda._gpu_trace as trace

        from .. import capture

        extension = capture.load()  # None where it does not build: the frees reach `_dealloc` then
        native = capture.load_trace()
        kinds = [(trace.MemoryDeallocationCallbacks, "free", self._dealloc),
                 (trace.MemoryAllocationCallbacks, "allocation", None),
                 (trace.EventCreationCallbacks, "event_creation", None),
                 (trace.EventDeletionCallbacks, "event_deletion", None),
                 (trace.EventRecordCallbacks, "event_record", self._event_record),
                 (trace.EventWaitCallbacks, "event_wait", self._event_wait)]
        if native is not None:
            return [native_trace(native, extension),
                    *(TraceShortcut(registry, _routed(native, kind), fallback) for registry, kind, fallback in kinds)]
        in_place = {} if extension is None else {"free": extension.traced_free, "allocation": extension.traced_nothing,
                                                 "event_creation": extension.traced_nothing,
                                                 "event_deletion": extension.traced_nothing}
        return [TraceShortcut(registry, _in_place(registry, in_place.get(kind)), fallback)
                for registry, kind, fallback in kinds]

    def _explicit_patches(self) -> list:
        """The explicit sync APIs (``EXPLICIT``), each marking its sync callbacks as explicit."""
        patches = []
        for owner, attr, name in EXPLICIT():
            original = getattr(owner, attr, None)
            if original is not None:
                patches.append(AttrPatch(owner, attr, self._explicitly(name, original)))
        return patches

    def install(self) -> None:
        import torch.cuda._gpu_trace as trace

        self.hb.add_stream(torch.cuda.default_stream().cuda_stream, "default stream")
        torch._C._activate_gpu_trace()
        pairs = [(trace.StreamCreationCallbacks, self._stream_created),  # records and waits: `_shortcuts`
                 (trace.EventSynchronizationCallbacks, self._event_sync),
                 (trace.StreamSynchronizationCallbacks, self._stream_sync),
                 (trace.DeviceSynchronizationCallbacks, self._device_sync)]
        for registry, callback in pairs:
            registry.add_callback(callback)
            self._registered.append((registry, callback))

    def uninstall(self) -> None:
        for registry, callback in self._registered:
            if callback in registry.callback_list:
                registry.callback_list.remove(callback)
        self._registered.clear()


class _SameType(type):
    """Every instance of the torch type counts as one of the subclass (``isinstance(s, torch.Stream)`` stays true for
    the streams torch hands out), and the subclass as that type for ``issubclass``."""

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, cls.torch_type)

    def __subclasscheck__(cls, sub) -> bool:
        return issubclass(sub, cls.torch_type)


def device_generic(model) -> tuple[type, type]:
    """``torch.Stream`` and ``torch.Event`` subclasses whose objects `model` (a CudaStreams) observes: a new stream is
    named after the user line that made it, ``synchronize`` is an explicit sync, and a ``query`` that returns True
    orders the host after that work, as torch.cuda's own types do under the model. A timing event stays torch's own
    type (torch's ``elapsed_time`` refuses a subclass): its query orders nothing."""
    base_stream, base_event = torch.Stream, torch.Event

    class Stream(base_stream, metaclass=_SameType):
        torch_type = base_stream

        def __new__(cls, *args, **kwargs):
            stream = base_stream.__new__(cls, *args, **kwargs)
            if "stream_id" not in kwargs and stream.device.type == "cuda":
                model.hb.add_stream(model.key(stream), f"stream created at {created_at()}")
            return stream

        synchronize = model._explicitly("Stream.synchronize()", base_stream.synchronize)
        query = model._query(base_stream.query, "Stream.query()", model._stream_done)

    class Event(base_event, metaclass=_SameType):
        torch_type = base_event

        def __new__(cls, *args, **kwargs):
            if kwargs.get("enable_timing"):  # torch's C elapsed_time takes its own type only: timing events stay it
                return base_event(*args, **kwargs)  # (their synchronize, outside any op, still counts as explicit)
            return base_event.__new__(cls, *args, **kwargs)

        synchronize = model._explicitly("Event.synchronize()", base_event.synchronize)
        query = model._query(base_event.query, "Event.query()", model._event_done)

    Stream.__module__ = Event.__module__ = "torch"
    Stream.__qualname__, Event.__qualname__ = "Stream", "Event"
    return Stream, Event


def native_trace(native, extension) -> CallPatch:
    """A patch: the GPU trace's interpreter is ``gpu_trace.cpp``'s from now on (it must come after the trace is
    activated), its frees and event records and waits going to the capture (`extension`) while installed. It hands
    torch's Python interpreter every event no `TraceShortcut` takes."""
    return CallPatch(lambda: native.install(extension.free_from_trace, extension.event_from_trace), native.uninstall)


def _routed(native, kind: str):
    """A `TraceShortcut`'s take: the trace's C++ interpreter keeps `kind`'s events (`native_trace`)."""
    return lambda taken: native.route(kind, taken)


def _in_place(registry, fast):
    """A `TraceShortcut`'s take: the C function `fast` in place of the registry's ``fire_callbacks`` (torch's Python
    interpreter looks that attribute up per event). None where there is no C function."""
    if fast is None:
        return None

    def take(taken: bool) -> None:
        own = vars(registry)
        if taken:
            own["fire_callbacks"] = fast
        elif own.get("fire_callbacks") is fast:
            del own["fire_callbacks"]
    return take


class TraceShortcut:
    """A patch: the events of one GPU trace registry kept out of Python (`take(True)`, given back with `take(False)`;
    `take` None: no extension built).

    Once the trace is on, torch reports every caching-allocator allocation and free and every event created or
    destroyed through its Python interpreter, even with no callback registered, and the registry's ``fire_callbacks``
    loop is a Python frame per call (about a hundred a launch-bound step). The shortcut is taken only while nobody else
    listens to the registry, else `fallback` (the model's own Python callback, where it needs the events) is
    registered; one who registers later (``add_callback``) gets the events back, with `fallback` registered before
    them. The trace stays on after the session, so a shortcut nobody displaced stays taken after it too (`_Idle`),
    until someone registers or the next session's shortcut installs.
    """

    def __init__(self, registry, take, fallback=None):
        self.registry, self.take, self.fallback = registry, take, fallback
        self._taken = self._fallback_added = False

    def install(self) -> None:
        _Idle.end(self.registry)
        if self.take is None or self.registry.callback_list or "fire_callbacks" in vars(self.registry):
            self._add_fallback()
            return
        self.take(True)
        self._taken = True
        vars(self.registry)["add_callback"] = self._add_callback

    def _add_callback(self, callback) -> None:
        self._remove_shortcut()
        self._add_fallback()
        self.registry.add_callback(callback)

    def _add_fallback(self) -> None:
        if self.fallback is not None and not self._fallback_added:
            self.registry.add_callback(self.fallback)
            self._fallback_added = True

    def _remove_shortcut(self) -> None:
        if self._taken:
            self.take(False)
            self._taken = False
        own = vars(self.registry)
        if "add_callback" in own and own["add_callback"] == self._add_callback:
            del own["add_callback"]

    def uninstall(self) -> None:
        if self._taken and not self.registry.callback_list:  # nobody displaced it: taken between sessions too
            _Idle(self.registry, self.take)
            self._taken = False
        self._remove_shortcut()
        if self._fallback_added and self.fallback in self.registry.callback_list:
            self.registry.callback_list.remove(self.fallback)
        self._fallback_added = False


class _Idle:
    """A shortcut left taken between sessions, on its registry's ``add_callback``: whoever registers gets the events
    back in Python first (torch's sanitizer does, enabled later in the process), and so does the next session's
    `TraceShortcut` before it decides for itself."""

    def __init__(self, registry, take):
        self.registry, self.take = registry, take
        vars(registry)["add_callback"] = self

    def __call__(self, callback) -> None:
        self.take(False)
        vars(self.registry).pop("add_callback", None)
        self.registry.add_callback(callback)

    @staticmethod
    def end(registry) -> None:
        """`registry`'s events back in Python, if a shortcut was left taken on it."""
        idle = vars(registry).get("add_callback")
        if isinstance(idle, _Idle):
            del vars(registry)["add_callback"]
            idle.take(False)
