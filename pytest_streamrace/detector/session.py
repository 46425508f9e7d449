"""One race-detection session: the happens-before core, the access tracker and the stream models (``models``).

The backend a user picks (``--streamrace-backend``, ``Detector(backend=...)``) names the stream model of torch.cuda's
streams: "virtual" emulates them on CPU, "cuda" observes real ones. Ops reach the tracker through the C++ capture
(``capture``), which costs a launch-bound step a fraction of what entering Python per op does, or, where it does not
build (no compiler, ``STREAMRACE_NATIVE=0``), through a TorchDispatchMode, with the same verdicts.

``with Detector(backend="virtual") as d: ...`` installs everything, and removes every patch and mode on exit so
torch is exactly as before (with a `Resident`, the patches it keeps come out when it is closed). Everything installed
is a *patch* (``patching.Patch``: install/uninstall), kept in one list and undone in reverse order: collectives and
framework adapters add their own with `install`. What does not
depend on the session is built once per process and reused (``_once``, ``_kept``); a `Resident` (pytest's sessions,
one a test) keeps it installed from one session to the next, so a test's start and end cost microseconds, not
milliseconds.
"""

from __future__ import annotations

import functools
import types
from typing import Hashable

from ..patching import CallPatch
from . import active as _handle

STREAM_MODELS = ("virtual", "cuda")  # what Detector(backend=...) selects


def _core(trace: bool):
    """The happens-before core: in C++ where the extension loads (``capture``), else hb.py's (same verdicts)."""
    from . import capture

    extension = capture.load()
    if extension is not None:
        from .hb_native import NativeHappensBefore

        return NativeHappensBefore(trace=trace, extension=extension)
    from .hb import HappensBefore

    return HappensBefore(trace=trace)


# What a session installs that does not depend on the session, built by the earliest session of its kind in this process
# and reused by every later one: building it was most of a session's start (a test's fixed cost under --streamrace).
# (what, kind) -> a patch list; (model class, kind) -> (the model, its patches but itself, [itself] where it is one),
# the model bound to each session in turn (its ``rebind``, which leaves nothing of the session before). Only one
# session is active at a time.
_built: dict = {}
_holding: "Resident | None" = None  # the resident whose held patches are installed now, if any


@functools.cache
def _modules(backend: str) -> types.SimpleNamespace:
    """What a session's start builds from, imported by the backend's earliest session (the models import torch) and
    looked up by every later one: a start made fourteen imports, about 20 us of a test's fixed cost. ``collectives`` is
    None where this torch has no torch.distributed."""
    from . import capture
    from .models import collectives, host_memory
    from .models.compiled import CompiledCode
    from .models.futures import Futures
    from .models.host_handoffs import HostHandoffs
    from .threads import Threads
    from .tracker import AccessTracker

    found = types.SimpleNamespace(capture=capture, collectives=None, host_memory=host_memory, CompiledCode=CompiledCode,
                                  Futures=Futures, HostHandoffs=HostHandoffs, Threads=Threads,
                                  AccessTracker=AccessTracker)
    if backend == "virtual":
        from .models import virtual_streams
        from .models.virtual_autograd import VirtualAutograd
        from .models.virtual_host_reads import HostReads

        found.virtual_streams, found.VirtualAutograd, found.HostReads = virtual_streams, VirtualAutograd, HostReads
    else:
        from .models.cuda import CudaStreams

        found.CudaStreams = CudaStreams
    if collectives.available():
        from .models.functional_collectives import FunctionalCollectives
        from .models.threaded_pg import ThreadedGroup

        found.collectives, found.FunctionalCollectives, found.ThreadedGroup = (collectives, FunctionalCollectives,
                                                                               ThreadedGroup)
    return found


def prepare(backend: str) -> None:
    """Import what a session of `backend` builds from, now: a caller that starts sessions later (pytest, before any
    test's clock starts) keeps the imports (and, under pytest, the rewriting of their asserts) out of its first
    session's start."""
    _known(backend)
    _modules(backend)


def _known(backend: str) -> None:
    """A backend `Detector(backend=...)` selects, else a ValueError that names those there are."""
    if backend not in STREAM_MODELS:
        raise ValueError(f"streamrace: unknown backend {backend!r}; expected one of {', '.join(STREAM_MODELS)}")


def _once(key, build) -> list:
    """Patches that read the session they serve through module state its models set at install."""
    patches = _built.get(key)
    if patches is None:
        patches = _built[key] = build()
    return patches


