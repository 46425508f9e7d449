"""torch.cuda's stream API on a CPU-only machine, with CUDA's ordering modelled in the happens-before core.

No kernel runs asynchronously on CPU, so a missing wait never corrupts anything here; what matters is that every
ordering the program *would* make on a GPU — stream waits, events, synchronizes, record_stream — reaches hb, and
that every op is attributed to the stream that would run it. While a Detector with the virtual model is active,
``torch.cuda.Stream``, ``Event``, ``stream()``, ``current_stream`` & co. are these classes and functions; the
originals come back when it exits (under pytest, after the last test: ``session.Resident``; between tests, with no
session, the stream calls raise). ``torch.cuda.is_available()`` stays False: code that branches on it for devices keeps
allocating on CPU.

torch's device-generic API is the same model, as on a one-GPU machine: ``torch.Stream`` and ``torch.Event`` are these
classes (so a ``torch.Stream()`` works with ``torch.cuda.stream``, ``wait_stream``, events, ``with stream:``), and
``torch.accelerator``'s stream calls (``current_stream``, ``set_stream``, ``synchronize``, ``current_device_index``,
``set_device_index``, ``device_index``) act on the virtual streams of device 0. Its device queries answer as torch
does on this machine (``is_available()`` False, ``device_count()`` 0, ``current_accelerator()`` the build's), for the
same reason as ``torch.cuda.is_available()``.
"""

from __future__ import annotations

import _thread
import abc
import functools
import threading
import time

import torch

from ...patching import AttrPatch, WhenImported
from .. import active
from ..frames import created_at


def _session_model() -> "VirtualStreams | None":
    return active.model(VirtualStreams)


def _model() -> "VirtualStreams":
    model = _session_model()
    if model is None:
        raise RuntimeError("streamrace: virtual CUDA streams are usable only while a streamrace Detector "
                           "(backend='virtual') is active")
    model.tracker.drain()
    return model


class Stream:
    """A virtual CUDA stream; it is its own key in hb. Named after the user line that created it."""

    def __init__(self, device=None, priority=0, **kwargs):
        self.priority = priority
        self.device = torch.device("cpu")
        self.name = f"stream created at {created_at()}"
        _model().hb.add_stream(self, self.name)

    device_index = 0
    device_type = 1  # c10::DeviceType::CUDA, for code that only reads it

    @property
    def cuda_stream(self) -> int:
        return 0 if self is _active_default() else id(self)

    @property
    def stream_id(self) -> int:
        return self.cuda_stream

    @property
    def native_handle(self) -> int:
        return self.cuda_stream

    def __enter__(self) -> "Stream":
        """``with stream:`` (torch.Stream's context): current in this thread inside, the previous one after."""
        _model().enter(self)
        return self

    def __exit__(self, *exc) -> None:
        model = _session_model()
        if model is not None:
            model.leave(self)

    def wait_event(self, event: "Event") -> None:
        event.wait(self)

    def wait_stream(self, stream: "Stream") -> None:
        _model().hb.wait_stream(self, _check(stream))

    def record_event(self, event: "Event | None" = None) -> "Event":
        event = Event() if event is None else event
        event.record(self)
        return event

    def query(self) -> bool:
        """Work is 'done' once the host asked: the host is then ordered after it, as after a synchronize."""
        self._host_waits("Stream.query()")
        return True

    def synchronize(self) -> None:
        self._host_waits("Stream.synchronize()")

    def _host_waits(self, api: str) -> None:
        model = _model()
        model.hb.synchronize_stream(self, implicit=model.tracker.explicit_sync(api))

    def __repr__(self) -> str:
        return f"<virtual torch.Stream: {self.name}>"


def _active_default():
    model = _session_model()
    return model.default if model is not None else None


def _check(stream) -> Stream:
    if not isinstance(stream, Stream):
        raise TypeError(f"streamrace: expected a torch.cuda.Stream (virtual), got {type(stream).__name__}")
    return stream


class Event:
    """A virtual CUDA event: a snapshot of a stream's progress in hb. Its time is the host's at record: a virtual
    stream's work runs when it is issued. Both ``torch.cuda.Event(enable_timing, blocking, interprocess)`` and
    ``torch.Event(device, *, enable_timing, ...)``: a virtual event keeps none of their flags."""

    device = torch.device("cpu")

    def __init__(self, *args, **kwargs):
        _model()
        self._recorded_at: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        model = _model()
        model.hb.record_event(self, model.current() if stream is None else _check(stream))
        self._recorded_at = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        model = _model()
        model.hb.wait_event(model.current() if stream is None else _check(stream), self)

    def query(self) -> bool:
        self._host_waits("Event.query()")
        return True

    def synchronize(self) -> None:
        self._host_waits("Event.synchronize()")

    def _host_waits(self, api: str) -> None:
        model = _model()
        model.hb.synchronize_event(self, implicit=model.tracker.explicit_sync(api))

    def elapsed_time(self, end_event: "Event") -> float:
        """Milliseconds between the two records. CUDA answers only for completed events, so the host has learnt
        that both completed: ordered as by two queries (timing code such as DeepSpeed's timers relies on it)."""
        if self._recorded_at is None or end_event._recorded_at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        model = _model()
        implicit = model.tracker.explicit_sync("Event.elapsed_time()")
        model.hb.synchronize_event(self, implicit=implicit)
        model.hb.synchronize_event(end_event, implicit=implicit)
        return (end_event._recorded_at - self._recorded_at) * 1e3

    def __repr__(self) -> str:
        return "<virtual torch.cuda.Event>"


