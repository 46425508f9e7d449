"""Side streams with labels: the names bindings, delay schedules and reports use for streams.

A label ("side 0") is stable across runs and backends, unlike a stream's handle or creation line; under a detector
the stream is also named after it, so race reports and binding records speak the same language.
"""

from __future__ import annotations

import weakref

import torch

DEFAULT = "default"

_virtual_labels: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # virtual stream -> label
_cuda_labels: dict[int, str] = {}  # cudaStream_t -> label (pooled handles come back: the newest label wins)
_order: list = []  # weak references to labelled streams, in creation order (one small ref per stream ever made)


def require_streams(what: str) -> None:
    """Fail clearly where no stream API exists: no GPU and no virtual backend active."""
    from ..detector import session

    if session.active() is None and not torch.cuda.is_available():
        raise RuntimeError(f"streamrace: {what} needs CUDA streams: run on a GPU, or on CPU with --streamrace "
                           "(virtual backend)")


def _is_virtual(stream) -> bool:
    from ..detector.session import Detector

    return Detector.is_virtual(stream)


def set_label(stream, label: str) -> None:
    if _is_virtual(stream):
        _virtual_labels[stream] = label
    else:
        _cuda_labels[stream.cuda_stream] = label


def new_stream(label: str):
    """A fresh torch.cuda.Stream known by `label` (and named so in the active detector's reports)."""
    stream = torch.cuda.Stream()
    set_label(stream, label)
    _order.append(weakref.ref(stream))
    from ..detector import session

    detector = session.active()
    if detector is not None:
        detector.name_stream(stream, f"{label} (streamrace forcing)")
    return stream


def side_streams(count: int, prefix: str = "side") -> list:
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"streamrace: the number of side streams must be a positive int, got {count!r}")
    require_streams("binding to side streams")
    return [new_stream(f"{prefix} {i}") for i in range(count)]


def label(stream) -> str | None:
    """A stream's label: its forcing label, "default" for the default stream, else None."""
    found = _virtual_labels.get(stream) if _is_virtual(stream) else _cuda_labels.get(stream.cuda_stream)
    if found is not None:
        return found
    return DEFAULT if stream == torch.cuda.default_stream() else None


def mark() -> int:
    """A point in the sequence of labelled streams: `labels_alive(mark())` sees only streams created later."""
    return len(_order)


def labels_alive(since: int = 0) -> list[str]:
    """Labels of the forcing streams created since `since` and still alive, oldest first."""
    out = []
    for ref in _order[since:]:
        stream = ref()
        found = label(stream) if stream is not None else None
        if found is not None and found not in out:
            out.append(found)
    return out