def _kept(cls, kind, *session) -> tuple:
    """A model of class `cls` bound to this session (`session`: its constructor's arguments): its patches that are
    not the model itself, and those that are (installed with each session)."""
    entry = _built.get((cls, kind))
    if entry is None:
        model = cls(*session)
        patches = model.patches()
        entry = _built[(cls, kind)] = (model, [p for p in patches if p is not model], [p for p in patches if p is model])
    else:
        entry[0].rebind(*session)
    return entry[1:]


class Resident:
    """The patches built once per process, left installed from one session to the next and taken out by `close()`:
    pytest's sessions (one a test) share one, so a test's start installs only what is its own. Between two sessions the
    patches stay in with no session active: the virtual stream calls raise, thread handoffs are no-ops, and a wrapper
    of a kept model (``_kept``) reports to the session that ran last. A session whose patches differ from those held
    (another backend; dynamo imported meanwhile) takes the held ones out first. The detector's own locks are C locks
    (``_thread``): one made from ``threading`` now would be a modelled handoff (``host_handoffs``)."""

    def __init__(self):
        self._held: list = []

    def hold(self, patches: list) -> None:
        global _holding
        if self._held == patches:  # the same objects, in the same order
            return
        self.close()
        if _holding is not None:  # another resident's (a pytest session run inside a test): the patches are shared
            _holding.close()
        _holding = self
        for patch in patches:
            patch.install()
            self._held.append(patch)

    def close(self) -> None:
        """Every held patch uninstalled, in reverse order: torch exactly as before the resident held anything."""
        global _holding
        if _holding is self:
            _holding = None
        uninstall_all(self._held)


def uninstall_all(patches: list) -> None:
    """Uninstall every patch of `patches`, last first, emptying it; the first failure is raised once all the rest are
    restored."""
    errors = []
    while patches:
        try:
            patches.pop().uninstall()
        except Exception as exc:  # keep restoring the rest; report the first failure
            errors.append(exc)
    if errors:
        raise errors[0]


def active() -> "Detector | None":
    """The detector active in this process, if any."""
    return _handle.session()


