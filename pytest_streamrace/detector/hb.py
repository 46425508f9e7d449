"""Happens-before over CUDA streams: which accesses to which bytes are not ordered, and so may race.

Torch-free on purpose: the torch side (real CUDA streams, virtual streams on CPU, collectives) translates what it
sees into these calls, and the rules can be unit-tested with synthetic ids.

Model. Each stream has a vector clock: its own component counts its launches (the epoch of its latest op), the
others say how much of each other stream's work is known to be complete before the stream's next op starts.
Event record snapshots a clock, event wait merges a snapshot into a stream's clock. Each host thread has a clock
too, as CUDA blocks only the thread that synchronizes: its synchronize calls merge into it, and a stream merges the
launching thread's clock at its next launch (work launched after that thread waited is ordered after what it waited
for). Threads share what they know only through a handoff: ``release(key)`` merges the calling thread's clock into a
sync object's, ``acquire(key)`` merges the object's into the caller's (a lock, a queue, a future, a thread's start
and join: ``detector/models/host_handoffs.py``). Every thread shares one host clock, the program's main one, until
``own_host()`` gives it a clock of its own (a thread the session follows from its start); ``acting_for`` names the
thread whose work a call applies, where that is not the calling thread (records drained on another thread). An
access A on stream s at epoch e is ordered before an op B on another stream when B's clock has s >= e. Clocks are
shared copy-on-write, so an Op keeps the clock it was launched with for free.

Latent view. A host sync is *implicit* when it is a value read back (``.item()``, ``.cpu()``, a data-dependent
size): the program did not ask for the ordering, it got it by accident, and the ordering goes when the read-back does.
Every clock has a strict twin that host ordering through implicit syncs never reaches; explicit syncs, waits and
events reach both. A pair ordered by the clocks but not by their strict twins is a *latent race*, reported apart with
the implicit sync that orders it today. Until the first implicit sync the twins are the same dict objects, so the
second view costs an identity test per op.
"""

from __future__ import annotations

import _thread
import contextlib
import re
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable

Frame = tuple[str, int, str]  # (filename, lineno, function)

RAW = "read-after-write"
WAR = "write-after-read"
WAW = "write-after-write"
FREE = "free-while-in-use"


class Site:
    """Where, in user code, something happened: the op ("aten::copy_", "all_reduce", "free", ...) and the
    user-relevant frames, innermost first. `frames` may also be given lazily, as any object whose resolve() returns
    them: the tracker captures a stack per op but names its frames only when something reads them (a race, a trace).
    """

    __slots__ = ("op", "_frames", "thread", "ordinal")

    def __init__(self, op: str, frames=(), thread: "ThreadOrigin | None" = None, ordinal: int = 0):
        self.op = op
        self._frames = frames
        self.thread = thread  # the thread it ran on, where that is not the program's main one (not in its identity)
        # the op's place among the ops captured on its thread (1, 2, ...; 0: unknown): with the thread, what names it
        # in a forced re-run of the same test (`--streamrace-confirm`); not in its identity either
        self.ordinal = ordinal

    @property
    def frames(self) -> tuple[Frame, ...]:
        frames = self._frames
        if frames.__class__ is not tuple:
            frames = self._frames = tuple(frames.resolve() if hasattr(frames, "resolve") else frames)
        return frames

    def location(self) -> str:
        if not self.frames:
            return "<unknown>"
        filename, lineno, _ = self.frames[0]
        return f"{filename}:{lineno}"

    def __eq__(self, other) -> bool:
        return isinstance(other, Site) and (self.op, self.frames) == (other.op, other.frames)

    def __hash__(self) -> int:
        return hash((self.op, self.frames))

    def __repr__(self) -> str:
        return f"Site({self.op!r}, {self.frames!r})"


