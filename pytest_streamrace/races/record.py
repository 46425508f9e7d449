"""The race record (schema v1): the one shape a race has outside the detector, and everything about it.

A detector ``hb.Race`` becomes a record (``from_race``) in the process that saw it; records are plain JSON data, so
they travel in ``user_properties`` from xdist workers, rank processes, torchrun ranks and followed children to the
process that writes the session's files. Here live the record's type, its identity (``key``), the location helpers,
every ``user_properties`` key the package uses, the ``--streamrace-json`` document writer, and the text renderer
everyone calls. Records rebuilt into races (``to_race``) carry their streams' names as stream keys, so rendering
needs no name table there. Torch-free: the detector does not import this package; this package reads the detector.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from typing import Callable, Iterable, Sequence, TypedDict

if sys.version_info >= (3, 11):
    from typing import NotRequired
else:  # typing_extensions: a dependency of torch
    from typing_extensions import NotRequired

from ..detector.hb import FREE, NATIVE, RAW, WAR, WAW, Access, Op, Race, Site, TensorInfo, ThreadOrigin, identity
from ..detector.host_party import is_host

SCHEMA_VERSION = 1
FRAMES_SHOWN = 3  # user frames per access in the text report
WIDTH = 116

# user_properties keys: how each part's findings ride on a test's reports (and reach junit XML)
OUTCOME = "streamrace_outcome"  # a rank's test body's own outcome, for the parent's --streamrace-confirm
RACES = "streamrace_races"  # [records] (with rank); the teardown report carries every phase's
TRACE = "streamrace_trace"  # [chrome trace events] of this test's ops
AFTER = "streamrace_after"  # [records with "test"] of children that outlived their test
HINTS = "streamrace_hints"  # [hint dicts], on the teardown report
SCHEDULE = "streamrace_schedule"  # the forcing delay schedule a report ran under
COMPILE = "streamrace_compile"  # the forcing compile mode's summary
EVIDENCE = "streamrace_repro"  # one rank's repro evidence dict

Ranked = tuple[int | None, Race]  # (rank or None outside distributed runs, race)
StreamName = Callable[[object], str]


class FrameRecord(TypedDict):
    file: str
    line: int
    function: str


class TensorRecord(TypedDict):
    name: str | None
    shape: list[int]
    dtype: str


class ThreadRecord(TypedDict):
    name: str  # the thread's name ("ThreadPoolExecutor-0_0")
    how: str  # "started" | "work submitted": what the call at `frames` did
    frames: list[FrameRecord]
    nth: NotRequired[int]  # threads of its name the session started before it, where any did (a forced run's key)
    # a pool's submitted task: {"id": "<submitter's key>/<its submit count>", "ordinal": the op's place in the task}
    task: NotRequired[dict]


class AccessRecord(TypedDict, total=False):
    thread: ThreadRecord  # only for a thread other than the program's main one
    op: str
    stream: str
    rw: str  # "read" | "write" | "free"
    start: int
    end: int
    seq: int
    tensor: TensorRecord
    frames: list[FrameRecord]


class _Required(TypedDict):
    kind: str
    rank: int | None
    count: int
    tensor: TensorRecord
    alloc: dict | None  # {"op", "frames"}
    earlier: AccessRecord
    later: AccessRecord


class Record(_Required, total=False):
    status: str  # set by ``policy.Policy.classify``: new | suppressed | baseline | expected
    suppressed_by: dict  # {"rule": "path:line", "text": rule}
    test: str  # the nodeid, in the JSON document and on records of followed children
    pid: int  # a followed child's
    after_test: bool  # judged after its test had finished (JSON document)
    latent: dict  # a latent race's hiding sync: {"op": ".item()", "at": "file:line", "function", "frames"}


# a detector race <-> a record


def _frames_to_json(site: Site) -> list[FrameRecord]:
    return [{"file": f, "line": n, "function": fn} for f, n, fn in site.frames]


def _tensor_to_json(t: TensorInfo) -> TensorRecord:
    return {"name": t.name, "shape": list(t.shape), "dtype": t.dtype}


def _access_to_json(access: Access, stream_name: StreamName, free: bool) -> AccessRecord:
    out = _access_fields(access, stream_name, free)
    site = access.op.site
    thread = site.thread
    if thread is not None:
        out["thread"] = {"name": thread.name, "how": thread.how, "frames": _frames_to_json(thread.site)}
        if thread.nth:  # the session started threads of this name before it
            out["thread"]["nth"] = thread.nth
    if getattr(site, "ordinal", 0):  # its op's place on its thread: what a confirmation's re-run holds back
        out["ordinal"] = site.ordinal
        if thread is not None and thread.task:  # a pool's task: its op's place in the task, whichever worker runs it
            out["thread"]["task"] = {"id": thread.task, "ordinal": site.ordinal - thread.base}
    return out


def _access_fields(access: Access, stream_name: StreamName, free: bool) -> AccessRecord:
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


def from_race(race: Race, stream_name: StreamName = str, rank: int | None = None) -> Record:
    """One detector race as a record (stream keys replaced by their names)."""
    alloc = race.alloc_site
    out: Record = {
        "kind": race.kind,
        "rank": rank,
        "count": race.count,
        "tensor": _tensor_to_json(race.later.tensor),
        "alloc": None if alloc is None else {"op": alloc.op, "frames": _frames_to_json(alloc)},
        "earlier": _access_to_json(race.earlier, stream_name, False),
        "later": _access_to_json(race.later, stream_name, race.kind == FREE),
    }
    if race.latent:
        sync = race.hidden_by
        out["latent"] = {"op": sync.op, "at": location(sync.frames),
                         "function": sync.frames[0][2] if sync.frames else None, "frames": _frames_to_json(sync)}
    return out


def _site_from_json(op: str, frames: list) -> Site:
    return Site(op, tuple((str(f["file"]), int(f["line"]), str(f["function"])) for f in frames))


def _tensor_from_json(t: dict) -> TensorInfo:
    return TensorInfo(tuple(int(n) for n in t["shape"]), str(t["dtype"]), t.get("name"))


def _access_from_json(a: dict) -> Access:
    site = _site_from_json(a["op"], a.get("frames", []))
    thread = a.get("thread")
    if thread is not None:
        task = thread.get("task") or {}
        site.thread = ThreadOrigin(str(thread["name"]), str(thread["how"]), _site_from_json("", thread["frames"]),
                                   int(thread.get("nth", 0)), str(task.get("id", "")),
                                   int(a.get("ordinal", 0)) - int(task.get("ordinal", 0)) if task else 0)
    op = Op(a["stream"], 0, int(a.get("seq", 0)), site)
    return Access(op, None, int(a.get("start", 0)), int(a.get("end", 0)), a["rw"] != "read",
                  _tensor_from_json(a["tensor"]))


def to_race(data: dict) -> Race:
    """The race ``from_race`` described (its rank is ``data["rank"]``). Malformed data raises ValueError."""
    try:
        alloc, latent = data.get("alloc"), data.get("latent")
        return Race(
            kind=str(data["kind"]),
            earlier=_access_from_json(data["earlier"]),
            later=_access_from_json(data["later"]),
            alloc_site=None if alloc is None else _site_from_json(alloc["op"], alloc.get("frames", [])),
            count=int(data.get("count", 1)),
            hidden_by=None if latent is None else _site_from_json(latent["op"], latent.get("frames", [])),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"not a streamrace race record: {type(exc).__name__}: {exc}") from None


LATENT = "latent"  # the kind label's prefix of latent races ("latent read-after-write"): a kind of their own


def label(kind: str, latent) -> str:
    """A race's kind as every output names it: a latent race's is "latent <kind>"."""
    return f"{LATENT} {kind}" if latent else kind


def kind_of(record: Record) -> str:
    """The record's kind label (``label``)."""
    return label(str(record.get("kind")), record.get("latent"))


