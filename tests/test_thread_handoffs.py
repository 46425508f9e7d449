"""A synchronize orders only the thread that made it, and Python's thread handoffs carry what a thread knows to
another, through pytest as users run it (virtual backend; `tests/gpu/` runs the same module on real streams).

Racy twins: a worker synchronizes (each kind of sync) while the test's thread goes on with no handoff from it, or with
one released before the sync; the test's read of the side stream's write is then unordered. Clean twins: the worker
synchronizes, then hands off through each modelled primitive; the test's thread receives before it reads. The clean
ones run under --streamrace-latent=fail too: no handoff may leave a latent race behind."""

import pytest

CASES = '''
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

SYNCS = {
    "device": lambda side, y: torch.cuda.synchronize(),
    "stream": lambda side, y: side.synchronize(),
    "event": lambda side, y: side.record_event().synchronize(),
    "event_query": lambda side, y: side.record_event().query(),
    "stream_query": lambda side, y: side.query(),
    "read_back": lambda side, y: y.item(),
}


def written_on_side(device):
    """x written on a side stream (and its sum, read back by a worker's `read_back`): nothing orders the default
    stream after it."""
    x = torch.ones(1024, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.mul_(2)                                                   # SIDE-WRITE
        y = x.sum()
    return x, side, y


@pytest.mark.streamrace(expect="race")
@pytest.mark.parametrize("sync", SYNCS)
def test_another_threads_sync_orders_nothing_here(sync, streamrace_device):
    x, side, y = written_on_side(streamrace_device)
    state = {"synced": False}

    def worker():
        SYNCS[sync](side, y)
        state["synced"] = True                                      # a plain variable: no handoff

    thread = threading.Thread(target=worker)
    thread.start()
    while not state["synced"]:
        time.sleep(0.001)
    x.add_(1)                                                       # MAIN-READ
    thread.join()


@pytest.mark.streamrace(expect="race")
def test_a_handoff_released_before_the_sync_carries_nothing(streamrace_device):
    x, side, y = written_on_side(streamrace_device)
    handoff, synced = queue.Queue(), threading.Event()

    def worker():
        handoff.put("go")
        torch.cuda.synchronize()
        synced.set()

    thread = threading.Thread(target=worker)
    thread.start()
    handoff.get()
    while not state_of(synced):
        time.sleep(0.001)
    x.add_(1)
    thread.join()


def state_of(event):
    return event._flag  # polled without is_set(): no handoff


def handoff_pairs():
    """name -> (make, send, receive): a primitive made by the test's thread, the worker's send after its sync, the
    test's thread's receive before its read."""
    def barrier():
        b = threading.Barrier(2)
        return b, b.wait, b.wait

    def condition():
        cond, box = threading.Condition(), []

        def send():
            with cond:
                box.append(1)
                cond.notify()

        def receive():
            with cond:
                cond.wait_for(lambda: box)
        return cond, send, receive

    def lock(kind):  # looked up when made, as `threading.Lock()` is: a lock made before the session is not seen
        def make():
            guard, box = getattr(threading, kind)(), []

            def send():
                with guard:
                    box.append(1)

            def receive():
                while True:
                    with guard:
                        if box:
                            return
                    time.sleep(0.001)
            return guard, send, receive
        return make

    def event():
        e = threading.Event()
        return e, e.set, e.wait

    def semaphore(kind):
        def make():
            s = kind(1)
            s.acquire()
            return s, s.release, s.acquire
        return make

    def a_queue(kind):
        def make():
            q = getattr(queue, kind)()
            return q, lambda: q.put(1), q.get
        return make

    return {
        "lock": lock("Lock"), "rlock": lock("RLock"), "condition": condition, "event": event,
        "semaphore": semaphore(threading.Semaphore), "bounded_semaphore": semaphore(threading.BoundedSemaphore),
        "barrier": barrier, "queue": a_queue("Queue"), "lifo_queue": a_queue("LifoQueue"),
        "priority_queue": a_queue("PriorityQueue"), "simple_queue": a_queue("SimpleQueue"),
    }


PAIRS = handoff_pairs()


@pytest.mark.streamrace(expect="clean")
@pytest.mark.parametrize("primitive", PAIRS)
@pytest.mark.parametrize("sync", ["device", "stream", "event"])  # explicit: a read-back's would stay latent
def test_a_sync_handed_off_orders_the_receiver(primitive, sync, streamrace_device):
    x, side, y = written_on_side(streamrace_device)
    _, send, receive = PAIRS[primitive]()

    def worker():
        SYNCS[sync](side, y)
        send()

    thread = threading.Thread(target=worker)
    thread.start()
    receive()
    x.add_(1)
    thread.join()


@pytest.mark.streamrace(expect="clean")
def test_a_futures_result_hands_off_its_workers_sync(streamrace_device):
    x, side, y = written_on_side(streamrace_device)
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(side.synchronize).result()
        x.add_(1)


@pytest.mark.streamrace(expect="clean")
def test_a_done_callback_hands_off_its_workers_sync(streamrace_device):
    x, side, y = written_on_side(streamrace_device)
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(side.synchronize)
        while future._state != "FINISHED":                          # polled: no handoff
            time.sleep(0.001)
        future.add_done_callback(lambda f: x.add_(1))               # runs here, already done


@pytest.mark.streamrace(expect="clean")
def test_a_join_hands_off_the_threads_sync(streamrace_device):
    x, side, y = written_on_side(streamrace_device)
    thread = threading.Thread(target=torch.cuda.synchronize)
    thread.start()
    thread.join()
    x.add_(1)


@pytest.mark.streamrace(expect="clean")
def test_a_submit_hands_off_the_submitters_sync(streamrace_device):
    x, side, y = written_on_side(streamrace_device)
    side.synchronize()
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(x.add_, 1).result()


@pytest.mark.streamrace(expect="clean")
def test_a_thread_starts_with_what_its_starter_knew(streamrace_device):
    x, side, y = written_on_side(streamrace_device)
    torch.cuda.synchronize()
    thread = threading.Thread(target=x.add_, args=(1,))
    thread.start()
    thread.join()


@pytest.mark.streamrace(expect="race")
def test_a_thread_started_before_the_sync_does_not_know_it(streamrace_device):
    x, side, y = written_on_side(streamrace_device)
    go = []
    thread = threading.Thread(target=lambda: (wait_for(go), x.add_(1)))
    thread.start()
    torch.cuda.synchronize()
    go.append(1)                                                    # a plain list: no handoff
    thread.join()


def wait_for(flag):
    while not flag:
        time.sleep(0.001)
'''


