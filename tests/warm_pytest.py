"""Test support: pytester's ``python -m pytest`` sessions forked from a process that has imported torch.

The suite starts about a hundred inner pytest sessions, and each would spend 1.5-2.5 s of CPU importing torch before
its first line of pytest ran: on a 2-core CI machine, a fifth of the suite. Here each xdist worker keeps one server
(this file, run as a script) that imports torch and pytest once and forks a session per request. From pytest's entry
point on, a forked session is the session a user starts: the same argv, environment, working directory, ``sys.path``
and standard streams, a process of its own that exits through the interpreter's shutdown (threads joined, atexit
handlers run, streams flushed; not its last step, freeing every object: `_shut_down`); the plugin, xdist
and every other pytest plugin are imported fresh in it (the server imports none of them), and so are dynamo and
Inductor. What differs: torch was imported under the server's environment (torch's import-time settings, and
OpenMP's thread count, follow the environment the server started with), the session's parent is the server, and
``/proc/<pid>/environ`` shows the server's environment.

A test whose subject is what a fresh interpreter does (what loading the plugin imports) is marked ``cold_start``;
``STREAMRACE_TESTS_COLD=1`` starts every session cold. Processes the sessions start (ranks' fork servers, xdist
workers, torchrun, ``subprocess`` children) are started by the code under test, as always.

Protocol, over a socket pair: the client sends a JSON request ``{"argv", "env", "cwd"}`` with the session's stdin,
stdout and stderr as passed file descriptors; the server answers ``{"pid": N}``, then ``{"status": S}`` when that
session exits (exit code, or -signal). The server serves one session at a time and exits when the client's end closes.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys

COLD = os.environ.get("STREAMRACE_TESTS_COLD") == "1"
_MAX = 1 << 20
_WORKER_ENV = dict(os.environ)  # the server's, as the worker started: not a test's monkeypatched one


def _recv_line(sock: socket.socket, fds: int = 0):
    """One JSON message (and `fds` passed descriptors); None at EOF."""
    if fds:
        data, got, _, _ = socket.recv_fds(sock, _MAX, fds)
    else:
        data, got = sock.recv(_MAX), []
    if not data:
        return None, got
    return json.loads(data), got


# -- client (in the xdist worker) ------------------------------------------------------------------------------------

class WarmSession:
    """The part of `subprocess.Popen` that `Pytester.run` uses, for a session the server forked."""

    stdin = None

    def __init__(self, server: "Server", pid: int):
        self._server, self.pid, self.returncode = server, pid, None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._server.sock.settimeout(timeout)
            try:
                message, _ = _recv_line(self._server.sock)
            except socket.timeout:
                raise subprocess.TimeoutExpired("pytest (forked)", timeout) from None
            finally:
                self._server.sock.settimeout(None)
            if message is None:
                raise RuntimeError("the warm pytest server exited while a session ran")
            self.returncode = message["status"]
        return self.returncode

    def poll(self):
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Server:
    """One per xdist worker, started with its first pytest session; it exits when this process closes its end."""

    def __init__(self):
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # one message per send
        env = {k: v for k, v in _WORKER_ENV.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen([sys.executable, __file__, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                     env=env, cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        theirs.close()

    def start(self, argv: list[str], env: dict, stdin, stdout, stderr) -> WarmSession:
        streams = [s if isinstance(s, int) else s.fileno() for s in (stdin, stdout, stderr)]
        request = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd()}).encode()
        socket.send_fds(self.sock, [request], streams)
        message, _ = _recv_line(self.sock)
        if message is None:
            raise RuntimeError(f"the warm pytest server (pid {self.proc.pid}) exited; its stderr is the worker's")
        return WarmSession(self, message["pid"])


_server: Server | None = None


def popen_for(pytester):
    """A replacement for `pytester.popen` that forks ``python -m pytest`` sessions from the server."""
    original = pytester.popen

    def popen(cmdargs, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=pytester.CLOSE_STDIN, **kw):
        args = [os.fspath(a) for a in cmdargs]
        if args[:2] != [sys.executable, "-mpytest"] or kw or stdin is not pytester.CLOSE_STDIN \
                or not hasattr(stdout, "fileno") or not hasattr(stderr, "fileno"):
            return original(cmdargs, stdout=stdout, stderr=stderr, stdin=stdin, **kw)
        global _server
        if _server is None or _server.proc.poll() is not None:
            _server = Server()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH", "")]))
        stdout.flush()
        stderr.flush()
        with open(os.devnull, "rb") as null:
            return _server.start(args[2:], env, null, stdout, stderr)

    return popen


# -- server ----------------------------------------------------------------------------------------------------------

def _serve(sock: socket.socket):
    """Answer requests until EOF; returns (request, streams) only in a forked child."""
    while True:
        request, streams = _recv_line(sock, fds=3)
        if request is None:
            os._exit(0)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            return request, streams
        for fd in streams:
            os.close(fd)
        sock.sendall(json.dumps({"pid": pid}).encode())
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        sock.sendall(json.dumps({"status": code}).encode())


def _become(request: dict, streams: list[int], base_path: list[str]) -> None:
    """In the forked child: take the session's streams, directory, environment and path."""
    for target, fd in enumerate(streams):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [request["cwd"], *extra, *base_path]  # as `python -m` builds it: the directory, PYTHONPATH, site
    import tempfile

    tempfile.tempdir = None  # gettempdir() caches TMPDIR as it was when first called
    sys.argv = ["-m", *request["argv"]]


def _main() -> None:
    import runpy

    sock = socket.socket(fileno=int(sys.argv[1]))
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the worker
    import pytest  # noqa: F401  (pytest itself, not its plugins: those load in each session)
    import torch  # noqa: F401

    base_path = sys.path[1:]  # without this file's folder
    gc.collect()
    gc.freeze()
    request, streams = _serve(sock)
    sock.close()
    _become(request, streams, base_path)
    try:
        runpy.run_module("pytest", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        code = _exit_code(exit_.code)
    _shut_down(code)


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _shut_down(code: int) -> None:
    """The interpreter's shutdown (non-daemon threads joined, atexit handlers, streams flushed) less its last step,
    freeing every object: with torch imported that takes 0.2-0.6 s, a third of a small session."""
    import atexit
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    _main()