@dataclass(frozen=True, eq=False)
class ThreadOrigin:
    """A thread other than the main one, for reports: its name and where its work came from (`how` the call at
    `site` gave it: "started" by Thread.start(), or "work submitted" to a pool). `nth`: how many threads of the same
    `stable_name` the session started before this one, so that a forced re-run tells the pool a program makes for
    each checkpoint from the one before it (their threads share a name and count their ops alike)."""

    name: str
    how: str
    site: Site
    nth: int = 0
    # a pool's work item: which submitted task this is ("<submitter's key>/<its submit count>", the same in a re-run
    # whichever worker runs it), and how many ops its worker had captured before it (its ops count from there)
    task: str = ""
    base: int = 0

    @property
    def key(self) -> str:
        return thread_key_of(self.name, self.nth)


# Python's own thread names count threads and pools process-wide ("Thread-3 (stage)", "ThreadPoolExecutor-2_0"): a
# pytest re-run runs the test several times in one process, so the count differs from pass to pass
_COUNTED = re.compile(r"^(Thread|ThreadPoolExecutor)-\d+")


def stable_name(name: str) -> str:
    """A thread's name as a forced run matches it: Python's process-wide count left out of its default names (two
    such threads of one target, or the same worker index of two default-named pools, share it; `ThreadOrigin.nth`
    tells them apart)."""
    return _COUNTED.sub(r"\1-*", name)


def thread_key_of(name: str, nth: int = 0) -> str:
    """How a forced run knows a thread: its `stable_name`, and which of the session's threads of that name it is."""
    return stable_name(name) + (f"#{nth}" if nth else "")


NATIVE = "native"  # the name (and `how`) of a thread Python did not start: autograd's device threads, on GPUs
NATIVE_THREAD = ThreadOrigin(NATIVE, NATIVE, Site("", ()))


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str
    name: str | None = None  # "model.0.weight", "ipg bucket", ...

    @classmethod
    def of(cls, desc) -> "TensorInfo":
        """A TensorInfo from what an access carries: one already, or a raw (shape, dtype, name) tuple. The tracker
        passes raw tuples because describing every access costs more than the rare race that names one."""
        if isinstance(desc, TensorInfo):
            return desc
        shape, dtype, name = desc
        return cls(tuple(shape), str(dtype).removeprefix("torch."), name)


@dataclass(slots=True, eq=False)  # one per op: identity is enough, and a plain __init__ is cheap
class Op:
    """One launch on a stream. seq is the global launch order (the time axis of traces)."""

    stream: Any
    epoch: int
    seq: int
    site: Site
    # The stream's knowledge of other streams when this op was launched (shared, never mutated).
    clock: dict = field(default_factory=dict, compare=False, repr=False)
    # The same without implicit host syncs (the latent view); the very object `clock` while no implicit sync counts.
    strict: dict | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Access:
    op: Op
    storage: Any
    start: int
    end: int
    write: bool
    tensor: TensorInfo


@dataclass
class Race:
    kind: str  # RAW | WAR | WAW | FREE
    earlier: Access  # the access not ordered before `later`
    later: Access  # for FREE: an access whose op.site.op == "free", on the allocation stream
    alloc_site: Site | None
    count: int = 1
    hidden_by: Site | None = None  # latent races: the implicit host sync that orders the pair today

    @property
    def latent(self) -> bool:
        return self.hidden_by is not None

    def key(self) -> tuple[str, str, str]:
        return identity(self.kind, self.earlier.op.site, self.later.op.site)


def identity(kind: str, earlier: Site, later: Site) -> tuple[str, str, str]:
    """What makes two races the same report: the kind and both user locations (also a race record's key)."""
    return (kind, where(earlier), where(later))


def where(site: Site) -> str:
    """A site's location for deduplication; sites without frames are told apart by their op."""
    return site.location() if site.frames else f"<unknown>:{site.op}"


_acting = threading.local()  # .ident: the thread whose work this thread applies (a drain of another's records)


def acting_thread() -> int:
    """The thread on whose behalf the core is called: the calling thread, unless `acting_for` says otherwise."""
    ident = getattr(_acting, "ident", None)
    return threading.get_ident() if ident is None else ident


@contextlib.contextmanager
def acting_for(ident: int | None):
    """Inside, core calls on this thread apply `ident`'s work (None: this thread's own)."""
    outer = getattr(_acting, "ident", None)
    _acting.ident = ident
    try:
        yield
    finally:
        _acting.ident = outer


