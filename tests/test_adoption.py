"""Adopting --streamrace in an existing suite: suppressions, a baseline, report-only mode, CI surfaces — in plain
sessions, under xdist, in distributed items and in a torchrun session, and bad input at the command line."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

# A race in a "third-party framework" (fakeframework/runtime/zero) and a race in the suite's own code.
FRAMEWORK = """
import torch

def reduce_into(x, side):
    with torch.cuda.stream(side):
        x.add_(1)                       # FRAMEWORK-WRITE
"""

SUITE = """
import pytest, torch
from pytest_streamrace.detector.session import active
from fakeframework.runtime.zero.stage import reduce_into

def overlap(device, name=None):
    side = torch.cuda.Stream()
    x = torch.zeros(1000, device=device)
    if name:
        active().name(x, name)
    side.wait_stream(torch.cuda.current_stream())
    reduce_into(x, side)
    y = x * 2                           # SUITE-READ
    torch.cuda.current_stream().wait_stream(side)

def own_overlap(device):
    side = torch.cuda.Stream()
    x = torch.zeros(1000, device=device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.mul_(3)                       # OWN-WRITE
    x.sum()                             # OWN-READ
    torch.cuda.current_stream().wait_stream(side)

def test_bucket(streamrace_device):
    overlap(streamrace_device, "ipg bucket")

def test_own(streamrace_device):
    own_overlap(streamrace_device)

def test_clean():
    pass
"""


def _framework(pytester):
    pytester.mkpydir("fakeframework")
    pytester.mkpydir("fakeframework/runtime")
    pytester.mkpydir("fakeframework/runtime/zero")
    pytester.path.joinpath("fakeframework/runtime/zero/stage.py").write_text(FRAMEWORK)


def _suite(pytester, source=SUITE, name="test_suite"):
    _framework(pytester)
    pytester.makepyfile(**{name: source})


def _line(pytester, marker, name="test_suite.py"):
    source = pytester.path.joinpath(name).read_text().splitlines()
    return next(i for i, text in enumerate(source, 1) if marker in text)


def _closing(result) -> str:
    return next(line for line in result.outlines if line.startswith("streamrace: ") and "checked" in line)


def _run(pytester, *args):
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "--streamrace", *args)


# suppressions


SUPPRESSIONS = """\
# the ZeRO bucket race is upstream's; tracked in deepspeed#1234
file:fakeframework/runtime/zero/* kind:raw
function:own_overlap kind:war   # stale: the race is read-after-write
tensor:nothing*
"""


def test_suppressed_races_pass_and_are_counted_per_rule_with_stale_rules_listed_under_xdist(pytester):
    _suite(pytester)
    pytester.path.joinpath("known.supp").write_text(SUPPRESSIONS)
    result = _run(pytester, "-n", "2", "--streamrace-suppress", "known.supp", "--streamrace-json", "races.json",
                  "--streamrace-trace", "trace.json")
    result.assert_outcomes(passed=2, failed=1)
    assert "FAILED test_suite.py::test_own" in result.stdout.str()
    result.stdout.fnmatch_lines([
        "*= streamrace =*",
        "suppressed (races per rule):",
        "     1  known.supp:2  file:fakeframework/runtime/zero/* kind:raw",
        "stale suppressions (matched nothing in this session):",
        "  known.supp:3  function:own_overlap kind:war",
        "  known.supp:4  tensor:nothing*",
        "new races (failing their tests):",
        f"  test_suite.py::test_own: read-after-write on a tensor at test_suite.py:{_line(pytester, 'OWN-READ')}",
        "streamrace: 3 tests checked, 2 races found: 1 suppressed, 0 in baseline, 1 new",
    ])
    races = json.loads(pytester.path.joinpath("races.json").read_text())["races"]
    by_test = {r["test"].split("::")[1]: r for r in races}
    assert by_test["test_bucket"]["status"] == "suppressed"  # kept in the JSON, marked
    assert by_test["test_bucket"]["suppressed_by"] == {"rule": "known.supp:2",
                                                       "text": "file:fakeframework/runtime/zero/* kind:raw"}
    assert by_test["test_own"]["status"] == "new"
    flows = {e["name"] for e in json.loads(pytester.path.joinpath("trace.json").read_text())["traceEvents"]
             if e.get("ph") == "s"}
    assert flows == {"read-after-write (suppressed)", "read-after-write"}


def test_rules_from_the_ini_relative_to_the_rootdir_add_to_the_command_line_ones(pytester):
    _suite(pytester)
    pytester.mkdir("ci")
    pytester.path.joinpath("ci/upstream.supp").write_text("tensor:ipg*\n")
    pytester.path.joinpath("local.supp").write_text("function:own_overlap\n")
    pytester.makeini("[pytest]\nstreamrace_suppressions =\n    ci/upstream.supp\n")
    pytester.mkdir("sub")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--streamrace", "--streamrace-suppress",
                                           "local.supp")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["     1  ci/upstream.supp:1  tensor:ipg*",
                                 "     1  local.supp:1  function:own_overlap",
                                 "streamrace: 3 tests checked, 2 races found: 2 suppressed, 0 in baseline, 0 new"])
    without = _run(pytester)  # the ini's file alone
    without.assert_outcomes(passed=2, failed=1)


# the baseline


def test_baseline_written_sorted_then_stable_when_lines_move_new_races_fail_fixed_ones_gone(pytester):
    _suite(pytester)
    update = _run(pytester, "-n", "2", "--streamrace-baseline", "ci/streamrace-baseline.json",
                  "--streamrace-baseline-update")
    update.assert_outcomes(passed=3)  # writing the baseline fails nothing
    update.stdout.fnmatch_lines(["baseline written: ci/streamrace-baseline.json (2 races)"])
    text = pytester.path.joinpath("ci/streamrace-baseline.json").read_text()
    assert text.splitlines() == [
        '{"version": 1, "generator": "pytest-streamrace --streamrace-baseline-update", "races": [',
        ' {"test": "test_suite.py::test_bucket", "kind": "read-after-write", "earlier": ["reduce_into", "aten::add_"],'
        ' "later": ["overlap", "aten::mul"]},',
        ' {"test": "test_suite.py::test_own", "kind": "read-after-write", "earlier": ["own_overlap", "aten::mul_"], '
        '"later": ["own_overlap", "aten::sum"]}',
        "]}",
    ]
    assert json.loads(text)["version"] == 1

    # Lines move (three lines inserted on top); test_own is fixed; test_clean gains a race.
    moved = "\n\n\n" + SUITE.replace("    own_overlap(streamrace_device)", "    pass").replace(
        "def test_clean():\n    pass", "def test_clean(streamrace_device):\n    own_overlap(streamrace_device)")
    pytester.makepyfile(test_suite=moved)
    result = _run(pytester, "-n", "2", "--streamrace-baseline", "ci/streamrace-baseline.json")
    result.assert_outcomes(passed=2, failed=1)
    assert "FAILED test_suite.py::test_clean" in result.stdout.str()
    read = _line(pytester, "SUITE-READ")
    result.stdout.fnmatch_lines([
        "in the baseline (reported, not failing):",
        f"  test_suite.py::test_bucket: read-after-write on tensor 'ipg bucket' at test_suite.py:{read}",
        "gone from the baseline (fixed? rewrite it with --streamrace-baseline-update):",
        "  test_suite.py::test_own: read-after-write, aten::mul_ in own_overlap then aten::sum in own_overlap",
        "new races (failing their tests):",
        "  test_suite.py::test_clean: read-after-write on a tensor at test_suite.py:*",
        "streamrace: 3 tests checked, 2 races found: 0 suppressed, 1 in baseline, 1 new",
    ])


def test_update_keeps_entries_of_tests_that_did_not_run(pytester):
    _suite(pytester)
    args = ("--streamrace-baseline", "b.json", "--streamrace-baseline-update")
    _run(pytester, *args).assert_outcomes(passed=3)
    _run(pytester, *args, "-k", "test_clean").assert_outcomes(passed=1, deselected=2)
    tests = [entry["test"] for entry in json.loads(pytester.path.joinpath("b.json").read_text())["races"]]
    assert tests == ["test_suite.py::test_bucket", "test_suite.py::test_own"]


# report-only, CI surfaces


def test_report_only_fails_nothing_and_reports_everything(pytester):
    _suite(pytester)
    result = _run(pytester, "--streamrace-report-only", "--streamrace-json", "races.json")
    result.assert_outcomes(passed=3)
    assert result.ret == 0
    result.stdout.fnmatch_lines([
        "new races (report-only, not failing):",
        "  test_suite.py::test_bucket: read-after-write on tensor 'ipg bucket' at test_suite.py:*",
        "  test_suite.py::test_own: read-after-write on a tensor at test_suite.py:*",
        "streamrace: 3 tests checked, 2 races found: 0 suppressed, 0 in baseline, 2 new (report-only)",
    ])
    assert [r["status"] for r in json.loads(pytester.path.joinpath("races.json").read_text())["races"]] == \
        ["new", "new"]


def test_github_actions_annotations_and_junit_property(pytester, monkeypatch):
    _suite(pytester)
    pytester.path.joinpath("known.supp").write_text("function:own_overlap\n")
    pytester.path.joinpath("b.json").write_text(
        '{"version": 1, "races": [{"test": "test_suite.py::test_bucket", "kind": "read-after-write", '
        '"earlier": ["reduce_into", "aten::add_"], "later": ["overlap", "aten::mul"]}]}\n')
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.delenv("GITHUB_WORKSPACE", raising=False)
    pytester.makepyfile(test_more="""
        import torch

        def test_new(streamrace_device):
            side = torch.cuda.Stream()  # SIDE
            x = torch.zeros(8, device=streamrace_device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                x.add_(1)
            x.mul_(2)  # LATER
            torch.cuda.current_stream().wait_stream(side)
    """)
    result = _run(pytester, "--streamrace-suppress", "known.supp", "--streamrace-baseline", "b.json",
                  "--junitxml", "junit.xml")
    result.assert_outcomes(passed=3, failed=1)
    later = _line(pytester, "LATER", "test_more.py")
    annotations = [line for line in result.outlines if line.startswith("::")]
    assert annotations == [
        f"::error file=test_more.py,line={later},title=streamrace%3A write-after-write::write-after-write on a tensor: "
        f"aten::mul_ on default stream is not ordered after aten::add_ (test_more.py:{later - 1}) on stream created "
        f"at test_more.py:{_line(pytester, 'SIDE', 'test_more.py')} [test_more.py::test_new]",
        f"::warning file=test_suite.py,line={_line(pytester, 'SUITE-READ')},title=streamrace%3A read-after-write "
        f"(in the baseline)::read-after-write on tensor 'ipg bucket': aten::mul on default stream is not ordered "
        f"after aten::add_ (stage.py:6) on stream created at test_suite.py:{_line(pytester, 'side = ')} "
        f"[test_suite.py::test_bucket]",
    ]  # the suppressed race (test_own) has none
    cases = ET.parse(pytester.path / "junit.xml").getroot().iter("testcase")
    counts = {case.get("name"): [p.get("value") for p in case.iter("property") if p.get("name") ==
                                 "streamrace_races"] for case in cases}
    assert counts == {"test_new": ["1"], "test_bucket": ["1"], "test_own": ["1"], "test_clean": ["0"]}

    monkeypatch.delenv("GITHUB_ACTIONS")
    quiet = _run(pytester, "--streamrace-suppress", "known.supp", "--streamrace-baseline", "b.json")
    quiet.assert_outcomes(passed=3, failed=1)
    assert not [line for line in quiet.outlines if line.startswith("::")]


def test_expected_races_are_neither_suppressed_nor_new(pytester):
    _suite(pytester, SUITE + """
@pytest.mark.streamrace(expect="race")
def test_meant_to_race(streamrace_device):
    own_overlap(streamrace_device)
""")
    pytester.path.joinpath("known.supp").write_text("function:test_meant_to_race\n")
    result = _run(pytester, "-k", "meant or clean", "--streamrace-suppress", "known.supp")
    result.assert_outcomes(passed=2, deselected=2)
    result.stdout.fnmatch_lines(["stale suppressions (matched nothing in this session):",
                                 "  known.supp:1  function:test_meant_to_race"])
    assert _closing(result) == ("streamrace: 2 tests checked, 1 race found: 0 suppressed, 0 in baseline, 0 new, "
                                "1 expected")


def test_closing_line_without_races(pytester):
    pytester.makepyfile(test_plain="def test_a():\n    pass\n\ndef test_b():\n    pass\n")
    result = _run(pytester)
    result.assert_outcomes(passed=2)
    assert _closing(result) == "streamrace: 2 tests checked, 0 races found: 0 suppressed, 0 in baseline, 0 new"


# distributed items and torchrun: each rank judges its own races, the printing process merges them

RANKS = """
import pytest, torch

def overlap(device, rank, only_on=None):
    side = torch.cuda.Stream()
    x = torch.zeros(64, device=device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(rank + 1)
    if only_on is None or rank == only_on:
        x.sum()                         # RANK-READ
    torch.cuda.current_stream().wait_stream(side)

@pytest.mark.distributed(world_size=2)
def test_upstream_race(rank, streamrace_device):
    overlap(streamrace_device, rank)

@pytest.mark.distributed(world_size=2)
def test_known_on_rank_1(rank, streamrace_device):
    overlap(streamrace_device, rank, only_on=1)

@pytest.mark.distributed(world_size=2)
def test_new_race(rank, streamrace_device):
    if rank == 0:
        overlap(streamrace_device, rank)
"""


def test_distributed_items_apply_the_levers_per_rank_and_merge(pytester):
    pytester.makepyfile(test_ranks=RANKS.replace("def test_new_race", "def _later_new_race"))
    pytester.path.joinpath("known.supp").write_text("function:test_upstream_race\n")
    levers = ("--streamrace-suppress", "known.supp", "--streamrace-baseline", "b.json")
    update = _run(pytester, *levers, "--streamrace-baseline-update")
    update.assert_outcomes(passed=2)
    entries = json.loads(pytester.path.joinpath("b.json").read_text())["races"]
    assert [e["test"] for e in entries] == ["test_ranks.py::test_known_on_rank_1"]  # suppressed ones left out

    pytester.makepyfile(test_ranks=RANKS)
    result = _run(pytester, *levers)
    result.assert_outcomes(passed=2, failed=1)
    assert "FAILED test_ranks.py::test_new_race" in result.stdout.str()
    result.stdout.fnmatch_lines([
        "     1  known.supp:1  function:test_upstream_race",
        "  test_ranks.py::test_known_on_rank_1: read-after-write on a tensor at test_ranks.py:* (rank 1)",
        "  test_ranks.py::test_new_race: read-after-write on a tensor at test_ranks.py:* (rank 0)",
        "streamrace: 3 tests checked, 3 races found: 1 suppressed, 1 in baseline, 1 new",
    ])
    # the race on both ranks is one race, seen on ranks 0 and 1, and suppressed on each
    assert "test_upstream_race" not in "\n".join(line for line in result.outlines if line.startswith("FAILED"))


def test_torchrun_session_applies_the_levers_on_every_rank_and_rank_0_counts_all(pytester):
    from test_torchrun import torchrun

    pytester.makepyfile(test_ranks=RANKS)
    pytester.path.joinpath("known.supp").write_text("function:test_upstream_race\n")
    levers = ("--streamrace", "--streamrace-suppress", "known.supp", "--streamrace-baseline", "b.json")
    update = torchrun(pytester.path, *levers, "--streamrace-baseline-update", "-k", "not test_new_race")
    assert update.returncode == 0, update.stdout
    # only rank 0 writes the baseline, and the race only rank 1 saw reached it
    entries = json.loads(pytester.path.joinpath("b.json").read_text())["races"]
    assert [e["test"] for e in entries] == ["test_ranks.py::test_known_on_rank_1"]

    proc = torchrun(pytester.path, *levers, "--junitxml", "junit.xml")
    assert proc.returncode != 0
    out = proc.stdout
    assert "1 failed, 2 passed" in out, out
    assert "FAILED test_ranks.py::test_new_race" in out
    assert "     1  known.supp:1  function:test_upstream_race" in out
    assert "test_ranks.py::test_known_on_rank_1: read-after-write on a tensor at test_ranks.py:" in out
    assert out.count("streamrace: 3 tests checked, 3 races found: 1 suppressed, 1 in baseline, 1 new") == 1
    cases = ET.parse(pytester.path / "junit.xml").getroot().iter("testcase")
    counts = {case.get("name"): [p.get("value") for p in case.iter("property") if p.get("name") ==
                                 "streamrace_races"] for case in cases}
    # rank 0 counts every rank's races: test_upstream_race raced on both ranks (one race, merged)
    assert counts == {"test_upstream_race": ["1"], "test_known_on_rank_1": ["1"], "test_new_race": ["1"]}


# bad input: one line, exit 4 (a usage error), no traceback


@pytest.mark.parametrize("files, args, message", [
    ({"s.supp": "# fine\nkind:raw file:x.py\nkind:rwa\n"}, ["--streamrace-suppress", "s.supp"],
     "ERROR: streamrace: s.supp:3: bad suppression term 'kind:rwa': kind is one of raw, war, waw, free, latent"),
    ({"s.supp": "file:a.py colour:red\n"}, ["--streamrace-suppress", "s.supp"],
     "ERROR: streamrace: s.supp:1: bad suppression term 'colour:red': expected KEY:GLOB with KEY one of kind, file, "
     "function, tensor"),
    ({"s.supp": "deepspeed/runtime/zero/*\n"}, ["--streamrace-suppress", "s.supp"],
     "ERROR: streamrace: s.supp:1: bad suppression term 'deepspeed/runtime/zero/*': expected KEY:GLOB *"),
    ({"s.supp": "function:\n"}, ["--streamrace-suppress", "s.supp"],
     "ERROR: streamrace: s.supp:1: bad suppression term 'function:': the glob after 'function:' is empty"),
    ({"tox.ini": "[pytest]\nstreamrace_suppressions = ci/none.supp\n"}, [],
     "ERROR: streamrace: cannot read suppression file ci/none.supp: No such file or directory"),
    ({}, ["--streamrace-baseline", "b.json"],
     "ERROR: streamrace: cannot read baseline b.json: no such file (write it with --streamrace-baseline-update)"),
    ({"b.json": "{not json"}, ["--streamrace-baseline", "b.json"],
     "ERROR: streamrace: cannot read baseline b.json: not JSON (*)"),
    ({"b.json": '{"races": []}'}, ["--streamrace-baseline", "b.json"],
     "ERROR: streamrace: cannot read baseline b.json: not a streamrace baseline of schema version 1"),
    ({"b.json": '{"version": 2, "races": [{"test": "t", "new": "field"}]}'}, ["--streamrace-baseline", "b.json"],
     "ERROR: streamrace: baseline b.json was written by a newer pytest-streamrace (schema version 2; this one reads "
     "version 1): upgrade pytest-streamrace or rewrite it with --streamrace-baseline-update"),
    ({"b.json": '{"version": 2, "races": []}'}, ["--streamrace-baseline", "b.json", "--streamrace-baseline-update"],
     "ERROR: streamrace: baseline b.json was written by a newer pytest-streamrace*"),
    ({}, ["--streamrace-baseline-update"],
     "ERROR: streamrace: --streamrace-baseline-update needs --streamrace-baseline FILE (the file to write)"),
], ids=["bad-kind", "bad-key", "no-colon", "empty-glob", "missing-ini-file", "missing-baseline", "not-json",
        "not-a-baseline", "newer-schema", "newer-schema-update", "update-without-file"])
def test_bad_input_is_one_line_and_exit_4(pytester, files, args, message):
    pytester.makepyfile(test_plain="def test_ok():\n    pass\n")
    for name, text in files.items():
        pytester.path.joinpath(name).write_text(text)
    result = _run(pytester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert len(result.errlines) == 1, result.errlines
    result.stderr.fnmatch_lines([message])
    assert "Traceback" not in result.stdout.str() + result.stderr.str()
    assert "test_ok" not in result.stdout.str()  # nothing ran
    if "b.json" in files:
        assert pytester.path.joinpath("b.json").read_text() == files["b.json"]  # never overwritten


def test_help_lists_the_levers_even_with_a_bad_baseline(pytester):
    result = _run(pytester, "--streamrace-baseline", "missing.json", "--help")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*--streamrace-suppress=FILE*", "*--streamrace-baseline=FILE*",
                                 "*--streamrace-baseline-update*", "*--streamrace-report-only*",
                                 "*streamrace_suppressions (linelist)*"])


# units: rule matching and the baseline file


def _race(kind="read-after-write", tensor="ipg bucket", earlier=(("/venv/site-packages/deepspeed/runtime/zero/"
          "stage3.py", 10, "reduce"),), later=(("/repo/tests/test_x.py", 5, "step"),)):
    def frames(fs):
        return [{"file": f, "line": n, "function": fn} for f, n, fn in fs]

    return {"kind": kind, "tensor": {"name": tensor, "shape": [4], "dtype": "torch.float32"},
            "earlier": {"op": "aten::add_", "frames": frames(earlier)},
            "later": {"op": "aten::mul", "frames": frames(later)}}


@pytest.mark.parametrize("rule, matches", [
    ("file:deepspeed/runtime/zero/*", True),  # a trailing part of the path
    ("file:/venv/site-packages/deepspeed/*", True),  # the whole path
    ("file:runtime/zero", False),  # a directory is not a file: use runtime/zero/*
    ("file:tests/test_x.py kind:raw", True),  # either access
    ("file:tests/test_x.py kind:war", False),  # every term must match
    ("function:red*", True),
    ("function:Reduce", False),  # case-sensitive
    ("tensor:ipg*", True),
    ("tensor:ipg", False),
    ("kind:free", False),
])
def test_rule_terms(rule, matches):
    from pytest_streamrace.races import policy

    (parsed,) = policy.parse_rules(rule, "s.supp")
    assert parsed.matches(_race()) is matches


def test_first_matching_rule_wins_and_comments_are_ignored():
    from pytest_streamrace.races import policy

    rules = policy.parse_rules("# header\n\nkind:raw  # all of them\ntensor:ipg*\n", "s.supp")
    assert [(r.where, r.text) for r in rules] == [("s.supp:3", "kind:raw"), ("s.supp:4", "tensor:ipg*")]
    assert policy.matching_rule(rules, _race()).where == "s.supp:3"
    assert policy.matching_rule(rules, _race(kind="write-after-read")).where == "s.supp:4"
    assert policy.matching_rule(rules, _race(kind="write-after-read", tensor=None)) is None


def test_baseline_signature_ignores_lines_and_ranks_and_round_trips(tmp_path):
    from pytest_streamrace.races import policy

    moved = _race(earlier=(("/x/stage3.py", 99, "reduce"),), later=(("/repo/tests/test_x.py", 50, "step"),))
    assert policy.signature("t::a", _race()) == policy.signature("t::a", dict(moved, rank=1)) == \
        ("t::a", "read-after-write", "reduce", "aten::add_", "step", "aten::mul")
    assert policy.signature("t::b", _race()) != policy.signature("t::a", _race())
    sigs = {policy.signature(t, _race()) for t in ("t::b", "t::a")}
    path = tmp_path / "sub" / "b.json"
    policy.write_baseline(str(path), sigs)
    assert policy.load_baseline(str(path), str(tmp_path)) == sigs
    lines = path.read_text().splitlines()
    assert lines[1] < lines[2] and len(lines) == 4  # sorted, one a line
