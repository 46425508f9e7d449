"""Ops captured in C++ (both stream models): what the dispatch mode hands the tracker, without entering Python per op.

A TorchDispatchMode costs a launch-bound training step 1.9-2.1x before it does anything (the "empty mode" column of
benchmarks/overhead.py on H200 hosts, docs/validation.md). This extension takes ops in C++ instead and records, per op
that reaches a kernel below autograd (composite ops decompose first, as they do before the dispatch mode; ops nested in
a recorded op are its own business, as under the mode), the byte ranges of the storages it reads and writes, its fresh
outputs, the current stream, whether it runs inside an autograd node, and the Python stack (torch's C++ capture, named
later). Which arguments are read or written is the tracker's own plan (``tracker._plan``), asked once per op. The ops
come from a kernel of ours at the BackendSelect dispatch key, which sees only the calls that reach a kernel
(``kernel_entry.cpp``), not from RecordFunction callbacks, which box every dispatcher call's arguments.

The tracker drains the records in order at every point where order matters (stream and event calls, frees, waits,
reading races); frees, and on a GPU the trace's event records and waits, arrive as markers in the same buffer. The
collectives models' ops (c10d's, functional collectives') are queued there too, with their arguments, stream and
stack, and modelled when drained: a c10d op torch's C++ issues as of before it ran; one Python issues
(``set_issuing``), and every functional collective, as it returned, with its Work or outputs. No op enters Python as
it runs. ``x.copy_(y)`` of a view onto the same bytes launches nothing and is no access.

On host memory (the virtual model) the current stream is the model's, set per thread (``set_stream``); the capture
is per thread, on the threads a dispatch mode would see (``observe``); a storage first seen by a record is held by it
until drained, and a watched storage's free is queued in order (``mark_free``), so an address handed out again before a
drain is never taken for the old storage; the arguments of ops whose host sync depends on them come along.

The C++ is ``capture.cpp`` and ``kernel_entry.cpp`` beside this module, shipped as package data and built on first use
with torch's C++ extension loader (a compiler is needed; about a minute, cached), saying so on stderr. The same module
holds the happens-before core in C++ (``hb_core.cpp``, submodule ``hb``; ``hb_native``), and the capture feeds it
without Python per op (``Feed``: the tracker's ``_apply_captured`` in C++, over the tracker's own tables; Python is
entered for host syncs, races and notes, and on host memory to watch the storages first seen).

``gpu_trace.cpp`` (``load_trace``, a module of its own) is the GPU trace's interpreter in C++ for the cuda model: it
keeps the allocator's frees, event records and waits, and the events nobody needs out of Python
(``models.cuda.native_trace``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.resources
import os
import re
import time

from .. import env

_extension = None
_failure: str | None = None


def load():
    """The compiled extension, or None with `failure()` saying why (no compiler, a torch without the headers)."""
    global _extension, _failure
    if _extension is None and _failure is None:
        if os.environ.get(env.NATIVE) == "0":  # deliberate (tests of the fallback): no warning
            _failure = f"{env.NATIVE}=0"
            return None
        try:
            _extension = _build("streamrace_capture", sources())
            from . import frames

            frames.use_capture(_extension)
        except Exception as exc:  # a failed build must leave the slower dispatch mode working, and say why
            _failure = _why(exc)
            import warnings

            try:
                warnings.warn(f"streamrace: the C++ op capture and core did not build ({_failure}); tracking "
                              "ops with the slower dispatch mode and the pure-Python happens-before core",
                              RuntimeWarning, stacklevel=2)
            except Warning:  # warnings made errors (-W error): the fallback must still run, every backend loads this
                pass
    if _extension is not None and _reported_in != os.getpid():  # again in a forked rank: its own output
        _report_fatal_signals(_extension)
    return _extension


_reported_in = 0  # the process whose output a fatal signal's native stack goes to


def _report_fatal_signals(extension) -> None:
    """A fatal signal's native stack (``fatal_signals.cpp``), in front of faulthandler's Python stacks: into the
    rank's output where the launcher names it (pytest's capture holds fd 2 while a test runs), else stderr."""
    path = os.environ.get(env.CRASH_OUTPUT)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC) if path else 2
    except OSError:
        fd = 2
    global _reported_in
    _reported_in = os.getpid()
    extension.report_fatal_signals(fd)


_trace = None
_trace_failure: str | None = None


def load_trace():
    """The GPU trace's interpreter in C++ (``gpu_trace.cpp``), or None with `trace_failure()` saying why. Built apart
    from the capture: its stubs are generated from torch's header, and a torch whose header they do not fit must still
    get the capture (the cuda model then keeps the trace's Python shortcut)."""
    global _trace, _trace_failure
    if _trace is None and _trace_failure is None:
        if load() is None:
            _trace_failure = "the capture did not build"
            return None
        try:
            from torch.utils.cpp_extension import include_paths

            header = os.path.join(include_paths()[0], "c10", "core", "impl", "PyInterpreter.h")
            with open(header, encoding="utf-8") as f:
                stubs = interpreter_stubs(f.read())
            code = importlib.resources.files(__package__).joinpath("gpu_trace.cpp").read_text(encoding="utf-8")
            _trace = _build("streamrace_trace", [code.replace("// STUBS", stubs)])
        except Exception as exc:
            _trace_failure = _why(exc)
    return _trace


def trace_failure() -> str | None:
    return _trace_failure


_VIRTUAL = re.compile(r"virtual (?P<returns>.+?)\b(?P<name>\w+)\((?P<params>.*)\) const = 0")


def interpreter_stubs(header: str) -> str:
    """Overrides of ``PyInterpreterVTable``'s pure virtual methods other than the GPU trace's, read from torch's
    header (their set changes between versions): each throws, as the trace's interpreter is asked only for those."""
    start = header.index("struct C10_API PyInterpreterVTable")
    body = header[header.index("{", start) + 1:header.index("\n};", start)]
    body = re.sub(r"//[^\n]*", "", body)
    stubs = []
    for declaration in body.split(";"):
        found = _VIRTUAL.fullmatch(" ".join(declaration.split()))
        if found is not None and not found["name"].startswith("trace_gpu_"):
            stubs.append(f'  {found["returns"]}{found["name"]}({found["params"]}) const override '
                         f'{{ unreachable("{found["name"]}"); }}')
    if not stubs:
        raise RuntimeError("no PyInterpreterVTable methods found in torch's header")
    return "\n".join(stubs)


_CFLAGS = ["-O2", "-DNDEBUG"]


def _build(prefix: str, code: list[str]):
    """One build per source, flags and torch installation (compiled against its headers and ABI): checkouts with other
    sources, and venvs with the same torch version (tox envs, a CI clone beside a checkout), share the extensions
    folder without rebuilding each other's in turn, a minute each time."""
    _ninja_on_path()
    # NDEBUG, as torch's release build is compiled: otherwise its headers give classes debug-only members
    # (RecordFunction's), whose layout would not match the library's, and debug-only code to inline dispatcher calls.
    import torch

    source = "\n".join(code)
    name, directory = _where(prefix, source, torch)
    path = os.path.join(directory, "main.cpp")
    # written only when it differs, so that ninja finds the build up to date; not load_inline, which puts
    # torch/extension.h (torch's whole C++ API: most of a minute's compiling) in front of every source
    try:
        with open(path, encoding="utf-8") as f:
            same = f.read() == source
    except OSError:
        same = False
    if not same:
        with open(path, "w", encoding="utf-8") as f:
            f.write(source)
    elif _built_here(name, directory, _advisory_lock(torch.__version__)):
        return _import(name, os.path.join(directory, f"{name}.so"))
    from torch.utils.cpp_extension import load

    if not _advisory_lock(torch.__version__):
        _clear_stale_lock(directory)
    _say_building(prefix, torch.__version__, directory)
    return load(name, [path], extra_cflags=_CFLAGS, build_directory=directory)


def _say_building(prefix: str, version: str, directory: str) -> None:
    """One line on stderr before a build: otherwise a first pytest session with this torch sits silent for a minute."""
    import sys

    what = "C++ op capture and happens-before core" if prefix == "streamrace_capture" else "GPU trace interpreter"
    try:
        print(f"streamrace: compiling its {what} for torch {version} (first use; about a minute, once: cached in "
              f"{directory})", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # a closed or broken stderr must not stop the build
        pass


_STALE_LOCK_S = 600  # a build takes one to three minutes on a loaded 2-core machine


def _clear_stale_lock(directory: str) -> None:
    """cpp_extension waits, without end, for the `lock` of a build that was killed (SIGTERM, SIGKILL, a CI timeout):
    every later session would hang at its start. So the wait is here: for a build under way until its lock goes, and
    a lock that outlives any build is removed (one left by a build killed a minute ago included)."""
    lock = os.path.join(directory, "lock")
    while True:
        try:
            age = time.time() - os.path.getmtime(lock)
        except OSError:
            return  # no lock: no build under way
        if age > _STALE_LOCK_S:
            with contextlib.suppress(OSError):
                os.remove(lock)
            return
        time.sleep(min(0.5, _STALE_LOCK_S - age + 0.01))


def _where(prefix: str, source: str, torch) -> tuple[str, str]:
    """The module's name and build folder: one per source, flags and torch installation."""
    headers = os.path.join(os.path.dirname(torch.__file__), "include")
    digest = hashlib.sha1(repr((source, _CFLAGS, headers)).encode()).hexdigest()[:10]
    name = f"{prefix}_{re.sub(r'[^0-9A-Za-z]', '_', torch.__version__)}_{digest}"
    return name, _build_directory(name, torch)


def _built_here(name: str, directory: str, advisory: bool = False) -> bool:
    """Whether the build folder (one per source, flags and torch installation) holds a finished build: then the module
    is imported as it is, without cpp_extension's per-process checks (ninja and the compiler run again, 0.2 s of every
    session's start). Nobody is building it now: no `lock`, or where cpp_extension's lock is `advisory`, none held."""
    if not os.path.exists(os.path.join(directory, f"{name}.so")):
        return False
    lock = os.path.join(directory, "lock")
    if not advisory:
        return not os.path.exists(lock)
    import fcntl

    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return True  # no lock file: no build ever ran here under a lock, or it was cleared
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released as the file closes
    except OSError:
        return False  # a build under way holds it
    finally:
        os.close(fd)
    return True


def _advisory_lock(version: str) -> bool:
    """Whether cpp_extension holds its build folder's `lock` as an OS-level advisory lock (torch 2.14 on): the file then
    stays after every build, and only a lock held means a build under way (the kernel releases a killed builder's).
    Before, the file's existence meant one, and a killed build's file stayed (`_clear_stale_lock`)."""
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2]) >= (2, 14)


