"""Race reports: text a person can act on for a failing test, and JSON for tools and for shipping races between
processes (ranks send ``to_dict`` output to the parent, which rebuilds them with ``from_dict`` and renders them).

Races rebuilt from JSON carry their streams' names as stream keys, so rendering needs no name table there.
"""

from __future__ import annotations

import json
import os
import textwrap
from typing import Callable, Iterable, Sequence

from .hb import FREE, RAW, WAR, WAW, Access, Op, Race, Site, TensorInfo

SCHEMA_VERSION = 1
FRAMES_SHOWN = 3  # user frames per access in the text report
WIDTH = 116

Ranked = tuple[int | None, Race]  # (rank or None outside distributed runs, race)
StreamName = Callable[[object], str]


# JSON


def _frames_to_json(site: Site) -> list[dict]:
    return [{"file": f, "line": n, "function": fn} for f, n, fn in site.frames]


def _tensor_to_json(t: TensorInfo) -> dict:
    return {"name": t.name, "shape": list(t.shape), "dtype": t.dtype}


def _access_to_json(access: Access, stream_name: StreamName, free: bool) -> dict:
    return {
        "op": access.op.site.op,
        "stream": stream_name(access.op.stream),
        "rw": "free" if free else ("write" if access.write else "read"),
        "start": access.start,
        "end": access.end,
        "seq": access.op.seq,
        "tensor": _tensor_to_json(access.tensor),
        "frames": _frames_to_json(access.op.site),
    }


def to_dict(race: Race, stream_name: StreamName = str, rank: int | None = None) -> dict:
    """One race as plain JSON data (stream keys replaced by their names)."""
    alloc = race.alloc_site
    return {
        "kind": race.kind,
        "rank": rank,
        "count": race.count,
        "tensor": _tensor_to_json(race.later.tensor),
        "alloc": None if alloc is None else {"op": alloc.op, "frames": _frames_to_json(alloc)},
        "earlier": _access_to_json(race.earlier, stream_name, False),
        "later": _access_to_json(race.later, stream_name, race.kind == FREE),
    }


def _site_from_json(op: str, frames: list) -> Site:
    return Site(op, tuple((str(f["file"]), int(f["line"]), str(f["function"])) for f in frames))


def _tensor_from_json(t: dict) -> TensorInfo:
    return TensorInfo(tuple(int(n) for n in t["shape"]), str(t["dtype"]), t.get("name"))


def _access_from_json(a: dict) -> Access:
    op = Op(a["stream"], 0, int(a.get("seq", 0)), _site_from_json(a["op"], a.get("frames", [])))
    return Access(op, None, int(a.get("start", 0)), int(a.get("end", 0)), a["rw"] != "read",
                  _tensor_from_json(a["tensor"]))


def from_dict(data: dict) -> Race:
    """The race ``to_dict`` described (its rank is ``data["rank"]``). Malformed data raises ValueError."""
    try:
        alloc = data.get("alloc")
        return Race(
            kind=str(data["kind"]),
            earlier=_access_from_json(data["earlier"]),
            later=_access_from_json(data["later"]),
            alloc_site=None if alloc is None else _site_from_json(alloc["op"], alloc.get("frames", [])),
            count=int(data.get("count", 1)),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"not a streamrace race record: {type(exc).__name__}: {exc}") from None


def json_document(ranked: Iterable[Ranked], stream_name: StreamName = str) -> dict:
    """The ``--streamrace-json`` document: one entry per race and rank."""
    return {"version": SCHEMA_VERSION, "races": [to_dict(race, stream_name, rank) for rank, race in ranked]}


def load_document(doc: dict) -> list[Ranked]:
    """Races of a ``json_document``; a document of another version or shape raises ValueError."""
    if not isinstance(doc, dict) or doc.get("version") != SCHEMA_VERSION or not isinstance(doc.get("races"), list):
        raise ValueError(f"not a streamrace JSON document of version {SCHEMA_VERSION}")
    return [(entry.get("rank") if isinstance(entry, dict) else None, from_dict(entry)) for entry in doc["races"]]


