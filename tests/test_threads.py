"""Races on Python threads other than the test's, through pytest as users run it (virtual backend): a user thread, a
thread pool's worker and the ranks of a MultiThreadedTestCase, each with a racy and a clean twin. Joining a thread or
waiting for a future orders the host, not the streams: only a stream wait or an event does. Threads that started
before the test (a pool's worker, a module fixture's thread) are checked in the test their work runs in."""

import json
import re

USER_THREADS = """
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest, torch

EARLY_POOL = ThreadPoolExecutor(max_workers=1)
EARLY_POOL.submit(lambda: None).result()  # its worker starts at import, before any test's session

def stage(x, done=None):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.mul_(2)                                   # STAGED
    if done is not None:
        done.record(side)


def test_thread_joined_without_stream_wait(streamrace_device):
    x = torch.ones(64, device=streamrace_device)
    worker = threading.Thread(target=stage, args=(x,))
    worker.start()                                  # JOINED-START
    worker.join()
    x.sum()                                         # READ-AFTER-JOIN


def test_thread_joined_then_event_waited(streamrace_device):
    x = torch.ones(64, device=streamrace_device)
    done = torch.cuda.Event()
    worker = threading.Thread(target=stage, args=(x, done))
    worker.start()
    worker.join()
    torch.cuda.current_stream().wait_event(done)
    x.sum()


def test_pool_result_without_stream_wait(streamrace_device):
    x = torch.ones(64, device=streamrace_device)
    with ThreadPoolExecutor(max_workers=2) as pool:
        pool.submit(stage, x).result()              # SUBMITTED
    x.sum()                                         # READ-AFTER-RESULT


def test_pool_started_before_the_test(streamrace_device):
    x = torch.ones(64, device=streamrace_device)
    EARLY_POOL.submit(stage, x).result()
    x.sum()                                         # READ-AFTER-EARLY-POOL


def test_pool_result_then_event_waited(streamrace_device):
    x = torch.ones(64, device=streamrace_device)
    done = torch.cuda.Event()
    with ThreadPoolExecutor(max_workers=2) as pool:
        pool.submit(stage, x, done).result()
    torch.cuda.current_stream().wait_event(done)
    x.sum()


JOBS = queue.Queue()


@pytest.fixture(scope="module")
def long_lived_worker():  # started during the first test that uses it; serves the module's later tests too
    def serve():
        for job in iter(JOBS.get, None):
            job()
    worker = threading.Thread(target=serve, daemon=True)
    worker.start()
    yield
    JOBS.put(None)
    worker.join()


def test_long_lived_worker_starts(long_lived_worker):
    pass


def test_long_lived_worker_serves_a_later_test(long_lived_worker, streamrace_device):
    x = torch.ones(64, device=streamrace_device)
    done = threading.Event()
    JOBS.put(lambda: (stage(x), done.set()))
    done.wait()
    x.sum()                                         # READ-AFTER-LONG-LIVED


def test_each_thread_has_its_own_current_stream(streamrace_device):
    side = torch.cuda.Stream()
    x = torch.ones(64, device=streamrace_device)
    seen = []
    with torch.cuda.stream(side):                   # current here, not in the worker
        worker = threading.Thread(target=lambda: seen.append(torch.cuda.current_stream()) or x.add_(1))
        worker.start()
        worker.join()
    assert seen == [torch.cuda.default_stream()]
    x.sum()                                         # same stream as the worker's add_: clean
"""

RANKS = """
import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiThreadedTestCase


class TestRanks(MultiThreadedTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_threads()

    def _written_on_side_stream(self):
        x = torch.ones(64) * (dist.get_rank() + 1)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.mul_(2)                               # RANK-WRITE
        return x, side

    def test_reduced_without_waiting_for_the_side_stream(self):
        x, side = self._written_on_side_stream()
        dist.all_reduce(x)                          # RANK-REDUCE

    def test_read_before_the_async_collective_is_waited(self):
        x, side = self._written_on_side_stream()
        torch.cuda.current_stream().wait_stream(side)
        work = dist.all_reduce(x, async_op=True)
        x.sum()                                     # RANK-EARLY-READ
        work.wait()

    def test_waited_collectives_are_clean(self):
        x, side = self._written_on_side_stream()
        torch.cuda.current_stream().wait_stream(side)
        dist.all_reduce(x)
        x.sum()
        work = dist.all_reduce(x, async_op=True)
        work.wait()
        out = torch.empty(128)
        dist.all_gather_into_tensor(out, x)
        part = torch.empty(32)
        dist.reduce_scatter_tensor(part, x)
        dist.broadcast(x, src=0)
        dist.barrier()
        assert out.sum() > 0 and part.sum() > 0 and x.sum() > 0
"""


