"""The ``--streamrace-trace`` timeline: Chrome trace JSON (opens in Perfetto and chrome://tracing).

One process track per rank, one thread track per stream, a slice per op, and a flow arrow from the earlier to the
later access of every race — latent races (``--streamrace-latent``) in a category and colour of their own, naming
the read-back that orders them today. Time is the global launch order (a slice every TICK µs), not wall time: the
detector reasons about order, and equal-width slices that never overlap keep each track well nested.
Each rank builds its own events (``trace_events``) and ships them as JSON; ``chrome_trace`` merges them.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Iterable, Sequence

from ..detector.hb import Op, Race
from .record import short_path

TICK = 10  # µs between consecutive launches
LATENT_COLOUR = "yellow"  # a Chrome trace reserved colour name: latent races' flows and their read-backs
DUR = 8  # µs per slice, < TICK so slices on a track never touch


def _ts(op: Op) -> int:
    return op.seq * TICK


def trace_events(timeline: Sequence[Op], races: Iterable[Race], stream_name: Callable[[object], str] = str,
                 rank: int | None = None, statuses: Sequence[str] = (),
                 confirmations: dict | None = None) -> list[dict]:
    """Chrome trace events of one process: its ops (``HappensBefore(trace=True).timeline``) and its races.
    `statuses`: each race's status (``policy``); races not "new" are marked with theirs."""
    pid = rank if rank is not None else 0
    events = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
               "args": {"name": f"rank {rank}" if rank is not None else "pytest"}}]
    tids: dict = {}
    slices: dict[Op, dict] = {}
    for op in timeline:
        tid = tids.get(op.stream)
        if tid is None:
            tid = tids[op.stream] = len(tids) + 1
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": stream_name(op.stream)}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                           "args": {"sort_index": tid}})
        frames = [f"{short_path(f)}:{n} ({fn})" for f, n, fn in op.site.frames]
        slices[op] = event = {
            "ph": "X", "cat": "op", "name": op.site.op, "pid": pid, "tid": tid, "ts": _ts(op), "dur": DUR,
            "args": {"location": frames[0] if frames else "<unknown>", "frames": frames,
                     "stream": stream_name(op.stream), "seq": op.seq},
        }
        events.append(event)
    for flow_id, race in enumerate(races, 1):
        first, second = slices.get(race.earlier.op), slices.get(race.later.op)
        if first is None or second is None:
            continue  # the race's ops are not in this timeline
        kind = f"latent {race.kind}" if race.latent else race.kind
        what = f"{kind} on {race.later.tensor.name or 'tensor'}"
        status = statuses[flow_id - 1] if flow_id <= len(statuses) else "new"
        mark = "" if status == "new" else f" ({status})"
        what += mark
        if race.latent:
            what += f", ordered today only by {race.hidden_by.op} at {race.hidden_by.location()}"
        confirmation = (confirmations or {}).get(race.key()) if not race.latent else None
        if confirmation:  # --streamrace-confirm's verdict, on both ends and on the arrow
            what += f"; {confirmation}"
        for end, other in ((first, second), (second, first)):
            end["args"].setdefault("races", []).append(f"{what} with {other['args']['location']}")
        common = {"cat": "latent race" if race.latent else "race", "name": kind + mark, "pid": pid, "id": flow_id}
        if confirmation:
            common["args"] = {"confirmation": confirmation}
        if race.latent:
            common["cname"] = LATENT_COLOUR
        events.append({**common, "ph": "s", "tid": first["tid"], "ts": first["ts"] + DUR // 2})
        events.append({**common, "ph": "f", "bp": "e", "tid": second["tid"], "ts": second["ts"] + DUR // 2})
    return events


def child_trace(pid, events: list) -> list:
    """A followed child's trace events, its process named after it (one more process of the session's trace)."""
    renamed = []
    for event in events:
        if event.get("name") == "process_name":
            name = event["args"]["name"]
            event = dict(event, args={"name": f"child pid {pid}" + (f", {name}" if name.startswith("rank") else "")})
        renamed.append(event)
    return renamed


def chrome_trace(event_lists: Iterable[Sequence[dict]]) -> dict:
    """One trace from several processes' events, flow ids renumbered so they stay unique."""
    merged: list[dict] = []
    next_id = 1
    for events in event_lists:
        ids: dict = {}
        for event in events:
            if event.get("ph") in ("s", "t", "f"):
                if event["id"] not in ids:
                    ids[event["id"]] = next_id
                    next_id += 1
                event = {**event, "id": ids[event["id"]]}
            merged.append(event)
    return {"traceEvents": merged, "otherData": {"generator": "pytest-streamrace", "time": "launch order"}}


def write_trace(path: str | os.PathLike, event_lists: Iterable[Sequence[dict]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(chrome_trace(event_lists), f)
        f.write("\n")

