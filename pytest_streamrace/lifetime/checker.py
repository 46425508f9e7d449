"""The lifetime checker: tracked storages, named phases, and the check that a storage is gone by its phase.

A storage is tracked through a weak reference (torch keeps a storage's Python object for as long as its memory
lives, so the reference dies exactly when the last tensor or C++ owner lets go). A storage resized to zero bytes
counts as released too: that is how ZeRO-3 and FSDP free memory while keeping the tensor objects.

Each tracked storage names the phase by which it must be gone; it is checked the first time that phase is marked
after it was tracked. Phases are plain names the test marks (`phase`), or marks around a call (`at_call`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from ..patching import AttrPatch
from . import sites
from .memory import PhasePeaks
from .report import format_peaks, format_problems


class LifetimeError(AssertionError):
    """Tracked buffers outlived their phase (or their phase never came)."""


@dataclass
class Buffer:
    name: str
    by: str  # the phase by which it must be released
    what: str  # "storage of bfloat16[4096, 4096] on cuda:0"
    ref: weakref.ref
    nbytes: int
    registered_at: tuple = ()
    alloc_frames: tuple = ()

    def live_bytes(self) -> int:
        storage = self.ref()
        return storage.nbytes() if storage is not None else 0


@dataclass
class Violation:
    buffer: Buffer
    phase: str
    occurrence: int
    nbytes: int  # what it still held at the check


class LifetimeChecker:
    """Track buffers with the phase by which they must be released; mark phases; read `problems()`.

        checker = LifetimeChecker(device)
        checker.track(grad_buffer, "gradient bucket", by="optimizer.step")
        checker.at_call(optimizer, "step", phase="optimizer.step")
        ...  # train
        checker.check()  # LifetimeError naming each buffer still alive when optimizer.step started

    device: where peaks are measured — a CUDA device reads the allocator's peak per phase; None or cpu sums the
    tracked storages that are alive.
    """

    def __init__(self, device=None):
        self._pending: list[Buffer] = []
        self._tracked: dict[int, Buffer] = {}  # id(storage) -> buffer, while tracked storages live (CPU peaks)
        self.violations: list[Violation] = []
        self.checked = 0  # buffers checked so far, released or not
        self._marks: dict[str, int] = {}  # phase -> times marked
        self._wrapped: list[AttrPatch] = []
        self.peaks = PhasePeaks(device, self._live_bytes)

    # registering

    def track(self, obj, name: str | None = None, *, by: str) -> None:
        """Track a tensor's storage (or an UntypedStorage): it must be released before phase `by` is next marked."""
        import torch

        if not isinstance(by, str) or not by:
            raise ValueError(f"buffer_lifetimes: track(..., by=PHASE) needs a phase name, got {by!r}")
        if isinstance(obj, torch.Tensor):
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                raise ValueError(f"buffer_lifetimes: a {obj.layout} tensor has no plain storage to track") from None
            what = f"storage of {str(obj.dtype).replace('torch.', '')}{list(obj.shape)} on {obj.device}"
        elif isinstance(obj, torch.UntypedStorage):
            storage, what = obj, f"storage on {obj.device}"
        else:
            raise TypeError(f"buffer_lifetimes: track() takes a tensor or an UntypedStorage, got {type(obj).__name__}")
        if storage.nbytes() == 0:
            raise ValueError(f"buffer_lifetimes: {name or 'this tensor'} holds no memory (0 bytes): nothing to track")
        buffer = Buffer(name or "tensor", by, what, weakref.ref(storage), storage.nbytes(),
                        sites.caller_frames(), sites.detector_alloc_frames(storage))
        key = id(storage)
        self._tracked[key] = buffer
        weakref.finalize(storage, self._tracked.pop, key, None)
        self._pending.append(buffer)
        self.peaks.sample()

    # phases

    def phase(self, name: str) -> None:
        """Mark phase `name` now: buffers due by it that are still alive are violations; a new memory segment opens."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"buffer_lifetimes: phase() needs a phase name, got {name!r}")
        occurrence = self._marks[name] = self._marks.get(name, 0) + 1
        due = [b for b in self._pending if b.by == name]
        self._pending = [b for b in self._pending if b.by != name]
        for b in due:
            held = b.live_bytes()
            if held:
                self.violations.append(Violation(b, name, occurrence, held))
        self.checked += len(due)
        self.peaks.mark(name, occurrence)

    def at_call(self, obj, attr: str, phase: str | None = None) -> None:
        """Mark `phase` (default: `attr`) whenever obj.attr is called, and 'after PHASE' when it returns.
        Undone by `close()`."""
        original = getattr(obj, attr)
        if not callable(original):
            raise TypeError(f"buffer_lifetimes: {type(obj).__name__}.{attr} is not callable")
        phase = phase or attr
        checker = self

        def marked(*args, **kwargs):
            checker.phase(phase)
            out = original(*args, **kwargs)
            checker.phase(f"after {phase}")
            return out

        patch = AttrPatch(obj, attr, marked)
        patch.install()
        self._wrapped.append(patch)

    def close(self) -> None:
        """Restore what `at_call` wrapped (the checker can still be read)."""
        while self._wrapped:
            self._wrapped.pop().uninstall()
        self.peaks.sample()

    def __enter__(self) -> "LifetimeChecker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # reading

    @property
    def unreached(self) -> list[Buffer]:
        """Tracked buffers whose phase was never marked after they were tracked — unchecked, so not known good."""
        return list(self._pending)

    def retained_bytes(self) -> int:
        return sum(v.nbytes for v in self.violations)

    def problems(self) -> str:
        """The report of every violation and unchecked buffer; '' when there is none."""
        return format_problems(self.violations, self._pending, list(self._marks))

    def peak_report(self) -> str:
        return format_peaks(self.peaks, self.peaks.source)

    def check(self) -> None:
        """Raise LifetimeError with the report when a buffer outlived its phase or was never checked."""
        text = self.problems()
        if text:
            raise LifetimeError(text)

    def _live_bytes(self) -> int:
        seen, total = set(), 0
        for b in list(self._tracked.values()):
            storage = b.ref()
            if storage is not None and id(storage) not in seen:
                seen.add(id(storage))
                total += storage.nbytes()
        return total
