"""Rank processes that other harnesses start, on GPUs (NCCL, one GPU per rank): PyTorch's MultiProcessTestCase and
torch.multiprocessing.spawn, each with a racy and a clean twin. Not collected (no test_ prefix):
tests/gpu/test_harnesses_gpu.py runs it with and without --streamrace:
without it every case passes (the race is silent); with it the racy twins fail with "stream race on ranks 0, 1".
"""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from torch.testing._internal.common_distributed import MultiProcessTestCase

SLEEP = 50_000_000  # cycles: the side stream is still busy when the default stream reads


def body(racy):
    side = torch.cuda.Stream()
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP)
        x.mul_(2)                                   # SIDE-WRITE
    if not racy:
        torch.cuda.current_stream().wait_stream(side)
    y = (x + 1).sum().item()                        # MAIN-READ
    torch.cuda.current_stream().wait_stream(side)
    dist.barrier()
    return y


class TestMultiProcessTestCase(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def _rank_body(self, racy):
        torch.cuda.set_device(self.rank)
        dist.init_process_group("nccl", store=dist.FileStore(self.file_name, self.world_size), rank=self.rank,
                                world_size=self.world_size, device_id=torch.device("cuda", self.rank))
        body(racy)
        dist.destroy_process_group()

    def test_racy(self):
        self._rank_body(True)

    def test_clean(self):
        self._rank_body(False)


def _spawned(rank, port, racy):
    torch.cuda.set_device(rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    body(racy)
    dist.destroy_process_group()


def _port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_spawn_racy():
    torch_mp.spawn(_spawned, args=(_port(), True), nprocs=2)


def test_spawn_clean():
    torch_mp.spawn(_spawned, args=(_port(), False), nprocs=2)
