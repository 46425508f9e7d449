"""NCCL's configuration files, read into a process's environment before it starts any thread.

At its first communicator, NCCL reads ``NCCL_CONF_FILE`` (else ``~/.nccl.conf``), then ``/etc/nccl.conf``, and calls
``setenv(name, value, 0)`` for each line's variable. Adding a variable can move glibc's environment array while
another thread walks it without a lock, and in torch 2.11 ProcessGroupNCCL's heartbeat monitor does, in ``getenv``, as
it starts: the rank dies of SIGSEGV (PyTorch #133744, PyTorch #167517). With every variable of those files set before
the process starts, NCCL's setenv finds each one present and changes nothing; the values are the ones NCCL would set,
so nothing else changes. Processes this project starts (ranks, ``streamrace run`` programs) and a session under
``--streamrace`` get them."""

from __future__ import annotations

import os

SYSTEM = "/etc/nccl.conf"


def files(environ) -> list[str]:
    """The files NCCL reads, in its order: ``NCCL_CONF_FILE`` or the user's ``~/.nccl.conf``, then the system's."""
    own = environ.get("NCCL_CONF_FILE")
    if own:
        return [own, SYSTEM]
    try:
        import pwd

        home = pwd.getpwuid(os.getuid()).pw_dir  # NCCL asks the password database, not $HOME
    except (ImportError, KeyError):
        return [SYSTEM]
    return [os.path.join(home, ".nccl.conf"), SYSTEM]


def variables(environ, paths: list[str] | None = None) -> dict[str, str]:
    """What NCCL's configuration files would add to `environ`: ``NAME=value`` lines (not ``#`` comments), names not
    set yet, the first file to name one winning, as NCCL's ``setenv(..., 0)`` does."""
    out: dict[str, str] = {}
    for path in files(environ) if paths is None else paths:
        try:
            with open(path, encoding="utf-8", errors="surrogateescape") as f:
                lines = f.read().split("\n")
        except OSError:
            continue
        for line in lines:
            name, sep, value = line.partition("=")
            name, value = name[:1023], value[:1023]
            if sep and name and not name.startswith("#") and name not in environ and name not in out:
                out[name] = value
    return out


def preset(environ: dict) -> dict:
    """`environ` with NCCL's configuration files' variables added (those it does not set already)."""
    return {**variables(environ), **environ}