def _registered_with_torch_bases() -> None:
    """Where torch's stream and event bases are abstract classes (``torch._streambase``, torch 2.4), these classes are
    registered as theirs: dynamo's first import checks that the CUDA device interface's ``Stream`` and ``Event`` derive
    from them, and inside a session those are these (an optimizer's first construction imports dynamo)."""
    try:
        from torch import _streambase
    except ImportError:
        return
    for base, cls in ((getattr(_streambase, "_StreamBase", None), Stream), (getattr(_streambase, "_EventBase", None),
                                                                            Event)):
        if isinstance(base, abc.ABCMeta):
            base.register(cls)


_registered_with_torch_bases()


class StreamContext:
    """``with torch.cuda.stream(s):`` — s is current in this thread inside; None is a no-op, as in torch."""

    def __init__(self, stream: Stream | None):
        self.stream = stream
        self._previous: Stream | None = None

    def __enter__(self):
        if self.stream is None:
            return None
        model = _model()
        self._previous = model.current()
        model.set_current(_check(self.stream))
        return self.stream

    def __exit__(self, *exc) -> None:
        model = _session_model() if self.stream is not None else None
        if model is not None:
            model.set_current(self._previous)


def stream(stream: Stream | None) -> StreamContext:
    return StreamContext(stream)


def current_stream(device=None) -> Stream:
    return _model().current()


def default_stream(device=None) -> Stream:
    return _model().default


def set_stream(stream: Stream | None) -> None:
    if stream is not None:
        _model().set_current(_check(stream))


def synchronize(device=None) -> None:
    """Explicit: it orders the host in both views, unless made from a file of the ``incidental-sync`` rule."""
    _synchronize_device("torch.cuda.synchronize()")


def _synchronize_device(api: str) -> None:
    model = _model()
    model.hb.synchronize_device(implicit=model.tracker.explicit_sync(api))


# torch.accelerator's stream calls, on device 0 of a one-GPU machine

# functions of their own, not torch.cuda's: dynamo keeps one handler per function and registers both modules' names

def accelerator_current_stream(device=None, /) -> Stream:
    return _model().current()


def accelerator_set_stream(stream: Stream) -> None:
    _model().set_current(_check(stream))


def accelerator_synchronize(device=None, /) -> None:
    _synchronize_device("torch.accelerator.synchronize()")


def current_device_index() -> int:
    return 0


def current_device_idx() -> int:
    import warnings

    warnings.warn("Use `current_device_index` instead.", FutureWarning, stacklevel=2)
    return 0


def _one_device(device) -> None:
    """The virtual streams are device 0's; another index fails as it does on a one-GPU machine."""
    if isinstance(device, str):
        device = torch.device(device)
    index = device.index if isinstance(device, torch.device) else device
    if index not in (None, 0, -1):
        raise RuntimeError(f"CUDA error: invalid device ordinal (streamrace virtual streams have one device; "
                           f"got device {device!r})")


def set_device_index(device, /) -> None:
    _one_device(device)


def set_device_idx(device, /) -> None:
    import warnings

    warnings.warn("Use `set_device_index` instead.", FutureWarning, stacklevel=2)
    _one_device(device)


class device_index:  # noqa: N801 (torch.accelerator's name)
    """``with torch.accelerator.device_index(i):`` — device 0 is the only one: nothing to switch."""

    def __init__(self, device, /):
        if device is not None:
            _one_device(device)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


def _sleep(cycles: int) -> None:
    """No real delay: the spin kernel is recorded as one op on the current stream."""
    model = _model()
    model.tracker.run("torch.cuda._sleep", model.current())


def record_stream(self: torch.Tensor, stream: Stream) -> None:
    """Tensor.record_stream: the allocator will not reuse the storage before `stream`'s work so far is done."""
    model = _model()
    _check(stream)
    if not model.tracker.on_device(self):
        raise RuntimeError("streamrace: record_stream on a tensor outside the virtual device (expected a CPU tensor)")
    key = model.tracker.storage_key(self)
    if key is not None:
        model.hb.record_stream(key, stream)


_API = ("stream", "current_stream", "default_stream", "set_stream", "synchronize", "_sleep", "record_stream",
        "accelerator_current_stream", "accelerator_set_stream", "accelerator_synchronize")
_OWNERS = {"record_stream": ("Tensor", "record_stream"),  # where each is patched in, when not torch.cuda
           **{f"accelerator_{name}": ("accelerator", name) for name in ("current_stream", "set_stream", "synchronize")}}
