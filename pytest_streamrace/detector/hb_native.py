"""The happens-before core in C++ (``hb_core.cpp``, in the capture's extension) with ``hb.HappensBefore``'s API.

Same rules, verdicts and bounds as hb.py, which stays the fallback where the extension does not build (``capture``).
The per-op calls (`record`, `launch`, `access`, `alloc`, `free`, ...) go straight into C++. Python keeps what needs
Python: events by key (weakly, as hb.py does: an event's snapshot goes with the event object), and the races — the core
hands each unordered pair over as a candidate, and a race's identity reads frames (``hb.identity``), so they are named,
deduplicated and counted here exactly as hb.py does. Ops are the core's ``Op`` objects: `stream`, `epoch`, `seq`,
`site`, `clock` and `strict` read as on ``hb.Op``.
"""

from __future__ import annotations

import _thread
import contextlib
import threading
from typing import Hashable

from .hb import FREE, RAW, WAR, WAW, Access, Events, Found, Race, Site, TensorInfo

_KINDS = (RAW, WAR, WAW, FREE)  # hb_core.cpp's Kind


def _handle(event) -> bool:
    """Whether an event key is a raw handle, which the core keeps (an int that fits its int64)."""
    return type(event) is int and -(1 << 63) <= event < (1 << 63)


class _Races(Found):
    """The races and latent races found so far (hb.Found, as hb.py keeps them), with the candidates the core hands
    over turned into them. Kept apart from the core object, which calls `judge`: a reference back to
    NativeHappensBefore would be a cycle through a C++ object (never collected)."""

    __slots__ = ("lock",)

    def __init__(self):
        super().__init__()
        # taken inside the core's lock, never the other way round; C locks, as hb.py's
        self.lock = _thread.allocate_lock()

    def judge(self, batch: list[tuple]) -> list[Race]:
        """The candidates of one access or allocation (hb.py's `found`) -> the races not reported before."""
        found: dict[tuple, Race] = {}
        with self.lock:
            for (latent, kind, a_op, storage, a_start, a_end, a_write, a_tensor, op, start, end, write, tensor,
                 alloc_site, hidden_by) in batch:
                kind = _KINDS[kind]
                earlier = Access(a_op, storage, a_start, a_end, a_write, TensorInfo.of(a_tensor))
                if kind == FREE:
                    later = Access(op, storage, start, end, True,
                                   TensorInfo.of(tensor) if tensor is not None else earlier.tensor)
                    race = Race(FREE, earlier, later, alloc_site)
                    found.setdefault(race.key(), race)
                    continue
                later = Access(op, storage, start, end, write, TensorInfo.of(tensor))
                if not latent:
                    race = Race(kind, earlier, later, alloc_site)
                    found.setdefault(race.key(), race)
                    continue
                self.add_latent(Race(kind, earlier, later, alloc_site,
                                     hidden_by=hidden_by if hidden_by is not None else Site("an implicit host sync")))
            return self.collect(found)


class NativeHappensBefore:
    """``hb.HappensBefore`` over the C++ core of `extension` (default: ``capture.load()``, which must succeed)."""

    def __init__(self, trace: bool = False, extension=None):
        if extension is None:
            from . import capture

            extension = capture.load()
            if extension is None:
                raise RuntimeError(f"streamrace: the C++ extension is not available ({capture.failure()})")
        self._found = _Races()
        # the C++ core itself: the capture's Feed and node binding call it without Python (hb.py has no `core`)
        core = self.core = extension.hb.Core(trace, self._found.judge)
        self._events = Events()  # event -> the core's snapshot, as hb.py keeps them
        self._event_lock = _thread.allocate_lock()
        # the per-op calls: bound C++ methods, no Python frame between the caller and the core
        self.record = core.record
        self.launch = core.launch
        self.access = core.access
        self.alloc = core.alloc
        self.free = core.free
        self.record_stream = core.record_stream
        self.wait_stream = core.wait_stream
        self.synchronize_stream = core.synchronize_stream
        self.synchronize_device = core.synchronize_device
        self.own_host = core.own_host
        self.drop_host = core.drop_host
        self._act_for, self._acting = extension.hb.act_for, extension.hb.acting
        self._handoffs = Events()  # sync object -> the core's snapshot released into it (as events are kept)
        self.add_stream = core.add_stream
        self.stream_name = core.stream_name
        self.alloc_site = core.alloc_site
        self.history_size = core.history_size

    @property
    def stream_count(self) -> int:
        """How many streams have been seen (named, launched on or ordered)."""
        return self.core.stream_count

    @property
    def frees_can_race(self) -> bool:
        """Whether a free may yet be judged or traced (see hb.HappensBefore.frees_can_race)."""
        return self.core.frees_can_race

    # events: raw handles (ints: the cuda model's) in the core, where the capture's feed records and waits on them
    # too; other keys' snapshots here, as hb.py keeps them (weakly where the key allows)

    def record_event(self, event: Hashable, stream: Hashable) -> None:
        if _handle(event):
            self.core.record_event(event, stream)
            return
        with self._event_lock:
            self._events.put(event, self.core.snapshot(stream))

    def wait_event(self, stream: Hashable, event: Hashable) -> None:
        if _handle(event):
            self.core.wait_event(stream, event)
            return
        with self._event_lock:
            self.core.wait_snapshot(stream, self._events.get(event))

    def synchronize_event(self, event: Hashable, implicit: Site | None = None) -> None:
        if _handle(event):
            snapshot = self.core.event_snapshot(event)
        else:
            with self._event_lock:
                snapshot = self._events.get(event)
        if snapshot is not None:
            self.core.synchronize_snapshot(snapshot, implicit)

    # host threads: handoffs by key here, as events are kept

    @contextlib.contextmanager
    def acting_for(self, ident: int | None):
        """Inside, this core's calls on this thread apply thread `ident`'s work (hb.acting_for)."""
        outer = self._acting()
        self._act_for(ident)
        try:
            yield
        finally:
            self._act_for(outer)

    def release(self, key: Hashable) -> None:
        with self._event_lock:
            self._handoffs.put(key, self.core.release(self._handoffs.get(key)))

    def acquire(self, key: Hashable) -> None:
        with self._event_lock:
            held = self._handoffs.get(key)
        if held is not None:
            self.core.acquire(held)

    # results

    @property
    def races(self) -> list[Race]:
        """All races so far, deduplicated by (kind, earlier location, later location), in order of discovery."""
        with self._found.lock:
            return list(self._found.races.values())

    @property
    def latent_races(self) -> list[Race]:
        """Pairs ordered today only by an implicit host sync (Race.hidden_by names it), in order of discovery."""
        with self._found.lock:
            return list(self._found.latent.values())

    def forget_races(self) -> None:
        """Report races seen so far again when they recur (a pool worker starting work for another test)."""
        with self._found.lock:
            self._found.clear()

    @property
    def timeline(self) -> list:
        """Every launch (and free) in order; empty unless trace=True."""
        return self.core.timeline
