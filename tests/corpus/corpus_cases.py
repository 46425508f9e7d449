"""The race corpus: racy and clean twins of the patterns behind real gradient-corruption bugs.

Each case carries its expected verdict as ``streamrace(expect=...)``, so ``pytest --streamrace`` passes on this file
exactly when every verdict is right — on CPU (virtual backend) and on a GPU (cuda backend). The file is not collected
by default (its name does not start with ``test_``): ``tests/test_corpus.py`` runs it through pytester, and
``tests/gpu/test_corpus_gpu.py`` runs it on a GPU, once with the plugin and once under PyTorch's own sanitizer.
Collective cases use a one-rank process group (gloo on CPU, nccl on a GPU): ordering, not data, is what they test.
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

race = pytest.mark.streamrace(expect="race")
clean = pytest.mark.streamrace(expect="clean")
N = 1 << 12


@pytest.fixture
def dev(streamrace_device):
    return streamrace_device


@pytest.fixture(scope="module")
def group():
    if not dist.is_initialized():
        path = os.path.join(tempfile.mkdtemp(prefix="streamrace-corpus-"), "store")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=f"file://{path}", rank=0, world_size=1)
    yield dist.group.WORLD


def side_stream_pair(dev):
    x = torch.zeros(N, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the side stream sees x's initialization
    return x, side


# 1-3: the three kinds between two streams


@race
def test_raw_side_write_default_read(dev):
    x, side = side_stream_pair(dev)
    with torch.cuda.stream(side):
        x.add_(1)
    x.sum()


@clean
def test_raw_side_write_default_read_after_wait(dev):
    x, side = side_stream_pair(dev)
    with torch.cuda.stream(side):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    x.sum()


@race
def test_war_default_read_side_write(dev):
    x, side = side_stream_pair(dev)
    x.sum()
    with torch.cuda.stream(side):
        x.fill_(2)
    torch.cuda.current_stream().wait_stream(side)


@clean
def test_war_default_read_side_write_after_wait(dev):
    x, side = side_stream_pair(dev)
    x.sum()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.fill_(2)
    torch.cuda.current_stream().wait_stream(side)


@race
def test_waw_two_side_streams(dev):
    x, first = side_stream_pair(dev)
    second = torch.cuda.Stream()
    second.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(first):
        x.fill_(1)
    with torch.cuda.stream(second):
        x.fill_(2)
    torch.cuda.current_stream().wait_stream(first)
    torch.cuda.current_stream().wait_stream(second)


@clean
def test_waw_two_side_streams_chained(dev):
    x, first = side_stream_pair(dev)
    second = torch.cuda.Stream()
    with torch.cuda.stream(first):
        x.fill_(1)
    second.wait_stream(first)
    with torch.cuda.stream(second):
        x.fill_(2)
    torch.cuda.current_stream().wait_stream(second)


# 4: views of one buffer


@race
def test_overlapping_views_at_other_offsets(dev):
    x, side = side_stream_pair(dev)
    with torch.cuda.stream(side):
        x[: N // 2 + 8].add_(1)
    x[N // 2:].sum()  # shares 8 elements with the side stream's write
    torch.cuda.current_stream().wait_stream(side)


@clean
def test_disjoint_slices_of_one_buffer(dev):
    x, side = side_stream_pair(dev)
    with torch.cuda.stream(side):
        x[: N // 2].add_(1)
    x[N // 2:].sum()
    torch.cuda.current_stream().wait_stream(side)


# 5-6: events and waits


@race
def test_event_recorded_before_the_write(dev):
    x, side = side_stream_pair(dev)
    done = torch.cuda.Event()
    with torch.cuda.stream(side):
        done.record()
        x.add_(1)
    torch.cuda.current_stream().wait_event(done)
    x.sum()
    torch.cuda.current_stream().wait_stream(side)


@clean
def test_event_recorded_after_the_write(dev):
    x, side = side_stream_pair(dev)
    done = torch.cuda.Event()
    with torch.cuda.stream(side):
        x.add_(1)
        done.record()
    torch.cuda.current_stream().wait_event(done)
    x.sum()


@race
def test_wait_on_the_wrong_stream(dev):
    x, producer = side_stream_pair(dev)
    bystander, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(producer):
        x.add_(1)
    consumer.wait_stream(bystander)
    with torch.cuda.stream(consumer):
        x.sum()
    torch.cuda.current_stream().wait_stream(producer)
    torch.cuda.current_stream().wait_stream(consumer)


@clean
def test_wait_on_the_producer_stream(dev):
    x, producer = side_stream_pair(dev)
    consumer = torch.cuda.Stream()
    with torch.cuda.stream(producer):
        x.add_(1)
    consumer.wait_stream(producer)
    with torch.cuda.stream(consumer):
        x.sum()
    torch.cuda.current_stream().wait_stream(consumer)


# 7-9: autograd — hooks bound to side streams, multi-producer buckets, backward on a side stream


def bound_params(dev, streams):
    """One parameter per stream, each with its AccumulateGrad node created (and so run) on that stream."""
    params, nodes = [], []
    for s in streams:
        p = torch.randn(N, device=dev, requires_grad=True)
        with torch.cuda.stream(s):
            nodes.append(p.expand_as(p).grad_fn.next_functions[0][0])
        params.append(p)
    return params, nodes


def hook_copy_then_consume(dev, sync):
    side = torch.cuda.Stream()
    (p,), nodes = bound_params(dev, [side])
    out = torch.zeros(N, device=dev)

    def copy(param):  # runs on `side`, the stream of p's AccumulateGrad node
        out.copy_(param.grad)

    p.register_post_accumulate_grad_hook(copy)
    (p * 3).sum().backward()
    reader = torch.cuda.Stream()
    if sync:
        reader.wait_stream(torch.cuda.current_stream())  # backward ended by joining `side` into this stream
    with torch.cuda.stream(reader):
        out.sum()
    torch.cuda.current_stream().wait_stream(reader)


@race
def test_hook_on_side_stream_consumed_on_unsynced_stream(dev):
    hook_copy_then_consume(dev, sync=False)


@clean
def test_hook_on_side_stream_consumed_after_backward_join(dev):
    hook_copy_then_consume(dev, sync=True)


def multi_producer_bucket(dev, wait_all):
    """Hooks on two streams copy gradients into slices of one bucket; the last one flushes it on a reduction
    stream — waiting only on its own stream is DeepSpeed #8061."""
    producers = [torch.cuda.Stream(), torch.cuda.Stream()]
    params, nodes = bound_params(dev, producers)
    bucket = torch.zeros(2 * N, device=dev)
    reduction = torch.cuda.Stream()
    seen = []

    def hook(i):
        def copy(param):
            bucket[i * N:(i + 1) * N].copy_(param.grad)
            seen.append(torch.cuda.current_stream())
            if len(seen) == len(params):
                for s in (seen if wait_all else seen[-1:]):
                    reduction.wait_stream(s)
                with torch.cuda.stream(reduction):
                    bucket.div_(2)
        return copy

    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(hook(i))
    (params[0] * 2 + params[1] * 3).sum().backward()
    torch.cuda.current_stream().wait_stream(reduction)


