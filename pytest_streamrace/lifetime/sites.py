"""Where a tracked buffer came from: the race detector's allocation site when it saw the allocation, else the user
frames that registered it — the place a person would go to find who keeps the buffer alive."""

from __future__ import annotations

from ..races.record import location

Frame = tuple  # (filename, lineno, function)


def caller_frames(limit: int = 3) -> tuple[Frame, ...]:
    """The innermost `limit` frames outside torch, pytest and this package (the detector's user frames)."""
    from ..detector.frames import user_frames  # torch: only once a buffer is tracked

    return user_frames(limit=limit, depth=3)


def detector_alloc_frames(storage) -> tuple[Frame, ...]:
    """The frames of the allocation the active race detector recorded for this storage; () when none is active or
    it did not see the allocation (it sees allocations made while it runs, on its device)."""
    from ..detector import session

    detector = session.active()
    return detector.allocation_frames(storage) if detector is not None else ()


def short(frame: Frame) -> str:
    return f"{location((frame,))} in {frame[2]}"
