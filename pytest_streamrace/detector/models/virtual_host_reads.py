"""Copies to the host under virtual streams: ``.cpu()``, ``.tolist()``, ``.numpy(force=True)`` of a device tensor.

On a GPU each is a copy kernel on the current stream that reads the tensor, and the host waits for it (``host_sync``).
Under virtual streams the device is the CPU, so these calls run no op the dispatch mode could see; the Tensor methods
are wrapped instead, for plain tensors only (subclasses and tracing's tensors come back as plain ones, or touch no
memory).
"""

from __future__ import annotations

import functools
import threading

import torch

from ...patching import WrapPatch
from ..host_sync import METHODS, HostSync

_PLAIN = (torch.Tensor, torch.nn.Parameter)


class HostReads:
    """A patch: the METHODS of torch.Tensor, read and synchronized on the current stream."""

    def __init__(self, tracker):
        self.tracker = tracker
        self._inside = threading.local()

    def rebind(self, tracker) -> None:
        """The next session's tracker: the patches are built once per process (``session``), and read it per call."""
        self.tracker = tracker

    def read_back(self, sync: HostSync, tensor: torch.Tensor) -> None:
        tracker = self.tracker
        if not tracker.enabled or not tracker.on_device(tensor) or tracker.is_host(tensor):
            return  # a host storage's read is the host's own (host_memory.HostBufferReads)
        stream = tracker.current_stream()
        tracker.run(sync.name, stream, reads=[tensor])
        tracker.host_synced(sync, stream)

    def _wrap(self, sync: HostSync, original):
        reads = self

        inside = self._inside

        @functools.wraps(original)
        def method(tensor, *args, **kwargs):
            if getattr(inside, "call", False):  # a torch function mode calls the method again from inside it
                return original(tensor, *args, **kwargs)
            if tensor.__class__ in _PLAIN and not torch.compiler.is_compiling() and sync.applies(args, kwargs, "cpu"):
                reads.read_back(sync, tensor)
            inside.call = True
            try:
                return original(tensor, *args, **kwargs)
            finally:
                inside.call = False
        return method

    def patches(self) -> list:
        return [WrapPatch(torch.Tensor, name, functools.partial(self._wrap, sync)) for name, sync in METHODS.items()]
