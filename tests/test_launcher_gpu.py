"""The nccl path: one GPU per rank, GPUs split between xdist workers. Skipped on machines with fewer than 2 GPUs.

Run on a GPU machine: `python -m pytest tests/test_launcher_gpu.py -v -n 0` (2+ GPUs; under xdist, 2 a worker).
"""

from __future__ import annotations

import pytest

from pytest_streamrace import env
from pytest_streamrace.launcher.placement import worker_share

# The sessions these tests start inherit this process's xdist worker, and with it its share of the GPUs (under -n 2 on
# two GPUs, one each: their items would run on gloo). Run them without workers: -n 0.
pytestmark = pytest.mark.skipif(len(worker_share(len(env.visible_gpus()))) < 2,
                                reason="needs 2 CUDA GPUs in this pytest process's share (-n 0 on a 2-GPU machine)")

NCCL = """
import os
import pytest, torch, torch.distributed as dist

@pytest.mark.distributed(world_size=2)
def test_auto_picks_nccl_one_gpu_per_rank(rank):
    assert dist.get_backend() == "nccl"
    assert torch.cuda.current_device() == rank == int(os.environ["LOCAL_RANK"])
    t = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    assert t.tolist() == [3.0] * 4

@pytest.mark.distributed(world_size=2, backend="nccl")
def test_nccl_failure_on_rank1(rank):
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    assert rank == 0, "rank 1 fails on purpose"

@pytest.mark.distributed(world_size=2, backend="nccl")
def test_nccl_raises_before_collective(rank):
    if rank == 1:
        raise ValueError("rank one gave up early")
    dist.all_reduce(torch.ones(1, device="cuda"))
    torch.cuda.synchronize()
"""


def test_nccl_ranks(pytester):
    pytester.makepyfile(NCCL)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=300)
    result.assert_outcomes(passed=1, failed=2)
    out = result.stdout.str()
    assert "distributed test failed on rank 1 of 2" in out and "AssertionError: rank 1 fails on purpose" in out
    assert "distributed test failed on rank 1 of 2 (rank 0 stopped while blocked)" in out
    assert "ValueError: rank one gave up early" in out


SPLIT = """
import os
import pytest, torch, torch.distributed as dist

@pytest.mark.distributed(world_size=1)
@pytest.mark.parametrize("i", range(4))
def test_worker_gpu(i, rank):
    assert dist.get_backend() == "nccl"
    worker = int(os.environ["PYTEST_XDIST_WORKER"][2:])
    count = torch.cuda.device_count() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    assert torch.cuda.current_device() == worker * count

@pytest.mark.distributed(world_size=2, backend="nccl")
def test_too_few_per_worker():
    pass
"""


def test_gpus_split_between_xdist_workers(pytester):
    if len(env.visible_gpus()) != 2:
        pytest.skip("written for exactly 2 GPUs")
    pytester.makepyfile(SPLIT)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "-rs", timeout=300)
    result.assert_outcomes(passed=4, skipped=1)
    result.stdout.fnmatch_lines(["*backend nccl needs 2 CUDA GPUs, this machine has 2 (1 for xdist worker gw*)*"])


# In the fork server only: initialize CUDA the way the variable says, before any rank forks.
CUDA_IN_SERVER = """
import ctypes, os, sys
if sys.argv[0].endswith("forkserver.py"):
    if os.environ["HOW"] == "torch":
        import torch
        torch.cuda.init()
    else:
        ctypes.CDLL("libcuda.so.1").cuInit(0)
"""

FSDP2_STEP = """
import os, sys
import pytest, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard

def server_state():
    server = os.getppid()
    with open("/proc/%d/maps" % server) as f:
        driver = any("libcuda" in line for line in f)
    return len(os.listdir("/proc/%d/task" % server)), driver

@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("i", range(3))
def test_fsdp2_step(i, rank):
    assert server_state()[0] == 1
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(16, 64, device="cuda")).sum().backward()
        optim.step()
        optim.zero_grad()
    torch.cuda.synchronize()
    print("libcuda loaded in the fork server:", server_state()[1])
"""


@pytest.mark.parametrize("how", ["torch", "driver"])
def test_a_fork_server_with_cuda_initialized_refuses_to_fork(pytester, monkeypatch, how):
    """A rank forked after CUDA was initialized inherits a driver it cannot use (crashes, hangs, 'initialization
    error'): the server refuses, in one line."""
    site = pytester.mkdir("site")
    (site / "sitecustomize.py").write_text(CUDA_IN_SERVER)
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("HOW", how)
    pytester.makepyfile("import pytest\n\n@pytest.mark.distributed(world_size=2)\ndef test_ranks():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=300)
    result.assert_outcomes(errors=1)
    why = "torch has initialized CUDA in it" if how == "torch" else "the CUDA driver is initialized in it"
    result.stdout.fnmatch_lines([f"*could not start the ranks: the rank fork server refused: *{why}*"])


def test_fsdp2_ranks_fork_from_a_server_without_cuda(pytester):
    """Stock FSDP2 steps on NCCL from the fork server, its state checked from each rank: single-threaded while they
    run (it was at fork, or it would have refused)."""
    pytester.makepyfile(FSDP2_STEP)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s", timeout=300)
    result.assert_outcomes(passed=3)