def _line(pytester, name, marker):
    source = pytester.path.joinpath(name).read_text().splitlines()
    return next(i for i, text in enumerate(source, 1) if marker in text)


def _failed(result) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^FAILED \S+::(\w+)", result.stdout.str(), re.M)}


def test_work_on_other_threads_is_checked(pytester):
    pytester.makepyfile(test_user_threads=USER_THREADS, test_ranks=RANKS)
    # the virtual model on every host: the rank threads' tensors are host tensors, which only it puts on streams (the
    # cuda backend's twins are tests/gpu/test_threads_gpu.py's)
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=5, failed=6)
    assert _failed(result) == {"test_thread_joined_without_stream_wait", "test_pool_result_without_stream_wait",
                               "test_pool_started_before_the_test", "test_long_lived_worker_serves_a_later_test",
                               "test_reduced_without_waiting_for_the_side_stream",
                               "test_read_before_the_async_collective_is_waited"}
    threads, ranks = "test_user_threads.py", "test_ranks.py"
    staged = _line(pytester, threads, "STAGED")
    write, reduce, early = (_line(pytester, ranks, m) for m in ("RANK-WRITE", "RANK-REDUCE", "RANK-EARLY-READ"))
    result.stdout.fnmatch_lines([
        "*_ test_thread_joined_without_stream_wait _*",
        "stream race: read-after-write*",
        f"*earlier*write*aten::mul_*on stream created at {threads}:*at {threads}:{staged} (stage)",
        # named though the thread ended before the race was found
        f"*on thread 'Thread-* (stage)', started at {threads}:{_line(pytester, threads, 'JOINED-START')} "
        "(test_thread_joined_without_stream_wait)",
        f"*later*read*aten::sum*on default stream*at {threads}:{_line(pytester, threads, 'READ-AFTER-JOIN')}*",
    ])
    result.stdout.fnmatch_lines([
        "*_ test_pool_result_without_stream_wait _*",
        "stream race: read-after-write*",
        f"*earlier*write*aten::mul_*at {threads}:{staged} (stage)",
        f"*on thread 'ThreadPoolExecutor-*', work submitted at {threads}:{_line(pytester, threads, 'SUBMITTED')} "
        "(test_pool_result_without_stream_wait)",
        f"*later*read*aten::sum*on default stream*at {threads}:{_line(pytester, threads, 'READ-AFTER-RESULT')}*",
    ])
    result.stdout.fnmatch_lines([
        "*_ test_pool_started_before_the_test _*",
        "stream race: read-after-write*",
        f"*later*read*aten::sum*at {threads}:{_line(pytester, threads, 'READ-AFTER-EARLY-POOL')}*",
    ])
    result.stdout.fnmatch_lines([
        "*_ test_long_lived_worker_serves_a_later_test _*",
        "stream race: read-after-write*",
        f"*later*read*aten::sum*at {threads}:{_line(pytester, threads, 'READ-AFTER-LONG-LIVED')}*",
    ])
    result.stdout.fnmatch_lines([
        "*_ TestRanks.test_read_before_the_async_collective_is_waited _*",
        "stream race: read-after-write*",
        "*earlier*write*all_reduce*on communication stream of rank ? in threaded process group*",
        f"*later*read*aten::sum*on default stream*at {ranks}:{early}*",
    ])
    result.stdout.fnmatch_lines([
        "*_ TestRanks.test_reduced_without_waiting_for_the_side_stream _*",
        "stream race: write-after-write*",
        f"*earlier*write*aten::mul_*at {ranks}:{write}*",
        f"*later*write*all_reduce*on communication stream of rank ? in threaded process group*at {ranks}:{reduce}*",
    ])


