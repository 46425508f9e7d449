"""c10d collectives called directly, as users overlap them: clean when waited, racy twins caught.

On a host with fewer GPUs than ranks the `distributed` marker runs the ranks on gloo, with CUDA tensors where the
test makes them: gloo then stages each collective through pinned host memory on a pooled stream and a worker thread
of its own, and `work.wait()` orders the caller's stream after it. Those copies are the collective's own work.
"""

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.distributed(world_size=2)


@pytest.mark.streamrace(expect="clean")
def test_async_all_reduce_waited(streamrace_device):
    t = torch.ones(1024, device=streamrace_device)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    assert (t * 2)[0].item() == 4.0


@pytest.mark.streamrace(expect="clean")
def test_sync_collectives_in_a_loop(streamrace_device):
    t = torch.ones(256, device=streamrace_device)
    out = torch.empty(512, device=streamrace_device)
    for _ in range(3):
        t.mul_(1.0)
        dist.all_reduce(t)
        dist.all_gather_into_tensor(out, t)
        dist.broadcast(t, src=0)
    assert out.sum().item() > 0


@pytest.mark.streamrace(expect="clean")
def test_comm_stream_waits_for_the_producer(streamrace_device):
    comm = torch.cuda.Stream()
    t = torch.randn(1024, device=streamrace_device)
    t.mul_(2)
    comm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(comm):
        work = dist.all_reduce(t, async_op=True)
    work.wait()
    torch.cuda.current_stream().wait_stream(comm)
    assert torch.isfinite(t.sum()).item()


@pytest.mark.streamrace(expect="race")
def test_output_read_before_wait(streamrace_device):
    t = torch.ones(1024, device=streamrace_device)
    work = dist.all_reduce(t, async_op=True)
    early = t * 2  # race: test_output_read_before_wait
    work.wait()
    assert early.numel() == 1024


@pytest.mark.streamrace(expect="race")
def test_input_written_while_the_collective_may_read_it(streamrace_device):
    t = torch.ones(1024, device=streamrace_device)
    work = dist.all_reduce(t, async_op=True)
    t.fill_(3.0)  # race: test_input_written_while_the_collective_may_read_it
    work.wait()
