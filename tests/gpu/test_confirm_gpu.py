"""--streamrace-confirm on real streams (cuda backend): the twins of tests/test_confirm.py, the race corpus, and on 2
GPUs an async NCCL collective's buffer read before wait() (issued on the test's thread, and on another) and a bucket
all-reduced before its copy, each race held back by a sleep kernel on its stream."""

import json

import pytest

import test_confirm as twins
import test_confirm_identity as identity

CLAIMS = {
    45: "`--streamrace-confirm` on real streams: each race forced into its bad order by a sleep kernel on the held "
        "stream; racy twins (read-after-write, write-after-read, write-after-write) confirmed with the values that "
        "changed, a write of the same values not confirmed, a latent race not tried; the corpus: every racy case "
        "confirmed or not confirmed/not tried with its reason; found in the re-run by what the accesses are: a pool "
        "task run by another worker, an output made on a side stream, a read freed while in use, each confirmed",
    46: "`--streamrace-confirm` on 2 ranks over NCCL: an async all-reduce's buffer read before `wait()` confirmed "
        "(the last rank holds its collective back; its peer reads the bytes from before it), and the same with the "
        "collective issued on another thread; a bucket filled on a side stream and all-reduced in place with no wait "
        "on it confirmed on both ranks",
}

pytestmark = pytest.mark.gpu


@pytest.mark.validates(45)
def test_each_race_is_forced_on_real_streams(pytester, gpu_result):
    result, by_test, runs = twins.run_cases(pytester, "cuda")
    twins.check_cases(pytester, result, by_test, runs)
    gpu_result.record("confirm seconds (5 tests with races)", twins.confirm_seconds(by_test))


@pytest.mark.validates(45)
def test_every_racy_case_of_the_corpus_is_confirmed_or_shown_benign_on_real_streams(pytester, gpu_result):
    confirmations = twins.check_corpus(pytester, "cuda")
    gpu_result.record("corpus verdicts", "13 racy cases as expected")
    gpu_result.record("free-while-in-use", confirmations[twins.FREED]["status"])


@pytest.mark.validates(45)
def test_each_race_is_found_by_what_its_accesses_are_on_real_streams(pytester, gpu_result):
    """A pool task run by another worker in each run, a fresh output made on a side stream (its memory filled with
    0xFF during the hold: an earlier pass may have left the very values there), a read freed while in use (held past
    its free, it sees what the block's next owner wrote: 0xFF, written at the free on the block's stream as its next
    owner would, or the zeros of the test's own next owners): each confirmed on real streams."""
    result, by_test, runs = identity.run(pytester, "cuda")
    identity.check(pytester, result, by_test, runs)
    gpu_result.record("confirm seconds (3 tests with races)", twins.confirm_seconds(by_test))


def _record(gpu_result, pytester) -> None:
    """What the forced re-runs measured, from rank 0's confirmation: the hold, how far the order inverted, the
    values."""
    found = json.loads((pytester.path / "races.json").read_text())["races"]
    confirmation = min(found, key=lambda r: r.get("rank", 0))["confirmation"]
    gpu_result.record("hold ms", confirmation.get("delay_ms"))
    gpu_result.record("lead ms", confirmation.get("lead_ms"))
    gpu_result.record("max |Δ|", confirmation.get("max_abs_diff"))
    gpu_result.record("elements", f'{confirmation.get("differing")} of {confirmation.get("elements")}')
    gpu_result.record("re-runs s", confirmation.get("test_seconds"))


@pytest.mark.validates(46)
@pytest.mark.gpu(count=2)
def test_a_collective_read_before_wait_is_confirmed_on_nccl(pytester, gpu_result):
    twins.check_collective(pytester, "cuda")
    _record(gpu_result, pytester)


@pytest.mark.validates(46)
@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("source", [twins.THREADED, twins.THREADED_ALIVE], ids=["joined", "alive"])
def test_a_collective_issued_on_another_thread_is_found_there_on_nccl(pytester, gpu_result, source):
    twins.check_collective(pytester, "cuda", source, thread="reducer")
    _record(gpu_result, pytester)


@pytest.mark.validates(46)
@pytest.mark.gpu(count=2)
def test_a_bucket_all_reduced_before_its_copy_is_confirmed_on_nccl(pytester, gpu_result):
    twins.check_bucket(pytester, "cuda")
    _record(gpu_result, pytester)
