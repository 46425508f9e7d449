"""Every ATen op as a launch on the current stream plus reads and writes of the bytes it touches.

A TorchDispatchMode sits below autograd, so it sees forward ops, the ops autograd's backward runs and the ops inside
hooks alike. Which argument is read or written comes from the op's schema (alias annotations), not from a list of
ops, so new and custom ops are classified too. Accesses are byte ranges of storages — the span a view really
touches — so overlapping views at other offsets conflict and disjoint slices of one buffer do not.
"""

from __future__ import annotations

import collections
import os
import re
import sys
import threading
import weakref
from typing import Callable, Hashable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .hb import HappensBefore, Race, Site, TensorInfo

# Factories that read only their inputs' metadata; "empty" ones do not write their output either (no kernel runs).
_METADATA_INPUTS = re.compile(r"^aten::(new_.*|.*_like|empty.*)$")
_NO_KERNEL = re.compile(r"^aten::(empty.*|new_empty.*)$")
_SKIPPED_OPS = {"aten::record_stream"}  # not a kernel: the backend turns it into hb.record_stream
_HANDLED_NAMESPACES = {"c10d"}  # modelled by a namespace handler (detector.collectives), never as plain ops


def _skip_prefixes() -> tuple[str, ...]:
    """Directories whose frames are machinery, not user code: torch, this package, pytest and pluggy."""
    import _pytest
    import pluggy

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dirs = [os.path.dirname(torch.__file__), package, os.path.dirname(_pytest.__file__),
            os.path.dirname(pluggy.__file__)]
    pytest = sys.modules.get("pytest")
    if getattr(pytest, "__file__", None):
        dirs.append(os.path.dirname(pytest.__file__))
    prefixes = tuple(d + os.sep for d in dirs)
    wrappers = sys.modules.get("typing_extensions")  # its @deprecated wrapper sits around some torch.distributed calls
    return prefixes + ((wrappers.__file__,) if getattr(wrappers, "__file__", None) else ())


_STDLIB = os.path.dirname(os.__file__) + os.sep
_skip_cache: dict[str, bool] = {}
_prefixes: tuple[str, ...] | None = None


def _is_internal(filename: str) -> bool:
    skip = _skip_cache.get(filename)
    if skip is None:
        global _prefixes
        if _prefixes is None:
            _prefixes = _skip_prefixes()
        in_packages = "site-packages" in filename or "dist-packages" in filename
        skip = (filename.startswith(_prefixes) or filename.startswith("<")
                or (filename.startswith(_STDLIB) and not in_packages))
        _skip_cache[filename] = skip
    return skip


