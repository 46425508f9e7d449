"""A race is a test failure like any other: pytest's xfail and skip handling applies to it."""

TWINS = """
import pytest, torch
from pytest_streamrace import StreamRaceError

def racy(device):
    side = torch.cuda.Stream()
    x = torch.zeros(1000, device=device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1)
    y = x * 2                           # read on the default stream, no wait: a race
    torch.cuda.current_stream().wait_stream(side)

def clean(device):
    side = torch.cuda.Stream()
    x = torch.zeros(1000, device=device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    y = x * 2

@pytest.mark.xfail(strict=True, reason="known race")
def test_strict_racy(streamrace_device):
    racy(streamrace_device)

@pytest.mark.xfail(strict=True, reason="known race")
def test_strict_clean(streamrace_device):
    clean(streamrace_device)

@pytest.mark.xfail(reason="known race")
def test_lax_racy(streamrace_device):
    racy(streamrace_device)

@pytest.mark.xfail(reason="known race")
def test_lax_clean(streamrace_device):
    clean(streamrace_device)

@pytest.mark.xfail(raises=StreamRaceError, strict=True)
def test_raises_race_racy(streamrace_device):
    racy(streamrace_device)

@pytest.mark.xfail(raises=StreamRaceError, strict=True)
def test_raises_race_clean(streamrace_device):
    clean(streamrace_device)

@pytest.mark.xfail(raises=ValueError)
def test_raises_other_racy(streamrace_device):
    racy(streamrace_device)

@pytest.mark.xfail(raises=ValueError)
def test_raises_other_clean(streamrace_device):
    clean(streamrace_device)
    raise ValueError("the failure this test expects")

@pytest.mark.skip(reason="not today")
def test_skipped_racy(streamrace_device):
    racy(streamrace_device)

def test_skip_after_race(streamrace_device):
    racy(streamrace_device)
    pytest.skip("skipped after its race")

def test_skip_after_clean(streamrace_device):
    clean(streamrace_device)
    pytest.skip("skipped after clean work")
"""


def test_xfail_and_skip_handle_races_as_failures(pytester):
    pytester.makepyfile(test_twins=TWINS)
    result = pytester.runpytest_subprocess("--streamrace", "-p", "no:randomly", "-rA")
    result.stdout.fnmatch_lines_random([
        "XFAIL test_twins.py::test_strict_racy - known race",
        "FAILED test_twins.py::test_strict_clean*",
        "XFAIL test_twins.py::test_lax_racy - known race",
        "XPASS test_twins.py::test_lax_clean*",
        "XFAIL test_twins.py::test_raises_race_racy*",
        "FAILED test_twins.py::test_raises_race_clean*",
        "FAILED test_twins.py::test_raises_other_racy*",
        "XFAIL test_twins.py::test_raises_other_clean*",
        "SKIPPED [[]1[]] test_twins.py:*: not today",
        "SKIPPED [[]1[]] test_twins.py:*: skipped after its race",
        "SKIPPED [[]1[]] test_twins.py:*: skipped after clean work",
    ])
    result.assert_outcomes(failed=3, xfailed=4, xpassed=1, skipped=3)
    # tests that ran to their end are checked, xfail ones included (not skipped ones); every race is counted
    result.stdout.fnmatch_lines(["streamrace: 8 tests checked, 5 races found: 0 suppressed, 0 in baseline, 5 new"])
    out = result.stdout.str()
    assert "[XPASS(strict)] known race" in out  # the clean twin of a strict xfail fails as pytest's own would
    # xfail(raises=ValueError) does not expect a race: the test fails with the race's text, not a traceback
    failure = out.split("_ test_raises_other_racy _")[1].split("\n_")[0]
    assert "stream race: read-after-write on tensor float32[1000]" in failure
    assert "StreamRaceError" not in failure and "Traceback" not in failure


def test_a_race_in_teardown_under_xfail_is_handled_as_a_teardown_exception_is(pytester):
    pytester.makepyfile(test_teardown="""
        import pytest, torch

        @pytest.fixture
        def races_at_teardown(streamrace_device):
            yield
            side = torch.cuda.Stream()
            x = torch.zeros(10, device=streamrace_device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                x.add_(1)
            y = x * 2

        @pytest.fixture
        def raises_at_teardown():
            yield
            raise RuntimeError("teardown failed")

        @pytest.fixture
        def clean_teardown(streamrace_device):
            yield
            torch.zeros(10, device=streamrace_device).add_(1)

        @pytest.mark.xfail(reason="teardown")
        def test_race(races_at_teardown):
            pass

        @pytest.mark.xfail(reason="teardown")
        def test_exception(raises_at_teardown):
            pass

        @pytest.mark.xfail(reason="teardown")
        def test_clean(clean_teardown):
            pass

        def test_race_not_expected(races_at_teardown):
            pass
    """)
    result = pytester.runpytest_subprocess("--streamrace", "-p", "no:randomly", "-rA")
    # pytest's rule for a teardown exception under xfail: the call passed (XPASS), the teardown is the xfail
    result.stdout.fnmatch_lines_random([
        "XFAIL at teardown of test_teardown.py::test_race - teardown",
        "XFAIL at teardown of test_teardown.py::test_exception - teardown",
        "XPASS test_teardown.py::test_race - teardown",
        "XPASS test_teardown.py::test_exception - teardown",
        "XPASS test_teardown.py::test_clean - teardown",
        "ERROR test_teardown.py::test_race_not_expected - 1 stream race*",
    ])
    result.assert_outcomes(passed=1, xpassed=3, xfailed=2, errors=1)


def test_strict_xfail_on_a_distributed_item(pytester):
    pytester.makepyfile(test_ranks=TWINS.split("@pytest.mark.xfail")[0] + """
@pytest.mark.xfail(strict=True, reason="known race")
@pytest.mark.distributed(world_size=2)
def test_racy_ranks(rank, streamrace_device):
    racy(streamrace_device)

@pytest.mark.xfail(strict=True, reason="known race")
@pytest.mark.distributed(world_size=2)
def test_clean_ranks(rank, streamrace_device):
    clean(streamrace_device)
""")
    result = pytester.runpytest_subprocess("--streamrace", "-p", "no:randomly", "-rA")
    result.stdout.fnmatch_lines_random(["XFAIL test_ranks.py::test_racy_ranks - known race",
                                        "FAILED test_ranks.py::test_clean_ranks*"])
    result.assert_outcomes(failed=1, xfailed=1)
    assert "[XPASS(strict)] known race" in result.stdout.str()
