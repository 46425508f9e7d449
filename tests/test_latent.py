"""Latent races: accesses that today's run orders only through a host sync the program did not ask for —
a value read back (``.item()``, ``.cpu()``) or an explicit sync made from a file of an ``incidental-sync`` rule (a
framework's timer). Run as users run them: a pytest subprocess under ``--streamrace`` on the virtual backend."""

from __future__ import annotations

import json

import pytest

CASES = """
import os, pytest, torch
from timer import time_step

def produced():
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x = torch.ones(8) * 2                      # PRODUCE
    return side, x

@pytest.mark.parametrize("read_back", ["item", "cpu"])
def test_read_back(read_back):
    side, x = produced()
    with torch.cuda.stream(side):
        if read_back == "item":
            x.sum().item()                         # ITEM
        else:
            x.cpu()                                # CPU
    x.add_(1)                                      # USE

def test_wait_stream():
    side, x = produced()
    with torch.cuda.stream(side):
        x.sum().item()
    torch.cuda.current_stream().wait_stream(side)  # the device-side wait: ordered in both views
    x.add_(1)

def test_synchronize():
    side, x = produced()
    with torch.cuda.stream(side):
        x.sum().item()
    torch.cuda.synchronize()                       # explicit: ordered in both views
    x.add_(1)

def test_timer():
    side, x = produced()
    time_step()                                    # a framework's timer synchronizes the device
    x.add_(1)                                      # TIMED-USE
"""

TIMER = """
import torch

def time_step():
    torch.cuda.synchronize()                       # TIMER-SYNC
"""


def line(source: str, tag: str) -> int:
    """The line of `tag` in the file pytester writes (it drops the source's leading newline)."""
    return next(n for n, text in enumerate(source.lstrip("\n").splitlines(), 1) if text.rstrip().endswith("# " + tag))


def run(pytester, *args, suppress: str | None = None):
    pytester.makepyfile(test_cases=CASES, timer=TIMER)
    if suppress is not None:
        pytester.path.joinpath("s.supp").write_text(suppress)
        args += ("--streamrace-suppress", "s.supp")
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual", "--streamrace-json",
                                           "races.json", "-p", "no:cacheprovider", "-rA", *args)
    doc = json.loads((pytester.path / "races.json").read_text())
    return result, doc["races"]


def latent_of(races, test):
    return [r for r in races if r["test"] == f"test_cases.py::{test}" and r.get("latent")]


def test_read_backs_are_latent_reported_and_passing(pytester):
    result, races = run(pytester, "--streamrace-trace", "trace.json")
    result.assert_outcomes(passed=5)
    out = result.stdout.str()
    for test, op, tag in (("test_read_back[item]", ".item()", "ITEM"), ("test_read_back[cpu]", ".cpu()", "CPU")):
        found = latent_of(races, test)
        assert found, races
        assert {r["latent"]["op"] for r in found} == {op}
        assert {r["latent"]["at"] for r in found} == {f"test_cases.py:{line(CASES, tag)}"}
        assert {r["later"]["frames"][0]["line"] for r in found} == {line(CASES, "USE")}
        assert {r["latent"]["function"] for r in found} == {"test_read_back"}
        assert f"test_cases.py::{test}: latent " in out
    # no real race anywhere, and no latent report where a wait or an explicit synchronize orders the pair
    assert [r for r in races if not r.get("latent")] == []
    assert latent_of(races, "test_wait_stream") == latent_of(races, "test_synchronize") == []
    assert latent_of(races, "test_timer") == []  # the timer's sync is explicit without the incidental-sync rule
    assert "latent races (ordered today only by a host sync the program did not ask for; not failing):" in out
    assert "0 new; 4 latent: 0 suppressed, 0 in baseline, 4 new" in out
    flows = [e for e in json.loads((pytester.path / "trace.json").read_text())["traceEvents"]
             if e.get("cat") == "latent race"]
    assert flows and {e["name"].split(" ", 1)[0] for e in flows} == {"latent"}


