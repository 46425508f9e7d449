"""Fork server: imports torch and pytest once, then forks each rank process from that warm state.

A rank started as a fresh ``python -m pytest`` spends ~1.5 s importing torch before the test runs, and another ~1.7 s
importing ``torch._dynamo`` once it builds an optimizer (~2.3 s more for Inductor, once it compiles); forked from
here it starts in ~0.2 s. Torch is imported before the first rank; dynamo and Inductor only once a rank has needed
them: each exiting rank says which of them it imported (a pipe every rank inherits), and the server imports those
between forks, once no rank runs, so the ranks after it start with them (Inductor on CPU builds of torch only).
Importing both up front cost every session ~4.6 s of CPU, most of whose ranks build no optimizer and compile nothing.
Forking is safe because this process never initializes CUDA and runs no Python threads (torch's OpenMP pool threads
are idle when it forks), and it imports only between forks.

Run as a script (``python forkserver.py``), not as ``-m pytest_streamrace...``: pytest warns about (and under
``-W error`` refuses) plugin modules imported before it could rewrite their asserts, so this process imports
nothing of pytest_streamrace; each rank's pytest imports the plugin fresh. (The parent imports this module
for `die_with_parent` only.) Environment variables read at import time by torch are those of the parent when the
server started; each rank gets the parent's environment as it is when the rank is forked.

Protocol, JSON lines. stdin: ``{"argv", "env", "cwd", "output"}`` — start a rank. stdout: ``{"ready": pid}``
once, ``{"pid": N}`` per request, ``{"exit": N, "status": S}`` when a rank exits (S: exit code, or -signal).
Before reaping a rank it kills the rank's process group, so nothing the rank started outlives it.
EOF on stdin, or SIGTERM (which also cuts short a warm-up import under way): kill every rank and exit at once.
"""

import ctypes
import faulthandler
import gc
import json
import os
import select
import signal
import sys

_PR_SET_PDEATHSIG = 1
# What a rank may have imported that the next ranks should find imported: dynamo (every optimizer's constructor) and
# Inductor (torch.compile; DeepSpeed's engine through its Muon module). Inductor's import initializes the CUDA driver
# (a driver thread appears, measured on an H200), so only a CPU build of torch warms it here.
_WARMABLE = ("torch._dynamo", "torch._inductor.compile_fx")
_warmed: set = set()
_needed_w = -1  # the write end of the pipe on which exiting ranks name the warmable modules they imported
_ranks: set[int] = set()  # forked and not yet reaped


def die_with_parent() -> None:
    """SIGKILL this process when the process that started it dies (even by SIGKILL)."""
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _run_rank(request: dict) -> None:
    """In the forked child: become a fresh session leader, take the rank's environment, run pytest, exit."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server's handler is not the rank's
        os.setsid()
        die_with_parent()
        out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[0] = request["cwd"]
        sys.argv = ["pytest", *request["argv"]]
        spec = json.loads(request["env"]["STREAMRACE_RANK_SPEC"])  # env.RANK_SPEC: this file imports nothing of ours
        faulthandler.register(signal.SIGUSR1, file=open(spec["stacks"], "a"), all_threads=True)
        import pytest

        code = int(pytest.main(request["argv"]))
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 70
    sys.stdout.flush()
    sys.stderr.flush()
    needed = [name for name in _WARMABLE if name in sys.modules and name not in _warmed]
    if needed:
        try:
            os.write(_needed_w, (" ".join(needed) + "\n").encode())  # one short write: atomic on a pipe
        except OSError:
            pass
    os._exit(code)


def _warm(names) -> None:
    """Import what a rank needed, between forks. Best effort: a rank that needs a module that failed here fails
    importing it, in its own test."""
    import torch

    for name in names:
        if name in _warmed or name not in _WARMABLE:
            continue
        _warmed.add(name)
        if name.startswith("torch._inductor") and torch.backends.cuda.is_built():
            continue
        try:
            __import__(name)
        except Exception:
            pass
    _freeze()


def _freeze() -> None:
    """Everything imported so far lives as long as the ranks: keep it out of their garbage collections, which
    would otherwise walk (and, touching each object, copy) all of torch's objects — pytest collects at exit."""
    gc.collect()
    gc.freeze()


def _reap() -> None:
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None:
            return
        try:
            os.killpg(info.si_pid, signal.SIGKILL)  # the rank is a zombie, so its pid cannot have been reused
        except ProcessLookupError:
            pass
        _, status = os.waitpid(info.si_pid, 0)
        _ranks.discard(info.si_pid)
        _send({"exit": info.si_pid, "status": os.waitstatus_to_exitcode(status)})


def _stop(*_) -> None:
    """Kill every rank's process group and exit, skipping the interpreter's finalization: with torch (and dynamo and
    Inductor, once warmed) imported, freeing their objects takes 0.2-1 s that the session's end would wait for."""
    for pid in _ranks:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os._exit(0)


def serve() -> None:
    signal.signal(signal.SIGTERM, _stop)
    die_with_parent()
    sys.path[0] = os.getcwd()  # as for `python -m pytest`, not this file's folder
    import pytest  # noqa: F401  the point of this process: pay for these imports once
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    global _needed_w
    needed_r, _needed_w = os.pipe()
    _freeze()
    _send({"ready": os.getpid()})
    pending = b""
    while True:
        # A warm-up waits until no rank runs: an import under way would hold back the report of a rank's exit,
        # which the parent waits for, and new ranks' requests come first.
        readable, _, _ = select.select([0] if _ranks else [0, needed_r], [], [], 0.01)
        if 0 in readable:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                _stop()
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _run_rank(request)
                _ranks.add(pid)
                _send({"pid": pid})
        elif needed_r in readable:
            _warm(os.read(needed_r, 1 << 16).decode().split())
        _reap()

if __name__ == "__main__":
    serve()
