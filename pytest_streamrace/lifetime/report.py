"""Text a person can act on: which buffer outlived its phase, how big it is, where it came from; peaks per phase."""

from __future__ import annotations

from .sites import short


def size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def violation_lines(v) -> list[str]:
    b = v.buffer
    lines = [f"  {b.name}: {size(v.nbytes)} ({b.what}) still alive at '{v.phase}' (#{v.occurrence}), "
             f"due to be released by then"]
    if b.alloc_frames:
        lines.append("      allocated at  " + short(b.alloc_frames[0]))
        lines += ["                    " + short(f) for f in b.alloc_frames[1:3]]
    lines.append("      registered at " + (short(b.registered_at[0]) if b.registered_at else "<unknown>"))
    return lines


def format_problems(violations, unreached, marked: list[str]) -> str:
    lines = []
    if violations:
        total = sum(v.nbytes for v in violations)
        lines.append(f"buffer lifetimes: {len(violations)} buffer(s), {size(total)}, outlived the phase that should "
                     f"have released them:")
        for v in violations:
            lines += violation_lines(v)
    if unreached:
        seen = ", ".join(f"'{p}'" for p in marked) or "none"
        lines.append(f"buffer lifetimes: {len(unreached)} buffer(s) were never checked — their phase never came "
                     f"(phases marked: {seen}):")
        lines += [f"  {b.name}: due by '{b.by}', registered at "
                  f"{short(b.registered_at[0]) if b.registered_at else '<unknown>'}" for b in unreached]
    return "\n".join(lines)


def format_peaks(peaks, source: str) -> str:
    rows = peaks.by_phase()
    width = max((len(p) for p in rows), default=5)
    lines = [f"peak memory per phase ({source}):"]
    lines += [f"  {phase:{width}}  {size(nbytes)}" for phase, nbytes in rows.items()]
    return "\n".join(lines)