def key(record: Record) -> tuple:
    """Records are the same report when kind (its label: a latent race is never the same report as a race) and
    both user locations are (``hb.identity``): merges ranks."""
    def site(side):
        access = record.get(side) or {}
        frames = access.get("frames") or []
        return Site(str(access.get("op")), tuple((f["file"], f["line"], f.get("function", "")) for f in frames[:1]))

    return identity(kind_of(record), site("earlier"), site("later"))


# the --streamrace-json document


def document(records: Iterable[Record]) -> dict:
    """The ``--streamrace-json`` document: one entry per race and rank."""
    return {"version": SCHEMA_VERSION, "races": list(records)}


def write_document(path: str | os.PathLike, records: Iterable[Record]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(document(records), f, indent=1)
        f.write("\n")


def load_document(doc: dict) -> list[Ranked]:
    """Races of a ``document``; a document of another version or shape raises ValueError."""
    if not isinstance(doc, dict) or doc.get("version") != SCHEMA_VERSION or not isinstance(doc.get("races"), list):
        raise ValueError(f"not a streamrace JSON document of version {SCHEMA_VERSION}")
    return [(entry.get("rank") if isinstance(entry, dict) else None, to_race(entry)) for entry in doc["races"]]


# records on a test's reports


def races_in(reports) -> list[dict]:
    """The records a test's reports carry (the teardown report has every phase's)."""
    return [race for r in reports if r.when == "teardown" for k, v in r.user_properties if k == RACES for race in v]


def add_races(reports, races: list[dict]) -> None:
    """Give the test's teardown report more records (another torchrun rank's, to rank 0)."""
    for r in reports:
        if r.when == "teardown" and races:
            r.user_properties.append((RACES, races))


# locations


def short_path(path: str) -> str:
    """A file name as a reader wants it: relative to the working directory, or from site-packages on."""
    if os.path.isabs(path):
        cwd = os.getcwd() + os.sep
        if path.startswith(cwd):
            return path[len(cwd):]
        for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
            _, sep, rest = path.rpartition(marker)
            if sep:
                return rest
    return path


def location(frames: Sequence) -> str:
    """``short/path.py:line`` of the innermost frame (a record's dicts or ``(file, line, function)`` tuples)."""
    if not frames:
        return "<unknown>"
    first = frames[0]
    filename, lineno = (first["file"], first["line"]) if isinstance(first, dict) else first[:2]
    return f"{short_path(str(filename))}:{lineno}"


def user_frame(frames: list[dict], root: str) -> tuple[str, int] | None:
    """(path relative to root, line) of the innermost frame in the repository's own code, else the innermost."""
    root = os.path.abspath(root) + os.sep
    for f in frames:
        path = str(f.get("file", ""))
        if path.startswith(root) and "site-packages" not in path and "dist-packages" not in path:
            return path[len(root):].replace(os.sep, "/"), int(f.get("line", 0))
    if frames:
        path = str(frames[0].get("file", ""))
        return (path[len(root):] if path.startswith(root) else path).replace(os.sep, "/"), int(frames[0]["line"])
    return None


def short(record: Record, at: bool = True) -> str:
    """One line: kind, tensor, the later access's location."""
    name = (record.get("tensor") or {}).get("name")
    frames = (record.get("later") or {}).get("frames") or []
    where = f" at {location(frames)}" if frames and at else ""
    line = f"{kind_of(record)} on {'tensor ' + repr(name) if name else 'a tensor'}{where}"
    latent = record.get("latent")
    if latent:
        line += f", ordered today only by {latent.get('op')} at {latent.get('at')}"
    return line


# text: the one renderer


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
    if race.latent:
        sync = race.hidden_by
        at = f" at {location(sync.frames)} ({sync.frames[0][2]})" if sync.frames else ""
        return (f"ordered today only by {sync.op}{at}; make '{later}' wait for '{earlier}' ({_how(earlier)}) to keep "
                f"it ordered when that read-back goes")
    if race.kind == FREE:
        use = "write" if race.earlier.write else "read"
        return (f"the tensor was freed while '{earlier}' may still {use} it, and the caching allocator may hand its "
                f"memory to new work on '{later}' at once: call tensor.record_stream(<{earlier}>) while the tensor "
                f"is alive, or make '{later}' wait for '{earlier}' ({_how(earlier)}) before dropping the last "
                f"reference")
    access = {RAW: "read", WAR: "write", WAW: "write"}.get(race.kind, "access")
    if is_host(later) and not is_host(earlier):
        return (f"the host goes on while the stream works: make the host wait for '{earlier}' (that stream's "
                f"synchronize(), an event recorded on it after the access and the event's synchronize(), or "
                f"torch.cuda.synchronize()) before this {access}")
    return (f"the later access is not ordered after the earlier one: make '{later}' wait for '{earlier}' "
            f"({_how(earlier)}) before this {access}")


def format_race(race: Race, stream_name: StreamName = str, ranks: Sequence[int] = ()) -> str:
    """One race: kind, tensor, allocation site, both accesses with a few frames each, a hint, the count."""
    tensor = race.later.tensor
    alloc = f" (allocated at {location(race.alloc_site.frames)})" if race.alloc_site and race.alloc_site.frames else ""
    on_ranks = ""
    if ranks:
        on_ranks = f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r in ranks)}"
    what = "latent stream race" if race.latent else "stream race"
    lines = [f"{what}{on_ranks}: {race.kind} on {describe_tensor(tensor)}{alloc}"]
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
        at = f"at {location(frames)}" + (f" ({frames[0][2]})" if frames else "")
        if free and not frames:  # the last reference went away once the test's own code had returned
            at = "at the end of the test (its last reference went away outside the test's code)"
        view = ""
        if access.tensor != tensor:
            view = f"  [{describe_tensor(access.tensor)}]"
        lines.append(f"  {label:<8} {rw:<6} {op:<{op_w}}  {stream:<{stream_w}}  {at}{view}".rstrip())
        indent = " " * (2 + 8 + 1 + 6 + 1)  # under the op column
        for filename, lineno, function in frames[1:FRAMES_SHOWN]:
            lines.append(f"{indent}from {short_path(filename)}:{lineno} ({function})")
        thread = access.op.site.thread
        if thread is not None and thread.how != NATIVE:  # a thread Python did not start has nothing to name
            origin = thread.site.frames
            at = f", {thread.how} at {location(origin)} ({origin[0][2]})" if origin else ""
            lines.append(f"{indent}on thread '{thread.name}'{at}")
    hint = _hint(race, stream_name(race.earlier.op.stream), stream_name(race.later.op.stream))
    lines.extend(textwrap.wrap(hint, WIDTH, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False))
    if race.count > 1:
        lines.append(f"  (seen {race.count} times)")
    return "\n".join(lines)


