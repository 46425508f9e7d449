"""Fork server: imports torch and pytest once, then forks each rank process from that warm state.

A rank started as a fresh ``python -m pytest`` spends ~1.5 s importing torch before the test runs, and another ~1.7 s
importing ``torch._dynamo`` once it builds an optimizer (~2.3 s more for Inductor, once it compiles); forked from
here it starts in ~0.2 s. Torch is imported before the first rank; dynamo and Inductor only once a rank has needed
them: each exiting rank says which of them it imported (a pipe every rank inherits), and the server imports those
between forks, once no rank runs, so the ranks after it start with them (Inductor on CPU builds of torch only).
Importing both up front cost every session ~4.6 s of CPU, most of whose ranks build no optimizer and compile nothing.

What a rank inherits, guaranteed: a process that never initialized CUDA and that was single-threaded when it forked.
A fork copies only the forking thread, so a lock another thread held stays held in the child forever, and CUDA (the
driver, a context, NCCL on top) does not survive a fork at all. So before every fork the server checks itself:
- CUDA: ``torch.cuda.is_initialized()`` is false, and the driver, where ``libcuda`` is loaded at all, answers
  "not initialized" (``cuDeviceGetCount`` before ``cuInit``, which initializes nothing);
- threads: ``/proc/self/task`` holds this thread only. numpy's OpenBLAS starts its pool when ``import torch`` imports
  numpy; OpenBLAS stops the pool before any fork (its own ``pthread_atfork`` handler) and the server computes nothing
  that would start it again, so the server forks a throwaway child once to let such pools stop, then counts.
A warm-up import that leaves the server unsafe (Inductor initializes the CUDA driver, which starts a thread) is undone
by re-executing the server with what it had warmed before, without that module, which the ranks then import themselves.
Anything else (a ``sitecustomize`` that starts a thread, say) and the server refuses to fork: the item fails with the
reason in one line, instead of ranks that crash or hang at random. Each rank enables ``faulthandler`` at once, so a
rank that dies of a signal (SIGSEGV in a native library) prints every Python thread's stack into its output, which the
parent shows.

Run as a script (``python forkserver.py``), not as ``-m pytest_streamrace...``: pytest warns about (and under
``-W error`` refuses) plugin modules imported before it could rewrite their asserts, so this process imports
nothing of pytest_streamrace; each rank's pytest imports the plugin fresh. (The parent imports this module
for `die_with_parent` only.) Environment variables read at import time by torch are those of the parent when the
server started; each rank gets the parent's environment as it is when the rank is forked.

Protocol, JSON lines. stdin: ``{"argv", "env", "cwd", "output"}`` — start a rank. stdout: ``{"ready": pid}``
once (again after a re-exec), ``{"pid": N}`` per request, or ``{"refused": why}`` where forking is unsafe,
``{"exit": N, "status": S}`` when a rank exits (S: exit code, or -signal).
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
import threading

_PR_SET_PDEATHSIG = 1
# What a rank may have imported that the next ranks should find imported: dynamo (every optimizer's constructor) and
# Inductor (torch.compile; DeepSpeed's engine through its Muon module). Inductor's import initializes the CUDA driver
# (a driver thread appears, measured on an H200), so only a CPU build of torch warms it here.
_WARMABLE = ("torch._dynamo", "torch._inductor.compile_fx")
_warmed: set = set()  # warmed, or not to be warmed (it left the server unsafe to fork)
# A re-executed server's state (JSON: "warm", the modules to import again; "skip", those not to; "pending", a request's
# first bytes read before the re-exec), in an environment variable of its own: no rank inherits it.
_STATE = "STREAMRACE_FORKSERVER_STATE"
_CUDA_ERROR_NOT_INITIALIZED = 3
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
        # A fatal signal's stacks into the output, through a descriptor of its own: pytest's capture redirects fd 2
        # while a test runs. pytest's faulthandler plugin, where on, takes over and gives it back at its end.
        faulthandler.enable(file=os.dup(2), all_threads=True)
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


def _warm(names, pending: bytes = b"") -> None:
    """Import what a rank needed, between forks (no rank runs). Best effort: a rank that needs a module that failed
    here fails importing it, in its own test. An import that left the server unsafe to fork is undone by
    re-executing the server without it."""
    import torch

    before = [name for name in _WARMABLE if name in _warmed and name in sys.modules]
    imported = []
    for name in names:
        if name in _warmed or name not in _WARMABLE:
            continue
        _warmed.add(name)
        if name.startswith("torch._inductor") and torch.backends.cuda.is_built():
            continue  # it initializes the CUDA driver: the re-exec below would undo it every time
        try:
            __import__(name)
            imported.append(name)
        except Exception:
            pass
    if imported and fork_hazard() is not None:
        state = {"warm": before, "skip": sorted(_warmed - set(before)), "pending": pending.decode()}
        os.environ[_STATE] = json.dumps(state)
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__)])
    _freeze()


def _threads() -> list[str]:
    """This process's other threads, by name (none where /proc cannot tell)."""
    me = str(threading.get_native_id())
    names = []
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    for tid in tids:
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass  # it ended meanwhile
    return names


def _quiesce() -> None:
    """Fork a child that exits at once: thread pools that stop themselves before a fork (OpenBLAS's) stop, and as
    this process computes nothing, stay stopped."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def _cuda_driver_initialized() -> bool:
    """Whether this process initialized the CUDA driver: asked only of a libcuda that is loaded already (RTLD_NOLOAD
    never loads it), with a call that initializes nothing (before cuInit every call returns NOT_INITIALIZED)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return False
    count = ctypes.c_int(0)
    return driver.cuDeviceGetCount(ctypes.byref(count)) != _CUDA_ERROR_NOT_INITIALIZED


def fork_hazard() -> str | None:
    """Why a rank forked from this process now could crash or hang, or None: CUDA initialized, or another thread."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "torch has initialized CUDA in it"
    if _cuda_driver_initialized():
        return "the CUDA driver is initialized in it"
    others = _threads()
    if others:
        _quiesce()
        others = _threads()
    if others:
        return f"{len(others)} thread(s) besides the forking one ({', '.join(others)})"
    return None


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
    state = json.loads(os.environ.pop(_STATE, "{}"))
    _warmed.update(state.get("skip", ()))
    for name in state.get("warm", ()):  # a re-executed server: what it had warmed safely before
        _warmed.add(name)
        try:
            __import__(name)
        except Exception:
            pass
    _freeze()
    _send({"ready": os.getpid()})
    pending = state.get("pending", "").encode()
    while True:
        # A warm-up waits until no rank runs: an import under way would hold back the report of a rank's exit,
        # which the parent waits for, and new ranks' requests come first.
        # The warm-up first where both are ready: the ranks that named a module exited before the parent, told of
        # their exit, asked for the next ranks, which must find it imported.
        readable, _, _ = select.select([0] if _ranks else [0, needed_r], [], [], 0.01)
        if needed_r in readable:
            _warm(os.read(needed_r, 1 << 16).decode().split(), pending)
        elif 0 in readable:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                _stop()
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                hazard = fork_hazard()
                if hazard is not None:
                    _send({"refused": f"forking a rank from it is unsafe: {hazard}"})
                    continue
                pid = os.fork()
                if pid == 0:
                    _run_rank(request)
                _ranks.add(pid)
                _send({"pid": pid})
        _reap()

if __name__ == "__main__":
    serve()
