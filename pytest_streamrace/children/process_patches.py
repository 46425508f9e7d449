"""The process-level patches a followed child puts in place, one function each (as coverage.py's ``patch.py``).

A child judges captured ops in batches, so it must drain its detector at the last moments its work is visible:

- ``exit_runs_first``: ``os._exit`` skips ``atexit``; a worker that ends this way still drains and writes its trace.
- ``queue_put_runs_first``: ``multiprocessing.queues.SimpleQueue.put`` is how a pool worker hands a task's result
  back; the next task may be another test's, so the races are judged before it.
- ``destroy_process_group_runs_first``: after ``torch.distributed.destroy_process_group`` the rank is gone, and the
  races must name it.

They stay for the process's life (the process is a child of a test, and ends with it). Each replacement is
marked (``MARK``, with ``__wrapped__`` naming the original), so patching twice — a forked child, a second import
hook — is a no-op. Nothing here imports anything: the child's start-up hook may run it before torch.
"""

from __future__ import annotations

import os

MARK = "_streamrace"  # attribute set on each replacement: this function is ours


def _ours(function) -> bool:
    return getattr(function, MARK, False)


def _mark(replacement, original):
    setattr(replacement, MARK, True)
    replacement.__wrapped__ = original
    return replacement


def exit_runs_first(before) -> None:
    """``os._exit(status)`` calls ``before()`` first."""
    original = os._exit
    if _ours(original):
        return

    def _exit(status):
        before()
        original(status)

    os._exit = _mark(_exit, original)


def queue_put_runs_first(queues_module, before) -> None:
    """``SimpleQueue.put`` (of the given ``multiprocessing.queues`` module) calls ``before()`` first."""
    simple = getattr(queues_module, "SimpleQueue", None)
    if simple is None or _ours(simple.put):
        return
    original = simple.put

    def put(self, obj):
        before()
        return original(self, obj)

    simple.put = _mark(put, original)


def destroy_process_group_runs_first(dist_module, before) -> None:
    """``torch.distributed.destroy_process_group`` (of the given module) calls ``before()`` first."""
    original = getattr(dist_module, "destroy_process_group", None)
    if original is None or _ours(original):
        return

    def destroy_process_group(*args, **kwargs):
        before()
        return original(*args, **kwargs)

    dist_module.destroy_process_group = _mark(destroy_process_group, original)