def happens_before(a: Op, b: Op) -> bool:
    """Whether op a is ordered before op b (same stream: program order)."""
    if a.stream == b.stream:
        return a.seq <= b.seq
    return b.clock.get(a.stream, 0) >= a.epoch


def _merge(clock: dict, other: dict) -> dict:
    """clock ∨ other; returns clock itself when other adds nothing (clocks are shared, never mutated)."""
    for key, value in other.items():
        if value > clock.get(key, 0):
            break
    else:
        return clock
    merged = dict(clock)
    for key, value in other.items():
        if value > merged.get(key, 0):
            merged[key] = value
    return merged


class _Stream:
    __slots__ = ("key", "name", "epoch", "known", "strict", "host_seen", "freed")

    def __init__(self, key, name: str):
        self.key = key
        self.name = name
        self.epoch = 0  # epoch of the latest op launched here
        self.known: dict = {}  # what this stream's next op is ordered after (other streams' epochs)
        self.strict: dict = self.known  # the same, implicit host syncs left out (the latent view)
        self.host_seen = 0  # the stamp of the host clock last merged into `known`
        # blocks freed back to this stream's pool while other streams' accesses to them were not yet ordered
        # before the free: (storage, free op, those accesses, alloc site, tensor) — judged at the next allocation
        self.freed: list[tuple] = []

    def now(self) -> dict:
        """Snapshot of everything ordered before this stream's next op, its own work included."""
        return self._now(self.known)

    def now_strict(self) -> dict:
        """`now` in the latent view; the same object as `now()` while the two views agree."""
        if self.strict is self.known:
            return self.now()
        return self._now(self.strict)

    def _now(self, known: dict) -> dict:
        if known.get(self.key, 0) >= self.epoch:
            return known
        snap = dict(known)
        snap[self.key] = self.epoch
        return snap

    def snapshot(self):
        """(now, now_strict), sharing one dict while the views agree: what an event records."""
        now = self.now()
        return now, (now if self.strict is self.known else self._now(self.strict))

    def learn(self, snapshot: dict, strict: dict) -> None:
        """Merge a snapshot pair into this stream's knowledge, keeping the twins one object while they agree."""
        same = self.strict is self.known
        self.known = _merge(self.known, snapshot)
        if same and strict is snapshot:
            self.strict = self.known
        else:
            self.strict = _merge(self.strict, strict)


class _Host:
    """One host thread's clock (or the shared one's): what that thread has learnt completed, in both views. `stamp`
    is unique across the core's hosts and changes with the clock, so a stream knows whether it has merged it."""

    __slots__ = ("known", "strict", "stamp")

    def __init__(self, stamp: int):
        self.known: dict = {}
        self.strict: dict = self.known  # through explicit syncs only (the latent view)
        self.stamp = stamp


class _Storage:
    __slots__ = ("nbytes", "alloc_stream", "alloc_site", "tensor", "history", "used_on")

    def __init__(self, nbytes=None, alloc_stream=None, alloc_site=None, tensor=None):
        self.nbytes = nbytes
        self.alloc_stream = alloc_stream
        self.alloc_site = alloc_site
        self.tensor = tensor
        self.history: list[tuple] = []  # (op, start, end, write, tensor), oldest first
        self.used_on: set | tuple = ()  # streams named by record_stream (a set once one is; most never are)


class Events:
    """Event -> snapshot, dropped with the event object where it can be weakly referenced (ints and handles cannot).
    Both cores keep events this way; the caller holds its lock."""

    __slots__ = ("_strong", "_weak")

    def __init__(self):
        self._strong: dict[Any, Any] = {}
        self._weak: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def put(self, event, snapshot) -> None:
        try:
            self._weak[event] = snapshot
        except TypeError:
            self._strong[event] = snapshot

    def get(self, event):
        try:
            return self._weak.get(event)
        except TypeError:
            return self._strong.get(event)