@pytest.mark.parametrize("latent", ["report", "fail"])
def test_syncs_and_handoffs_on_threads(pytester, latent):
    pytester.makepyfile(test_handoffs=CASES)
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual",
                                           f"--streamrace-latent={latent}", "-p", "no:cacheprovider", "-q")
    # every racy twin reported, every clean one clean: the markers turn each right verdict into a pass
    result.assert_outcomes(passed=6 + 1 + 11 * 3 + 5 + 1)
    assert "stream race" not in result.stdout.str().split("passed")[-1]


def test_another_threads_sync_is_named_in_the_race(pytester):
    pytester.makepyfile(test_handoffs=CASES.replace('@pytest.mark.streamrace(expect="race")\n@pytest.mark.parametrize',
                                                    '@pytest.mark.parametrize'))
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual", "-p", "no:cacheprovider",
                                           "-k", "orders_nothing_here and device")
    result.assert_outcomes(failed=1)
    source = pytester.path.joinpath("test_handoffs.py").read_text().splitlines()
    write = next(i for i, text in enumerate(source, 1) if "SIDE-WRITE" in text)
    read = next(i for i, text in enumerate(source, 1) if "MAIN-READ" in text)
    result.stdout.fnmatch_lines([
        "stream race: write-after-write*",
        f"*earlier*write*aten::mul_*at test_handoffs.py:{write}*",
        f"*later*write*aten::add_*on default stream*at test_handoffs.py:{read}*",
    ])


LIBRARY_THREADS = '''
import threading
from concurrent.futures import ThreadPoolExecutor

import torch


def test_pool_race(streamrace_device):
    x = torch.ones(1024, device=streamrace_device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.mul_(2)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="stager") as pool:
        pool.submit(torch.Tensor.add_, x, 1).result()               # SUBMIT


def test_thread_race(streamrace_device):
    x = torch.ones(1024, device=streamrace_device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.mul_(2)
    thread = threading.Thread(target=torch.Tensor.add_, args=(x, 1), name="copier")
    thread.start()                                                  # START
    thread.join()
'''


def test_races_on_library_threads_name_a_frame_and_the_thread(pytester):
    """No frame of the test's runs on these threads: the report names the innermost frame it has (a library's, else
    the standard library's) and the thread, with the call that started it or submitted its work."""
    pytester.makepyfile(test_library_threads=LIBRARY_THREADS)
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual", "-p", "no:cacheprovider",
                                           "--streamrace-json", "races.json")
    result.assert_outcomes(failed=2)
    source = pytester.path.joinpath("test_library_threads.py").read_text().splitlines()
    submit = next(i for i, text in enumerate(source, 1) if "SUBMIT" in text)
    start = next(i for i, text in enumerate(source, 1) if "# START" in text)
    result.stdout.fnmatch_lines([
        "*later*write*aten::add_*on default stream*at *concurrent*futures*thread.py:* (run)",
        f"*on thread 'stager_0', work submitted at test_library_threads.py:{submit} (test_pool_race)",
    ])
    result.stdout.fnmatch_lines([
        "*later*write*aten::add_*on default stream*at *threading.py:* (run)",
        f"*on thread 'copier', started at test_library_threads.py:{start} (test_thread_race)",
    ])
    assert "<unknown>" not in result.stdout.str()
    import json

    races = json.loads(pytester.path.joinpath("races.json").read_text())["races"]
    threads = {r["later"]["thread"]["name"]: r["later"]["thread"] for r in races if "thread" in r["later"]}
    assert threads["stager_0"]["how"] == "work submitted"
    assert threads["stager_0"]["frames"][0]["line"] == submit
    assert threads["copier"]["how"] == "started" and threads["copier"]["frames"][0]["line"] == start
    assert all("thread" not in r["earlier"] for r in races)  # the main thread is not named


def test_a_lock_taken_inside_the_detectors_own_work_is_no_handoff(monkeypatch):
    """A lock made and taken while the detector holds its core's lock on this thread (a module a report's frames
    import, a finalizer) is the detector's, not a handoff: taking it must neither deadlock nor reach the core."""
    import threading

    from pytest_streamrace.detector import session
    from pytest_streamrace.detector.hb import HappensBefore

    monkeypatch.setattr(session, "_core", HappensBefore)  # hb.py's core: its lock is a plain, non-reentrant one
    outcome = []

    def inside_the_detector():
        try:
            with session.Detector("virtual") as detector:
                lock = threading.Lock()  # a modelled lock: made while the session runs
                with detector.tracker._lock, detector.hb._lock:
                    with lock:
                        pass
            outcome.append("done")
        except Exception as exc:  # shown by the assertion below
            outcome.append(exc)

    worker = threading.Thread(target=inside_the_detector, daemon=True)
    worker.start()
    worker.join(60)
    assert outcome == ["done"], outcome or "taking a lock inside the detector's own work deadlocked"