def test_fail_mode_fails_and_names_the_read_back(pytester):
    result, races = run(pytester, "--streamrace-latent=fail")
    result.assert_outcomes(passed=3, failed=2)
    out = " ".join(result.stdout.str().split())  # the hint is wrapped
    assert "FAILED test_cases.py::test_read_back[item]" in out and "FAILED test_cases.py::test_read_back[cpu]" in out
    for tag, op in (("ITEM", ".item()"), ("CPU", ".cpu()")):
        assert f"ordered today only by {op} at test_cases.py:{line(CASES, tag)} (test_read_back); make 'default " \
               "stream' wait for 'stream created at test_cases.py:" in out
    assert "latent stream race: write-after-write on tensor float32[8]" in out


def test_ini_twin_and_off(pytester):
    pytester.makeini("[pytest]\nstreamrace_latent = fail\n")
    result, _ = run(pytester)
    result.assert_outcomes(passed=3, failed=2)
    result, races = run(pytester, "--streamrace-latent=off")  # the command line wins
    result.assert_outcomes(passed=5)
    assert races == [] and "latent" not in result.stdout.str().split("= streamrace =")[-1]


def test_suppressions_apply_to_latent_races_as_a_kind_of_their_own(pytester):
    # rules without kind:latent leave latent races alone
    result, races = run(pytester, "--streamrace-latent=fail", suppress="file:test_cases.py\nkind:waw\n")
    result.assert_outcomes(passed=3, failed=2)
    assert "stale suppressions" in result.stdout.str()
    result, races = run(pytester, "--streamrace-latent=fail",
                        suppress="kind:latent file:test_cases.py function:test_read_back\n")
    result.assert_outcomes(passed=5)
    assert {r["status"] for r in races} == {"suppressed"}
    assert "s.supp:1  kind:latent file:test_cases.py function:test_read_back" in result.stdout.str()
    result, races = run(pytester, "--streamrace-latent=fail", suppress="kind:latent kind:raw\n")  # none is a RAW
    result.assert_outcomes(passed=3, failed=2)


def test_baseline_keeps_latent_and_real_races_apart(pytester):
    result, _ = run(pytester, "--streamrace-latent=fail", "--streamrace-baseline", "base.json",
                    "--streamrace-baseline-update")
    result.assert_outcomes(passed=5)
    entries = json.loads((pytester.path / "base.json").read_text())["races"]
    assert entries and {e["kind"].split(" ")[0] for e in entries} == {"latent"}
    result, races = run(pytester, "--streamrace-latent=fail", "--streamrace-baseline", "base.json")
    result.assert_outcomes(passed=5)
    assert {r["status"] for r in races} == {"baseline"}
    # the same pairs as real races (the read-back gone): a latent baseline entry does not cover them
    pytester.makepyfile(test_cases=CASES.replace("x.sum().item()                         # ITEM", "pass")
                        .replace("x.cpu()                                # CPU", "pass"), timer=TIMER)
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual", "-p", "no:cacheprovider",
                                           "--streamrace-baseline", "base.json")
    result.assert_outcomes(passed=3, failed=2)
    # and a baseline of those real races does not cover the latent ones
    pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual", "-p", "no:cacheprovider",
                                  "--streamrace-baseline", "real.json", "--streamrace-baseline-update")
    assert {e["kind"] for e in json.loads((pytester.path / "real.json").read_text())["races"]} == \
        {"write-after-write"}
    result, _ = run(pytester, "--streamrace-latent=fail", "--streamrace-baseline", "real.json")
    result.assert_outcomes(passed=3, failed=2)


