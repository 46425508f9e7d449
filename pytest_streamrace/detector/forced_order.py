"""A race's bad order, forced in a re-run of the test that reported it (``--streamrace-confirm``).

The forced run knows the race's two accesses by their ops' places on their threads (``Site.ordinal``: the capture
counts the ops it records per thread), and the capture calls `ForcedOrder` right before and right after each of the two
ops, on the issuing thread, with the op's arguments (``capture.cpp``'s forcing). What changes is the order of the two
accesses and nothing else; what is observed is the bytes the race is about, as the test would see them in the ordered
run and in the forced one, both taken in this same run.

- **cuda**: the stream of the access that must come first (the earlier one) is held back right before it by a sleep
  kernel on that stream, long enough for the later access to run first; snapshots are copies taken on the accesses'
  own streams, so they see what the accesses saw. Timing events on both streams tell whether the order really
  inverted; where it did not, the result says so and the delay it used. A later access that is a collective runs on
  its communicator's stream: its end and bytes are taken on a private stream once Python has its work back
  (`collective_returned`). A later write that reads what it writes is judged by `left_behind`.
- **virtual**: ops run on the host in program order, so the bad order is given to the data instead. A read that
  raced with an earlier write (RAW) runs on the bytes as they were before that write, and the write's bytes come back
  after it (unless the read's op wrote them itself). A read before a write (WAR) and two writes (WAW) are observed:
  the bytes the read would have seen, or that would have been left, with the other order.

The result is a plain dict (JSON-able), read by the harness that re-ran the test or program (``races/confirmation.py``).
"""

from __future__ import annotations

import _thread
import contextlib
import threading
import time

import torch

from .frames import thread_origin
from .host_sync import incidental
from .hb import FREE, RAW, WAR, WAW
from .midway import MidwaySample
from .models import host_handoffs

MAIN = "main"
# Writes whose bytes do not depend on what was there: on a GPU, what they leave is what an ordered run leaves too.
OVERWRITES = frozenset({"aten::fill_", "aten::copy_", "aten::zero_", "aten::normal_", "aten::uniform_",
                        "aten::random_", "aten::bernoulli_", "aten::exponential_", "aten::empty_like",
                        "aten::zeros_like", "aten::ones_like", "aten::full_like"})


def thread_key(ident: int) -> str:
    """How a thread is named across runs: its followed name (`ThreadOrigin.key`), "native" for a thread Python did not
    start, else "main" (the test's own thread, and any thread the session does not follow)."""
    origin = thread_origin(ident)
    return origin.key if origin is not None else MAIN


class Side:
    """One access of the race, as the locate run's record gives it: its op's place on its thread (`ordinal`; none for
    a free, which is no op), or on a pool's submitted task (`task`, `task_ordinal`), whichever worker runs it."""

    def __init__(self, data: dict):
        self.thread = str(data.get("thread_key") or MAIN)  # the plan's `thread_key_of`
        self.ordinal = int(data.get("ordinal") or 0)
        self.task = str(data.get("task") or "")
        self.task_ordinal = int(data.get("task_ordinal") or 0)
        self.op = str(data["op"])
        self.write = data["rw"] != "read"
        self.start, self.end = int(data["start"]), int(data["end"])

    def at_place(self, ordinal: int, thread: int) -> bool:
        """Whether the op the capture calls about stands where this access's op stood: its task's n-th op (on the
        worker running that task now), else its thread's n-th op."""
        if self.task:
            origin = thread_origin(thread)
            return origin is not None and origin.task == self.task and ordinal - origin.base == self.task_ordinal
        return self.ordinal == ordinal

    def where(self) -> str:
        return f"op {self.task_ordinal} of task '{self.task}'" if self.task else \
            f"op {self.ordinal} of thread '{self.thread}'"


def _collective(op: str) -> bool:
    """A race's op that is a collective: a collectives model's name ("all_reduce"), or an op of a c10d namespace."""
    return op != "free" and ("::" not in op or "c10d" in op.partition("::")[0])


def same_op(recorded: str, op: str) -> bool:
    """Whether the op the capture calls about is the one the race names: the same schema, or, for a collectives
    model's name ("all_reduce"), an op of a collectives namespace (``c10d::allreduce_``)."""
    return recorded == op or ("::" not in recorded and "c10d" in op.partition("::")[0])


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's whole storage as bytes (a view: writing it writes the storage)."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)


