"""Python's thread handoffs as happens-before edges between host threads, as ThreadSanitizer models pthreads.

A synchronize orders only the thread that made it (CUDA blocks the calling thread): another thread learns what it
learnt only through a handoff, so each of these is a release on one side and an acquire on the other (``hb.release`` /
``hb.acquire`` on the object as the key):

- ``threading.Thread``: ``start()`` → the thread's first step; the thread's last step → a ``join()`` that saw it end;
- ``Lock`` / ``RLock`` made while a session runs: release → acquire (a lock made before it is a C object, not seen);
- ``Condition``: leaving its ``with`` block, ``notify`` / ``notify_all`` → entering it, the return of ``wait`` /
  ``wait_for``;
- ``Event``: ``set()`` → a ``wait()`` or ``is_set()`` that returned True;
- ``Semaphore`` / ``BoundedSemaphore``: ``release()`` → an ``acquire()`` that returned True;
- ``Barrier``: every party's ``wait()`` → every party's return from it;
- ``queue.Queue`` (``LifoQueue``, ``PriorityQueue``) and ``queue.SimpleQueue`` made while a session runs: ``put`` →
  ``get``;
- ``concurrent.futures.Future``: ``set_result`` / ``set_exception`` → ``result()``, ``exception()``, a ``done()`` that
  returned True, a done callback; a pool's ``submit`` → the work item's run.

Anything else (a plain variable polled, a C++ queue) orders nothing. The classes are patched where they are Python, so
objects made before the session count too; the C ones (locks, ``SimpleQueue``) are replaced by modelled twins for
what is made while the session runs. Each edge first drains the ops captured so far, so the ops a thread issued
before the handoff are applied with what it knew then. Everything here hands off to the session active now and never
raises into the program.
"""

from __future__ import annotations

import _thread
import queue
import threading
from concurrent import futures
from concurrent.futures import thread as pool

from ...patching import AttrPatch, WrapPatch
from ..frames import set_thread_origin, stack, thread_origin
from ..hb import Site, ThreadOrigin, stable_name

_session = None  # (hb, tracker) of the active session, or None: every edge is then a no-op
_inside = threading.local()  # .busy: this thread is applying an edge (a drain's own locks are not handoffs)


def _edge(step: str, key) -> None:
    session = _session
    if session is None or getattr(_inside, "busy", False):
        return
    hb, tracker = session
    if tracker.busy_here():  # the detector's own work on this thread (a module it imports, a finalizer): no handoff
        return
    _inside.busy = True
    try:
        tracker.drain()
        getattr(hb, step)(key)
    except Exception:  # never in the program's thread: the edge goes unmodelled
        pass
    finally:
        _inside.busy = False


def release(key) -> None:
    """What this thread knows goes into `key` (the sending side of a handoff)."""
    _edge("release", key)


def acquire(key) -> None:
    """This thread learns what was released into `key` (the receiving side)."""
    _edge("acquire", key)


def thread_started(thread) -> None:
    """On a thread the session follows, before its first step: a host clock of its own, with what its starter knew,
    and its name and start for reports."""
    session = _session
    if session is None:
        return
    try:
        session[0].own_host()
        set_thread_origin(threading.get_ident(), ThreadOrigin(thread.name, "started", _origin(thread), _nth(thread)))
    except Exception:
        return
    acquire(thread)


def thread_ending(thread) -> None:
    """Its last step: what it knew goes to whoever joins it; its ident goes back to the shared clock."""
    release(thread)
    set_thread_origin(threading.get_ident(), None)
    session = _session
    if session is not None:
        try:
            session[0].drop_host()
        except Exception:
            pass


def work_item_starting(item) -> None:
    """A pool work item: its worker learns what its submitter knew; a worker started before the session gets a clock
    of its own first (it is not the main thread)."""
    session = _session
    if session is not None:
        try:
            session[0].own_host()
            worker = threading.current_thread()
            task, base = getattr(item, _TASK, ""), _captured_so_far()
            set_thread_origin(threading.get_ident(), ThreadOrigin(worker.name, "work submitted", _origin(item),
                                                                  _nth(worker), task, base))
            watch = task_watch
            if watch is not None and task:
                watch(task, base)
        except Exception:
            return
    acquire(item)