_opaque = False


def _opaque_to_dynamo(_dynamo=None) -> None:
    """torch.compile must not trace the virtual API (it would run at trace time, once, and the compiled code would not
    switch streams at all): each entry point graph-breaks and runs when the compiled program gets there, as the real
    API's calls run on a GPU. Done once dynamo is imported (importing it costs seconds; most tests never compile)."""
    global _opaque
    if _opaque:
        return
    _opaque = True

    def disabled(fn):
        try:
            return torch.compiler.disable(fn, reason="streamrace: virtual CUDA stream API (runs eagerly)")
        except TypeError:  # a torch without `reason`
            return torch.compiler.disable(fn)

    for cls, names in ((Stream, ("__init__", "__enter__", "__exit__", "wait_event", "wait_stream", "record_event",
                                 "query", "synchronize")),
                       (Event, ("__init__", "record", "wait", "query", "synchronize")),
                       (StreamContext, ("__enter__", "__exit__"))):
        for name in names:
            setattr(cls, name, disabled(vars(cls)[name]))
    module = globals()
    for name in _API:
        original = module[name]
        module[name] = disabled(original)
        if _session_model() is not None:  # dynamo arrived during a session: what it patched in becomes the opaque one
            owner, attr = _OWNERS.get(name, ("cuda", name))
            owner = getattr(torch, owner, None)  # torch.accelerator: torch 2.6 on
            if getattr(owner, attr, None) is original:
                setattr(owner, attr, module[name])


class VirtualStreams:
    """The per-session state (default stream, each thread's current stream) and the torch.cuda patches.

    Where the tracker takes ops from the C++ capture, each thread's current stream is also the capture's state: a
    small int per stream (`keys[i]` is the stream, 0 the default one), set with it. A thread that never set one is on
    the default stream, in both."""

    def __init__(self, hb, tracker):
        self.hb = hb
        self.tracker = tracker
        self._tls = threading.local()
        self.default = Stream.__new__(Stream)
        self.default.priority = 0
        self.default.device = torch.device("cpu")
        self.default.name = "default stream"
        hb.add_stream(self.default, self.default.name)
        self.keys: list[Stream] = [self.default]
        self._indices: dict[Stream, int] = {self.default: 0}
        self._lock = _thread.allocate_lock()  # not threading's: it may be a modelled one by now (hb.py)
        tracker.capture_streams = self.keys

    def current(self) -> Stream:
        return getattr(self._tls, "stream", self.default)

    def current_function(self):
        """`current` as a function that does not hold this model: the tracker's, which the model holds (no cycle, so a
        finished session is freed as its last reference goes, not by the collector), and a C call, not a frame."""
        return functools.partial(getattr, self._tls, "stream", self.default)

    def set_current(self, stream: Stream) -> None:
        self._tls.stream = stream
        if self.tracker.capturing:
            self.tracker.capture_stream(self.index(stream))

    def enter(self, stream: Stream) -> None:
        """``with stream:``: `stream` current in this thread until the matching `leave`."""
        _check(stream)
        entered = self._tls.__dict__.setdefault("entered", [])
        entered.append(self.current())
        self.set_current(stream)

    def leave(self, stream: Stream) -> None:
        entered = self._tls.__dict__.get("entered")
        if entered:
            self.set_current(entered.pop())

    def index(self, stream: Stream) -> int:
        """The capture's small int for `stream` (given on first use)."""
        index = self._indices.get(stream)
        if index is None:
            with self._lock:
                index = self._indices.get(stream)
                if index is None:
                    self.keys.append(stream)
                    index = self._indices[stream] = len(self.keys) - 1
        return index

    def patches(self) -> list:
        """What must be replaced in torch while the model is active (AttrPatch objects)."""
        import torch.cuda.streams

        replacements = {"Stream": Stream, "Event": Event, "stream": stream,
                        "current_stream": current_stream, "default_stream": default_stream,
                        "set_stream": set_stream, "synchronize": synchronize, "_sleep": _sleep}
        out = [AttrPatch(torch.cuda, name, value) for name, value in replacements.items()]
        out += [AttrPatch(torch.cuda.streams, "Stream", Stream), AttrPatch(torch.cuda.streams, "Event", Event),
                AttrPatch(torch, "Stream", Stream), AttrPatch(torch, "Event", Event),
                AttrPatch(torch.Tensor, "record_stream", record_stream)]
        accelerator = {"current_stream": accelerator_current_stream, "set_stream": accelerator_set_stream,
                       "synchronize": accelerator_synchronize, "current_device_index": current_device_index,
                       "current_device_idx": current_device_idx, "set_device_index": set_device_index,
                       "set_device_idx": set_device_idx, "device_index": device_index}
        module = getattr(torch, "accelerator", None)  # torch 2.6 on; a program cannot call what its torch lacks
        out += [AttrPatch(module, name, value) for name, value in accelerator.items()
                if hasattr(module, name)]  # older torch lacks some
        out.append(WhenImported("torch._dynamo", _opaque_to_dynamo))
        return out
