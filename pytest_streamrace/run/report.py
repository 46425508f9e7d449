"""What the program's processes found, as it arrives and at the end: the same records, policy, text, JSON and trace
as ``pytest --streamrace`` (``races.record``, ``races.policy``, ``races.tally``, ``races.trace``, ``races.hints``).

Records come from the followed processes' data files (``children.following``). Each race record is classified by the
policy when it arrives; a race not seen before (by kind and both locations, any rank) is said on stderr at once,
prefixed by its rank. At the end the races are merged across processes and ranks with their final counts (a
process that ends writes each race's count again: ``recount``), and the report is the pytest one: the race texts,
the detector's notes, the summary lines and the closing line.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import TextIO

from ..races import hints, record
from ..races.policy import BASELINE, NEW, SUPPRESSED, Policy
from ..races.tally import Tally
from ..races.trace import child_trace, write_trace

NEW_RACES = 3  # the exit status where new races were found (not under --report-only)


def label(program: list[str]) -> str:
    """The program's name in the baseline and the JSON (their "test"): its script (the first ``.py`` argument), else
    its module (the last ``-m``: a launcher's comes first), else its command's name — stable across arguments such as
    ``--nproc_per_node``."""
    script = next((arg for arg in program[1:] if arg.endswith(".py")), None)
    if script is not None:
        return f"run:{script}"
    modules = [program[i + 1] for i in range(1, len(program) - 1) if program[i] == "-m"]
    return f"run:{modules[-1] if modules else os.path.basename(program[0])}"


class Findings:
    """The races, notes, traces and processes the program's followed processes reported."""

    def __init__(self, policy: Policy, name: str, out: TextIO = sys.stderr):
        self.policy = policy
        self.name = name
        self.out = out
        self.tally = Tally(policy, unit="program", failing="failing the run")
        self.races: dict[tuple, dict] = {}  # (pid, record.key) -> record, its count the latest
        self.said: set[tuple] = set()  # record.key of races said as they were found
        self.notes: list[tuple[int | None, str]] = []
        self.traces: list[tuple[int | None, list]] = []  # (pid, events)
        self.processes: dict[int, int | None] = {}  # pid -> rank (None: no rank)

    def feed(self, records: list[dict]) -> None:
        for entry in records:
            kind, pid, rank = entry.get("kind"), entry.get("pid"), entry.get("rank")
            if pid is not None and (rank is not None or pid not in self.processes):
                self.processes[pid] = rank
            if kind in ("race", "recount") and isinstance(entry.get("race"), dict):
                self._race(dict(entry["race"], pid=pid), kind == "recount")
            elif kind == "note" and isinstance(entry.get("text"), str):
                if (rank, entry["text"]) not in self.notes:
                    self.notes.append((rank, entry["text"]))
            elif kind == "trace" and isinstance(entry.get("events"), list):
                self.traces.append((pid, entry["events"]))

    def _race(self, race: dict, recount: bool) -> None:
        try:
            key = record.key(race)
        except (KeyError, TypeError, AttributeError):
            return  # not a race record: a broken line loses that race only
        known = self.races.get((race.get("pid"), key))
        if known is not None:
            known["count"] = max(int(known.get("count", 1)), int(race.get("count", 1)))
            return
        status = self.policy.classify(self.name, race, False)
        self.races[(race.get("pid"), key)] = race
        if key not in self.said and status != SUPPRESSED and not recount:
            self.said.add(key)
            self._say(race, status)

    def _say(self, race: dict, status: str) -> None:
        rank = race.get("rank")
        who = f"rank {rank}" if rank is not None else f"pid {race.get('pid')}"
        what = {NEW: "", BASELINE: " (in the baseline)"}.get(status, f" ({status})")
        earlier = race.get("earlier") or {}
        self.out.write(f"streamrace [{who}]: {record.short(race)}{what}; earlier {earlier.get('op')} on "
                       f"{earlier.get('stream')} at {record.location(earlier.get('frames') or [])}\n")
        self.out.flush()

    # the end

    def failing(self) -> bool:
        return any(self.policy.fails(e["status"], bool(e["race"].get("latent"))) for e in self.tally.races.values())

    def finish(self, status: int, signal_name: str | None, json_path: str | None, trace_path: str | None) -> int:
        """Write the report, the files and the baseline; the exit status."""
        records = list(self.races.values())
        self.tally.checked.append(self.name)
        self.tally.add_races(self.name, records)
        if json_path:
            _write(json_path, lambda path: record.write_document(path, [dict(r, test=self.name) for r in records]))
        if trace_path:
            _write(trace_path, lambda path: write_trace(path, _one_process_each(self.traces)))
        if self.policy.update:
            self.tally.write_baseline()
        failing = self.failing()
        self._print(records, status, signal_name, failing)
        return NEW_RACES if failing else status

    def _print(self, records: list[dict], status: int, signal_name: str | None, failing: bool) -> None:
        width = min(shutil.get_terminal_size((100, 24)).columns, 120)
        lines = ["", " streamrace ".center(width, "=")]
        shown = [r for r in records if r.get("status") != SUPPRESSED]
        if shown:
            lines += [record.format_records(shown), ""]
        if self.notes:
            lines.append(f" {hints.SECTION} ".center(width, "-"))
            found = [hints.note_hint(text, rank) for rank, text in self.notes]
            lines += [f"{self.name}: {line}" for _, line in hints.merged([(self.name, h) for h in found])]
            lines += hints.advice(found)
            lines.append("")
        ranks = sorted({r for r in self.processes.values() if r is not None})
        n = len(self.processes)
        if n:
            followed = f"{n} Python process{'es' if n != 1 else ''} followed" + \
                (f" (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})" if ranks else "")
        else:
            followed = (f"no Python process was followed: only processes that import torch, run by this interpreter's "
                        f"environment ({sys.prefix}), are")
        ended = f"stopped by {signal_name}, " if signal_name else ""
        lines.append(f"streamrace: {ended}the program exited with status {status}; {followed}")
        lines += self.tally.summary()
        if failing:
            lines.append(f"streamrace: exit status {NEW_RACES}: new races (--report-only reports them without failing)")
        if os.environ.get("GITHUB_ACTIONS") == "true":
            for line in self.tally.annotations():
                print(line, flush=True)
        self.out.write("\n".join(lines) + "\n")
        self.out.flush()


def _write(path: str, write) -> None:
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write(path)
    except OSError as exc:
        sys.stderr.write(f"streamrace run: cannot write {path}: {exc.strerror or exc}\n")


def _one_process_each(traces: list[tuple[int | None, list]]) -> list[list[dict]]:
    """Each followed process its own trace process (two without a rank would share pid 0), named after its pid."""
    out = []
    for index, (pid, events) in enumerate(traces):
        out.append([dict(event, pid=index * 1000 + event.get("pid", 0)) for event in child_trace(pid, events)])
    return out