# A forced run's hook (``forced_order.ForcedOrder``): called on the worker as it starts a submitted task, with the
# task's identity and its worker's op count so far
task_watch = None
_TASK = "_streamrace_task"  # on a work item: "<submitter's key>/<its submit count>"
_submits: dict = {}  # submitter's key -> tasks it submitted in this session


def _captured_so_far() -> int:
    from .. import capture

    extension = capture._extension
    return extension.thread_ordinal() if extension is not None else 0


def _mark_task(item) -> None:
    """A submitted task's identity: its submitter (a task itself where a pool's worker submits it; else its thread's
    key) and how many it submitted before, in this session. The same in a re-run, whichever worker runs it."""
    if _session is None:
        return
    try:
        origin = thread_origin(threading.get_ident())
        submitter = (origin.task or origin.key) if origin is not None else "main"
        with _counting:
            n = _submits.get(submitter, 0)
            _submits[submitter] = n + 1
        setattr(item, _TASK, f"{submitter}/{n}")
    except Exception:
        pass


_ORIGIN = "_streamrace_origin"  # where a thread was started or a work item submitted (a Site), on the object
_NTH = "_streamrace_nth"  # on a thread: how many of the session's threads of its stable name started before it
_started_by_name: dict = {}  # stable name -> threads of that name started in this session
_counting = _thread.allocate_lock()  # a C lock made at import: no handoff


def _origin(obj) -> Site:
    return getattr(obj, _ORIGIN, None) or Site("")


def _nth(thread) -> int:
    return getattr(thread, _NTH, 0)


def _count_start(thread) -> None:
    """Numbered in the order of start() calls (not of first steps, which race): a program that starts its threads
    in one order starts them so in a re-run."""
    if _session is None:
        return
    try:
        name = stable_name(thread.name)
        with _counting:
            n = _started_by_name.get(name, 0)
            _started_by_name[name] = n + 1
        setattr(thread, _NTH, n)
    except Exception:
        pass


def _mark_origin(obj, op: str) -> None:
    if _session is not None:
        try:
            setattr(obj, _ORIGIN, Site(op, stack()))
        except Exception:
            pass


# the patched methods: the original, with the edge on the side where it holds

def _releasing_before(original):
    def call(self, *args, **kwargs):
        release(self)
        return original(self, *args, **kwargs)
    return _named(call, original)


