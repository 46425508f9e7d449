"""DistributedDataParallel as users train with it: clean in every stock configuration, racy twins caught."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

pytestmark = pytest.mark.distributed(world_size=2)


def _model(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)).to(device)


def _ddp(device, **kwargs):
    model = _model(device)
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **kwargs)


def _train(ddp, device, steps=3):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(steps):
        ddp(torch.randn(4, 16, device=device)).sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.streamrace(expect="clean")
@pytest.mark.parametrize("options", [{}, {"gradient_as_bucket_view": True}, {"static_graph": True},
                                     {"bucket_cap_mb": 0.001}, {"broadcast_buffers": False}],
                         ids=["default", "bucket-view", "static-graph", "small-buckets", "no-buffer-sync"])
def test_ddp(streamrace_device, options):
    _train(_ddp(streamrace_device, **options), streamrace_device)


@pytest.mark.streamrace(expect="clean")
@pytest.mark.parametrize("hook", ["allreduce", "fp16", "bf16", "powersgd", "builtin-fp16"])
def test_comm_hooks(streamrace_device, hook):
    if hook == "bf16" and streamrace_device.type != "cuda":
        pytest.skip("DDP's bf16_compress_hook needs NCCL")
    ddp = _ddp(streamrace_device)
    if hook == "allreduce":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif hook == "powersgd":  # its first iterations run allreduce, then the low-rank compression
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    _train(ddp, streamrace_device, steps=4)


@pytest.mark.streamrace(expect="clean")
def test_no_sync_accumulation(streamrace_device):
    ddp = _ddp(streamrace_device)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(2):
        with ddp.no_sync():
            ddp(torch.randn(4, 16, device=streamrace_device)).sum().backward()
        ddp(torch.randn(4, 16, device=streamrace_device)).sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.streamrace(expect="clean")
def test_user_async_all_reduce_waited(streamrace_device):
    ddp = _ddp(streamrace_device)
    _train(ddp, streamrace_device, steps=1)
    loss = torch.ones(1, device=streamrace_device)
    work = dist.all_reduce(loss, async_op=True)
    work.wait()
    assert loss.item() == 2.0


@pytest.mark.streamrace(expect="race")
def test_hook_scales_bucket_on_side_stream(streamrace_device):
    """A comm hook that divides the bucket on its own stream, without waiting for the stream that filled it."""
    side = torch.cuda.Stream()

    def hook(state, bucket):
        buffer = bucket.buffer()
        with torch.cuda.stream(side):
            buffer.div_(dist.get_world_size())  # race: test_hook_scales_bucket_on_side_stream
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])

    ddp = _ddp(streamrace_device)
    ddp.register_comm_hook(None, hook)
    _train(ddp, streamrace_device, steps=2)


@pytest.mark.streamrace(expect="race")
def test_user_async_all_reduce_read_before_wait(streamrace_device):
    ddp = _ddp(streamrace_device)
    _train(ddp, streamrace_device, steps=1)
    loss = torch.ones(1, device=streamrace_device)
    work = dist.all_reduce(loss, async_op=True)
    logged = loss * 1  # race: test_user_async_all_reduce_read_before_wait
    work.wait()
