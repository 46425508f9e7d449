"""The children's start-up hook: a ``.pth`` file that lives in site-packages only while a session runs.

Written the way coverage.py's ``patch = subprocess`` writes its own: one file per pytest process
(``pytest-streamrace-<pid>.pth``), removed when the session ends, and at interpreter exit as a fallback (Ctrl-C, a
session that never started). A session killed outright cannot remove its file, so each session holds an exclusive
``flock`` on its own file while it lives, and sweeps the files nobody holds (pids are not unique across containers
that share a venv; locks are). The one line checks the environment variable and costs nothing otherwise.

Not shipped in the wheel: setuptools installs no top-level ``.pth`` from a wheel nor from an editable install
without custom commands, and pytest-cov, which did, has dropped it for coverage.py's way.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import sysconfig
import tempfile
import time

from .. import env

PREFIX = "pytest-streamrace-"
LEGACY = "pytest-streamrace-subprocess.pth"  # earlier versions wrote it once and left it forever
LINE = ("import os; exec('try:\\n from pytest_streamrace.children.child import start; start()\\nexcept Exception: "
        f"pass') if os.environ.get({env.SUBPROCESS!r}, '0') not in ('', '0') else None\n")


class StartupHook:
    """This process's ``.pth`` file: `install` it, `remove` it (both never raise)."""

    def __init__(self, folder: str | None = None):
        self.folder = folder or sysconfig.get_paths()["purelib"]
        self.path: str | None = None
        self._fd: int | None = None

    def install(self) -> str | None:
        """Write the file; None, or why it could not be (children started by exec are then not followed)."""
        if self.path is not None:
            return None
        sweep(self.folder)
        path = os.path.join(self.folder, f"{PREFIX}{os.getpid()}.pth")
        try:
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{PREFIX}", suffix=".tmp")
        except OSError as exc:
            return f"cannot write into {self.folder} ({exc.strerror or exc})"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held before the file has its name: a sweeper never sees it free
            os.write(fd, LINE.encode())
            os.fchmod(fd, 0o644)
            os.replace(tmp, path)
        except OSError as exc:
            os.close(fd)
            _unlink(tmp)
            return f"cannot write {path} ({exc.strerror or exc})"
        self.path, self._fd = path, fd
        atexit.register(self.remove)
        return None

    def remove(self) -> None:
        if self.path is None:
            return
        if self._owner == os.getpid():
            _unlink(self.path)
        os.close(self._fd)
        self.path = self._fd = None

    @property
    def _owner(self) -> int:
        return int(os.path.basename(self.path)[len(PREFIX):-len(".pth")])


def sweep(folder: str) -> None:
    """Remove hook files no live session holds (sessions that were killed), and the legacy one."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        path = os.path.join(folder, name)
        if name == LEGACY:
            _unlink(path)
        elif name.startswith(PREFIX) and name.endswith(".pth") and not held(path):
            _unlink(path)
        elif name.startswith(f".{PREFIX}") and name.endswith(".tmp") and _age(path) > 60 and not held(path):
            _unlink(path)  # a session killed while writing (a younger one may be between create and lock)


def held(path: str) -> bool:
    """Whether a live process holds this hook file's lock."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return True  # gone already, or not ours to judge
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def _age(path: str) -> float:
    try:
        return time.time() - os.stat(path).st_mtime
    except OSError:
        return 0.0


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
