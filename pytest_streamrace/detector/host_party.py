"""The host as a party: host memory that a stream's copy touches, and the host's own accesses to it.

A ``non_blocking`` copy between the device and pinned host memory runs on a stream while the host goes on: the host
reading the copy's output, or rewriting its source, before it has synchronized with that stream is a race as real as
two streams'. Such storages are *host storages*: pinned memory (on the virtual backend, where every tensor is a CPU
one, what the program pinned tells host memory apart from memory standing for the device's), and on GPUs the host
side of every ``non_blocking`` copy between the device and pinned memory. An op whose tensors are host storages and no
device memory is the host's: launched on its thread's *host timeline*, one more timeline of the happens-before model,
ordered after what that thread learnt by its synchronizes and handoffs, and taught back to the thread at once (the
host did it before it issues anything else). A copy between the device and a host storage is the stream's, as on the
GPU. Code that touches no host storage pays one empty-set test per op.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

# A captured op's stream when the op is its thread's host's (capture.cpp's kHostStream): no stream's key is negative.
HOST_STREAM = -(1 << 63)

ASYNC_COPIES = frozenset({"aten::copy_", "aten::_to_copy"})


@dataclass(frozen=True)
class HostTimeline:
    """One thread's host, as a timeline of the model: a stream's key that no real or virtual stream shares."""

    ident: int
    name: str

    def __str__(self) -> str:
        return self.name


def name_of(ident: int) -> str:
    thread = threading._active.get(ident)
    if thread is None or thread is threading.main_thread():
        return "the host"
    return f"the host (thread '{thread.name}')"


def is_host(stream_name: str) -> bool:
    """Whether a stream's name is a host timeline's (a report's hint tells the host to synchronize)."""
    return stream_name.startswith("the host")


def non_blocking(name: str, args, kwargs) -> bool:
    """Whether a copy op (``ASYNC_COPIES``) was asked not to block the host."""
    if name == "aten::copy_":
        return bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    return bool(kwargs.get("non_blocking", args[1] if len(args) > 1 and isinstance(args[1], bool) else False))