@race
def test_multi_producer_bucket_reduction_waits_on_one_producer(dev):
    multi_producer_bucket(dev, wait_all=False)


@clean
def test_multi_producer_bucket_reduction_waits_on_every_producer(dev):
    multi_producer_bucket(dev, wait_all=True)


def backward_on_side_stream(dev, sync):
    w = torch.randn(N, device=dev, requires_grad=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (w * w).sum().backward()
    if sync:
        torch.cuda.current_stream().wait_stream(side)
    w.grad.sum()
    # w.grad lives in the side stream's memory pool: keep its free after the default stream's read
    side.wait_stream(torch.cuda.current_stream())


@race
def test_backward_on_side_stream_grad_read_without_wait(dev):
    backward_on_side_stream(dev, sync=False)


@clean
def test_backward_on_side_stream_grad_read_after_wait(dev):
    backward_on_side_stream(dev, sync=True)


# 10-11: collectives


@race
def test_async_collective_output_read_before_wait(dev, group):
    x = torch.ones(N, device=dev)
    work = dist.all_reduce(x, async_op=True)
    x.sum()
    work.wait()


@clean
def test_async_collective_output_read_after_wait(dev, group):
    x = torch.ones(N, device=dev)
    work = dist.all_reduce(x, async_op=True)
    work.wait()
    x.sum()


@clean
def test_sync_collective_output_read_on_the_same_stream(dev, group):
    x = torch.ones(N, device=dev)
    dist.all_reduce(x)  # NCCL runs a synchronous collective on the current stream; gloo waits on it in Python
    x.sum()


@race
def test_sync_collective_output_read_on_another_stream(dev, group):
    x = torch.ones(N, device=dev)
    reader = torch.cuda.Stream()
    reader.wait_stream(torch.cuda.current_stream())  # before the collective: not ordered after it
    dist.all_reduce(x)
    with torch.cuda.stream(reader):
        x.sum()
    torch.cuda.current_stream().wait_stream(reader)


def collective_from_side_stream(dev, sync):
    """Data written on the default stream, all-reduced from a side stream: the communication stream waits on the
    current (side) stream only — Megatron-LM #3670's shape."""
    x = torch.zeros(N, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    x.add_(1)
    if sync:
        side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dist.all_reduce(x)
    torch.cuda.current_stream().wait_stream(side)


@race
def test_collective_on_stream_that_waited_on_the_wrong_stream(dev, group):
    collective_from_side_stream(dev, sync=False)


@clean
def test_collective_on_stream_that_waited_on_the_producer(dev, group):
    collective_from_side_stream(dev, sync=True)


# 12: the caching allocator


def free_while_side_reads(dev, record):
    side = torch.cuda.Stream()
    x = torch.ones(N, device=dev)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        total = x.sum()
    if record:
        x.record_stream(side)
    del x  # its block can go to the next allocation on the default stream at once
    torch.zeros(N, device=dev)
    torch.cuda.current_stream().wait_stream(side)
    return total


@race
def test_free_while_another_stream_reads(dev):
    free_while_side_reads(dev, record=False)


@clean
def test_free_after_record_stream(dev):
    free_while_side_reads(dev, record=True)
