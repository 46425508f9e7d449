"""A race's bad order, forced in a re-run of the test that reported it (``--streamrace-confirm``).

The forced run knows the race's two accesses by their ops' places on their threads (``Site.ordinal``: the capture
counts the ops it records per thread), and the capture calls `ForcedOrder` right before and right after each of the two
ops, on the issuing thread, with the op's arguments (``capture.cpp``'s forcing). What changes is the order of the two
accesses and nothing else; what is observed is the bytes the race is about, as the test would see them in the ordered
run and in the forced one, both taken in this same run.

- **cuda**: the stream of the access that must come first (the earlier one) is held back right before it by a sleep
  kernel on that stream, long enough for the later access to run first; snapshots are copies taken on the accesses'
  own streams, so they see what the accesses saw. Timing events on both streams tell whether the order really
  inverted; where it did not, the result says so and the delay it used.
- **virtual**: ops run on the host in program order, so the bad order is given to the data instead. A read that
  raced with an earlier write (RAW) runs on the bytes as they were before that write, and the write's bytes come back
  after it (unless the read's op wrote them itself). A read before a write (WAR) and two writes (WAW) are observed:
  the bytes the read would have seen, or that would have been left, with the other order.

The result is a plain dict (JSON-able), read by the pytest side (``races/confirm.py``).
"""

from __future__ import annotations

import threading
import time

import torch

from .frames import thread_origin
from .hb import RAW, WAR, WAW

MAIN = "main"


def thread_key(ident: int) -> str:
    """How a thread is named across runs: its followed name, else "main" (the test's own thread, and any thread the
    session does not follow)."""
    origin = thread_origin(ident)
    return origin.name if origin is not None else MAIN


class Side:
    """One access of the race, as the locate run's record gives it."""

    def __init__(self, data: dict):
        self.thread = str(data.get("thread_key") or MAIN)
        self.ordinal = int(data["ordinal"])
        self.op = str(data["op"])
        self.write = data["rw"] != "read"
        self.start, self.end = int(data["start"]), int(data["end"])


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's whole storage as bytes (a view: writing it writes the storage)."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)


def _flat(values) -> list:
    out = []
    for value in values or ():
        out += _flat(value) if isinstance(value, (list, tuple)) else [value]
    return out


def _tensors(values) -> list[torch.Tensor]:
    out = []
    for value in values or ():
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out += _tensors(value)
    return out


