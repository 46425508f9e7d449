"""Where the autograd engine's accesses come from: the forward op that created the node running them.

On a GPU the engine runs backward nodes on its own device threads, in C++, with no frame of the program's on the
stack, so a race on a gradient would read ``aten::sum on ... at <unknown>``. Anomaly mode answers that by storing a
stack per node as it is created, at a cost per op. Here nothing extra is taken: the forward op's site is captured
anyway, and autograd numbers each node with a sequence number the node keeps (what the profiler links forward and
backward by). The C++ capture reads the number off the forward op's record; the dispatch mode, below autograd, sees the
number move on at the op whose autograd kernel just created a node. A backward access without frames of its own takes
the forward op's, named as the backward of that node.
"""

from __future__ import annotations

from itertools import islice

from .frames import Captured, LibraryFrame, thread_origin
from .hb import Site


class ForwardSites:
    """Forward ops' sites by autograd sequence number, bounded (nodes older than `limit` newer ones are forgotten:
    their accesses keep ``<unknown>``). The bound is what keeps a long test's memory flat: one entry holds a captured
    stack (about 1 KB), so 16,384 of them cap the table near 16 MB, and a graph of up to that many nodes between a
    node's forward and its backward still has every backward access named (benchmarks/memory.py)."""

    def __init__(self, limit: int = 1 << 14):
        self._sites: dict[int, Site] = {}
        self._limit = limit

    def forward(self, seq: int, site: Site) -> None:
        """Node `seq` was created by the forward op at `site` (a later call for the same number replaces it: in the
        capture, ops that create no node carry the number the next node will get, so the last one is the creator)."""
        sites = self._sites
        sites[seq] = site
        if len(sites) > self._limit:
            for old in list(islice(sites, self._limit // 4)):
                del sites[old]

    def backward(self, frames, seq: int, node: str | None):
        """The frames of an access made inside node `node` (number `seq`): its own user frames, or else the forward
        op's, lazily (named when read)."""
        return _InBackward(frames, self._sites.get(seq), node or "a backward node")


def site_of(op: str, stack, forward: Site | None, node: str | None, thread: int = 0, ordinal: int = 0,
            origin=None) -> Site:
    """The Site of an op the C++ feed applied (capture.cpp), made when a report or a trace first reads it: `stack` is
    the capture's (None: no frames), and inside an autograd node (`node`) the forward op's site names it as
    `ForwardSites.backward` does; `thread`: the recording thread's ident; `origin`: its ThreadOrigin as the op was
    applied, where the session follows it (by now the thread may have ended, its ident another thread's)."""
    frames = Captured(stack) if stack is not None else ()
    named = origin if origin is not None else thread_origin(thread)
    if node is None:
        return Site(op, frames, named, ordinal)
    return Site(op, _InBackward(frames, forward, node), named, ordinal)


class _InBackward:
    __slots__ = ("own", "forward", "node")

    def __init__(self, own, forward: Site | None, node: str):
        self.own, self.forward, self.node = own, forward, node

    def resolve(self, limit: int = 5) -> tuple[tuple[str, int, str], ...]:
        own = self.own
        frames = own.resolve() if hasattr(own, "resolve") else own
        if (frames and not isinstance(frames, LibraryFrame)) or self.forward is None or not self.forward.frames:
            return tuple(frames)
        (filename, lineno, function), *rest = self.forward.frames
        return ((filename, lineno, f"backward of {self.node}, created by {self.forward.op} in {function}"),
                *rest)[:limit]
