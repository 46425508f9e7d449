"""FSDP2 (``fully_shard``) as users train with it: clean in its stock configurations, racy twins caught."""

import pytest
import torch
import torch.nn as nn

fsdp = pytest.importorskip("torch.distributed.fsdp")

pytestmark = pytest.mark.distributed(world_size=2)


def _model(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16)).to(device)


def _sharded(device, **options):
    model = _model(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fsdp.fully_shard(layer, **options)
    fsdp.fully_shard(model, **options)
    return model


def _train(model, device, steps=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.randn(4, 16, device=device)).sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.streamrace(expect="clean")
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard-after-forward", "keep-unsharded"])
def test_fully_shard(streamrace_device, reshard):
    _train(_sharded(streamrace_device, reshard_after_forward=reshard), streamrace_device)


@pytest.mark.streamrace(expect="clean")
def test_mixed_precision(streamrace_device):
    policy = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _train(_sharded(streamrace_device, mp_policy=policy), streamrace_device)


@pytest.mark.streamrace(expect="clean")
def test_gradient_accumulation(streamrace_device):
    model = _sharded(streamrace_device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.set_requires_gradient_sync(False)
    model(torch.randn(4, 16, device=streamrace_device)).sum().backward()
    model.set_requires_gradient_sync(True)
    model(torch.randn(4, 16, device=streamrace_device)).sum().backward()
    opt.step()


@pytest.mark.streamrace(expect="race")
def test_grad_norm_on_side_stream_without_wait(streamrace_device):
    """Overlapping the gradient norm on a side stream, which never waited for the backward's reduce-scatters."""
    model = _sharded(streamrace_device)
    model(torch.randn(4, 16, device=streamrace_device)).sum().backward()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        norms = [p.grad.to_local().norm() for p in model.parameters()]  # race: test_grad_norm_on_side_stream_without_wait
    torch.cuda.current_stream().wait_stream(side)
    torch.stack(norms).sum()