def write_json(path: str | os.PathLike, ranked: Iterable[Ranked], stream_name: StreamName = str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(json_document(ranked, stream_name), f, indent=1)
        f.write("\n")


# text


def short_path(path: str) -> str:
    """A file name as a reader wants it: relative to the working directory, or from site-packages on."""
    if os.path.isabs(path):
        cwd = os.getcwd() + os.sep
        if path.startswith(cwd):
            return path[len(cwd):]
        _, sep, rest = path.rpartition("site-packages" + os.sep)
        if sep:
            return rest
    return path


def _location(site: Site) -> str:
    if not site.frames:
        return "<unknown>"
    filename, lineno, _ = site.frames[0]
    return f"{short_path(filename)}:{lineno}"


def describe_tensor(t: TensorInfo) -> str:
    dtype = t.dtype.removeprefix("torch.")
    named = f"'{t.name}' " if t.name else ""
    return f"tensor {named}{dtype}[{', '.join(str(n) for n in t.shape)}]"


def _how(earlier_stream: str) -> str:
    how = "stream.wait_stream / event.wait"
    if "communication" in earlier_stream:
        how += ", or work.wait() on an async collective's work"
    return how


def _hint(race: Race, earlier: str, later: str) -> str:
    if race.kind == FREE:
        use = "write" if race.earlier.write else "read"
        return (f"the tensor was freed while '{earlier}' may still {use} it, and the caching allocator may hand its "
                f"memory to new work on '{later}' at once: call tensor.record_stream(<{earlier}>) while the tensor "
                f"is alive, or make '{later}' wait for '{earlier}' ({_how(earlier)}) before dropping the last "
                f"reference")
    access = {RAW: "read", WAR: "write", WAW: "write"}.get(race.kind, "access")
    return (f"the later access is not ordered after the earlier one: make '{later}' wait for '{earlier}' "
            f"({_how(earlier)}) before this {access}")


def format_race(race: Race, stream_name: StreamName = str, ranks: Sequence[int] = ()) -> str:
    """One race: kind, tensor, allocation site, both accesses with a few frames each, a hint, the count."""
    tensor = race.later.tensor
    alloc = f" (allocated at {_location(race.alloc_site)})" if race.alloc_site and race.alloc_site.frames else ""
    on_ranks = ""
    if ranks:
        on_ranks = f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r in ranks)}"
    lines = [f"stream race{on_ranks}: {race.kind} on {describe_tensor(tensor)}{alloc}"]
    rows = []
    for label, access in (("earlier", race.earlier), ("later", race.later)):
        free = race.kind == FREE and access is race.later
        rw = "free" if free else ("write" if access.write else "read")
        op = "" if free else access.op.site.op
        rows.append((label, rw, op, "on " + stream_name(access.op.stream), access))
    op_w = max(len(r[2]) for r in rows)
    stream_w = max(len(r[3]) for r in rows)
    for label, rw, op, stream, access in rows:
        frames = access.op.site.frames
        at = f"at {_location(access.op.site)}" + (f" ({frames[0][2]})" if frames else "")
        if free and not frames:  # the last reference went away once the test's own code had returned
            at = "at the end of the test (its last reference went away outside the test's code)"
        view = ""
        if access.tensor != tensor:
            view = f"  [{describe_tensor(access.tensor)}]"
        lines.append(f"  {label:<8} {rw:<6} {op:<{op_w}}  {stream:<{stream_w}}  {at}{view}".rstrip())
        indent = " " * (2 + 8 + 1 + 6 + 1)  # under the op column
        for filename, lineno, function in frames[1:FRAMES_SHOWN]:
            lines.append(f"{indent}from {short_path(filename)}:{lineno} ({function})")
    hint = _hint(race, stream_name(race.earlier.op.stream), stream_name(race.later.op.stream))
    lines.extend(textwrap.wrap(hint, WIDTH, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False))
    if race.count > 1:
        lines.append(f"  (seen {race.count} times)")
    return "\n".join(lines)


def merge_ranks(ranked: Iterable[Ranked]) -> list[tuple[tuple[int, ...], Race]]:
    """Races deduplicated across ranks by location pair: (ranks it was seen on, race with the summed count)."""
    merged: dict[tuple, tuple[list, Race]] = {}
    for rank, race in ranked:
        key = race.key()
        if key not in merged:
            merged[key] = ([], Race(race.kind, race.earlier, race.later, race.alloc_site, 0))
        ranks, total = merged[key]
        total.count += race.count
        if rank is not None and rank not in ranks:
            ranks.append(rank)
    result = [(tuple(sorted(ranks)), race) for ranks, race in merged.values()]
    result.sort(key=lambda item: item[0])  # stable: grouped by ranks, discovery order within a group
    return result


def format_races(ranked: Iterable[Ranked], stream_name: StreamName = str) -> str:
    """The failure text of a test: every race, merged across ranks and grouped by the ranks that saw it."""
    merged = merge_ranks(ranked)
    if not merged:
        return "no stream races"
    n = len(merged)
    head = f"{n} stream race{'s' if n > 1 else ''} (unordered cross-stream accesses; deduplicated by location pair)"
    return "\n\n".join([head] + [format_race(race, stream_name, ranks) for ranks, race in merged])
