"""Where in user code something happened: which frames are the user's, and stacks taken per op but named only when
read (a race, a trace) — capturing is cheap, naming is not, and few stacks are ever read."""

from __future__ import annotations

import os
import re
import sys
import threading

import torch

from .hb import NATIVE_THREAD


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
    generated = inductor_cache_dir()  # Inductor's generated wrapper code and kernels
    if generated:
        dirs.append(generated)
    prefixes = tuple(d + os.sep for d in dirs)
    wrappers = sys.modules.get("typing_extensions")  # its @deprecated wrapper sits around some torch.distributed calls
    return prefixes + ((wrappers.__file__,) if getattr(wrappers, "__file__", None) else ())


def inductor_cache_dir() -> str:
    """Where Inductor writes generated code (its frames are machinery, not the user's), without importing Inductor:
    TORCHINDUCTOR_CACHE_DIR, else its default, <tmp>/torchinductor_<user>."""
    configured = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if configured:
        return os.path.abspath(configured)
    import getpass
    import tempfile

    try:
        user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    except Exception:
        user = "unknown"
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")


_STDLIB = os.path.dirname(os.__file__) + os.sep
_USER, _MACHINERY, _HARNESS = 0, 1, 2
_kinds: dict[str, int] = {}  # filename -> _USER | _MACHINERY | _HARNESS
_prefixes: tuple[str, ...] | None = None


def _kind(filename: str) -> int:
    """User code, machinery to look through (torch, this package, the standard library), or the test harness
    (pytest, pluggy): nothing beneath the harness's frames is the test's own code, so the walk stops there."""
    kind = _kinds.get(filename)
    if kind is not None:
        return kind
    global _prefixes
    if _prefixes is None:
        _prefixes = _skip_prefixes()
    in_packages = "site-packages" in filename or "dist-packages" in filename
    if os.sep + "_pytest" + os.sep in filename or os.sep + "pluggy" + os.sep in filename:
        kind = _HARNESS
    elif filename.startswith((*_prefixes, "<")) or (filename.startswith(_STDLIB) and not in_packages):
        kind = _MACHINERY
    else:
        kind = _USER
    _kinds[filename] = kind
    return kind


def _user_only(frames, limit: int) -> tuple[tuple[str, int, str], ...]:
    """The innermost `limit` of (file, line, function) frames, innermost first, that are user code; where none is
    (a library's own thread: torch's checkpoint stager), the innermost library frame (else the standard library's), so
    a report still says where."""
    out = []
    library = stdlib = None
    for filename, lineno, function in frames:
        kind = _kind(filename)
        if kind == _USER:
            out.append((filename, lineno, function))
            if len(out) == limit:
                break
        elif kind == _HARNESS:
            break
        elif library is None and not filename.startswith((_OURS, "<")):
            if not _in_stdlib(filename):
                library = (filename, lineno, function)
            elif stdlib is None:
                stdlib = (filename, lineno, function)
    if not out and (library or stdlib) is not None:
        return LibraryFrame((library or stdlib,))
    return tuple(out)


class LibraryFrame(tuple):
    """The one frame `_user_only` gives where no frame is the user's: a backward's access prefers its forward op's
    user frames to it (``backward_sites``)."""

    __slots__ = ()


_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _in_stdlib(filename: str) -> bool:
    return filename.startswith(_STDLIB) and "site-packages" not in filename and "dist-packages" not in filename


def _walk(frame):
    while frame is not None:
        code = frame.f_code
        yield code.co_filename, frame.f_lineno, code.co_name
        frame = frame.f_back


def user_frames(limit: int = 5, depth: int = 1) -> tuple[tuple[str, int, str], ...]:
    """The innermost `limit` frames outside torch, pytest and this package, walked now. Per op, `stack()` is
    cheaper."""
    return _user_only(_walk(sys._getframe(depth)), limit)


try:  # torch's C++ stack capture (what its memory snapshots use): code objects and offsets, named later
    from torch._C._profiler import gather_traceback as _gather
    from torch._C._profiler import symbolize_tracebacks as _symbolize
except ImportError:
    _gather = None


class _Stack:
    """A Python stack captured in C — no frame objects, so no locals (and tensors) kept alive — whose user frames
    are named only when read: every op needs its stack kept, few ever have it read."""

    __slots__ = ("traceback",)

    def __init__(self):
        self.traceback = _gather(True, False, False)

    def resolve(self, limit: int = 5) -> tuple[tuple[str, int, str], ...]:
        frames = _symbolize([self.traceback])[0]
        return _user_only(((f["filename"], f["line"], f["name"]) for f in frames), limit)


class Captured:
    """A stack the C++ capture took (``detector.capture``), named when read."""

    __slots__ = ("stack",)

    def __init__(self, stack):
        self.stack = stack

    def resolve(self, limit: int = 5) -> tuple[tuple[str, int, str], ...]:
        if self.stack is None:  # taken on a thread that never ran Python (capture.cpp's stack_here): no frames
            return ()
        return _user_only(self.stack.frames(), limit)


def _walked_now():
    return user_frames(depth=2)


_taken_natively = None  # the capture extension's stack taker, once it is loaded (``use_capture``)


def stack():
    """The caller's user frames for a Site, cheaply: captured now, named when read. The capture extension's taker
    where it is loaded (it names frames itself: torch's symbolizer imports Inductor, two seconds, when it first runs);
    else torch's capture; else walked at once."""
    if _taken_natively is not None:
        return Captured(_taken_natively())
    return _Stack() if _gather is not None else _walked_now()


def use_capture(extension) -> None:
    """Take stacks with the capture extension's taker from now on (``capture.load`` calls this)."""
    global _taken_natively
    _taken_natively = extension.stack


_origins: dict = {}  # thread ident -> hb.ThreadOrigin, for the threads the session follows (models.host_handoffs)


_main_ident = threading.main_thread().ident


def thread_origin(ident: int):
    """The ThreadOrigin of a followed thread (its name, where its current work came from), else None; for a thread
    Python did not start (no ``threading.Thread`` of its own: autograd's device threads, which run a GPU backward and
    its hooks), the one ``NATIVE_THREAD``. Ops are counted per thread (``Site.ordinal``): a forced re-run must not
    take the main thread's n-th op for such a thread's."""
    origin = _origins.get(ident) if _origins else None
    if origin is not None or ident == _main_ident or not ident:
        return origin
    thread = threading._active.get(ident)
    if thread is None or isinstance(thread, threading._DummyThread):
        return NATIVE_THREAD
    return None


def set_thread_origin(ident: int, origin) -> None:
    """Name a followed thread's work from now on (None: forget it, the thread ends)."""
    if origin is None:
        _origins.pop(ident, None)
    else:
        _origins[ident] = origin


def created_at() -> str:
    """"file.py:line" of the innermost user frame: how streams are named after the line that created them."""
    frames = user_frames(limit=1, depth=2)
    if not frames:
        return "<unknown>"
    filename, lineno, _ = frames[0]
    return f"{os.path.basename(filename)}:{lineno}"