class Found:
    """The races and latent races found so far, deduplicated by `Race.key` with counts: one book for both cores, so
    they name and count alike. The caller holds its lock."""

    __slots__ = ("races", "latent")

    def __init__(self):
        self.races: dict[tuple, Race] = {}
        self.latent: dict[tuple, Race] = {}

    def collect(self, found: dict[tuple, Race]) -> list[Race]:
        """One access's (or allocation's) races by key -> those not reported before; the others are counted."""
        new = []
        for key, race in found.items():
            seen = self.races.get(key)
            if seen is None:
                self.races[key] = race
                new.append(race)
            else:
                seen.count += 1
        return new

    def add_latent(self, race: Race) -> None:
        seen = self.latent.get(race.key())
        if seen is None:
            self.latent[race.key()] = race
        else:
            seen.count += 1

    def clear(self) -> None:
        self.races.clear()
        self.latent.clear()


class HappensBefore:
    """Ordering of streams, events and the host, and the races between accesses it leaves unordered."""

    def __init__(self, trace: bool = False):
        self._trace = trace
        # autograd may call in from its device threads; a C lock: `threading.Lock` may be a modelled one by now
        # (host_handoffs, while a session's patches are in), whose handoffs would come back here
        self._lock = _thread.allocate_lock()
        self._streams: dict[Any, _Stream] = {}
        self._events = Events()
        self._stamps = 1  # the last stamp handed to a host (0: no stream has merged any)
        self._shared = _Host(1)  # every thread's until it owns one: the program's main host
        self._hosts: dict[int, _Host] = {}  # thread ident -> its own host
        self._handoffs = Events()  # sync object -> (clock, strict clock) released into it
        # implicit host syncs, newest last: (seq, what the host learnt, the read-back's site) — names a latent race
        self._implicit: deque = deque(maxlen=4096)
        self._seq = 0
        self._storages: dict[Any, _Storage] = {}
        self._found = Found()
        self._timeline: list[Op] = []

    # streams

    def add_stream(self, stream: Hashable, name: str) -> None:
        with self._lock:
            self._stream(stream).name = name

    @property
    def stream_count(self) -> int:
        """How many streams have been seen (named, launched on or ordered)."""
        return len(self._streams)

    @property
    def frees_can_race(self) -> bool:
        """Whether a free may yet be judged or traced (its site read): not while one stream at most has been seen,
        since a storage used on its allocation stream alone has no hazard."""
        return self._trace or len(self._streams) > 1

    def stream_name(self, stream) -> str:
        state = self._streams.get(stream)
        return state.name if state is not None else str(stream)

    def _stream(self, key) -> _Stream:
        state = self._streams.get(key)
        if state is None:
            state = self._streams[key] = _Stream(key, str(key))
        return state

    # ordering

    def record_event(self, event: Hashable, stream: Hashable) -> None:
        with self._lock:
            self._events.put(event, self._stream(stream).snapshot())

    def wait_event(self, stream: Hashable, event: Hashable) -> None:
        with self._lock:
            self._wait(self._stream(stream), self._events.get(event))

    def wait_stream(self, waiter: Hashable, target: Hashable) -> None:
        with self._lock:
            self._wait(self._stream(waiter), self._stream(target).snapshot())

    @staticmethod
    def _wait(state: _Stream, snapshot: tuple[dict, dict] | None) -> None:
        if snapshot is not None:  # waiting on a never-recorded event completes at once (CUDA semantics)
            state.learn(*snapshot)

    def synchronize_stream(self, stream: Hashable, implicit: Site | None = None) -> None:
        """The host waits for `stream`. implicit: the site of a value read back (``.item()``, ``.cpu()``), an
        ordering the program got by accident — it orders the host in the normal view only (see the latent view)."""
        with self._lock:
            self._host_learns(self._stream(stream).snapshot(), implicit)

    def synchronize_event(self, event: Hashable, implicit: Site | None = None) -> None:
        with self._lock:
            snapshot = self._events.get(event)
            if snapshot is not None:
                self._host_learns(snapshot, implicit)

    def synchronize_device(self, implicit: Site | None = None) -> None:
        with self._lock:
            for state in self._streams.values():
                self._host_learns(state.snapshot(), implicit)

    def _host_learns(self, snapshot: tuple[dict, dict], implicit: Site | None = None,
                     host: _Host | None = None) -> None:
        """The calling thread's host (or `host`) learns a snapshot: a sync it made, or a handoff it acquired."""
        host = self._host() if host is None else host
        now, strict = snapshot
        same = host.strict is host.known
        merged = _merge(host.known, now)
        if implicit is None:
            merged_strict = merged if same and strict is now else _merge(host.strict, strict)
        else:
            merged_strict = host.strict
            if merged is not host.known:
                self._implicit.append((self._seq, now, implicit))
        if merged is not host.known or merged_strict is not host.strict:
            host.known, host.strict = merged, merged_strict
            self._stamps += 1
            host.stamp = self._stamps

    # host threads

    @staticmethod
    def acting_for(ident: int | None):
        """Inside, this core's calls on this thread apply thread `ident`'s work (hb.acting_for)."""
        return acting_for(ident)

    def _host(self) -> _Host:
        return self._hosts.get(acting_thread(), self._shared)

    def own_host(self) -> None:
        """The calling thread gets a clock of its own, empty (a thread the session follows from its start: what it
        knows comes from `acquire`). No change for a thread that has one."""
        with self._lock:
            ident = acting_thread()
            if ident not in self._hosts:
                self._stamps += 1
                self._hosts[ident] = _Host(self._stamps)

    def drop_host(self) -> None:
        """The calling thread's own clock is forgotten (the thread ends; its ident may be reused)."""
        with self._lock:
            self._hosts.pop(acting_thread(), None)

    def release(self, key: Hashable) -> None:
        """A handoff: what the calling thread knows is merged into the sync object `key` (a lock released, an item
        put, a future's result set, a thread started or ending)."""
        with self._lock:
            host = self._host()
            held = self._handoffs.get(key)
            if held is None:
                self._handoffs.put(key, (host.known, host.strict))
                return
            known, strict = held
            same = strict is known and host.strict is host.known
            merged = _merge(known, host.known)
            self._handoffs.put(key, (merged, merged if same else _merge(strict, host.strict)))

    def acquire(self, key: Hashable) -> None:
        """The other side of a handoff: the calling thread learns what was released into `key` (nothing if never)."""
        with self._lock:
            held = self._handoffs.get(key)
            if held is not None:
                self._host_learns(held)

    # work

    def launch(self, stream: Hashable, site: Site) -> Op:
        with self._lock:
            return self._launch(stream, site)

    def access(self, op: Op, storage: Hashable, start: int, end: int, write: bool, tensor) -> list[Race]:
        """Bytes [start, end) of storage accessed by op; tensor: a TensorInfo or (shape, dtype, name). Returns the
        races not reported before."""
        with self._lock:
            found: dict[tuple, Race] = {}
            self._access(op, storage, start, end, write, tensor, found)
            return self._collect(found)

    def record(self, stream: Hashable, site: Site, accesses=(), allocs=()) -> tuple[Op, list[Race]]:
        """One op in one call (the tracker's per-op path: one lock, one launch): launch it on `stream`, allocate
        its fresh storages — (storage, nbytes, tensor) — then apply its accesses — (storage, start, end, write,
        tensor). Returns the op and the races not reported before."""
        with self._lock:
            op = self._launch(stream, site)
            found: dict[tuple, Race] = {}  # per access, so one op racing twice at one location pair counts twice
            new: list[Race] = []
            for storage, nbytes, tensor in allocs:
                self._alloc(storage, nbytes, stream, site, tensor, found)
                if found:
                    new += self._collect(found)
                    found.clear()
            storages = self._storages
            for storage, start, end, write, tensor in accesses:
                st = storages.get(storage)
                if st is not None and not st.history and end > start:  # a fresh storage's first use: nothing to judge
                    st.history.append((op, start, end, write, tensor))
                    continue
                self._access(op, storage, start, end, write, tensor, found)
                if found:
                    new += self._collect(found)
                    found.clear()
            return op, new

    def _launch(self, stream: Hashable, site: Site) -> Op:
        state = self._streams.get(stream)
        if state is None:
            state = self._stream(stream)
        host = self._host()
        if state.host_seen != host.stamp:
            state.learn(host.known, host.strict)
            state.host_seen = host.stamp
        state.epoch += 1
        self._seq += 1
        op = Op(stream, state.epoch, self._seq, site, state.known, state.strict)
        if self._trace:
            self._timeline.append(op)
        return op

    def _access(self, op: Op, storage, start: int, end: int, write: bool, tensor, found: dict) -> None:
        if end <= start:
            return
        st = self._storages.get(storage)
        if st is None:
            st = self._storages[storage] = _Storage()
        history = st.history
        if not history:
            history.append((op, start, end, write, tensor))
            return
        stream = op.stream
        clock = op.clock
        strict = op.strict
        two_views = strict is not None and strict is not clock
        kept = []
        for rec in history:
            a_op, a_start, a_end, a_write, a_tensor = rec
            if a_start < end and start < a_end:
                a_stream = a_op.stream
                ordered = a_op.seq <= op.seq if a_stream == stream else clock.get(a_stream, 0) >= a_op.epoch
                if ordered and two_views and a_stream != stream and strict.get(a_stream, 0) < a_op.epoch:
                    if write or a_write:
                        self._latent_race(a_op, a_start, a_end, a_write, a_tensor, op, storage, start, end,
                                          write, tensor, st.alloc_site)
                    ordered = False  # keep rec: later accesses may be latent races with it too (never races)
                elif not ordered and (write or a_write):
                    kind = WAW if write and a_write else (WAR if write else RAW)
                    race = Race(kind, Access(a_op, storage, a_start, a_end, a_write, TensorInfo.of(a_tensor)),
                                Access(op, storage, start, end, write, TensorInfo.of(tensor)), st.alloc_site)
                    found.setdefault(race.key(), race)
                if ordered and (write or (not a_write and a_stream == stream)):
                    # Dominated where they overlap: a later access racing with rec on those bytes also races
                    # with this one (ordering is transitive). Keep only rec's uncovered bytes, so detection
                    # is unchanged and history stays bounded in loops.
                    if a_start < start:
                        kept.append((a_op, a_start, start, a_write, a_tensor))
                    if end < a_end:
                        kept.append((a_op, end, a_end, a_write, a_tensor))
                    continue
            kept.append(rec)
        kept.append((op, start, end, write, tensor))
        st.history = kept

    def _latent_race(self, a_op, a_start, a_end, a_write, a_tensor, op, storage, start, end, write, tensor,
                     alloc_site) -> None:
        """A pair ordered only through an implicit host sync: kept apart from races, with that sync named."""
        kind = WAW if write and a_write else (WAR if write else RAW)
        race = Race(kind, Access(a_op, storage, a_start, a_end, a_write, TensorInfo.of(a_tensor)),
                    Access(op, storage, start, end, write, TensorInfo.of(tensor)), alloc_site,
                    hidden_by=self._hiding_sync(a_op, op))
        self._found.add_latent(race)

    def _hiding_sync(self, earlier: Op, later: Op) -> Site:
        """The first implicit sync between the two ops that taught the host the earlier one's epoch."""
        for seq, learnt, site in self._implicit:
            if earlier.seq <= seq < later.seq and learnt.get(earlier.stream, 0) >= earlier.epoch:
                return site
        return Site("an implicit host sync")

    def _collect(self, found: dict[tuple, Race]) -> list[Race]:
        return self._found.collect(found)

    # memory

    def alloc(self, storage: Hashable, nbytes: int, stream: Hashable, site: Site, tensor=None) -> list[Race]:
        """A new block for work on `stream`. The caching allocator may hand out any block freed to this stream's
        pool, so this is where a free's hazards become races: an access to a freed block not ordered before this
        point may still be running when the new owner writes the memory. Returns the races not reported before."""
        with self._lock:
            found: dict[tuple, Race] = {}
            self._alloc(storage, nbytes, stream, site, tensor, found)
            return self._collect(found)

    def _alloc(self, storage, nbytes, stream, site, tensor, found: dict) -> None:
        self._storages[storage] = _Storage(nbytes, stream, site, tensor)
        state = self._streams.get(stream)
        if state is None or not state.freed:
            return
        host = self._host()
        if state.host_seen != host.stamp:
            state.learn(host.known, host.strict)
            state.host_seen = host.stamp
        now = _merge(host.known, state.now())
        for freed_storage, free_op, hazards, alloc_site, freed_tensor, nbytes_freed in state.freed:
            for a in hazards:
                if now.get(a.op.stream, 0) < a.op.epoch:
                    freed = Access(free_op, freed_storage, 0, nbytes_freed, True,
                                   TensorInfo.of(freed_tensor) if freed_tensor is not None else a.tensor)
                    race = Race(FREE, a, freed, alloc_site)
                    found.setdefault(race.key(), race)
        state.freed = []  # each hazard is judged once: resolved (ordered) or reported here

    def record_stream(self, storage: Hashable, stream: Hashable) -> None:
        """Tensor.record_stream. Like the caching allocator, which records an event on every such stream when the
        block is freed, this covers all of `stream`'s work on the storage launched before the free."""
        with self._lock:
            st = self._storages.get(storage)
            if st is None:
                st = self._storages[storage] = _Storage()
            if not st.used_on:
                st.used_on = set()
            st.used_on.add(stream)

    def free(self, storage: Hashable, site: Site) -> list[Race]:
        """The host frees storage: the block goes back to its allocation stream's pool, reusable by that stream's
        next allocation. Accesses from other streams not yet ordered before that point (and not covered by
        record_stream) are kept and judged at the stream's next allocation (see ``alloc``) — so a stream that waits
        for the other streams before it allocates again is clean, as it is on a GPU. Forgets the storage's history.

        A storage whose allocation was never seen (it existed before tracking began) reports nothing: without its
        allocation stream there is no telling which work may reuse the block. Returns [] (kept for symmetry)."""
        with self._lock:
            st = self._storages.pop(storage, None)
            if st is None or st.alloc_stream is None:
                return []
            stream = st.alloc_stream
            self._seq += 1
            for rec in st.history:  # the common case, used on its own stream only: no list built
                if rec[0].stream != stream:
                    break
            else:
                if not self._trace:
                    return []  # nothing to judge, no op to keep
            others = [rec for rec in st.history if rec[0].stream != stream and rec[0].stream not in st.used_on]
            if not others and not self._trace:
                return []
            state = self._stream(stream)
            safe = _merge(self._host().known, state.now())  # ordered before any reuse of the block
            hazards = [Access(a_op, storage, a_start, a_end, a_write, TensorInfo.of(a_tensor))
                       for a_op, a_start, a_end, a_write, a_tensor in others
                       if safe.get(a_op.stream, 0) < a_op.epoch]
            op = Op(stream, state.epoch, self._seq, site, safe)
            if self._trace:
                self._timeline.append(op)
            if hazards:
                state.freed.append((storage, op, hazards, st.alloc_site, st.tensor, st.nbytes))
            return []

    # results

    @property
    def races(self) -> list[Race]:
        """All races so far, deduplicated by (kind, earlier location, later location), in order of discovery."""
        with self._lock:
            return list(self._found.races.values())

    @property
    def latent_races(self) -> list[Race]:
        """Pairs ordered today only by an implicit host sync (Race.hidden_by names it), in order of discovery."""
        with self._lock:
            return list(self._found.latent.values())

    def forget_races(self) -> None:
        """Report races seen so far again when they recur (a pool worker starting work for another test)."""
        with self._lock:
            self._found.clear()

    @property
    def timeline(self) -> list[Op]:
        """Every launch (and free) in order; empty unless trace=True."""
        with self._lock:
            return list(self._timeline)

    def alloc_site(self, storage: Hashable) -> Site | None:
        """Where a live storage was allocated, when its allocation was seen."""
        with self._lock:
            known = self._storages.get(storage)
            return known.alloc_site if known is not None else None

    def history_size(self, storage: Hashable | None = None) -> int:
        """Accesses remembered for one storage, or for all: what pruning keeps bounded."""
        with self._lock:
            if storage is not None:
                st = self._storages.get(storage)
                return len(st.history) if st else 0
            return sum(len(st.history) for st in self._storages.values())