class ForcedOrder:
    """Installed for one test; `result()` after it."""

    def __init__(self, kind: str, earlier: dict, later: dict, backend: str, delay_ms: float = 200.0):
        self.kind = kind
        self.earlier, self.later = Side(earlier), Side(later)
        self.cuda = backend == "cuda"
        # the bytes both accesses touch: the race is about these, and only these are snapshot and swapped
        self.lo, self.hi = max(self.earlier.start, self.later.start), min(self.earlier.end, self.later.end)
        self.works: list = []  # the earlier op's async work handles (a collective's): waited on before observing
        self.delay_ms = float(delay_ms)
        self.seen: dict[str, str] = {}  # side -> the op found at its place ("earlier"/"later")
        self.candidates: dict[int, tuple] = {}  # storage ptr -> (bytes view, snapshot) at the earlier access
        self.storage = None  # the bytes both accesses touched
        self.ordered = self.forced = None  # snapshots: what the access saw (or left) in each order
        self.events = None
        self.host = {}
        self.problem: str | None = None
        self.unwritten = False
        self._lock = threading.Lock()

    # installing

    def install(self, capture) -> None:
        ordinals = sorted({self.earlier.ordinal, self.later.ordinal})
        capture.set_forcing(self._called, ordinals)

    @staticmethod
    def uninstall(capture) -> None:
        capture.set_forcing(None, [])

    # the capture's calls

    def _called(self, when: str, ordinal: int, thread: int, op: str, stream: int, inputs, outputs) -> None:
        key = thread_key(thread)
        with self._lock:
            for name, side in (("earlier", self.earlier), ("later", self.later)):
                if side.ordinal == ordinal and side.thread == key:
                    if "::" in side.op and side.op != op:  # (a model's op, "all_reduce", is named by the model)
                        self.problem = self.problem or (
                            f"the re-run took another path: its {name} access's place ran {op}, not {side.op}")
                        return
                    self.seen[name] = op
                    try:
                        if name == "earlier" and when == "after":
                            self.works += [v for v in _flat(outputs) if hasattr(v, "wait") and
                                           not isinstance(v, torch.Tensor)]
                        getattr(self, f"_{name}_{when}")(_tensors(inputs), _tensors(outputs))
                    except Exception as exc:  # never into the test: the confirmation says it could not be tried
                        self.problem = self.problem or (
                            f"forcing failed at the {name} access: {type(exc).__name__}: {exc}")
                    return

    def _covering(self, tensors, side: Side) -> list[torch.Tensor]:
        return [t for t in tensors if t.untyped_storage().nbytes() >= self.hi and t.numel() > 0]

    def _region(self, view: torch.Tensor, side: Side | None = None) -> torch.Tensor:
        return view[self.lo:self.hi]

    def _earlier_before(self, inputs, outputs) -> None:
        if self.cuda:
            stream = torch.cuda.current_stream()
            torch.cuda._sleep(int(self.delay_ms * _cycles_per_ms()))
            self.events = [torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)]
            self.events[0].record(stream)  # the held access starts after this
        self.host["earlier"] = time.perf_counter()
        for t in self._covering(inputs, self.earlier):
            view = _bytes_of(t)
            # before the earlier access: what a held-back write has not written yet (RAW), what a held-back read
            # sees once the later write went first (WAR, taken later on the same held stream)
            self.candidates[t.untyped_storage().data_ptr()] = (view, self._region(view, self.earlier).clone())

    def _earlier_after(self, inputs, outputs) -> None:
        # after the earlier access: what it wrote (RAW: the ordered read's bytes; WAW: the forced run's leftovers)
        for t in self._covering(inputs + outputs, self.earlier):
            ptr = t.untyped_storage().data_ptr()
            view, before = self.candidates.get(ptr, (_bytes_of(t), None))[:2]
            self.candidates[ptr] = (view, before, self._region(view, self.earlier).clone())

    def _shared(self, tensors) -> tuple | None:
        for t in self._covering(tensors, self.later):
            found = self.candidates.get(t.untyped_storage().data_ptr())
            if found is not None:
                return found
        return None

    def _later_before(self, inputs, outputs) -> None:
        self.host["later"] = time.perf_counter()
        found = self._shared(inputs)
        if found is None:
            return
        view = found[0]
        self.storage = view
        for work in self.works:  # the earlier op's own async part done: its bytes are final
            try:
                work.wait()
            except Exception:
                pass
        region = self._region(view, self.later)
        if self.kind == RAW:
            if self.cuda:  # taken on the reader's stream right before it: what it reads with the write held back
                self.forced = region.clone()
            else:
                before = found[1]
                self.ordered = region.clone()
                if before is None:  # written where nothing was before it (a fresh output): the read gets junk bytes
                    self.unwritten = True
                    self.forced = torch.full_like(region, 0xFF)  # NaN in every float type
                else:
                    self.forced = before
                region.copy_(self.forced)  # the read runs on the bytes as they were before the write
        elif self.kind == WAR:
            self.ordered = region.clone()  # what the held-back read would see if it came first

    def _later_after(self, inputs, outputs) -> None:
        found = self._shared(inputs + outputs) if self.storage is None else None
        if found is not None:
            self.storage = found[0]
        if self.storage is None:
            return
        region = self._region(self.storage, self.later)
        if self.cuda:
            stream = torch.cuda.current_stream()
            if self.events is not None:
                self.events[1].record(stream)  # the later access has run by this point on its stream
            if self.kind == RAW:
                entry = self._entry()
                if entry is not None and len(entry) > 2:
                    self.ordered = entry[2]
            elif self.kind == WAR:
                entry = self._entry()
                if entry is not None:  # taken on the held stream before the read: the bytes it sees
                    self.forced = entry[1]
            elif self.kind == WAW:
                self.ordered = region.clone()  # the later write's bytes: what the ordered run leaves
                entry = self._entry()
                if entry is not None and len(entry) > 2:
                    self.forced = entry[2]  # the held write lands last
            return
        if self.kind == RAW:
            if self.forced is not None and self.ordered is not None and torch.equal(region, self.forced):
                region.copy_(self.ordered)  # the held write lands after the read (unless the read's op wrote here)
        elif self.kind == WAR:
            self.forced = region.clone()  # the later write's bytes: what the read sees when the write goes first
        elif self.kind == WAW:
            entry = self._entry()
            if entry is not None and len(entry) > 2:
                self.ordered = region.clone()
                self.forced = entry[2]
                region.copy_(self.forced)  # the earlier write lands last

    def _entry(self):
        for entry in self.candidates.values():
            if entry[0].untyped_storage().data_ptr() == self.storage.untyped_storage().data_ptr():
                return entry
        return None

    # the result

    def result(self, dtype: str | None = None) -> dict:
        """What the forced run saw: status "forced" with the values, or "not-tried" with the reason."""
        out: dict = {"kind": self.kind, "held": "earlier", "backend": "cuda" if self.cuda else "virtual"}
        if self.cuda:
            out["delay_ms"] = self.delay_ms
        if "earlier" in self.host and "later" in self.host:
            out["host_gap_ms"] = round((self.host["later"] - self.host["earlier"]) * 1000, 3)
        if self.problem:
            return dict(out, status="not-tried", reason=self.problem)
        missing = [name for name in ("earlier", "later") if name not in self.seen]
        if missing:
            return dict(out, status="not-tried",
                        reason=f"the re-run never reached the {' and '.join(missing)} access")
        if self.ordered is None or self.forced is None:
            return dict(out, status="not-tried", reason="the two accesses shared no bytes in the re-run")
        if self.cuda:
            torch.cuda.synchronize()
            if self.events is not None:
                lead = self.events[1].elapsed_time(self.events[0])  # > 0: the held access started after the later one
                out["inverted"] = lead > 0
                out["lead_ms"] = round(lead, 3)
                if lead <= 0:
                    return dict(out, status="not-tried",
                                reason=f"a {self.delay_ms:g} ms hold did not invert the order")
        out.update(compare(self.ordered, self.forced, dtype))
        if self.unwritten:
            out["unwritten"] = True
        out["status"] = "forced"
        return out


