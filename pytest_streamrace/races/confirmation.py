"""A race's confirmation, whichever harness re-runs what reported it (a test: ``races.confirm``; a program under
``streamrace run --confirm``: ``run.confirm``): which races can be forced, the plan a forced run is told (the race's two
ops by their places on their threads), the environment it runs in, the holds a GPU re-run tries, and the verdict from
what its processes wrote.

A race's confirmation is a dict on its record (``confirmation``): ``status`` "confirmed" (the bytes it touched change
under the forced order, or the test's outcome does), "not-confirmed" (the same values in the forced run: the race
cannot change what this test computes), or "not-tried" with the ``reason``; the numbers; and how long it took. No
pytest here: a followed process of a user's program must not pay for it.
"""

from __future__ import annotations

import json
import os

from ..detector.hb import thread_key_of
from . import record as records_

_FORCED = {"read-after-write", "write-after-read", "write-after-write", "free-while-in-use"}
FREE = "free-while-in-use"
CONFIRMED, NOT_CONFIRMED, NOT_TRIED = "confirmed", "not-confirmed", "not-tried"
INCIDENTAL = " (incidental)"  # the end of a latent race's sync op where an incidental-sync rule made it one


def forcing_environ(environ: dict, backend: str) -> dict:
    """A forced re-run's environment, where it has no warm-up pass (a distributed item's ranks, a program's processes).
    CUDA loads a kernel's module at the kernel's first launch (torch asks for lazy loading), and a load may synchronize
    the context: the first launch of the later access's kernel then blocks the host until the held stream's sleep is
    over, and the later access can never go first. On GPUs such a re-run loads every module as its context is made.
    NCCL (2.22 on) connects a communicator's peers at its first collective, not as it is made: where that first
    collective is the later access, its setup is work of the same kind, so the re-run's communicators connect as they
    are made (unless the user set otherwise)."""
    if backend == "cuda":
        environ["CUDA_MODULE_LOADING"] = "EAGER"
        environ.setdefault("NCCL_RUNTIME_CONNECT", "0")
    return environ


def read_files(folder: str) -> list[dict]:
    """What a re-run's processes wrote into `folder`, a JSON file each (one cut short by a crash is left out)."""
    found = []
    for name in sorted(os.listdir(folder)):
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                found.append(json.load(f))
        except (OSError, ValueError):
            continue
    return found


def why_not(data: dict) -> str | None:
    """Why a race record cannot be forced (None: it can), wherever its process is."""
    if data.get("latent") and not str(data["latent"].get("op", "")).endswith(INCIDENTAL):
        return "a latent race: its order is kept today by a host sync at {} that the program needs".format(
            data["latent"].get("at") or data["latent"].get("op"))
    if data.get("kind") not in _FORCED:
        return f"a {data.get('kind')} is not forced"
    if data["kind"] == FREE and data.get("earlier", {}).get("rw") != "read":
        return "a write freed while in use is not forced (what it corrupts is the block's next owner's)"
    if not placed(data):
        return "its ops were not captured (the C++ capture is off, or a model made them)"
    return None


def placed(data: dict) -> bool:
    """Whether a record names its ops' places, as a forced run finds them: both ops' (a free is no op: the earlier
    access's, the read the free may hand to the block's next owner)."""
    earlier, later = data.get("earlier") or {}, data.get("later") or {}
    return bool(earlier.get("ordinal")) and (data.get("kind") == FREE or bool(later.get("ordinal")))


def plan_for(k: tuple, located: list[dict] | None) -> dict | None:
    for found in located or ():
        for data in found.get("races", ()):
            if records_.key(data) == k and placed(data):
                return plan_of(data)
    return None


def forcing_for(k: tuple, located: list[dict] | None) -> dict | None:
    """A forced re-run's plans for race `k` as the locating re-run placed it: ``plan`` for the test's own process
    (each rank's, for a distributed item), and ``plans`` by rank (``rank_key``) for the processes the test started,
    which pick theirs when the capture first reaches one of its ops (``ForRank``). None: it did not show."""
    own, plans = None, {}
    for found in located or ():
        for data in found.get("races", ()):
            if records_.key(data) != k or not placed(data):
                continue
            if data.get("pid") is None:
                own = own or plan_of(data)
            else:
                plans.setdefault(rank_key(data.get("rank")), plan_of(data))
    if own is None and not plans:
        return None
    return {"plan": own, "plans": plans} if plans else {"plan": own}


