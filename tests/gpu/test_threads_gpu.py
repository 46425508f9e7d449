"""The thread twins of tests/test_thread_handoffs.py on real CUDA streams (cuda backend): a synchronize orders only
the thread that made it, each modelled handoff carries it, a race on a library's thread names a frame and the thread,
and races on started threads and pool workers are confirmed (tests/test_threads.py's twins)."""

import importlib.util
import os

import pytest

CLAIMS = {30: "Threads on real streams: a synchronize (device, stream, event, query, read-back) on another thread "
              "orders nothing here; each modelled handoff (locks, conditions, events, semaphores, barriers, queues, "
              "futures, submit, start/join) carries it; a race on a library's thread names a frame and the thread; "
              "races on started threads and pool workers confirmed by --streamrace-confirm"}

pytestmark = [pytest.mark.gpu, pytest.mark.validates(30)]


def _cpu_twins():
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "test_thread_handoffs.py")
    spec = importlib.util.spec_from_file_location("thread_handoff_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TWINS = _cpu_twins()


@pytest.mark.parametrize("latent", ["report", "fail"])
def test_syncs_and_handoffs_on_threads_on_real_streams(pytester, latent, gpu_result):
    pytester.makepyfile(test_handoffs=TWINS.CASES)
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=cuda",
                                           f"--streamrace-latent={latent}", "-p", "no:cacheprovider", "-q")
    twins = 6 + 1 + 11 * 3 + 5 + 1
    result.assert_outcomes(passed=twins)
    gpu_result.record("twins right", f"{twins} of {twins}")


def test_races_on_library_threads_name_a_frame_and_the_thread_on_real_streams(pytester, gpu_result):
    pytester.makepyfile(test_library_threads=TWINS.LIBRARY_THREADS)
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=cuda", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*on thread 'stager_0', work submitted at test_library_threads.py:*"])
    result.stdout.fnmatch_lines(["*on thread 'copier', started at test_library_threads.py:*"])
    gpu_result.record("named", "'stager_0' (work submitted), 'copier' (started)")


def test_races_on_other_threads_are_confirmed_on_real_streams(pytester, gpu_result):
    import test_threads

    gpu_result.record("summary", test_threads.check_thread_races_confirmed(pytester, "cuda"))
