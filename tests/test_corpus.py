"""The race corpus under `pytest --streamrace` (virtual backend): every verdict right, with the right kind, from the
C++ capture and core (its records applied inline and by its applier thread) and from the pure-Python fallback (``STREAMRACE_NATIVE=0``: a machine without a compiler)."""

import json
from pathlib import Path

import pytest

CORPUS = Path(__file__).parent / "corpus" / "corpus_cases.py"

RACY = {
    "test_raw_side_write_default_read": "read-after-write",
    "test_war_default_read_side_write": "write-after-read",
    "test_waw_two_side_streams": "write-after-write",
    "test_overlapping_views_at_other_offsets": "read-after-write",
    "test_event_recorded_before_the_write": "read-after-write",
    "test_wait_on_the_wrong_stream": "read-after-write",
    "test_hook_on_side_stream_consumed_on_unsynced_stream": "read-after-write",
    "test_multi_producer_bucket_reduction_waits_on_one_producer": "write-after-write",
    "test_backward_on_side_stream_grad_read_without_wait": "read-after-write",
    "test_async_collective_output_read_before_wait": "read-after-write",
    "test_sync_collective_output_read_on_another_stream": "read-after-write",
    "test_collective_on_stream_that_waited_on_the_wrong_stream": "write-after-write",
    "test_free_while_another_stream_reads": "free-while-in-use",
}


@pytest.mark.parametrize("native, applier", [("1", "inline"), ("1", "thread"), ("0", "inline")],
                         ids=["native", "applier-thread", "fallback"])
def test_corpus_verdicts_and_kinds(pytester, monkeypatch, native, applier):
    monkeypatch.setenv("STREAMRACE_NATIVE", native)
    monkeypatch.setenv("STREAMRACE_APPLIER", applier)  # the records applied by the capture's thread, or inline
    result = pytester.runpytest_subprocess(str(CORPUS), "--streamrace", "-p", "no:cacheprovider",
                                           "--streamrace-json", "races.json", "-rf")
    result.assert_outcomes(passed=2 * len(RACY))
    found: dict[str, set] = {}
    for race in json.loads(pytester.path.joinpath("races.json").read_text())["races"]:
        found.setdefault(race["test"].rsplit("::", 1)[1], set()).add(race["kind"])
    assert set(found) == set(RACY), "clean twins must report nothing, racy ones something"
    for test, kind in RACY.items():
        assert kind in found[test], (test, found[test])


def test_flipped_verdicts_fail_every_racy_case(pytester):
    """The same racy cases fail when their expected verdict is flipped: the markers are not what makes them pass."""
    flipped = CORPUS.read_text().replace('race = pytest.mark.streamrace(expect="race")',
                                         'race = pytest.mark.streamrace(expect="clean")')
    pytester.makepyfile(corpus_flipped=flipped)
    result = pytester.runpytest_subprocess("corpus_flipped.py", "--streamrace", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=len(RACY), failed=len(RACY))