def _flat(values) -> list:
    out = []
    for value in values or ():
        out += _flat(value) if isinstance(value, (list, tuple)) else [value]
    return out


def _works(values) -> list:
    """A collective's async work handles among `values`."""
    return [v for v in _flat(values) if hasattr(v, "wait") and not isinstance(v, torch.Tensor)]


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

    def __init__(self, kind: str, earlier: dict, later: dict, backend: str, delay_ms: float = 200.0,
                 incidental=()):
        self.kind = kind
        self.incidental = tuple(incidental)  # the incidental-sync rules' files: syncs the program did not ask for
        self.later_thread: int | None = None  # the thread that issued the later access
        self.earlier, self.later = Side(earlier), Side(later)
        self.cuda = backend == "cuda"
        # the bytes both accesses touch: the race is about these, and only these are snapshot and swapped
        self.lo, self.hi = max(self.earlier.start, self.later.start), min(self.earlier.end, self.later.end)
        self.works: list = []  # the earlier op's async work handles (a collective's): waited on before observing
        self.later_works: list = []  # the later op's, where it is a collective: waited for before observing
        self.awaiting = None  # (thread, candidate) of a later collective on a GPU, until Python has its work back
        self.one_rank = False  # the later collective's world has one rank: it leaves what it reads
        self.delay_ms = float(delay_ms)
        self.seen: dict[str, str] = {}  # side -> the op found at its place ("earlier"/"later")
        self.candidates: dict[int, tuple] = {}  # storage ptr -> (bytes view, snapshot) at the earlier access
        self.ordered = self.forced = None  # snapshots: what the access saw (or left) in each order
        self.events = None
        self.midway: MidwaySample | None = None  # every thread's place halfway through the hold (cuda)
        self.host = {}
        self.problem: str | None = None
        self.unwritten = False
        self.read_modify_write = False  # a later write that reads what it writes, compared by what it read (cuda)
        self._op = ""  # the op the capture called about
        self.entry = None  # the candidate both accesses touch
        self.peer = False  # a rank that does not hold its collective back, and sees the other order (cuda)
        self._lock = _thread.allocate_lock()  # not threading's: one made while a session runs is a modelled handoff
        self.elsewhere: dict[str, list[str]] = {}  # side -> the ops other than it found at its place (diagnostics)
        self._capture = None
        # a fresh output held back (cuda): memory for its snapshot after the write and for what the later read sees of
        # it first, and the stream that poisons it, all taken before the hold (`_poison`)
        self.fresh_spare: list = []
        self.poison_stream = None
        # a read freed while in use (cuda): its block's pointer, bytes that do not keep it alive, its allocation
        # stream, and the deallocation callback that writes it as its next owner would (`_next_owner`)
        self.freed_block: tuple | None = None
        self.block_freed = False  # the program freed it during the re-run
        self._on_free = None
        # a later access the host makes (an op on pinned memory a held copy writes or reads), cuda: whether the hold
        # was still on when it was done, and so the host's access came first
        self.host_later = False
        self.host_inverted: bool | None = None

    # installing

    def install(self, capture) -> None:
        self._capture = capture
        capture.set_forcing(self.reached, self.ordinals())
        host_handoffs.task_watch = self.task_started

    def ordinals(self) -> list[int]:
        """The places the capture calls about from the start (a task's are added as a worker starts the task)."""
        return sorted({side.ordinal for side in (self.earlier, self.later) if side.ordinal and not side.task})

    def task_started(self, task: str, base: int) -> None:
        """A worker starts a submitted task (``host_handoffs``): where it is one of the race's, the place its op will
        have on that worker."""
        for side in (self.earlier, self.later):
            if side.task == task and self._capture is not None:
                self._capture.add_forcing_ordinal(base + side.task_ordinal)

    # the capture's calls

    def reached(self, when: str, ordinal: int, thread: int, op: str, stream: int, inputs, outputs) -> None:
        key = thread_key(thread)
        with self._lock:
            for name, side in (("earlier", self.earlier), ("later", self.later)):
                if not side.at_place(ordinal, thread):
                    continue
                # the same place on the same thread (or task), and the same op: the threads Python started that the
                # session does not follow share the name "main", those Python did not start (autograd's) "native"
                if (side.thread != key and not side.task) or not same_op(side.op, op):
                    if when == "before" and len(self.elsewhere.setdefault(name, [])) < 3:
                        self.elsewhere[name].append(f"{op} on thread '{key}'")  # what ran at its place instead
                    continue
                self.seen[name] = op
                self._op = op
                try:
                    if when == "after":  # a collective's async work handles (gloo's: on GPUs, none)
                        works = _works(outputs)
                        if name == "earlier":
                            self.works += works
                        else:
                            self.later_works = works
                    getattr(self, f"_{name}_{when}")(_tensors(inputs), _tensors(outputs))
                except Exception as exc:  # never into the test: the confirmation says it could not be tried
                    self.problem = self.problem or (
                        f"forcing failed at the {name} access: {type(exc).__name__}: {exc}")
                return

    def _covering(self, tensors) -> list[torch.Tensor]:
        return [t for t in tensors if t.untyped_storage().nbytes() >= self.hi and t.numel() > 0]

    def _region(self, view: torch.Tensor) -> torch.Tensor:
        return view[self.lo:self.hi]

    def _earlier_before(self, inputs, outputs) -> None:
        self.host["earlier"] = time.perf_counter()
        holds = self.cuda and self._holds_here()
        covering = self._covering(inputs)
        for t in covering:  # before the hold: the bytes a held-back read sees if it comes first (WAR, cuda)
            view = self._unowned(t) if self.kind == FREE and holds else _bytes_of(t)
            first = self._region(view).clone()
            # a held stream's snapshots get their memory now: a device allocation issued between the hold and the
            # later access keeps the two from running at once (CUDA's implicit synchronization)
            spare = [_device_like(first), _device_like(first)] if holds else []
            self.candidates[t.untyped_storage().data_ptr()] = {"view": view, "first": first, "spare": spare}
        if holds:
            stream = torch.cuda.current_stream()
            _load_own_kernels()
            cycles = int(self.delay_ms * _cycles_per_ms())
            # [the held access starts after this, the later access has run by this, the hold starts after this]:
            # the last tells how long the held stream really slept, where the order did not invert
            self.events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            self.events[2].record(stream)
            # where the earlier access writes a fresh output: its snapshot after the write and what the later read
            # sees of it, copied into memory taken before the hold, and poisoned from a stream made before it (an
            # allocation or a new stream between the hold and the later access can wait the hold out)
            if self.kind == RAW:
                self.fresh_spare = [torch.empty(self.hi - self.lo, dtype=torch.uint8, device=stream.device)
                                    for _ in range(2)]
                self.poison_stream = torch.cuda.Stream()
            torch.cuda._sleep(cycles)
            self.events[0].record(stream)
            self.midway = MidwaySample(self.delay_ms / 2000.0)  # where the host is, should it wait the hold out
        elif self.cuda and self.peer:  # the last rank holds its collective: where this one is, should it wait it out
            self.midway = MidwaySample(self.delay_ms / 2000.0)
        for entry in self.candidates.values():
            # right before the earlier access (on a GPU, once the hold is over): what a held-back write has not
            # written yet when the read runs (RAW), what a held-back read sees once the write went first (WAR)
            entry["held"] = entry["first"] if not holds else self._snapshot(entry)

    def _unowned(self, t: torch.Tensor) -> torch.Tensor:
        """A read freed while in use, on a GPU: its block as bytes that do not keep it alive (a view of the storage
        would, and the program's free would never happen in the re-run), watched for its free (`_next_owner`)."""
        construct = getattr(torch._C, "_construct_storage_from_data_pointer", None)
        if construct is None or self.freed_block is not None:
            return _bytes_of(t)
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        view = torch.empty(0, dtype=torch.uint8, device=t.device).set_(construct(ptr, t.device, storage.nbytes()))
        self.freed_block = (ptr, view, _allocation_stream(ptr))
        import torch.cuda._gpu_trace as trace

        self._on_free = self._next_owner
        trace.register_callback_for_memory_deallocation(self._on_free)
        return view

    def _next_owner(self, ptr: int) -> None:
        """The allocator frees the block the held read reads: write it as its next owner would, 0xFF (NaN in every
        float type) on the stream it was allocated on, where the allocator hands it out again at once. Issued at the
        free, before any next owner's work on that stream; it changes nothing the program still owns."""
        if self.freed_block is None or ptr != self.freed_block[0] or self.block_freed:
            return
        self.block_freed = True
        _, view, handle = self.freed_block
        try:
            from .session import active

            detector = active()
            stream = torch.cuda.ExternalStream(handle) if handle else torch.cuda.default_stream(view.device)
            with detector.paused() if detector is not None else contextlib.nullcontext(), torch.cuda.stream(stream):
                self._region(view).fill_(0xFF)
        except Exception as exc:  # never into the test (nor the allocator's free)
            self.problem = self.problem or f"forcing failed at the free: {type(exc).__name__}: {exc}"

    def _stop_watching_frees(self) -> None:
        if self._on_free is not None:
            import torch.cuda._gpu_trace as trace

            listeners = trace.MemoryDeallocationCallbacks.callback_list
            if self._on_free in listeners:
                listeners.remove(self._on_free)
            self._on_free = None

    def _hold_on(self) -> bool:
        """Whether the held stream is still in its hold (cuda): the event after the sleep not reached yet. Asked of the
        event base itself: the model's query would take a True as the host observing the stream."""
        return self.events is not None and not torch._C._CudaEventBase.query(self.events[0])

    def _snapshot(self, entry: dict) -> torch.Tensor:
        """The candidate's bytes now, on the current stream: into memory taken before the hold where there is some."""
        region = self._region(entry["view"])
        spare = entry.get("spare")
        # pinned host bytes are copied on the stream too (non_blocking: a blocking copy would wait the hold out)
        return spare.pop().copy_(region, non_blocking=True) if spare else region.clone()

    def _holds_here(self) -> bool:
        """Whether this process holds the earlier access back. A collective runs on the communicator's own stream,
        which waits for the issuing one: holding that delays the collective, but also whatever this rank issues next
        on it. So one rank, the last, holds its collective back, and its peers, whose collective cannot finish
        without it, see the other order."""
        if not self._op.startswith("c10d::"):
            return True
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return True
        if dist.get_world_size() == 1 and self.kind == RAW:
            # holding it would hold the stream the read runs on too (the communicator's waits for the issuing one),
            # and a world of one has no peer to see the other order: what the read sees in each order is the bytes
            # before the collective and after it, compared without a hold (`result`)
            self.one_rank = True
            return False
        if dist.get_world_size() < 2:
            return True
        self.peer = dist.get_rank() != dist.get_world_size() - 1
        return not self.peer

    def _earlier_after(self, inputs, outputs) -> None:
        # after the earlier access: what it wrote (RAW: the ordered read's bytes; WAW: the forced run's leftovers)
        for t in self._covering(inputs + outputs):
            fresh = t.untyped_storage().data_ptr() not in self.candidates
            entry = self.candidates.setdefault(t.untyped_storage().data_ptr(), {"view": _bytes_of(t)})
            if fresh and self.cuda and self.events is not None and self.kind == RAW:
                self._poison(entry)
                if self.fresh_spare:
                    entry["spare"] = [self.fresh_spare.pop()]
            entry["after"] = self._snapshot(entry)

    def _poison(self, entry: dict) -> None:
        """A fresh output of the held write (cuda): its memory holds what the allocator's last user left, maybe the
        same values from an earlier pass. Filled with 0xFF bytes (NaN in every float type) on a stream of its own,
        after what the held stream ran before its hold and while it sleeps: a read that comes first sees those."""
        poison = self.poison_stream or torch.cuda.Stream()
        poison.wait_event(self.events[2])
        with torch.cuda.stream(poison):
            self._region(entry["view"]).fill_(0xFF)
        entry["poisoned"] = torch.cuda.Event()
        entry["poisoned"].record(poison)

    def _shared(self, tensors) -> dict | None:
        for t in self._covering(tensors):
            found = self.candidates.get(t.untyped_storage().data_ptr())
            if found is not None:
                return found
        return None

    def _later_before(self, inputs, outputs) -> None:
        self.host["later"] = time.perf_counter()
        self.later_thread = threading.get_ident()
        if self.midway is not None:
            self.midway.cancel()  # issued before halfway: nothing waited out the hold
        found = self._shared(inputs)
        if found is None:
            return
        self.entry = found
        if self.cuda and _on_host(inputs + outputs):
            # the host's own access (pinned memory a held copy fills or reads): it runs now, during the hold
            self.host_later = True
            region = self._region(found["view"])
            if self.kind == RAW and self.earlier.op in OVERWRITES and self._hold_on():
                # the held copy has not written these bytes yet, and overwrites them when it runs: what was there
                # may be the very values from an earlier pass (pinned blocks are cached), so the host reads 0xFF
                region.fill_(0xFF)
                found["poisoned"] = True
            found["host_saw"] = region.clone()
            self.unwritten = "poisoned" in found  # the host read bytes the held copy had not written
            return
        if self.cuda:
            if "held" not in found and "poisoned" in found:  # a fresh output: what this read sees of it first
                torch.cuda.current_stream().wait_event(found["poisoned"])
                region = self._region(found["view"])
                found["held"] = self.fresh_spare.pop().copy_(region) if self.fresh_spare else region.clone()
                self.unwritten = True
            return  # nothing else on the later access's stream before it: the snapshots are the held stream's
        self._wait_works()  # the earlier op's async part done (gloo's thread): its bytes are final
        region = self._region(found["view"])
        if self.kind == RAW:
            self.ordered = region.clone()
            if "held" not in found:  # written where nothing was before it (a fresh output): the read gets junk bytes
                self.unwritten = True
                self.forced = torch.full_like(region, 0xFF)  # NaN in every float type
            else:
                self.forced = found["held"]
            region.copy_(self.forced)  # the read runs on the bytes as they were before the write
        elif self.kind == WAR:
            self.ordered = region.clone()  # what the held-back read would see if it came first

    def _later_after(self, inputs, outputs) -> None:
        self.host["later_done"] = time.perf_counter()
        if self.entry is None:
            self.entry = self._shared(inputs + outputs)
        entry = self.entry
        if entry is None:
            return
        region = self._region(entry["view"])
        if self.cuda:
            collective = self._op.startswith("c10d::")
            if collective:  # it runs on its communicator's stream: observed once Python has its work back
                self.awaiting = (threading.get_ident(), entry)
            elif self.host_later and self.events is not None:
                self.host_inverted = self._hold_on()  # done on the host while the held access had not started
            elif self.events is not None:
                self.events[1].record(torch.cuda.current_stream())  # the later access has run by here on its stream
            if self.kind == RAW and self.host_later:  # what the host read, against the copy's bytes
                self.forced, self.ordered = entry.get("host_saw"), entry.get("after")
            elif self.kind == RAW:
                # the read saw what the held stream had before the write; a collective's own bytes (it writes on its
                # communicator's stream) are read at the end, and a peer's read saw them before the collective ran
                self.forced = entry.get("after") if self.peer else entry.get("held")
                self.ordered = None if self.works or self.peer else entry.get("after")
            elif self.kind == WAR:
                self.ordered, self.forced = entry.get("first"), entry.get("held")
            elif self.kind == WAW and self.later.op in OVERWRITES:
                self.ordered = region.clone()  # the later write's bytes: what the ordered run leaves
                self.forced = entry.get("after")  # the held write lands last
            elif self.kind == WAW:
                # the later write also reads what it writes (div_, add_, an in-place collective): it ran during the
                # hold on the bytes as they were before it, and what it left is taken once it is done
                self.read_modify_write = True
                if not collective:
                    entry["later"] = region.clone()
            return
        for work in self.later_works:  # a collective's async part (gloo's thread) done: its bytes are final
            work.wait()
        if self.kind == RAW:
            if self.forced is not None and self.ordered is not None and torch.equal(region, self.forced):
                region.copy_(self.ordered)  # the held write lands after the read (unless the read's op wrote here)
        elif self.kind == WAR:
            self.forced = region.clone()  # the later write's bytes: what the read sees when the write goes first
        elif self.kind == WAW and "after" in entry:
            self.ordered = region.clone()
            self.forced = entry["after"]
            region.copy_(self.forced)  # the earlier write lands last

    def collective_returned(self, result) -> None:
        """A collective Python issued has returned (its Work, or what holds it): where it was the later access on a
        GPU, a private stream waits for it, and its end and the bytes it left are taken there, so that nothing the
        program issues next waits on them. (Its Work is not waited for inside the op: it is not ready there.) A
        synchronous one may return no Work (NCCL in torch 2.11: "the backend has sync'ed at CPP level", as torch's
        ``all_reduce`` puts it): the issuing stream already waits for it, so the private stream waits for that one."""
        awaiting = self.awaiting
        if awaiting is None or awaiting[0] != threading.get_ident():
            return
        self.awaiting = None
        try:
            works = _works([result])
            if not works and result is not None:
                self.problem = self.problem or (f"the later access ({self.later.op}) returned no work to wait for "
                                                f"({type(result).__name__})")
                return
            observer = torch.cuda.Stream()
            observer.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(observer):
                for work in works:
                    work.wait()  # the current stream, the observer, waits for the collective
                if self.events is not None:
                    self.events[1].record(observer)
                if self.kind == WAW:
                    awaiting[1]["later"] = self._region(awaiting[1]["view"]).clone()
            self.one_rank = _world_size() == 1
        except Exception as exc:  # never into the program: the confirmation says it could not be tried
            self.problem = self.problem or f"observing the later collective failed: {type(exc).__name__}: {exc}"

    def _wait_works(self) -> None:
        for work in self.works:
            try:
                work.wait()
            except Exception:
                pass
        self.works = []

    # the result

    def _waited_out(self, out: dict, whose: str, since: str, held: str) -> dict:
        """Not tried: the host spent the hold itself between the two accesses (`host_waited`)."""
        return dict(out, status="not-tried", host_waited=True,
                    reason=f"the host waited out {whose or 'the '}{self.delay_ms:g} ms hold before it issued the later "
                           f"access ({out['host_gap_ms']:.1f} ms after {since}): something between the two "
                           f"synchronizes with {held}, so no hold inverts them" + self._where_waited(out))

    def _where_waited(self, out: dict) -> str:
        """Where the threads were halfway through the hold: the call that waited it out is among them."""
        places = self.midway.where() if self.midway is not None else None
        if not places:
            return ""
        out["threads_midway"] = places
        said = "; halfway through the hold, " + ", ".join(places)
        if self.midway.gil_held_ms is not None:
            out["gil_held_ms"] = self.midway.gil_held_ms
            said += (f" (no Python thread could run until {self.midway.gil_held_ms:g} ms after that: the waiting call "
                     "held the GIL)")
        return said + self._the_call(out)

    def _the_call(self, out: dict) -> str:
        """The call that waited: where the thread that issued the later access was halfway through the hold. Made
        from a file of an incidental-sync rule, it is a sync the program did not ask for: the race is latent, ordered
        today by that call."""
        found = self.midway.call_of(self.later_thread)
        if found is None:
            return ""
        place, frames = found
        out["waited_at"] = place
        said = f"; the call that waited: {place}"
        if self.incidental and incidental(frames, self.incidental):
            out["latent_sync"] = place
            said += (" (a sync the program did not ask for: an incidental-sync rule names its file; the race is "
                     "latent, ordered today by that call)")
        return said

    def _not_inverted(self, out: dict, lead: float) -> dict:
        """Not tried: the later access ran after the held one anyway. Says how long the held stream slept and how long
        the later access's own call took on the host: a call that waited out the hold synchronizes with the held
        stream inside it (no longer hold helps), a hold that slept less than asked did not hold."""
        slept = self.events[2].elapsed_time(self.events[0])
        call_ms = round((self.host.get("later_done", self.host["later"]) - self.host["later"]) * 1000, 3)
        out.update(slept_ms=round(slept, 3), later_call_ms=call_ms, cycles_per_ms=round(_cycles_per_ms()))
        why = (f"a {self.delay_ms:g} ms hold did not invert the order (the later access ran {-lead:.1f} ms after the "
               f"held one started; the host issued it {out.get('host_gap_ms', 0):.1f} ms after the held one")
        if host_waited(self.delay_ms, call_ms):
            out["host_waited"] = True
            why += f", and its own call took {call_ms:.1f} ms: it waited for the held stream inside"
        if slept < 0.5 * self.delay_ms:
            why += f"; the held stream slept {slept:.1f} ms of the {self.delay_ms:g} asked"
        # issued after halfway through the hold: where the host was then
        return dict(out, status="not-tried", reason=why + ")" + self._where_waited(out))

    def _host_not_first(self, out: dict) -> dict:
        """Not tried: the host's access was done only after the hold was over."""
        why = (f"the host's access ran after the {self.delay_ms:g} ms hold was over (issued "
               f"{out.get('host_gap_ms', 0):.1f} ms after the held one)")
        if host_waited(self.delay_ms, out.get("host_gap_ms", 0.0)):
            out["host_waited"] = True
            why += ": something between the two synchronizes with the held stream" + self._where_waited(out)
        return dict(out, status="not-tried", reason=why)

    def _one_rank_collective(self) -> bool:
        return (self.one_rank or _world_size() == 1) and any(_collective(s.op) for s in (self.earlier, self.later))

    def _freed(self, out: dict, dtype: str | None) -> dict:
        """A read freed while in use (free-while-in-use), held back past its free: what it read against what it sees
        of the block once the allocator may hand it out. On a GPU the held stream reads the block as it is after the
        hold (the next allocation on the freeing stream may have written it meanwhile); on the virtual backend a block
        handed back holds the allocator's bytes, 0xFF (NaN in every float type), as a fresh output's do."""
        entry = next((e for e in self.candidates.values() if "first" in e), None)
        if entry is None:
            return dict(out, status="not-tried", reason="the read freed while in use touched no tensor in the re-run")
        if self.cuda:
            torch.cuda.synchronize()
            forced = entry.get("held")
            if self.freed_block is not None and not self.block_freed:
                return dict(out, status="not-tried", reason="the block was not freed while the read was held back")
        else:
            forced = torch.full_like(entry["first"], 0xFF)
        out.update(compare(entry["first"], forced, dtype), freed=True, status="forced")
        if not out["differing_bytes"]:
            out["reason"] = "nothing wrote the freed block while the read was held back"
        return out

    def _never_reached(self, missing: list[str]) -> str:
        """Why a side was not found: where it was looked for, and what ran there instead (the op counts differ)."""
        places = []
        for name in missing:
            side = getattr(self, name)
            found = self.elsewhere.get(name)
            ran = f"; the re-run ran {', '.join(found)} there" if found else ""
            places.append(f"{side.op}, {side.where()}{ran}")
        return f"the re-run never reached the {' and '.join(missing)} access ({'; '.join(places)})"

    def result(self, dtype: str | None = None) -> dict:
        """What the forced run saw: status "forced" with the values, or "not-tried" with the reason."""
        if self.midway is not None:
            self.midway.cancel()
        self._stop_watching_frees()
        self.fresh_spare, self.poison_stream = [], None
        out: dict = {"kind": self.kind, "held": "earlier", "backend": "cuda" if self.cuda else "virtual"}
        if self.cuda:
            out["delay_ms"] = self.delay_ms
            if self.peer:
                out["held_by"] = "the last rank"
        if "earlier" in self.host and "later" in self.host:
            out["host_gap_ms"] = round((self.host["later"] - self.host["earlier"]) * 1000, 3)
        if self.awaiting is not None:
            self.problem = self.problem or (f"the later access ({self.later.op}) is a collective whose work never "
                                            "came back to Python, where the forced run observes it")
        if self.problem:
            return dict(out, status="not-tried", reason=self.problem)
        missing = [name for name in (("earlier",) if self.kind == FREE else ("earlier", "later"))
                   if name not in self.seen]
        if missing:
            return dict(out, status="not-tried", reason=self._never_reached(missing))
        if self.kind == FREE:
            return self._freed(out, dtype)
        if self.cuda:
            torch.cuda.synchronize()
            if self.entry is not None and self.ordered is None and self.kind == RAW:  # a collective's, now done
                self.ordered = self._region(self.entry["view"]).clone()
            if self.read_modify_write:
                seen = left_behind(self.entry.get("first"), self.entry.get("after"), self.entry.get("later"),
                                   one_rank=self.one_rank)
                if seen is None:
                    return dict(out, status="not-tried", reason="the bytes before the held write were not observed")
                self.ordered, self.forced, how = seen
                self.read_modify_write = how == "read"
                if how == "identity":
                    out["identity"] = True
        if self.ordered is None or self.forced is None:
            return dict(out, status="not-tried", reason="the two accesses shared no bytes in the re-run")
        if self.cuda:
            if self.peer and host_waited(self.delay_ms, out.get("host_gap_ms", 0.0)):  # its read waited for the hold
                return self._waited_out(out, "the last rank's ", "the collective", "the collective")
            if self.events is not None and self.host_later:
                out["inverted"] = bool(self.host_inverted)
                if not self.host_inverted:
                    return self._host_not_first(out)
            elif self.events is not None:
                lead = self.events[1].elapsed_time(self.events[0])  # > 0: the held access started after the later one
                out["inverted"] = lead > 0
                out["lead_ms"] = round(lead, 3)
                if lead <= 0 and host_waited(self.delay_ms, out.get("host_gap_ms", 0.0)):
                    return self._waited_out(out, "", "the held one", "the held stream")
                if lead <= 0:
                    return self._not_inverted(out, lead)
        out.update(compare(self.ordered, self.forced, dtype))
        if self.cuda and self.events is None and self.one_rank and out["differing_bytes"]:
            return dict(out, status="not-tried", reason=(
                "a collective over a world of one rank cannot be held back apart from the stream its read runs on, "
                "and it changed the bytes: no forced order shows what the read would see"))
        if not out["differing_bytes"] and self._one_rank_collective():
            out["one_rank"] = True  # the reason the values are the same: an all-reduce of one rank is the identity
        if self.unwritten:
            out["unwritten"] = True
        if self.read_modify_write:
            out["read_modify_write"] = True
        out["status"] = "forced"
        return out


