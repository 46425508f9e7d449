"""--streamrace-nondefault-stream: the test body runs on a fresh stream, which exposes code that assumes the
default stream."""

ASSUMES_DEFAULT = """
import torch
from pytest_streamrace.forcing import streams

def test_runs_on_a_fresh_stream():
    assert streams.label(torch.cuda.current_stream()) == "test stream"
    assert torch.cuda.current_stream() is not torch.cuda.default_stream()

def test_waits_on_the_default_stream_instead_of_the_current_one(streamrace_device):
    x = torch.ones(1000, device=streamrace_device) * 2
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.default_stream())  # the bug: means torch.cuda.current_stream()
    with torch.cuda.stream(side):
        x.sum()
    torch.cuda.current_stream().wait_stream(side)
"""


def test_default_stream_assumptions_race_only_on_a_nondefault_stream(pytester):
    pytester.makepyfile(test_streams=ASSUMES_DEFAULT)
    plain = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual", "-p", "no:cacheprovider")
    plain.assert_outcomes(passed=1, failed=1)  # the first test fails: it is on the default stream
    assert "stream race" not in plain.stdout.str()
    forced = pytester.runpytest_subprocess(
        "--streamrace", "--streamrace-backend=virtual", "--streamrace-nondefault-stream", "-p", "no:cacheprovider")
    forced.assert_outcomes(passed=1, failed=1)
    forced.stdout.fnmatch_lines([
        "*_ test_waits_on_the_default_stream_instead_of_the_current_one _*",
        "stream race: read-after-write on tensor float32[[]1000[]]*",
        "*earlier  write  aten::mul  on test stream (streamrace forcing)*",
    ])


def test_nondefault_stream_without_streams_is_a_usage_error(pytester):
    pytester.makepyfile("def test_ok(): pass")
    result = pytester.runpytest_subprocess("--streamrace-nondefault-stream", "-p", "no:cacheprovider")
    assert result.ret == 4
    result.stderr.fnmatch_lines(["ERROR: --streamrace-nondefault-stream needs CUDA streams: run on a GPU, or add "
                                 "--streamrace to use virtual streams on CPU"])
