"""Where a tracked buffer came from: the race detector's allocation site when it saw the allocation, else the user
frames that registered it — the place a person would go to find who keeps the buffer alive."""

from __future__ import annotations

import os
import sys

Frame = tuple  # (filename, lineno, function)

_HERE = os.path.dirname(os.path.abspath(__file__))
_MACHINERY = (os.sep + "torch" + os.sep, os.sep + "_pytest" + os.sep, os.sep + "pluggy" + os.sep, _HERE)


def caller_frames(limit: int = 3, depth: int = 2) -> tuple[Frame, ...]:
    """The innermost `limit` frames outside torch, pytest and this package."""
    frame = sys._getframe(depth)
    out = []
    while frame is not None and len(out) < limit:
        filename = frame.f_code.co_filename
        if not (filename.startswith("<") or any(part in filename for part in _MACHINERY)):
            out.append((filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return tuple(out)


def detector_alloc_frames(storage) -> tuple[Frame, ...]:
    """The frames of the allocation the active race detector recorded for this storage; () when none is active or
    it did not see the allocation (it sees allocations made while it runs, on its device)."""
    from ..detector import session

    detector = session.active()
    return detector.allocation_frames(storage) if detector is not None else ()


def short(frame: Frame) -> str:
    filename, lineno, function = frame
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in filename:
            filename = filename.rsplit(marker, 1)[1]
            break
    else:
        try:
            filename = os.path.relpath(filename)
        except ValueError:
            pass
        if filename.startswith(".." + os.sep + ".."):
            filename = os.path.basename(filename)
    return f"{filename}:{lineno} in {function}"