def _acquiring_after(original, when=None):
    """`original`, then an acquire where its result says it got the object (`when(result)`; None: always)."""
    def call(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if when is None or when(result):
            acquire(self)
        return result
    return _named(call, original)


def _named(call, original):
    call.__name__ = getattr(original, "__name__", call.__name__)
    call.__qualname__ = getattr(original, "__qualname__", call.__qualname__)
    call.__doc__ = getattr(original, "__doc__", None)
    call.__wrapped__ = original
    return call


def _true(result) -> bool:
    return result is True


def _acquiring_if_true(original):
    """`original`, then an acquire where it returned True (an event waited for, a semaphore got, a future done)."""
    return _acquiring_after(original, _true)


def _acquiring_finally(original):
    """`original`, then an acquire even when it raised (a future's exception was released into it too)."""
    def call(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        finally:
            acquire(self)
    return _named(call, original)


def _around(original):
    """Release before and acquire after (a condition's wait, a barrier's)."""
    return _acquiring_finally(_releasing_before(original))


def _followed(bootstrap_inner):
    def run(self):
        thread_started(self)
        try:
            bootstrap_inner(self)
        finally:
            thread_ending(self)
    return _named(run, bootstrap_inner)


def _item_run(run):
    def call(self, *args, **kwargs):
        work_item_starting(self)
        return run(self, *args, **kwargs)
    return _named(call, run)


def _joined(thread_join):
    def join(self, timeout=None):
        thread_join(self, timeout)
        if not self.is_alive():
            acquire(self)
    return _named(join, thread_join)


def _done_callback(add_done_callback):
    def add(self, fn):
        def called(future):
            acquire(future)
            return fn(future)
        return add_done_callback(self, called)
    return _named(add, add_done_callback)


def _submitted(work_item_init):
    def init(self, *args, **kwargs):
        work_item_init(self, *args, **kwargs)
        _mark_origin(self, "submit")
        _mark_task(self)
        release(self)
    return _named(init, work_item_init)


def _started(start):
    def call(self, *args, **kwargs):
        _mark_origin(self, "Thread.start")
        _count_start(self)
        release(self)
        return start(self, *args, **kwargs)
    return _named(call, start)


# the C objects, as modelled twins made while a session runs

class _Handoff:
    """A lock's twin: the real one inside, a handoff on each release → acquire."""

    __slots__ = ("_lock", "__weakref__")

    def __init__(self, lock):
        self._lock = lock

    def acquire(self, blocking=True, timeout=-1):
        got = self._lock.acquire(blocking, timeout)
        if got:
            acquire(self)
        return got

    def release(self):
        release(self)
        self._lock.release()

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()

    def _at_fork_reinit(self):
        self._lock._at_fork_reinit()

    def __repr__(self):
        return f"<streamrace-modelled {self._lock!r}>"


class _ModelledLock(_Handoff):
    """``threading.Lock()`` while a session runs."""

    __slots__ = ()

    def __init__(self):
        super().__init__(_thread.allocate_lock())

    def locked(self):
        return self._lock.locked()


class _ModelledRLock(_Handoff):
    """``threading.RLock()`` while a session runs, with what ``Condition`` asks of one."""

    __slots__ = ()

    def __init__(self):
        super().__init__(_real_rlock())

    def _is_owned(self):
        return self._lock._is_owned()

    def _release_save(self):
        release(self)
        return self._lock._release_save()

    def _acquire_restore(self, state):
        self._lock._acquire_restore(state)
        acquire(self)

    def _recursion_count(self):
        return self._lock._recursion_count()


_real_rlock = threading.RLock


class _ModelledSimpleQueue(queue.SimpleQueue):
    """A ``queue.SimpleQueue`` whose put → get is a handoff (``put_nowait`` / ``get_nowait`` are C aliases of the
    originals, so they are modelled here too)."""

    def put(self, item, block=True, timeout=None):
        release(self)
        super().put(item, block, timeout)

    def put_nowait(self, item):
        self.put(item, False)

    def get(self, block=True, timeout=None):
        item = super().get(block, timeout)
        acquire(self)
        return item

    def get_nowait(self):
        return self.get(False)


class HostHandoffs:
    """The patch: the handoffs above, for the session whose hb and tracker are given."""

    def __init__(self, hb, tracker):
        self.hb, self.tracker = hb, tracker

    def patches(self) -> list:
        T, C, E, S, B, Q, F = (threading.Thread, threading.Condition, threading.Event, threading.Semaphore,
                               threading.Barrier, queue.Queue, futures.Future)
        out = [
            WrapPatch(T, "start", _started),
            WrapPatch(T, "join", _joined),
            WrapPatch(T, "_bootstrap_inner", _followed),
            AttrPatch(threading, "Lock", _ModelledLock),
            AttrPatch(threading, "RLock", _ModelledRLock),
            WrapPatch(C, "__enter__", _acquiring_after),
            WrapPatch(C, "__exit__", _releasing_before),
            WrapPatch(C, "wait", _around),
            WrapPatch(C, "wait_for", _around),
            WrapPatch(C, "notify", _releasing_before),
            WrapPatch(C, "notify_all", _releasing_before),
            WrapPatch(E, "set", _releasing_before),
            WrapPatch(E, "wait", _acquiring_if_true),
            WrapPatch(E, "is_set", _acquiring_if_true),
            WrapPatch(S, "release", _releasing_before),
            WrapPatch(S, "acquire", _acquiring_if_true),
            WrapPatch(S, "__enter__", _acquiring_if_true),
            WrapPatch(B, "wait", _around),
            WrapPatch(Q, "put", _releasing_before),
            WrapPatch(Q, "get", _acquiring_after),
            AttrPatch(queue, "SimpleQueue", _ModelledSimpleQueue),
            WrapPatch(F, "set_result", _releasing_before),
            WrapPatch(F, "set_exception", _releasing_before),
            WrapPatch(F, "result", _acquiring_finally),
            WrapPatch(F, "exception", _acquiring_finally),
            WrapPatch(F, "done", _acquiring_if_true),
            WrapPatch(F, "add_done_callback", _done_callback),
        ]
        if hasattr(pool, "_WorkItem"):
            out += [WrapPatch(pool._WorkItem, "__init__", _submitted),
                    WrapPatch(pool._WorkItem, "run", _item_run)]
        return out + [self]

    def install(self) -> None:
        global _session
        _started_by_name.clear()
        _submits.clear()
        _session = (self.hb, self.tracker)

    def uninstall(self) -> None:
        global _session
        _session = None
