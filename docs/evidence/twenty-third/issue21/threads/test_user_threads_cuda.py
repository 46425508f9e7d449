
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
    worker.start()
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
        pool.submit(stage, x).result()
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