def user_frames(limit: int = 5, depth: int = 1) -> tuple[tuple[str, int, str], ...]:
    """The innermost `limit` frames outside torch, pytest and this package — cheap enough to take per op."""
    frame = sys._getframe(depth)
    out = []
    skip = _code_skip
    while frame is not None and len(out) < limit:
        code = frame.f_code
        internal = skip.get(code)
        if internal is None:
            internal = skip[code] = _is_internal(code.co_filename)
        if not internal:
            out.append((code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    return tuple(out)


_code_skip: dict = {}  # code object -> whether its frames are machinery


def created_at() -> str:
    """"file.py:line" of the innermost user frame: how streams are named after the line that created them."""
    frames = user_frames(limit=1, depth=2)
    if not frames:
        return "<unknown>"
    filename, lineno, _ = frames[0]
    return f"{os.path.basename(filename)}:{lineno}"


def byte_range(t: torch.Tensor) -> tuple[int, int] | None:
    """[start, end) bytes of its storage that a tensor's elements span; None when it has no elements."""
    numel = t.numel()
    if numel == 0:
        return None
    size = t.element_size()
    span = numel - 1 if t.is_contiguous() else sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    start = t.storage_offset() * size
    return start, start + (span + 1) * size


def tensor_info(t: torch.Tensor, name: str | None) -> TensorInfo:
    return TensorInfo(tuple(t.shape), str(t.dtype).removeprefix("torch."), name)


_HANDLED = "handled"  # plan of ops a namespace handler models (collectives)
_SKIPPED = "skipped"  # plan of ops that are no kernel on any stream


def _plan(func):
    """How an op touches its arguments, worked out once per op from its schema: (name, (index, name, is_write) of
    the arguments it reads or writes, per return whether it is a fresh tensor, whether its kernel writes its
    output). Arguments aliased without a write are views (no data moves); the inputs of *_like / new_* / empty*
    factories only lend metadata."""
    if func.namespace in _HANDLED_NAMESPACES:
        return _HANDLED
    schema = func._schema
    name = schema.name
    if name in _SKIPPED_OPS:
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
    return name, tuple(inputs), fresh if any(fresh) else (), _NO_KERNEL.match(name) is None


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


class AccessTracker(TorchDispatchMode):
    """Turns ATen ops into hb launches and accesses on the stream `current_stream()` names.

    device_type: the tensors that live on the modelled device ("cpu" under virtual streams, "cuda" on GPUs); others
    are host memory and ignored. track_frees: on CPU a storage's death is seen with weakref.finalize; on CUDA the
    allocator's deallocation callback calls `free_storage` instead.
    """

    def __init__(self, hb: HappensBefore, current_stream: Callable[[], Hashable], device_type: str,
                 track_frees: bool = True, on_race: Callable[[list[Race]], None] | None = None):
        super().__init__()
        self.hb = hb
        self.current_stream = current_stream
        self.device_type = device_type
        self.track_frees = track_frees
        self.on_race = on_race
        self.names: dict[Hashable, str] = {}  # storage key -> human name ("model.0.weight")
        self.last_writer: dict[Hashable, Hashable] = {}  # storage key -> stream of its latest write
        # op namespace -> handler(func, args, kwargs, out) that models those ops itself (collectives: "c10d")
        self.namespace_handlers: dict[str, Callable] = {}
        self.redirect: dict[Hashable, Hashable] = {}  # storage key -> stream of the next op reading it (autograd)
        self._seen: dict[Hashable, weakref.finalize | None] = {}  # storages alive and known
        self._frees: collections.deque = collections.deque()
        self._lock = threading.RLock()
        self.enabled = True
        self._plans: dict = {}  # op -> _plan(...)
        # Real autograd (cuda backend): the engine record_stream()s a gradient produced on one stream for the stream
        # of the node that consumes it — in C++, where no hook sees it. The virtual model does this in its hooks.
        self.engine_records_streams = False

    # storages

    def storage_key(self, t: torch.Tensor) -> Hashable | None:
        """The key of a tensor's storage (its data pointer, unique while it lives); registers its free."""
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return None  # sparse, nested, functional wrappers: no plain storage
        key = storage.data_ptr()
        if key == 0:
            return None
        if key not in self._seen:
            self._seen[key] = weakref.finalize(storage, self._finalized, key) if self.track_frees else None
        return key

    def _finalized(self, key: Hashable) -> None:
        if self._seen.get(key) is not None:
            self.note_free(key, Site("free", user_frames()))

    def note_free(self, key: Hashable, site: Site) -> None:
        """The storage's memory went back to the allocator. Queued, not applied: this may run inside a garbage
        collection or an allocator callback at any point, even while hb holds its lock; `drain` applies it."""
        self._frees.append((key, site))

    def drain(self) -> None:
        """Apply the frees seen since the last call: report uses not ordered before them, forget the storages.
        Every entry point (an op, a stream call, reading races) drains first, so a freed address is forgotten
        before it can be handed out again."""
        while self._frees:
            key, site = self._frees.popleft()
            if self._seen.pop(key, False) is False:
                continue
            self.names.pop(key, None)
            self.last_writer.pop(key, None)
            self._report(self.hb.free(key, site))

    def detach(self) -> None:
        """Stop watching storages (the session ends): no finalizer fires into a finished detector."""
        for fin in self._seen.values():
            if fin is not None:
                fin.detach()
        self._seen.clear()

    # accesses

    def on_device(self, t: torch.Tensor) -> bool:
        return t.device.type == self.device_type

    def run(self, op_name: str, stream: Hashable, reads=(), writes=(), frames=None):
        """Launch one op on `stream` that reads and writes the given tensors: the public way for collectives and
        other work the dispatch mode does not see. Returns the hb Op."""
        with self._lock:
            self.drain()
            op = self.hb.launch(stream, Site(op_name, frames if frames is not None else user_frames()))
            for t in reads:
                self._access(op, t, False)
            for t in writes:
                self._access(op, t, True)
            return op

    def _access(self, op, t: torch.Tensor, write: bool) -> None:
        if not self.on_device(t):
            return
        span = byte_range(t)
        if span is None:
            return
        key = self.storage_key(t)
        if key is None:
            return
        if write:
            self.last_writer[key] = op.stream
        elif self.engine_records_streams and self.last_writer.get(key, op.stream) != op.stream \
                and torch._C._current_autograd_node() is not None:
            self.hb.record_stream(key, op.stream)  # read inside a node: taken as one of its incoming gradients
        self._report(self.hb.access(op, key, span[0], span[1], write, tensor_info(t, self.names.get(key))))

    def _alloc(self, op, t: torch.Tensor) -> bool:
        """A fresh output: remember where it was allocated. False when its storage was already known."""
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return False
        if storage.data_ptr() == 0 or storage.data_ptr() in self._seen:
            return False
        key = self.storage_key(t)
        self.hb.alloc(key, storage.nbytes(), op.stream, op.site, tensor_info(t, None))
        return True

    def _report(self, races: list[Race]) -> None:
        if races and self.on_race is not None:
            self.on_race(races)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.enabled:
            return out
        plan = self._plans.get(func)
        if plan is None:
            plan = self._plans[func] = _plan(func)
        if plan is _HANDLED:
            handler = self.namespace_handlers.get(func.namespace)
            if handler is not None:
                with self._lock:
                    self.drain()
                    handler(func, args, kwargs, out)
            return out
        if plan is _SKIPPED:
            return out
        with self._lock:
            self.drain()
            self._record(plan, args, kwargs, out)
        return out

    def _record(self, plan, args, kwargs, out) -> None:
        name, inputs, fresh_returns, writes_output = plan
        reads: list[torch.Tensor] = []
        writes: list[torch.Tensor] = []
        nargs = len(args)
        for i, arg_name, write in inputs:
            if i < nargs:
                value = args[i]
            elif arg_name in kwargs:
                value = kwargs[arg_name]
            else:
                continue
            if isinstance(value, torch.Tensor):
                (writes if write else reads).append(value)
            elif isinstance(value, (list, tuple)):
                (writes if write else reads).extend(v for v in value if isinstance(v, torch.Tensor))
        fresh: list[torch.Tensor] = []
        if fresh_returns:
            results = out if isinstance(out, (tuple, list)) and len(fresh_returns) == len(out) else (out,)
            for is_fresh, value in zip(fresh_returns, results):
                if is_fresh:
                    fresh.extend(t for t in _tensors(value) if self.on_device(t))
        if not (reads or writes or fresh):
            return
        if not any(self.on_device(t) for t in reads + writes + fresh):
            return
        stream = self.current_stream()
        if self.redirect:
            for t in reads + writes:
                key = self.storage_key(t) if self.on_device(t) else None
                if key in self.redirect:
                    stream = self.redirect.pop(key)
                    break
        op = self.hb.launch(stream, Site(name, user_frames()))
        for t in reads:
            self._access(op, t, False)
        for t in writes:
            self._access(op, t, True)
        for t in fresh:
            if byte_range(t) is None:
                continue
            self._alloc(op, t)
            if writes_output:
                self._access(op, t, True)