def _on_host(tensors) -> bool:
    """An op the host runs itself: every tensor it touches is in host memory."""
    return bool(tensors) and all(t.device.type == "cpu" for t in tensors)


def _device_like(first: torch.Tensor) -> torch.Tensor:
    """Memory for a snapshot a held stream takes: on the device, where a pinned host block's bytes are copied too."""
    device = first.device if first.device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.empty(first.shape, dtype=first.dtype, device=device)


def _allocation_stream(ptr: int) -> int | None:
    """The stream the caching allocator gave the block at `ptr` to (its segment's: the allocator reuses a freed block
    for that stream's next allocations); None where it is not the caching allocator's."""
    for segment in torch.cuda.memory_snapshot():
        if segment["address"] <= ptr < segment["address"] + segment["total_size"]:
            return int(segment["stream"])
    return None


def _world_size() -> int | None:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else None


def left_behind(first, after, later, one_rank: bool = False) -> tuple | None:
    """A write-after-write on a GPU whose later write reads what it writes (``x.div_(n)``, an in-place all-reduce):
    (ordered, forced, what is compared) from three snapshots of the forced run, where the later write ran first.
    `first`: the bytes before the held write, which the later write read; `after`: what the held write wrote, which
    it leaves behind landing last; `later`: what the later write made of `first`.

    - The held write wrote the bytes already there: the ordered run's later write read the same bytes, so `later` is
      what it leaves, and `after` what the forced one leaves ("left behind", exact).
    - The later write leaves what it reads (a collective of a world of one rank; or it left nonzero bytes unchanged,
      as ``x.mul_(1)``): it would leave the held write's bytes in the ordered run too ("identity": the same values,
      not confirmed). Bytes all zero tell nothing: an all-reduce or a division of zeros leaves them.
    - Else the later write computed on the bytes before the held write instead of its bytes: what it read is
      compared, `after` against `first` ("read")."""
    if first is None or after is None or later is None:
        return None
    if torch.equal(first, after):
        return later, after, "left behind"
    if one_rank or (torch.equal(later, first) and bool(first.any())):
        return after, after, "identity"
    return after, first, "read"


