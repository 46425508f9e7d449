"""Which process this is, decided once per session and held as an object (as pytest-cov's controllers are).

A test session under this plugin runs in one of five roles: a plain session, an xdist controller, an xdist worker,
a rank child (one rank of a ``distributed`` item, started by the launcher), or a torchrun rank. Any of them may
also be a followed child: a process started by a test that runs under ``--streamrace``. Exactly one process of a
run writes the session's files and prints the summaries; the others ship their findings to it on their reports.

Torch-free, and below every part of the package: it reads the environment and the config (and ``env``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from . import env

SESSION, XDIST_CONTROLLER, XDIST_WORKER, RANK_CHILD, TORCHRUN_RANK = (
    "session", "xdist controller", "xdist worker", "rank child", "torchrun rank")
_role_key = pytest.StashKey["Role"]()


@dataclass(frozen=True)
class Role:
    kind: str  # one of the five above
    rank: int | None = None  # a torchrun rank's
    world_size: int | None = None  # a torchrun session's
    followed: bool = False  # started by a test running under --streamrace

    @property
    def writes_session_files(self) -> bool:
        """The process that writes ``--streamrace-json``/``--streamrace-trace`` and prints the summaries."""
        return self.kind in (SESSION, XDIST_CONTROLLER) or (self.kind == TORCHRUN_RANK and self.rank == 0)

    @property
    def speaks_for_torchrun(self) -> bool:
        """Says what stops a session: every torchrun rank stops, only rank 0 says why; other roles speak alone."""
        return self.kind != TORCHRUN_RANK or self.rank == 0


def of(config: pytest.Config) -> Role:
    """This process's role (decided at the first call, then held on the config)."""
    role = config.stash.get(_role_key, None)
    if role is None:
        role = config.stash[_role_key] = decide(config, os.environ)
    return role


def decide(config: pytest.Config, environ) -> Role:
    followed = environ.get(env.SUBPROCESS, "") not in ("", "0")
    run = env.torchrun_env(environ)
    if run is not None:
        return Role(TORCHRUN_RANK, run.rank, run.world_size, followed)
    if environ.get(env.RANK_SPEC):
        return Role(RANK_CHILD, followed=followed)
    if hasattr(config, "workerinput"):
        return Role(XDIST_WORKER, followed=followed)
    option = config.option  # read before xdist's own pytest_cmdline_main turns -n N into --dist load
    if getattr(option, "numprocesses", None) or getattr(option, "tx", None) or getattr(option, "dist", "no") != "no":
        return Role(XDIST_CONTROLLER, followed=followed)
    return Role(SESSION, followed=followed)

