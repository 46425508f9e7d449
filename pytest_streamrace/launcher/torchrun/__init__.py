"""pytest sessions launched by torchrun: every rank runs the same session in lockstep, outcomes are collective.

``torchrun --nproc_per_node N -m pytest ...`` starts N pytest processes (how Megatron runs its unit tests). Left
alone they disagree: a test failing on rank 1 passes on rank 0, which prints; a skip on some ranks leaves the
others blocked in a collective; a hang blocks every rank for the collective timeout. This module makes the N
sessions behave as one:

Process group
    Initialized once at session start from the torchrun environment (``env://``): nccl with
    ``cuda.set_device(LOCAL_RANK)`` when CUDA has a GPU for every local rank, else gloo. A group the user's code
    initialized earlier (``conftest.py`` ``pytest_configure``/``pytest_sessionstart``) is joined, not replaced.
    Only a group created here is destroyed at session end, and only when no rank went missing.

``distributed`` tests
    Run in-process on every rank (no nested spawning). ``world_size=`` other than the torchrun world size, or a
    ``backend=`` other than the session's, skips the test on every rank with a reason naming both.

Collective outcomes
    After each item (all its phases ran locally) every rank posts a summary of its reports to the torchrun store
    (a ``PrefixStore`` on the default group's store; store ops time out, collectives could hang) under the item's
    running number, and reads every other rank's. Per phase: all ranks agree → the local report stands; any rank
    failed → the phase fails on every rank and the report shows each failing rank's own traceback under
    "rank N"; outcomes differ otherwise (e.g. a skip on some ranks) → the phase fails naming each rank's outcome
    and skip reason. Exit codes therefore agree across ranks. The teardown report's ``user_properties`` whose
    keys start with ``streamrace_`` (races, traces, hints: every phase's) travel with the summary and are appended to
    the other ranks' teardown reports, so rank 0 reads every rank's as its own. After collection the ranks
    compare their ordered test ids (and collection errors); a difference stops every rank before the first test
    (a shuffling plugin with per-rank seeds, or a file that fails to import on one rank, would otherwise
    desynchronize them).

Output
    Only rank 0 prints: the terminal reporter of the other ranks writes to a closed gate. Their failures reach
    rank 0 through the exchange. Only rank 0 writes ``--junitxml`` and ``.pytest_cache`` (the others still read
    the cache, so ``--lf`` selects alike everywhere). If rank 0 itself went missing, the lowest rank that noticed
    opens its gate and prints the rest of its session (the failure and the summary). An INTERNALERROR opens the
    gate of its rank.

Hangs and crashes
    An item's timeout T is the ``distributed`` marker's ``timeout=``, else ``--streamrace-timeout`` (ini
    ``streamrace_timeout``), else 300 s; G = 5 s is the grace. Times count from the item's start on each rank.
    - At T, a rank still running the item dumps its Python stacks (faulthandler, all threads) into the store.
    - A rank waiting in the exchange stops waiting when every missing rank posted its stack, or at T + G. The
      item fails with "rank K did not report within T s" and that rank's stack if it posted one, and the session
      stops (``session.shouldstop``): the rank exits non-zero and torchrun stops every other rank.
    - Every rank stuck in the item (e.g. all blocked in one collective): at T + G rank 0 writes the stacks of
      every rank to its terminal and exits with status 1 (the session summary is lost); the other ranks exit at
      T + 2G unless torchrun stopped them first.
    - A rank that crashes makes torchrun stop the others at once (SIGTERM; no handler is installed so that a rank
      blocked in C code dies at once); torchrun's own error summary names the rank and its exit code or signal.

Not combinable with pytest-xdist (``-n``): a clear usage error says so.

Modules: ``plugin`` (the rank's pytest plugin), ``exchange`` (store posts and gathers), ``verdict`` (the collective
outcome of a phase), ``watch`` (the output gate, the hang watchdog).
"""

from __future__ import annotations

from .plugin import install, leave_files_to_rank_0

__all__ = ["install", "leave_files_to_rank_0"]
