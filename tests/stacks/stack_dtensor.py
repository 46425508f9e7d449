"""DTensor tensor parallelism (``parallelize_module`` with Colwise/RowwiseParallel): clean, and a racy twin caught."""

import pytest
import torch
import torch.nn as nn

tp = pytest.importorskip("torch.distributed.tensor.parallel")

pytestmark = pytest.mark.distributed(world_size=2)


def _parallel(device):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)).to(device)
    mesh = init_device_mesh(device.type, (2,))
    return tp.parallelize_module(model, mesh, {"0": tp.ColwiseParallel(), "2": tp.RowwiseParallel()})


@pytest.mark.streamrace(expect="clean")
def test_tensor_parallel_training(streamrace_device):
    model = _parallel(streamrace_device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(4, 16, device=streamrace_device)).sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.streamrace(expect="race")
def test_sharded_grad_read_on_side_stream_without_wait(streamrace_device):
    model = _parallel(streamrace_device)
    model(torch.randn(4, 16, device=streamrace_device)).sum().backward()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        total = sum(p.grad.to_local().sum() for p in model.parameters())  # race: test_sharded_grad_read_on_side_stream_without_wait
    torch.cuda.current_stream().wait_stream(side)