def skip_syncs(globs) -> "callable":
    """Explicit synchronizes made from the files of an ``incidental-sync`` rule (a framework's timer) do nothing
    until the returned function is called: the latent race they order today runs in its bad order. Returns the undo."""
    from .frames import user_frames

    places = [(torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda.Event, "synchronize")]
    saved = [(owner, name, owner.__dict__[name]) for owner, name in places if name in owner.__dict__]

    def skipping(original):
        def call(*args, **kwargs):
            if incidental(user_frames(limit=8, depth=2), globs):
                return None
            return original(*args, **kwargs)
        return call

    for owner, name, original in saved:
        setattr(owner, name, skipping(original))

    def undo() -> None:
        for owner, name, original in saved:
            setattr(owner, name, original)
    return undo


def host_waited(delay_ms: float, gap_ms: float) -> bool:
    """Whether the host spent the hold itself between the two accesses (about the hold's length, not more): it waited
    for the held stream, and a longer hold only makes it wait longer."""
    return 0.9 * delay_ms <= gap_ms <= 1.25 * delay_ms + 50.0


_CYCLES: list[float] = []
_LOADED: list[bool] = []


def _load_own_kernels() -> None:
    """Launch once, before any hold, the kernels the forcing itself runs while a held stream sleeps (a fresh output's
    poison fill, the byte snapshots): CUDA loads a kernel's module at its first launch, and that load can wait for the
    sleeping stream, so a first launch during the hold keeps the later access from going first. The test's own kernels
    are loaded by the re-run's warm-up pass (``confirm_run``) or ``CUDA_MODULE_LOADING=EAGER``; these run in no pass
    but a forced one. Called inside the capture's call about the held op, so none of it is recorded."""
    if _LOADED:
        return
    scratch = torch.empty(64, dtype=torch.uint8, device="cuda")
    scratch.fill_(0xFF)
    scratch[:32].clone().copy_(scratch[32:])
    _cycles_per_ms()
    _LOADED.append(True)


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
