"""--streamrace-confirm finds a race's accesses in its re-run by what they are, through pytest as users run it
(virtual backend; `tests/gpu/test_confirm_gpu.py` runs the same cases on real streams): a pool's task by
the task (its submitter and submit count), whichever worker runs it in the re-run; a tensor the test allocates, by
the op that makes it, wherever the allocator puts it; a read freed while in use, held back past its free. Each racy
twin is confirmed with the values that changed; each clean twin is never re-run."""

import json

from test_confirm import run_cases

CASES = '''
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

race = pytest.mark.streamrace(expect="race")
RUNS = [0]  # the runs of the pool test in this process: each puts its task on another worker


@pytest.fixture(autouse=True)
def count_runs(request):
    with open(os.path.join(str(request.config.rootpath), "runs.txt"), "a") as f:
        f.write(request.node.name + "\\n")


def stage(x, done=None):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.mul_(3)                                       # TASK-WRITE
    if done is not None:
        done.record(side)


def on_a_new_worker(pool, busy, task, *args):
    """`task` submitted once `busy` workers are held by tasks another thread submitted: a new worker, the
    busy-th, runs it. The test's own submit count is the same whichever worker that is."""
    started, go = [], threading.Event()

    def hold():
        started.append(1)
        go.wait()

    helper = threading.Thread(target=lambda: [pool.submit(hold) for _ in range(busy)], name="helper")
    helper.start()
    helper.join()
    while len(started) < busy:
        time.sleep(0.001)
    future = pool.submit(task, *args)                   # SUBMITTED
    return future, go


def pooled(device, racy):
    busy, RUNS[0] = RUNS[0] % 3, RUNS[0] + 1
    x = torch.ones(4096, device=device)
    done = None if racy else torch.cuda.Event()
    with ThreadPoolExecutor(max_workers=3) as pool:
        future, go = on_a_new_worker(pool, busy, stage, x, done)
        future.result()
        if done is not None:
            torch.cuda.current_stream().wait_event(done)
        y = x + 1                                       # READ-AFTER-TASK
        go.set()
    torch.cuda.synchronize()


@race
def test_pool_task_on_another_worker_each_run(streamrace_device):
    pooled(streamrace_device, racy=True)


def test_pool_task_waited_for(streamrace_device):
    pooled(streamrace_device, racy=False)


def made_on_a_side_stream(device, racy):
    x = torch.ones(4096, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    for _ in range(3):                                  # the allocator's blocks in use differ from the first run's
        torch.empty(1 << 12, device=device)
    with torch.cuda.stream(side):
        out = x * 3                                     # FRESH-WRITE: a new tensor, made on the side stream
    if not racy:
        torch.cuda.current_stream().wait_stream(side)
    total = out.sum()                                   # FRESH-READ
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


@race
def test_output_made_on_a_side_stream_read_without_wait(streamrace_device):
    made_on_a_side_stream(streamrace_device, racy=True)


def test_output_made_on_a_side_stream_read_after_wait(streamrace_device):
    made_on_a_side_stream(streamrace_device, racy=False)


def freed_while_read(device, racy):
    side = torch.cuda.Stream()
    x = torch.ones(4096, device=device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        total = x.sum()                                 # FREED-READ
    if not racy:
        x.record_stream(side)
    del x
    # the block's next owner on the default stream: a few, so that one gets it whichever free block of that size the
    # allocator picks first (earlier passes of the re-run left some)
    owners = [torch.zeros(4096, device=device) for _ in range(4)]
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    return total


@race
def test_read_freed_while_in_use(streamrace_device):
    freed_while_read(streamrace_device, racy=True)


def test_read_freed_after_record_stream(streamrace_device):
    freed_while_read(streamrace_device, racy=False)
'''


def line(pytester, marker: str) -> int:
    text = (pytester.path / "test_identity.py").read_text()
    return next(n for n, line_ in enumerate(text.splitlines(), 1) if marker in line_)


def run(pytester, backend: str, *extra: str):
    """The cases under --streamrace-confirm: (the run, {test: [records]}, runs per test)."""
    return run_cases(pytester, backend, *extra, files={"test_identity": CASES})