class Detector:
    """Detects unsynchronized cross-stream accesses while active (a context manager; one per process at a time).

    backend (the stream model) "virtual": torch.cuda's stream API works on CPU tensors with CUDA's ordering modelled;
    "cuda": real streams and events are observed. trace=True keeps the op timeline (`timeline`) for Chrome traces.
    latent=False: host syncs all count as ordering, and no latent race is kept (`latent_races`). incidental: globs of
    files whose explicit syncs count as implicit ones (a framework's timers; the ``incidental-sync:`` rule).
    resident: a `Resident` that keeps the patches built once per process installed after this session ends (for the
    next session; its owner closes it); without one, every patch is uninstalled at exit.
    """

    def __init__(self, backend: str = "virtual", trace: bool = False, latent: bool = True, incidental=(),
                 resident: Resident | None = None):
        _known(backend)
        self.backend = backend
        self.hb = _core(trace)
        self.tracker = None
        self.streams = None  # the stream model of torch.cuda's streams: VirtualStreams or CudaStreams
        self.capture_failure: str | None = None  # why ops come from the dispatch mode, not the C++ capture
        self.op_source: str | None = None  # where ops came from: "capture" (C++) or "dispatch mode"
        self.latent, self.incidental = latent, tuple(incidental)
        self.resident = resident
        self._patches: list = []
        self._forced = False  # whether `force` was given an order

    # lifecycle

    def __enter__(self) -> "Detector":
        _handle.enter(self)
        try:
            self._install_stream_models()
        except BaseException:
            self._uninstall_all()
            _handle.leave(self)
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.tracker is not None:
                self.tracker.drain()
        finally:
            if self._forced:  # (a session that forced nothing has nothing to take out)
                self.force(None)
            self._uninstall_all()
            if self.tracker is not None:
                self.tracker.detach()
            _handle.leave(self)

    def _install_stream_models(self) -> None:
        """The models' patches: those built once per process (`shared`: `_once`, `_kept`), kept installed by the
        resident from the session before where there is one, then this session's own (the models themselves), in
        the order they were listed; the op source last."""
        m = _modules(self.backend)
        extension = m.capture.load()  # the op source (None: the dispatch mode), which virtual autograd's binding follows
        self.capture_failure = m.capture.failure()
        shared: list = []  # no patch here touches an attribute one of `own` does (tests/test_session_face.py)
        own: list = []

        def kept(cls, kind, *session):
            patches, model = _kept(cls, kind, *session)
            shared.extend(patches)
            own.extend(model)

        if self.backend == "virtual":
            virtual_streams = m.virtual_streams
            self.tracker = m.AccessTracker(self.hb, self._current, "cpu", track_frees=True)
            self.streams = virtual_streams.VirtualStreams(self.hb, self.tracker)
            shared += _once(("virtual streams", virtual_streams._opaque), self.streams.patches)
            self.tracker.current_stream = self.streams.current_function()  # per op: no detour through the session
            autograd = m.VirtualAutograd(self.streams, self.hb, self.tracker, extension)
            own += autograd.patches()
            kept(m.HostReads, None, self.tracker)
            kept(m.host_memory.PinnedMemory, None, self.tracker)
            on_outputs = autograd.adopt_outputs
            function_mode = lambda: autograd.mode  # noqa: E731 (exists once autograd's patches are installed)
        else:
            self.tracker = m.AccessTracker(self.hb, self._current, "cuda", track_frees=False)
            self.tracker.engine_records_streams = True
            self.streams = m.CudaStreams(self.hb, self.tracker)
            self.tracker.current_stream = self.streams.current
            own += self.streams.patches()
            kept(m.host_memory.AsyncCopies, None, self.tracker)
            on_outputs = None  # the engine binds compiled code's autograd nodes itself
            function_mode = None
        kept(m.host_memory.HostBufferReads, None, self.tracker)
        _handle.register(self.streams)
        compiled = m.CompiledCode(self.tracker, self._current, on_outputs)
        _handle.register(compiled)
        own += compiled.patches(self.backend)
        if m.collectives is not None:
            kept(m.collectives.Collectives, None, self.hb, self.tracker, self._current)
            own += m.FunctionalCollectives(self.hb, self.tracker, self._current).patches()
            own += m.ThreadedGroup(self.hb, self.tracker, self._current).patches()
        kept(m.Futures, self.backend, self.hb, self.tracker, self._current, self.backend == "virtual")
        threads, handoffs = m.Threads(self.tracker, function_mode), m.HostHandoffs(self.hb, self.tracker)
        shared += _once("threads", threads.patches)[:-1]  # the models themselves (last) are per session
        shared += _once("handoffs", handoffs.patches)[:-1]  # wraps Threads' thread entry, as installed
        own += [threads, handoffs]
        self.tracker.latent, self.tracker.incidental = self.latent, self.incidental
        if self.resident is not None:
            self.resident.hold(shared)
        else:
            if _holding is not None:  # the same patch objects: installed twice, the second would keep the first's value
                _holding.close()
            for patch in shared:
                self.install(patch)
        for patch in own:
            self.install(patch)
        # last in, first out: our own setup is not traced
        self.install(self._op_source(extension))

    def _op_source(self, extension):
        """Ops captured in C++ (``capture``) where the extension builds; else the dispatch mode, and
        `capture_failure` says why."""
        if extension is None:
            self.op_source = "dispatch mode"
            return CallPatch(self.tracker.__enter__, lambda: self.tracker.__exit__(None, None, None))
        self.op_source = "capture"
        return CallPatch(lambda: self.tracker.capture_with(extension), self.tracker.stop_capture)

    def _current(self):
        return self.streams.current()

    def install(self, patch) -> None:
        """Install a patch (install()/uninstall()) now; it is uninstalled when the session ends, in reverse order."""
        patch.install()
        self._patches.append(patch)

    def _uninstall_all(self) -> None:
        uninstall_all(self._patches)

    # what tests and reports read

    def force(self, order) -> str | None:
        """Run a race's bad order in this session (a ``forced_order.ForcedOrder``; None: stop): the capture calls it
        at the race's two ops. Returns why it cannot (no C++ capture), else None."""
        capture = self.tracker._capture if self.tracker is not None else None
        if capture is None:
            return None if order is None else "forcing an order needs the C++ capture"
        self._forced = self._forced or order is not None
        self.tracker.stop_applier()  # a forced run's records, applied by its own threads as they drain
        if order is None:
            from .models import host_handoffs

            capture.set_forcing(None, [])
            host_handoffs.task_watch = None
        else:
            order.install(capture)
        self.tracker.forcing = None if order is None else order.reached  # host accesses no op makes
        collectives = self.tracker.fixed_rules.get("c10d")
        if collectives is not None:  # a collective's work, which the capture does not hand over, as Python gets it
            collectives.returned = None if order is None else order.collective_returned
        return None

    def stream_name(self, key: Hashable) -> str:
        """The human name of a stream by its hb key ("default stream", "stream created at test_x.py:12"); one made in
        an earlier session keeps the name it got then."""
        name = self.hb.stream_name(key)
        if name == str(key) and hasattr(self.streams, "name_of"):
            return self.streams.name_of(key)
        return name

    @property
    def timeline(self):
        """Every launch (and free) in order, for Chrome traces; empty unless trace=True."""
        if self.tracker is not None:
            self.tracker.drain()
        return self.hb.timeline

    @property
    def notes(self) -> list[str]:
        """What this session could not model and skipped, once each."""
        return list(self.tracker.notes) if self.tracker is not None else []

    def forget_races(self) -> None:
        """Report races seen so far again when they recur (a pool worker starting work for another test)."""
        self.hb.forget_races()

    def allocation_frames(self, storage) -> tuple:
        """The user frames of the allocation this session saw for `storage` (an untyped storage); () when it did not
        see it (it sees allocations made while it runs, on its device)."""
        if self.tracker is not None:
            self.tracker.drain()
        site = self.hb.alloc_site(storage.data_ptr())
        return tuple(site.frames) if site is not None else ()

    @property
    def races(self):
        """All races so far, deduplicated by (kind, earlier location, later location)."""
        if self.tracker is not None:
            self.tracker.drain()
        return self.hb.races

    @property
    def latent_races(self):
        """Pairs ordered today only by an implicit host sync (``hb.Race.hidden_by`` names it); [] with latent=False."""
        if self.tracker is not None:
            self.tracker.drain()
        return self.hb.latent_races if self.latent else []

    def name(self, obj, name: str | None = None) -> None:
        """Give tensors human names for reports: a module's parameters and buffers by qualified name (prefixed
        with `name.` when given), or one tensor as `name`."""
        import torch

        tracker = self._require_active()
        tracker.drain()  # storages are known by address: the ops captured so far land first
        if isinstance(obj, torch.nn.Module):
            prefix = f"{name}." if name else ""
            for qualified, tensor in [*obj.named_parameters(), *obj.named_buffers()]:
                self._name_tensor(tracker, tensor, prefix + qualified)
        elif isinstance(obj, torch.Tensor):
            if not name:
                raise ValueError("streamrace: Detector.name(tensor, name) needs a name for a tensor")
            self._name_tensor(tracker, obj, name)
        else:
            raise TypeError(f"streamrace: Detector.name takes a torch.nn.Module or a torch.Tensor, "
                            f"got {type(obj).__name__}")

    @staticmethod
    def _name_tensor(tracker, tensor, name: str) -> None:
        if tracker.on_device(tensor):
            key = tracker.storage_key(tensor)
            if key is not None:
                tracker.names[key] = name

    # the public hooks for collectives and framework adapters

    def current_stream(self) -> Hashable:
        """The hb key of the stream the next op on this thread would use."""
        self._require_active()
        return self.streams.current()

    def stream_key(self, stream) -> Hashable:
        """The hb key of a torch.cuda.Stream (the virtual stream itself, or a real stream's handle)."""
        self._require_active()
        return stream if self.backend == "virtual" else self.streams.key(stream)

    def run(self, op: str, stream: Hashable, reads=(), writes=(), frames=None):
        """Record one op launched on `stream` (an hb key) reading and writing the given tensors — for work the
        dispatch mode does not see (a collective on a communication stream). Returns the hb Op; races found
        land in `races`."""
        return self._require_active().run(op, stream, reads, writes, frames)

    def paused(self):
        """A context in which this thread's ops are not tracked (work the caller models itself through `run`)."""
        return self._require_active().paused()

    def name_stream(self, stream, label: str) -> None:
        """Name a torch.cuda.Stream in this session's reports (forcing names its side streams after their labels)."""
        self._require_active()
        self.hb.add_stream(self.stream_key(stream), label)

    @staticmethod
    def is_virtual(stream) -> bool:
        """Whether `stream` is a virtual stream (the virtual stream model's torch.cuda.Stream), not a real one; asked
        of the class, it needs no active session (a stream outlives its session)."""
        from .models.virtual_streams import Stream

        return isinstance(stream, Stream)

    def subscribe(self, on_race=None, on_note=None) -> None:
        """Be told of races as they are found (`on_race(races)`) and of each new note (`on_note(text)`), from now on;
        a child process passes both on to its parent. Ops from the C++ capture are judged in batches: at the next
        stream, event or synchronize call, read of `races`, or every few hundred ops."""
        tracker = self._require_active()
        tracker.on_race, tracker.on_note = on_race, on_note

    def _require_active(self):
        if _handle.session() is not self or self.tracker is None:
            raise RuntimeError("streamrace: this Detector is not active (use it inside `with Detector(...)`)")
        return self.tracker


def streamrace_device():
    """The torch.device tests should allocate on: cpu under the virtual stream model, cuda under the cuda one (and,
    with no detector active, cuda when a GPU is present)."""
    import torch

    detector = _handle.session()
    if detector is not None:
        model = detector.backend
    else:
        model = "cuda" if torch.cuda.is_available() else "virtual"
    if model == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