def rank_key(rank) -> str:
    """A plan's key in ``plans``: the rank its process reported ("none": a process without one)."""
    return "none" if rank is None else str(rank)


def plan_of(data: dict) -> dict:
    """What a forced run needs of a race record (one with both ordinals): its kind and its two ops' places; for a
    latent race (only an incidental sync orders it today), that sync, which the forced run skips."""
    plan = {"kind": data["kind"], "earlier": _side(data["earlier"]), "later": _side(data["later"]),
            "dtype": _dtype(data)}
    if data.get("latent"):
        plan["skipped"] = data["latent"].get("at")
    return plan


def _dtype(data: dict) -> str:
    """The dtype the race's bytes are compared in: the later access's, unless it sees them as raw bytes (a copy of
    untyped storage, as DCP's stager makes) and the earlier one knows better."""
    later, earlier = data["later"]["tensor"]["dtype"], data["earlier"]["tensor"]["dtype"]
    return earlier if later == "uint8" and earlier != "uint8" else later


def _side(access: dict) -> dict:
    thread = access.get("thread")
    side = {"thread_key": thread_key_of(thread["name"], thread.get("nth", 0)) if thread else None,
            "ordinal": access.get("ordinal", 0), "op": access["op"],
            "rw": access["rw"], "start": access["start"], "end": access["end"],
            "at": _at(access)}
    task = (thread or {}).get("task")
    if task:  # a pool's task: found by the task, on whichever worker runs it
        side["task"], side["task_ordinal"] = task["id"], task["ordinal"]
    return side


def _at(access: dict) -> str:
    return records_.location(access.get("frames") or ())


def held_longer(plan: dict, delay_ms: float) -> dict:
    """A forced run's plan with a longer hold."""
    return dict(plan, delay_ms=delay_ms)


def forcing_held_longer(forcing: dict, delay_ms: float) -> dict:
    out = {"plan": held_longer(forcing["plan"], delay_ms) if forcing.get("plan") else None}
    if "plans" in forcing:
        out["plans"] = {rank: held_longer(plan, delay_ms) for rank, plan in forcing["plans"].items()}
    return out


MAX_HOLD_MS = 10_000.0


def next_hold(before: list[dict] | None, results: list[dict]) -> float | None:
    """The hold for another forced run of a race whose last one gave `results` (one per record of it: a rank's; in
    `before`, the run before it, in the same order), or None where there is to be none: none once a host waited for
    the held stream, else the longest any asks. Each harness's re-runs of a race follow this."""
    marked = [_grew_with_hold(b, r) for b, r in zip(before or [None] * len(results), results)]
    if any(r.get("host_waited") for r in marked):
        return None
    asked = [hold for hold in map(_longer_hold, marked) if hold is not None]
    return max(asked) if asked else None


def _longer_hold(result: dict) -> float | None:
    """The hold to try next where a GPU hold was too short to invert the order, else None: the host took longer
    between the two accesses than the held stream slept (a communicator's first use, a kernel's first launch), so
    the held access ran first anyway. Twice what it took, up to MAX_HOLD_MS."""
    delay, gap = result.get("delay_ms"), result.get("host_gap_ms", 0.0)
    if delay is None or delay >= MAX_HOLD_MS or result.get("host_waited"):
        return None
    short = (result["status"] == NOT_TRIED and "did not invert" in str(result.get("reason"))) or \
        (result["status"] == NOT_CONFIRMED and result.get("held_by") and gap > delay / 2)
    return min(MAX_HOLD_MS, 2 * (gap + delay)) if short else None


def _grew_with_hold(before: dict | None, result: dict) -> dict:
    """`result`, marked `host_waited` where the host's gap between the two accesses grew by about as much as the hold
    did since the try `before`: something between them waits for the held stream, every time, so a longer hold only
    makes it wait longer. Said as the reason, with both tries' numbers."""
    if before is None or result.get("status") != NOT_TRIED or result.get("host_waited"):
        return result
    try:
        added = result["delay_ms"] - before["delay_ms"]
        grew = result["host_gap_ms"] - before["host_gap_ms"]
    except (KeyError, TypeError):
        return result
    if added <= 0 or grew < 0.8 * added:
        return result
    result.update(host_waited=True, reason=(
        f"the host's gap between the two accesses grew with the hold ({before['host_gap_ms']:.0f} ms at a "
        f"{before['delay_ms']:g} ms hold, {result['host_gap_ms']:.0f} ms at {result['delay_ms']:g} ms): something "
        f"between the two waits for the held stream, so no hold inverts them ({result.get('reason')})"))
    return result