def check(pytester, result, by_test, runs) -> None:
    result.assert_outcomes(passed=6)  # the racy twins are marked as such
    assert sorted(by_test) == ["test_output_made_on_a_side_stream_read_without_wait",
                               "test_pool_task_on_another_worker_each_run", "test_read_freed_while_in_use"], by_test
    for clean in ("test_pool_task_waited_for", "test_output_made_on_a_side_stream_read_after_wait",
                  "test_read_freed_after_record_stream"):
        assert runs[clean] == 1, runs  # never re-run

    pool = by_test["test_pool_task_on_another_worker_each_run"]
    assert [r["kind"] for r in pool] == ["read-after-write"], pool
    task = pool[0]["earlier"]["thread"]["task"]
    assert task["id"] == "main/0" and task["ordinal"] >= 1, task  # the test's first submit
    confirmation = pool[0]["confirmation"]
    assert (confirmation["status"], confirmation["differing"], confirmation["max_abs_diff"]) == \
        ("confirmed", 4096, 2.0), json.dumps(confirmation)  # x + 1 read 1 for 3
    assert confirmation["held"] == f"test_identity.py:{line(pytester, 'TASK-WRITE')}"

    fresh = [r for r in by_test["test_output_made_on_a_side_stream_read_without_wait"]
             if r["kind"] == "read-after-write"]
    assert fresh and fresh[0]["later"]["frames"][0]["line"] == line(pytester, "FRESH-READ"), fresh
    confirmation = fresh[0]["confirmation"]
    assert confirmation["status"] == "confirmed" and confirmation["unwritten"], json.dumps(confirmation)
    assert confirmation["differing"] == confirmation["elements"] == 4096

    freed = by_test["test_read_freed_while_in_use"]
    assert [r["kind"] for r in freed] == ["free-while-in-use"], freed
    confirmation = freed[0]["confirmation"]
    assert (confirmation["status"], confirmation["freed"], confirmation["differing"]) == ("confirmed", True, 4096), \
        json.dumps(confirmation)
    assert confirmation["held"] == f"test_identity.py:{line(pytester, 'FREED-READ')}"
    result.stdout.fnmatch_lines([
        f"*confirmed: free-while-in-use test_identity.py:{line(pytester, 'FREED-READ')} -> *: with the read at * held "
        "back, the values read at * differed * (the read saw the block after its free)*",
        "streamrace confirmations: 3 confirmed, 0 not confirmed, 0 not tried*"])


def test_each_race_is_found_in_its_re_run_by_what_its_accesses_are(pytester):
    check(pytester, *run(pytester, "virtual"))


def test_a_pool_task_is_named_by_its_submitter_and_submit_count():
    """A task's identity: its submitter (the thread's key, or the task it runs in) and how many that submitter had
    submitted before in the session; each op of it names its place in the task."""
    from pytest_streamrace.detector.hb import Access, Op, Site, TensorInfo, ThreadOrigin
    from pytest_streamrace.races.confirmation import plan_of
    from pytest_streamrace.races.record import from_race, to_race
    from pytest_streamrace.detector.hb import Race

    tensor = TensorInfo((64,), "float32")
    worker = ThreadOrigin("ThreadPoolExecutor-3_2", "work submitted", Site("submit", ()), 0, "main/4", 10)
    write = Access(Op(1, 0, 1, Site("aten::mul_", (("t.py", 3, "stage"),), worker, 13)), None, 0, 256, True, tensor)
    read = Access(Op(0, 0, 2, Site("aten::add", (("t.py", 7, "test"),), None, 5)), None, 0, 256, False, tensor)
    data = from_race(Race("read-after-write", write, read, None))
    assert data["earlier"]["thread"]["task"] == {"id": "main/4", "ordinal": 3}
    back = to_race(data).earlier.op.site.thread
    assert (back.task, back.base) == ("main/4", 10)
    plan = plan_of(data)
    assert (plan["earlier"]["task"], plan["earlier"]["task_ordinal"]) == ("main/4", 3)
    assert "task" not in plan["later"]


def test_a_not_confirmed_race_says_why():
    from pytest_streamrace.races.confirmation import verdict

    plan = {"kind": "read-after-write", "earlier": {"at": "t.py:3"}, "later": {"at": "t.py:7"}}
    same = {"status": "forced", "differing": 0, "differing_bytes": 0, "elements": 4, "bytes": 16}
    assert verdict(plan, [{"forced": same, "outcome": "passed"}], None, "passed")["reason"] == \
        "the held-back write stores the values already there"
    one_rank = verdict(plan, [{"forced": dict(same, one_rank=True), "outcome": "passed"}], None, "passed")
    assert (one_rank["status"], one_rank["reason"]) == (
        "not-confirmed", "a collective over a world of one rank leaves the bytes it reads")
