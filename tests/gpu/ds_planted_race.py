"""A race planted in DeepSpeed DistributedTest bodies (copied next to DeepSpeed's tests/unit/ by
tests/gpu/test_harnesses_gpu.py).

Two tests of one class share a reused forkserver pool (reuse_dist_env): the first is clean, the second races, so
a correct run fails only the second (its race attributed to it, not to the first, though the same workers ran both).
"""
import torch
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from unit.common import DistributedTest


def body(racy):
    device = get_accelerator().current_device_name()
    side = torch.cuda.Stream()
    x = torch.ones(1 << 20, device=device)
    dist.all_reduce(x)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        if x.is_cuda:
            torch.cuda._sleep(50_000_000)  # the side stream is still busy when the default stream reads
        x.mul_(2)                          # PLANTED-WRITE
    if not racy:
        torch.cuda.current_stream().wait_stream(side)
    y = (x + 1).sum().item()               # PLANTED-READ
    torch.cuda.current_stream().wait_stream(side)
    return y


class TestPlantedRace(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_a_clean(self):
        body(False)

    def test_b_racy(self):
        body(True)