_CYCLES: list[float] = []


def _cycles_per_ms() -> float:
    """The sleep kernel's cycles per millisecond on this GPU, measured once."""
    if not _CYCLES:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 10_000_000
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _CYCLES.append(cycles / max(start.elapsed_time(end), 1e-3))
    return _CYCLES[0]


def compare(ordered: torch.Tensor, forced: torch.Tensor, dtype: str | None) -> dict:
    """The two snapshots (bytes) as values of the race's dtype: how many differ and by how much."""
    ordered, forced = ordered.cpu(), forced.cpu()
    values = {"bytes": int(ordered.numel()), "differing_bytes": int((ordered != forced).sum())}
    kind = getattr(torch, dtype, None) if dtype else None
    if isinstance(kind, torch.dtype) and ordered.numel() % max(torch.empty(0, dtype=kind).element_size(), 1) == 0:
        a, b = ordered.view(kind), forced.view(kind)
        differs = (a != b) & ~(a.isnan() & b.isnan()) if a.is_floating_point() else a != b
        values["elements"] = int(a.numel())
        values["differing"] = int(differs.sum())
        if a.is_floating_point() or a.is_complex():
            delta = (a.double() - b.double()).abs()
            delta = delta[~delta.isnan()] if values["differing"] else delta[:0]
            values["max_abs_diff"] = float(delta.max()) if delta.numel() else 0.0
            values["forced_nonfinite"] = int((~b.isfinite()).sum())
        elif values["differing"]:
            values["max_abs_diff"] = float((a.long() - b.long()).abs().max())
    else:
        values["elements"], values["differing"] = values["bytes"], values["differing_bytes"]
    return values
