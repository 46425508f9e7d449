"""Pinned memory and non_blocking copies, as PyTorch's guide to them uses them: the host is a party.

A non_blocking copy between the device and pinned memory runs on a stream while the host goes on; the host reading the
copy's output, or rewriting its source, before it synchronized with that stream races with the copy (PyTorch's "A
guide on good usage of non_blocking and pin_memory()" warns of each hazard here). Each racy twin tags its race line.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

N = 4096


def _produced(device):
    x = torch.randn(N, device=device)
    x.mul_(2)  # the device's work the copy reads after
    return x


@pytest.mark.streamrace(expect="race")
def test_device_to_host_read_before_sync(streamrace_device):
    host = torch.empty(N, pin_memory=True)
    host.copy_(_produced(streamrace_device), non_blocking=True)
    assert host.sum().item() != 0.5  # race: test_device_to_host_read_before_sync


@pytest.mark.streamrace(expect="clean")
def test_device_to_host_read_after_sync(streamrace_device):
    host = torch.empty(N, pin_memory=True)
    host.copy_(_produced(streamrace_device), non_blocking=True)
    torch.cuda.current_stream().synchronize()
    assert host.sum().item() != 0.5


@pytest.mark.streamrace(expect="clean")
def test_device_to_host_read_after_event_sync(streamrace_device):
    host = torch.empty(N, pin_memory=True)
    host.copy_(_produced(streamrace_device), non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    copied.synchronize()
    assert host.tolist()[0] != 0.5


@pytest.mark.streamrace(expect="race")
def test_device_to_host_numpy_before_sync(streamrace_device):
    host = torch.empty(N, pin_memory=True)
    host.copy_(_produced(streamrace_device), non_blocking=True)
    assert host.numpy().shape == (N,)  # race: test_device_to_host_numpy_before_sync


def _copied_on_a_side_stream(device):
    side = torch.cuda.Stream()
    x = _produced(device)
    host = torch.empty(N, pin_memory=True)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        host.copy_(x, non_blocking=True)
    return side, host


@pytest.mark.streamrace(expect="race")
def test_side_stream_copy_read_after_syncing_the_default_stream(streamrace_device):
    _, host = _copied_on_a_side_stream(streamrace_device)
    torch.cuda.current_stream().synchronize()  # not the copy's stream
    assert host.max().item() != 0.5  # race: test_side_stream_copy_read_after_syncing_the_default_stream


@pytest.mark.streamrace(expect="clean")
def test_side_stream_copy_read_after_syncing_its_stream(streamrace_device):
    side, host = _copied_on_a_side_stream(streamrace_device)
    side.synchronize()
    assert host.max().item() != 0.5


def _staged_steps(device, wait_for_copy: bool):
    staging = torch.empty(N, pin_memory=True)
    on_device = torch.empty(N, device=device)
    copied = torch.cuda.Event()
    for step in range(3):
        if wait_for_copy and step:
            copied.synchronize()
        staging.copy_(torch.full((N,), float(step)))  # race: test_staging_buffer_rewritten_while_a_copy_may_read_it
        on_device.copy_(staging, non_blocking=True)
        copied.record()
        on_device.mul_(2)
    return on_device


@pytest.mark.streamrace(expect="race")
def test_staging_buffer_rewritten_while_a_copy_may_read_it(streamrace_device):
    _staged_steps(streamrace_device, wait_for_copy=False)


@pytest.mark.streamrace(expect="clean")
def test_staging_buffer_rewritten_after_the_copy_finished(streamrace_device):
    _staged_steps(streamrace_device, wait_for_copy=True)


def _prefetch(device, guarded: bool):
    """Two pinned buffers, filled by the host in turn and copied to the device on a stream of their own."""
    copy_stream = torch.cuda.Stream()
    pinned = [torch.empty(N, pin_memory=True) for _ in range(2)]
    on_device = [torch.empty(N, device=device) for _ in range(2)]
    copied = [torch.cuda.Event(), torch.cuda.Event()]
    total = torch.zeros((), device=device)
    for step in range(4):
        i = step % 2
        if guarded and step >= 2:
            copied[i].synchronize()  # the copy that read this buffer two steps ago is done
        pinned[i].copy_(torch.full((N,), float(step)))  # race: test_prefetcher_without_events
        copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(copy_stream):
            on_device[i].copy_(pinned[i], non_blocking=True)
            copied[i].record()
        torch.cuda.current_stream().wait_stream(copy_stream)
        total += on_device[i].sum()
    return total


@pytest.mark.streamrace(expect="clean")
def test_prefetcher_with_events(streamrace_device):
    assert _prefetch(streamrace_device, guarded=True).item() == N * 6


@pytest.mark.streamrace(expect="race")
def test_prefetcher_without_events(streamrace_device):
    _prefetch(streamrace_device, guarded=False)


@pytest.mark.streamrace(expect="clean")
def test_pinned_batches_copied_to_the_device(streamrace_device):
    batch = torch.randn(64, 16).pin_memory()
    assert batch.is_pinned()
    on_device = batch.to(streamrace_device, non_blocking=True)
    assert on_device.data_ptr() != batch.data_ptr()
    assert on_device.sum().item() == pytest.approx(batch.sum().item(), rel=1e-4)


@pytest.mark.streamrace(expect="clean")
@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_pin_memory_training_loop(streamrace_device, workers):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    loader = DataLoader(data, batch_size=16, pin_memory=True, num_workers=workers)
    model = nn.Linear(8, 1).to(streamrace_device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        assert x.is_pinned()
        x, y = x.to(streamrace_device, non_blocking=True), y.to(streamrace_device, non_blocking=True)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.streamrace(expect="clean")
def test_pinned_block_freed_during_a_copy_and_allocated_again(streamrace_device):
    """torch's pinned allocator records the copy's stream on the block and hands it out again only once the copy is
    done: a buffer dropped right after its non_blocking copy is safe."""
    on_device = torch.empty(N, device=streamrace_device)
    for step in range(4):
        staging = torch.full((N,), float(step), pin_memory=True)
        on_device.copy_(staging, non_blocking=True)
        del staging
    assert on_device.max().item() == 3


class _PinnedPool:
    """A program's own free list of pinned buffers, as offload engines keep one: a buffer given back goes to the next
    request. With `events`, it goes out once the copy that last read it is done."""

    def __init__(self, events: bool):
        self.free, self.events = [], events

    def get(self):
        if not self.free:
            return torch.empty(N, pin_memory=True)
        buffer, done = self.free.pop()
        if done is not None:
            done.synchronize()
        return buffer

    def give_back(self, buffer):
        done = None
        if self.events:
            done = torch.cuda.Event()
            done.record()
        self.free.append((buffer, done))


def _staged_through_a_pool(device, events: bool):
    pool, on_device = _PinnedPool(events), torch.empty(N, device=device)
    for step in range(3):
        staging = pool.get()
        staging.fill_(float(step))  # race: test_pinned_buffer_given_back_during_a_copy_and_handed_out_again
        on_device.copy_(staging, non_blocking=True)
        pool.give_back(staging)
        on_device.mul_(2)
    return on_device


@pytest.mark.streamrace(expect="race")
def test_pinned_buffer_given_back_during_a_copy_and_handed_out_again(streamrace_device):
    _staged_through_a_pool(streamrace_device, events=False)


@pytest.mark.streamrace(expect="clean")
def test_pinned_buffer_handed_out_again_after_its_copy(streamrace_device):
    _staged_through_a_pool(streamrace_device, events=True)


@pytest.mark.streamrace(expect="clean")
def test_a_tensor_pointed_at_a_buffer_a_copy_fills(streamrace_device):
    """``set_`` moves no bytes: torch DCP's stager points a new tensor at the pinned buffer its copy is filling."""
    host = torch.empty(N, pin_memory=True)
    host.copy_(_produced(streamrace_device), non_blocking=True)
    view = torch.empty(()).set_(host.untyped_storage(), 0, (N,), (1,))  # as the stager: new_empty([]), then set_
    torch.cuda.current_stream().synchronize()
    assert view.sum().item() != 0.5