def test_races_on_other_threads_are_confirmed_in_re_runs(pytester):
    """A re-run runs the test several times in one process, and Python's default thread names count threads and pools
    process-wide: the forced pass still finds each race's access on its thread (a started thread that ended before the
    race was found, a pool's worker, a worker started before the test, a module fixture's thread)."""
    check_thread_races_confirmed(pytester, "virtual")


A_POOL_PER_CHECKPOINT = """
from concurrent.futures import ThreadPoolExecutor

import pytest, torch


def checkpoints(device, racy_step):
    # DCP's shape: each checkpoint makes a new pool whose one worker copies what the step wrote on a side stream;
    # the step `racy_step` lets the copy run without waiting for that write, the other waits
    x = torch.ones(4096, device=device)
    side = torch.cuda.Stream()
    for step in range(2):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.add_(2)                                   # STEP-WRITE
        if step != racy_step:
            torch.cuda.current_stream().wait_stream(side)
        staged = torch.empty_like(x)
        with ThreadPoolExecutor(max_workers=1) as pool:
            pool.submit(staged.copy_, x).result()       # STAGING-READ
        torch.cuda.current_stream().wait_stream(side)


@pytest.mark.parametrize("racy_step", [0, 1])
def test_checkpoints(streamrace_device, racy_step):
    checkpoints(streamrace_device, racy_step)
"""


def test_a_forced_run_tells_a_pool_made_per_checkpoint_from_the_one_before(pytester):
    """Each checkpoint's new pool has a worker of the same name ("ThreadPoolExecutor-*_0" once Python's count is left
    out) whose ops count from 0 alike: a forced run must find the race on the pool it was found on, not force the
    same op of another checkpoint too (DCP's stager; on GPUs the second pool's copy came after the first checkpoint's
    upload had waited out the hold, and the race read as one no hold can invert)."""
    pytester.makepyfile(test_pools=A_POOL_PER_CHECKPOINT)
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual", "--streamrace-confirm",
                                           "--streamrace-json=races.json", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    records = json.loads((pytester.path / "races.json").read_text())["races"]
    races = {r["test"].split("[")[-1].rstrip("]"): r for r in records}
    assert sorted(races) == ["0", "1"], list(races)
    assert "nth" not in races["0"]["later"]["thread"] and races["1"]["later"]["thread"]["nth"] == 1
    for step, (read, instead) in {"0": (1, 3), "1": (3, 5)}.items():  # the copy sees x before its step's add_
        confirmation = races[step]["confirmation"]
        assert (confirmation["status"], confirmation["differing"], confirmation["max_abs_diff"]) == \
            ("confirmed", 4096, float(instead - read)), (step, confirmation)
    result.stdout.fnmatch_lines(["streamrace confirmations: 2 confirmed, 0 not confirmed, 0 not tried*"])


def test_a_forced_run_matches_python_s_default_thread_names_without_their_count():
    # (not in a pytester test: pytester drops the modules a test imports, torch among them, when it ends)
    from pytest_streamrace.detector.hb import stable_name

    assert stable_name("Thread-3 (stage)") == stable_name("Thread-1 (stage)") == "Thread-* (stage)"
    assert stable_name("ThreadPoolExecutor-2_0") == "ThreadPoolExecutor-*_0" != stable_name("ThreadPoolExecutor-2_1")
    assert stable_name("reducer") == "reducer" and stable_name("MyThread-3") == "MyThread-3"


def check_thread_races_confirmed(pytester, backend: str) -> str:
    """The racy twins on threads, confirmed; the summary's confirmations line."""
    pytester.makepyfile(test_user_threads=USER_THREADS)
    result = pytester.runpytest_subprocess("--streamrace", f"--streamrace-backend={backend}", "--streamrace-confirm",
                                           "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, failed=4)
    result.stdout.fnmatch_lines(["streamrace confirmations: 4 confirmed, 0 not confirmed, 0 not tried*"])
    return next(line for line in result.outlines if line.startswith("streamrace confirmations: "))
