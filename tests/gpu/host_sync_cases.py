"""Host-synchronizing read-backs on a GPU (cuda backend), the twins of tests/test_host_sync.py plus what only a GPU
has: pinned memory, a non-blocking copy into pageable memory (synchronous in CUDA, though torch's GPU trace reports no
synchronize for it: the capture orders the host after it itself), and read-backs on the legacy default stream, whose
handle is 0. Not collected (no test_ prefix): tests/gpu/test_syncs_gpu.py runs it in a pytest of its own:

    python -m pytest tests/gpu/host_sync_cases.py --streamrace --streamrace-backend=cuda -rA
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU cases")


def produced_on_a_side_stream():
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the side stream is still busy when the host moves on, unless it waits
        x = torch.ones(1 << 20, device="cuda") * 2
    return side, x


READ_BACKS = pytest.mark.parametrize("read_back", [
    lambda x: x.cpu(), lambda x: x.tolist(), lambda x: x.numpy(force=True), lambda x: x.to("cpu"),
    lambda x: x.sum().item(), lambda x: bool(x[0]), lambda x: x[x > 1], lambda x: x.nonzero(),
    lambda x: torch.unique(x), lambda x: torch.equal(x, x), lambda x: torch.empty(x.shape).copy_(x),
], ids=["cpu", "tolist", "numpy_force", "to_cpu", "item", "bool", "mask_index", "nonzero", "unique", "equal",
        "copy_to_host"])


@READ_BACKS
def test_clean_read_back_on_the_producing_stream(read_back):
    side, x = produced_on_a_side_stream()
    with torch.cuda.stream(side):
        read_back(x)
    x.add_(1)


def test_clean_non_blocking_copy_into_pageable_memory():
    side, x = produced_on_a_side_stream()
    with torch.cuda.stream(side):
        torch.empty(x.shape).copy_(x, non_blocking=True)  # pageable: cudaMemcpyAsync returns once it is done
    x.add_(1)


def test_racy_non_blocking_copy_into_pinned_memory():
    side, x = produced_on_a_side_stream()
    with torch.cuda.stream(side):
        torch.empty(x.shape, pin_memory=True).copy_(x, non_blocking=True)
    x.add_(1)


def test_racy_non_blocking_to_cpu():
    side, x = produced_on_a_side_stream()
    with torch.cuda.stream(side):
        x.to("cpu", non_blocking=True)  # its output is pinned: no wait
    x.add_(1)


def test_racy_read_back_on_another_stream():
    side, x = produced_on_a_side_stream()
    x.tolist()


@READ_BACKS
def test_clean_read_back_on_the_default_stream(read_back):
    """The legacy default stream's handle is 0 (DeepSpeed ZeRO-3's trace check reads back there): its read-back
    orders a side stream's later work as any other stream's does."""
    torch.cuda._sleep(50_000_000)
    x = torch.ones(1 << 20, device="cuda") * 2
    read_back(x)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x.add_(1)


def test_racy_side_stream_after_the_default_stream_without_a_read_back():
    torch.cuda._sleep(50_000_000)
    x = torch.ones(1 << 20, device="cuda") * 2
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x.add_(1)


def test_clean_event_queried_done_then_used_on_another_stream():
    """The host polls the producer's event until it is done (DeepSpeed pools buffers this way): what it issues next
    is ordered after that work, though torch's GPU trace reports no sync for a query."""
    side, x = produced_on_a_side_stream()
    done = side.record_event()
    while not done.query():
        pass
    x.add_(1)


def test_clean_stream_queried_done_then_used_on_another_stream():
    side, x = produced_on_a_side_stream()
    while not side.query():
        pass
    x.add_(1)


def test_racy_event_queried_for_earlier_work():
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    earlier = side.record_event()  # before the write: its being done says nothing of the write
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        x = torch.ones(1 << 20, device="cuda") * 2
    while not earlier.query():
        pass
    x.add_(1)