def verdict(plan: dict, forced: list[dict], problem: str | None, outcome: str) -> dict:
    """A race's confirmation from the files a forced run's processes wrote (or why there are none), against the
    outcome of the run that reported it."""
    if problem:
        return {"status": NOT_TRIED, "reason": problem}
    results = [f.get("forced") for f in forced if f.get("forced")]
    done = [r for r in results if r.get("status") == "forced"]
    outcomes = [f.get("outcome") for f in forced if f.get("outcome")]
    forced_outcome = next((o for o in outcomes if o != "passed"), outcomes[0] if outcomes else None)
    if not done:
        tried = [r for r in results if r.get("reason")]
        if not tried:
            return {"status": NOT_TRIED, "reason": "the re-run never reached the race"}
        # the hold's numbers; `host_waited` also tells `_longer_hold` that a longer hold would only be waited out
        numbers = {k: tried[0][k] for k in ("delay_ms", "host_gap_ms", "lead_ms", "slept_ms", "later_call_ms",
                                           "host_waited", "held_by", "waited_at", "latent_sync") if k in tried[0]}
        return {"status": NOT_TRIED, "reason": tried[0]["reason"], **numbers}
    best = max(done, key=lambda r: (r.get("differing", 0), r.get("max_abs_diff", 0.0)))
    out = {k: v for k, v in best.items() if k != "status"}
    out["held"] = plan["earlier"]["at"]
    if plan.get("skipped"):
        out["skipped_sync"] = plan["skipped"]
    out["observed"] = plan["later"]["at"]
    out["runs"] = 1
    out["outcome"] = {"ordered": outcome, "forced": forced_outcome}
    changed = best.get("differing", 0) > 0 or (forced_outcome is not None and forced_outcome != outcome)
    out["status"] = CONFIRMED if changed else NOT_CONFIRMED
    if not changed:
        out["reason"] = benign(plan["kind"], out)
    return out


def benign(kind: str, result: dict) -> str:
    """Why a forced order left the values the same: what the race cannot change in this run."""
    if result.get("reason"):
        return result["reason"]
    if result.get("one_rank"):
        return "a collective over a world of one rank leaves the bytes it reads"
    if result.get("identity"):
        return "the later write leaves what it reads unchanged here"
    return {"write-after-write": "both writes leave the same bytes",
            "write-after-read": "the later write stores the values the read sees anyway"}.get(
        kind, "the held-back write stores the values already there")


def describe(data: dict, result: dict, unit: str = "test") -> str:
    """One line (or two) a person reads: what was forced and what changed (`unit`: what ran, "test" or "program")."""
    kind = records_.kind_of(data)
    where = f"{kind} {_at(data.get('earlier', {}))} -> {_at(data.get('later', {}))}"
    status = result["status"]
    if status == NOT_TRIED:
        return f"not tried: {where}: {result.get('reason')}"
    rw = data["earlier"]["rw"]
    seen = "left behind" if data["kind"] == "write-after-write" and not result.get("read_modify_write") else "read"
    skipped = f" and the incidental sync at {result['skipped_sync']} skipped" if result.get("skipped_sync") else ""
    what = (f"with the {rw} at {result['held']} held back{skipped}, the values {seen} at "
            f"{result['held'] if data['kind'] in ('write-after-read', FREE) else result['observed']}")
    if status == NOT_CONFIRMED:
        why = f" ({benign(data['kind'], result)})"
        return f"not confirmed: {where}: {what} were identical in {result.get('runs', 1)} forced run{why}"
    line = f"confirmed: {where}: {what} differed"
    if "max_abs_diff" in result:
        line += f" by max |Δ| = {result['max_abs_diff']:.6g}"
    line += f" in {result.get('differing', 0):,} of {result.get('elements', 0):,} elements"
    if result.get("unwritten"):
        line += " (the read saw bytes the write had not written yet)"
    if result.get("freed"):
        line += " (the read saw the block after its free)"
    if result.get("forced_nonfinite"):
        line += f"; {result['forced_nonfinite']:,} not finite"
    forced = (result.get("outcome") or {}).get("forced")
    if forced and forced != (result.get("outcome") or {}).get("ordered"):
        line += f"; the {unit} then {forced}"
    return line

