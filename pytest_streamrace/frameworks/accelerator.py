"""Code that makes streams only when ``torch.accelerator.is_available()`` says so, on CPU under the virtual backend.

The virtual backend keeps ``torch.accelerator.is_available()`` False, as torch answers on a machine without a GPU,
so that code choosing a device by it keeps allocating on CPU. Some code asks it only to decide whether to make a
stream: torch DCP's ``DefaultStager`` creates its staging stream with ``torch.Stream()`` only when it answers True,
and refuses non-blocking copies otherwise; its ``StateDictStager`` pins its staging memory only where
``torch.cuda.is_available()`` says so. Inside `accelerator_available()` both answer True, so that code runs its GPU
path on the virtual streams, its pinned memory host memory (``models.host_memory``); where it allocates is unchanged
(``current_accelerator()`` keeps its answer, and the block is for constructing such objects only).
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def accelerator_available():
    """``torch.accelerator.is_available()`` answers True inside (for constructing such objects; leave it soon after).
    Needs an active Detector with the virtual backend: the streams the code then makes are the virtual ones."""
    import torch

    from ..detector.session import active
    from ..patching import patched

    detector = active()
    if detector is None or detector.backend != "virtual":
        raise RuntimeError("streamrace: accelerator_available() needs an active Detector(backend='virtual') "
                           "(enter it first, or run under --streamrace on CPU)")
    with patched(torch.accelerator, "is_available", _available), patched(torch.cuda, "is_available", _available):
        yield


def _available() -> bool:
    return True
