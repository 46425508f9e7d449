"""Ops captured in C++ (both stream models): what the dispatch mode hands the tracker, without entering Python per op.

A TorchDispatchMode costs a launch-bound training step 1.6-1.7x before it does anything (measured on H200 hosts,
docs/gpu-validation.md). This extension registers a global RecordFunction callback instead and records, per op that
reaches a kernel below autograd (composite ops decompose first, as they do before the dispatch mode; ops nested in a
recorded op are its own business, as under the mode), the byte ranges of the storages it reads and writes, its fresh
outputs, the current stream, whether it runs inside an autograd node, and the Python stack (torch's C++ capture, named
later). Which arguments are read or written is the tracker's own plan (``tracker._plan``), asked once per op.

The tracker drains the records in order at every point where order matters (stream and event calls, frees, waits,
reading races); frees arrive as markers in the same buffer. c10d ops are handed to Python on the issuing thread, as
the dispatch mode did (their model needs the process group, the Work object and the stream of that moment), twice:
before they run, and as they return. ``x.copy_(y)`` of a view onto the same bytes launches nothing and is no access.

On host memory (the virtual model) the current stream is the model's, set per thread (``set_stream``); the callback
is per thread, on the threads a dispatch mode would see (``observe``); a storage first seen by a record is held by it
until drained, and a watched storage's free is queued in order (``mark_free``), so an address handed out again before a
drain is never taken for the old storage; the arguments of ops whose host sync depends on them come along.

The C++ is ``capture.cpp`` beside this module, shipped as package data and built on first use with torch's C++
extension loader (a compiler is needed; about 20-40 s, cached). The same module holds the happens-before core in C++
(``hb_core.cpp``, submodule ``hb``; ``hb_native``), and the capture feeds it without Python per op (``Feed``: the
tracker's ``_apply_captured`` in C++, over the tracker's own tables; Python is entered for host syncs, races and
notes, and on host memory to watch the storages first seen).
"""

from __future__ import annotations

import hashlib
import importlib.resources
import os
import re

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
            _ninja_on_path()
            # NDEBUG: torch's headers give RecordFunction debug-only members otherwise, and its layout would not
            # match the release build of torch.
            import torch
            from torch.utils.cpp_extension import load_inline

            # one build per torch version (compiled against its headers and ABI) and per source: checkouts with other
            # sources share the extensions folder without rebuilding each other's
            code = sources()
            digest = hashlib.sha1("\0".join(code).encode()).hexdigest()[:10]
            name = f"streamrace_capture_{re.sub(r'[^0-9A-Za-z]', '_', torch.__version__)}_{digest}"
            _extension = load_inline(name, code, extra_cflags=["-O2", "-DNDEBUG"],
                                     build_directory=_build_directory(name, torch))
        except Exception as exc:  # a failed build must leave the slower dispatch mode working, and say why
            _failure = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
            import warnings

            try:
                warnings.warn(f"streamrace: the C++ op capture and core did not build ({_failure}); tracking "
                              "ops with the slower dispatch mode and the pure-Python happens-before core",
                              RuntimeWarning, stacklevel=2)
            except Warning:  # warnings made errors (-W error): the fallback must still run, every backend loads this
                pass
    return _extension


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
    """The extension's C++ sources (package data), in the order they are joined: the happens-before core
    (``hb_core.cpp``), the virtual model's node binding (``node_streams.cpp``), then the capture (``capture.cpp``),
    which uses both and whose module binds them."""
    files = importlib.resources.files(__package__)
    return [files.joinpath(name).read_text(encoding="utf-8")
            for name in ("hb_core.cpp", "node_streams.cpp", "capture.cpp")]


def failure() -> str | None:
    return _failure
