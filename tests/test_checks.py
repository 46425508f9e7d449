"""`pytest --streamrace` as users run it: verdicts, markers, the JSON and trace files, xdist, bad input."""

import json

import pytest

RACY_AND_CLEAN = """
import pytest, torch

def test_racy(streamrace_device):
    side = torch.cuda.Stream()
    x = torch.zeros(1000, device=streamrace_device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1)                       # RACY-WRITE
    y = x * 2                           # RACY-READ
    torch.cuda.current_stream().wait_stream(side)

def test_clean(streamrace_device):
    side = torch.cuda.Stream()
    x = torch.zeros(1000, device=streamrace_device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    y = x * 2

@pytest.mark.streamrace(expect="race")
def test_expected_race(streamrace_device):
    test_racy(streamrace_device)

@pytest.mark.streamrace(expect="race")
def test_expected_race_missing(streamrace_device):
    test_clean(streamrace_device)
"""


def _line(pytester, marker):
    source = pytester.path.joinpath("test_streams.py").read_text().splitlines()
    return next(i for i, text in enumerate(source, 1) if marker in text)


def test_racy_test_fails_with_kind_and_both_locations(pytester):
    pytester.makepyfile(test_streams=RACY_AND_CLEAN)
    result = pytester.runpytest_subprocess("--streamrace")
    result.assert_outcomes(passed=2, failed=2)
    write, read = _line(pytester, "RACY-WRITE"), _line(pytester, "RACY-READ")
    result.stdout.fnmatch_lines([
        "*streamrace: CPU-only; not under torchrun; race checks on (virtual backend)*",
        "*_ test_racy _*",
        "stream race: read-after-write on tensor float32[[]1000[]] (allocated at test_streams.py:*",
        f"*earlier*write*aten::add_*on stream created at test_streams.py:*at test_streams.py:{write} (test_racy)",
        f"*later*read*aten::mul*on default stream*at test_streams.py:{read} (test_racy)",
        "*_ test_expected_race_missing _*",
        "*expected a stream race*none was detected*",
    ])
    assert "test_clean" not in "\n".join(l for l in result.outlines if l.startswith("FAILED"))


def test_without_streamrace_nothing_is_checked(pytester):
    pytester.makepyfile(test_plain="def test_ok():\n    pass\n")
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*race checks off (--streamrace to enable)*"])


def test_json_and_trace_files_under_xdist(pytester):
    pytester.makepyfile(test_streams=RACY_AND_CLEAN)
    result = pytester.runpytest_subprocess("--streamrace", "-n", "2", "--streamrace-json", "races.json",
                                           "--streamrace-trace", "trace.json")
    result.assert_outcomes(passed=2, failed=2)
    doc = json.loads(pytester.path.joinpath("races.json").read_text())
    assert doc["version"] == 1
    by_test = {}
    for race in doc["races"]:
        by_test.setdefault(race["test"].split("::")[1], []).append(race)
    assert set(by_test) == {"test_racy", "test_expected_race"}  # expected races are recorded too
    raw = [r for r in by_test["test_racy"] if r["kind"] == "read-after-write"]
    assert len(raw) == 1
    assert raw[0]["earlier"]["op"] == "aten::add_" and raw[0]["later"]["op"] == "aten::mul"
    assert raw[0]["later"]["frames"][0]["line"] == _line(pytester, "RACY-READ")

    trace = json.loads(pytester.path.joinpath("trace.json").read_text())["traceEvents"]
    processes = {e["args"]["name"] for e in trace if e.get("name") == "process_name"}
    assert {"test_streams.py::test_racy (pytest)", "test_streams.py::test_clean (pytest)"} <= processes
    flows = [e for e in trace if e.get("ph") in ("s", "f")]
    assert flows and len(flows) % 2 == 0


@pytest.mark.parametrize("args, message", [
    (["--streamrace", "--streamrace-backend=cuda"], "--streamrace-backend=cuda needs a GPU, and none is visible*"),
    (["--streamrace", "--streamrace-backend=gpu"], "ERROR: streamrace: --streamrace-backend = 'gpu': expected one of "
                                                   "auto, cuda, virtual"),
    (["--streamrace", "-o", "streamrace_backend=gpu"], "*ini streamrace_backend = 'gpu': expected one of*"),
])
def test_bad_backend_is_a_one_line_usage_error(pytester, args, message):
    pytester.makepyfile(test_plain="def test_ok():\n    pass\n")
    result = pytester.runpytest_subprocess(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}"])
    assert "Traceback" not in result.stderr.str()


def test_bad_expect_value_is_one_error_for_its_test(pytester):
    pytester.makepyfile(test_bad="""
        import pytest
        @pytest.mark.streamrace(expect="maybe")
        def test_x():
            pass
    """)
    result = pytester.runpytest_subprocess("--streamrace")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["@pytest.mark.streamrace: expect must be 'race' or 'clean', got 'maybe'"])
    assert "KeyError" not in result.stdout.str() and "Traceback" not in result.stdout.str()


def test_distributed_item_detects_in_every_rank_and_merges_into_the_json(pytester):
    pytester.makepyfile(test_ranks="""
        import pytest, torch

        @pytest.mark.distributed(world_size=2)
        def test_racy_on_each_rank(rank, streamrace_device):
            side = torch.cuda.Stream()
            x = torch.zeros(64, device=streamrace_device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                x.add_(rank + 1)
            x.sum()  # RACY-READ
            torch.cuda.current_stream().wait_stream(side)
    """)
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-json", "races.json")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["distributed test failed on ranks 0, 1 of 2",
                                 "*stream race on rank 0: read-after-write*",
                                 "*stream race on rank 1: read-after-write*"])
    races = json.loads(pytester.path.joinpath("races.json").read_text())["races"]
    assert sorted(r["rank"] for r in races if r["kind"] == "read-after-write") == [0, 1]
    assert all(r["test"] == "test_ranks.py::test_racy_on_each_rank" for r in races)
