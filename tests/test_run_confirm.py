"""`streamrace run --confirm -- PROGRAM` on CPU (virtual streams), as users run it: the program runs again once per
distinct race with that race forced in every followed process. A read that raced with a write changing its values is
confirmed, a write of the values already there is not, a gloo collective's buffer read before wait() is confirmed on
each rank with that rank's own numbers; the exit status stays the first run's."""

from __future__ import annotations

import json
import sys
import textwrap

from test_run_command import _line, _torchrun, job  # noqa: F401  (job: a fixture)
from test_subprocesses import tmpdir_marker  # noqa: F401  (a fixture job uses)

RACY = """
import sys
import torch

x = torch.ones(64)
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    x.fill_(1.0 if "--benign" in sys.argv else 3.0)   # WRITE
y = x + 1                                             # READ
torch.cuda.synchronize()
print("first run" if y.sum().item() == 64 * 2 + (0 if "--benign" in sys.argv else 128) else "another run")
"""

READ_BEFORE_WAIT = """
import torch, torch.distributed as dist

dist.init_process_group("gloo")
x = torch.full((64,), float(dist.get_rank() + 1))
work = dist.all_reduce(x, async_op=True)              # ALL-REDUCE
y = x * 2                                             # READ-BEFORE-WAIT
work.wait()
dist.destroy_process_group()
"""


def _write(job, name: str, text: str) -> None:
    (job.path / name).write_text(textwrap.dedent(text).lstrip("\n"))


def _races(job) -> list[dict]:
    return json.loads((job.path / "races.json").read_text())["races"]


def test_a_read_of_values_the_write_changes_is_confirmed(job):  # noqa: F811
    _write(job, "racy.py", RACY)
    out = job("--backend", "virtual", "--confirm", "--json", "races.json", "--", sys.executable, "racy.py")
    assert out.returncode == 3, out.stderr  # the first run's races decide it, as without --confirm
    assert out.stdout.splitlines() == ["first run"], out.stdout  # a re-run's output goes nowhere
    [race] = _races(job)
    # the first run's records name each op's place on its thread: the forced run needs nothing else
    assert race["earlier"]["ordinal"] > 0 and race["later"]["ordinal"] > race["earlier"]["ordinal"]
    confirmation = race["confirmation"]
    assert confirmation["status"] == "confirmed", confirmation
    assert (confirmation["differing"], confirmation["elements"], confirmation["max_abs_diff"]) == (64, 64, 2.0)
    assert confirmation["held"] == f"racy.py:{_line(RACY, 'WRITE')}"
    assert confirmation["outcome"] == {"ordered": "exited with status 0", "forced": "exited with status 0"}
    assert "streamrace: confirming 1 race: the program runs again once for each" in out.stderr
    assert (f"run:racy.py: confirmed: read-after-write racy.py:{_line(RACY, 'WRITE')} -> racy.py:{_line(RACY, 'READ')}"
            f": with the write at racy.py:{_line(RACY, 'WRITE')} held back, the values read at "
            f"racy.py:{_line(RACY, 'READ')} differed by max |Δ| = 2 in 64 of 64 elements") in out.stderr
    assert "streamrace confirmations: 1 confirmed, 0 not confirmed, 0 not tried (re-runs took" in out.stderr


def test_a_write_of_the_values_already_there_is_not_confirmed(job):  # noqa: F811
    _write(job, "racy.py", RACY)
    out = job("--backend", "virtual", "--confirm", "--json", "races.json", "--", sys.executable, "racy.py", "--benign")
    assert out.returncode == 3, out.stderr
    [race] = _races(job)
    confirmation = race["confirmation"]
    assert (confirmation["status"], confirmation["differing"], confirmation["elements"]) == ("not-confirmed", 0, 64)
    assert "run:racy.py: not confirmed: read-after-write" in out.stderr
    assert "streamrace confirmations: 0 confirmed, 1 not confirmed, 0 not tried" in out.stderr


def test_a_collective_read_before_wait_is_confirmed_on_both_torchrun_ranks(job):  # noqa: F811
    _write(job, "dist.py", READ_BEFORE_WAIT)
    out = job("--backend", "virtual", "--confirm", "--json", "races.json", "--", *_torchrun("dist.py"))
    assert out.returncode == 3, out.stderr
    races = {race["rank"]: race for race in _races(job)}
    assert sorted(races) == [0, 1], races
    for rank, race in races.items():
        confirmation = race["confirmation"]
        assert confirmation["status"] == "confirmed", (rank, confirmation)
        assert confirmation["differing"] == 64
        # each rank's own forced read: x holds its own value (rank + 1), not the sum 3
        assert confirmation["max_abs_diff"] == 3 - (rank + 1), (rank, confirmation)
    assert "streamrace confirmations: 1 confirmed, 0 not confirmed, 0 not tried" in out.stderr


def test_without_races_nothing_runs_again(job):  # noqa: F811
    out = job("--backend", "virtual", "--confirm", "--", sys.executable, "script.py", "--clean")
    assert out.returncode == 0, out.stderr
    assert "confirm" not in out.stderr


def _gpu_race(rank: int) -> dict:
    """A race record as a GPU run of a 2-rank program writes it (the ops' places on their threads)."""
    side = {"stream": "default stream", "start": 0, "end": 64, "tensor": {"name": "w", "shape": [16], "dtype": "float32"},
            "frames": [{"file": "/job/train.py", "line": 12, "function": "step"}]}
    return {"kind": "read-after-write", "rank": rank,
            "earlier": dict(side, op="aten::addcdiv_", rw="write", ordinal=83, seq=105),
            "later": dict(side, op="aten::copy_", rw="read", ordinal=27, seq=140, stream="staging",
                          frames=[{"file": "/job/train.py", "line": 20, "function": "stage"}])}


def test_a_gpu_hold_too_short_is_tried_longer_and_stops_once_the_host_waits_for_it(monkeypatch):
    """On GPUs a program's re-run follows the tests' hold policy: a hold shorter than the host's own time between the
    two accesses is tried again longer, and not again once the host's gap grows with the hold. (The forced runs are
    stood in for: this machine has no GPU to hold.)"""
    import io

    from pytest_streamrace.run import confirm as run_confirm

    tries = []

    def rerun(program, backend, variable, plans, limit, mask):
        delay = plans["0"].get("delay_ms", 200.0)
        tries.append({rank: plan.get("delay_ms") for rank, plan in plans.items()})
        gap = 735.0 if len(tries) == 1 else delay + 520.0  # the second try: the host waited out the hold and more
        forced = {"status": "not-tried", "reason": f"a {delay:g} ms hold did not invert the order", "delay_ms": delay,
                  "host_gap_ms": gap}
        return [{"rank": r, "forced": forced} for r in (0, 1)], 3, None, None

    monkeypatch.setattr(run_confirm, "_rerun", rerun)
    races = [_gpu_race(0), _gpu_race(1)]
    run_confirm.confirm(["python", "train.py"], "cuda", "", races, 3, 10.0, set(), out=io.StringIO())
    assert tries == [{"0": None, "1": None}, {"0": 2 * (735.0 + 200.0), "1": 2 * (735.0 + 200.0)}]
    for data in races:
        confirmation = data["confirmation"]
        assert confirmation["status"] == "not-tried" and confirmation["host_waited"] is True
        assert confirmation["reason"].startswith("the host's gap between the two accesses grew with the hold (735 ms "
                                                 "at a 200 ms hold, 2390 ms at 1870 ms)")