def test_incidental_sync_rule_turns_a_timer_sync_into_a_latent_report(pytester):
    result, races = run(pytester, suppress="incidental-sync:timer.py\n")
    result.assert_outcomes(passed=5)
    found = latent_of(races, "test_timer")
    assert found, races
    assert {r["latent"]["op"] for r in found} == {"torch.cuda.synchronize() (incidental)"}
    assert {r["latent"]["at"] for r in found} == {f"timer.py:{line(TIMER, 'TIMER-SYNC')}"}
    assert {r["later"]["frames"][0]["line"] for r in found} == {line(CASES, "TIMED-USE")}
    # a sync outside the chosen files stays explicit
    assert latent_of(races, "test_synchronize") == []
    result, _ = run(pytester, "--streamrace-latent=fail", suppress="incidental-sync:timer.py\n")
    result.assert_outcomes(passed=2, failed=3)
    assert "ordered today only by torch.cuda.synchronize() (incidental) at timer.py:" in result.stdout.str()


def test_bad_incidental_rule_is_a_usage_error(pytester):
    pytester.makepyfile(test_cases=CASES, timer=TIMER)
    pytester.path.joinpath("s.supp").write_text("incidental-sync:timer.py kind:raw\n")
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-suppress", "s.supp", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "s.supp:1: bad rule 'incidental-sync:timer.py kind:raw'" in result.stderr.str()


@pytest.mark.parametrize("mode", ["report", "fail"])
def test_github_annotations_are_warnings(pytester, monkeypatch, mode):
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    result, _ = run(pytester, f"--streamrace-latent={mode}", "-k", "read_back and item")
    lines = [text for text in result.outlines if text.startswith("::")]
    assert lines and all(text.startswith("::warning" if mode == "report" else "::error") for text in lines)
    assert all("title=streamrace%3A latent " in text and "except through .item() at test_cases.py:" in text
               for text in lines)


CHILD = """
import torch
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    x = torch.ones(8) * 2
    x.sum().item()
x.add_(1)
"""


@pytest.mark.parametrize("mode, failed", [("report", 0), ("fail", 1), ("off", 0)])
def test_processes_a_test_starts_report_latent_races_under_the_session_mode(pytester, mode, failed):
    pytester.path.joinpath("child_work.py").write_text(CHILD)
    pytester.makepyfile(test_child="""
import subprocess, sys

def test_child():
    subprocess.run([sys.executable, "child_work.py"], check=True)
""")
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual", "--streamrace-json",
                                           "races.json", "-p", "no:cacheprovider", f"--streamrace-latent={mode}")
    result.assert_outcomes(passed=1 - failed, failed=failed)
    races = json.loads((pytester.path / "races.json").read_text())["races"]
    if mode == "off":
        assert races == []
        return
    assert races and all(r["pid"] and r["latent"]["op"] == ".item()" for r in races)
    assert {r["latent"]["at"] for r in races} == {"child_work.py:7"}


def test_a_latent_record_round_trips():
    from pytest_streamrace.detector.hb import HappensBefore, Site
    from pytest_streamrace.races import record

    hb = HappensBefore()
    op = hb.launch("s1", Site("aten::mul", (("t.py", 1, "f"),)))
    hb.access(op, "x", 0, 8, True, ((2,), "float32", None))
    hb.synchronize_stream("s1", implicit=Site(".item()", (("t.py", 2, "f"),)))
    op = hb.launch("s2", Site("aten::add_", (("t.py", 3, "f"),)))
    hb.access(op, "x", 0, 8, True, ((2,), "float32", None))
    (race,) = hb.latent_races
    data = record.from_race(race)
    assert data["kind"] == "write-after-write" and record.kind_of(data) == "latent write-after-write"
    assert data["latent"] == {"op": ".item()", "at": "t.py:2", "function": "f",
                              "frames": [{"file": "t.py", "line": 2, "function": "f"}]}
    assert record.to_race(data).hidden_by == race.hidden_by
    assert record.key(data) != record.key({k: v for k, v in data.items() if k != "latent"})
    text = record.format_records([data])
    assert text.startswith("1 latent stream race") and "ordered today only by .item() at t.py:2 (f)" in text
