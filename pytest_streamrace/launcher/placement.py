"""Which backend an item runs on, and which GPU each of its ranks gets.

GPUs are split between xdist workers (a contiguous share each) so that two workers never put ranks on one GPU;
each rank gets one GPU of its worker's share. Decided without torch (``env.visible_gpus``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .. import env


@dataclass(frozen=True)
class Placement:
    backend: str
    devices: list[int | None]  # per rank: CUDA device index, or None on gloo


class Unservable(Exception):
    """This machine (or this xdist worker's share of it) cannot run the item; the message says what is missing."""


def worker_share(gpu_count: int, environ=os.environ) -> list[int]:
    """Indices of the GPUs this pytest process may use: all of them, or its xdist worker's contiguous share."""
    try:
        worker = int(environ["PYTEST_XDIST_WORKER"].lstrip("gw"))
        workers = int(environ["PYTEST_XDIST_WORKER_COUNT"])
    except (KeyError, ValueError):
        return list(range(gpu_count))
    if workers <= 1:
        return list(range(gpu_count))
    if gpu_count < workers:  # not enough to split: workers take turns on single GPUs
        return [worker % gpu_count] if gpu_count else []
    per = gpu_count // workers
    return list(range(worker * per, (worker + 1) * per))


def place(world_size: int, backend: str | None, environ=os.environ) -> Placement:
    gpus = env.visible_gpus()
    share = worker_share(len(gpus), environ)
    if backend == "gloo" or (backend is None and len(share) < world_size):
        return Placement("gloo", [None] * world_size)
    if len(share) < world_size:
        have = f"this machine has {len(gpus)}"
        if len(share) != len(gpus):
            have += f" ({len(share)} for xdist worker {environ['PYTEST_XDIST_WORKER']})"
        raise Unservable(f"backend nccl needs {world_size} CUDA GPU{'s' if world_size != 1 else ''}, {have}")
    return Placement("nccl", share[:world_size])