def merge_ranks(ranked: Iterable[Ranked]) -> list[tuple[tuple[int, ...], Race]]:
    """Races deduplicated across ranks by location pair: (ranks it was seen on, race with the summed count)."""
    merged: dict[tuple, tuple[list, Race]] = {}
    for rank, race in ranked:
        key = (race.latent, race.key())
        if key not in merged:
            merged[key] = ([], Race(race.kind, race.earlier, race.later, race.alloc_site, 0, race.hidden_by))
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
    real = [item for item in merged if not item[1].latent]
    latent = [item for item in merged if item[1].latent]
    parts = []
    if real:
        n = len(real)
        parts.append(f"{n} stream race{'s' if n > 1 else ''} (unordered cross-stream accesses; deduplicated by "
                     "location pair)")
        parts += [format_race(race, stream_name, ranks) for ranks, race in real]
    if latent:
        n = len(latent)
        parts.append(f"{n} latent stream race{'s' if n > 1 else ''} (ordered today only by a host sync the program "
                     "did not ask for; deduplicated by location pair)")
        parts += [format_race(race, stream_name, ranks) for ranks, race in latent]
    return "\n\n".join(parts)


def format_records(records: Iterable[Record]) -> str:
    """``format_races`` for records (other processes' races: a rank's, a followed child's)."""
    return format_races([(r.get("rank"), to_race(r)) for r in records])


def format_children(records: list[dict]) -> str:
    """The failure text for races in processes a test started: the marker's rendering, "stream race on rank N"."""
    pids = sorted({r.get("pid") for r in records if r.get("pid") is not None})
    return f"{format_records(records)}\n  (in {'processes' if len(pids) > 1 else 'a process'} the test started: " \
           f"pid {', '.join(map(str, pids))})"


def format_after(records: list[dict]) -> str:
    """Races of processes judged after the test that started them had finished, grouped by that test."""
    lines = []
    by_test: dict[str, list] = {}
    for race in records:
        by_test.setdefault(race.get("test", "?"), []).append(race)
    for test, found in by_test.items():
        lines.append(f"from processes started by {test}, judged after that test had finished:")
        lines.append(format_records(found))
        lines.append("")
    return "\n".join(lines).rstrip()