def _import(name: str, path: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _why(exc: Exception) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"


def _build_directory(name: str, torch) -> str:
    """torch's own cache folder for the build, found from the user's home in the password database rather than
    $HOME: test harnesses (pytester) point $HOME at a fresh folder per test, and every process there would build the
    extension again (a minute each). TORCH_EXTENSIONS_DIR, when set, is used as torch uses it."""
    import sys

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        try:
            import pwd

            home = pwd.getpwuid(os.getuid()).pw_dir
        except (ImportError, KeyError):
            home = os.path.expanduser("~")
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
        device = "cpu" if torch.version.cuda is None else f"cu{torch.version.cuda.replace('.', '')}"
        root = os.path.join(cache, "torch_extensions", f"py{sys.version_info.major}{sys.version_info.minor}_{device}")
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    return path


def _ninja_on_path() -> None:
    """torch builds with the `ninja` on PATH; a venv that was not activated has the pip package's out of sight."""
    import shutil

    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def sources() -> list[str]:
    """The extension's C++ sources (package data), in the order they are joined: the timers of the detector's own
    work that the others use (``timers.cpp``, off unless a benchmark turns them on), the happens-before core
    (``hb_core.cpp``), what differs between torch releases (``torch_compat.cpp``), the virtual model's node binding
    (``node_streams.cpp``), the native stack of a fatal signal (``fatal_signals.cpp``), the capture
    (``capture.cpp``), which uses them and whose module binds them, then the thread that applies its records beside
    the program (``applier.cpp``) and its kernel entry (``kernel_entry.cpp``), which hands it ops."""
    files = importlib.resources.files(__package__)
    return [files.joinpath(name).read_text(encoding="utf-8")
            for name in ("timers.cpp", "hb_core.cpp", "torch_compat.cpp", "node_streams.cpp", "fatal_signals.cpp",
                         "capture.cpp", "applier.cpp", "kernel_entry.cpp")]


def failure() -> str | None:
    return _failure
