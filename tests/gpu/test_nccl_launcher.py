"""The launcher on real GPUs with NCCL (needs 2 GPUs; skipped elsewhere). Run by scripts/device/validate.sh."""

import pytest

from pytest_streamrace import hardware

pytestmark = pytest.mark.skipif(len(hardware.visible_gpus()) < 2, reason="needs 2 CUDA GPUs")


def test_two_ranks_get_nccl_and_one_gpu_each(pytester):
    pytester.makepyfile(test_nccl="""
        import os, pytest, torch, torch.distributed as dist

        @pytest.mark.distributed(world_size=2)
        def test_all_reduce_on_gpus(rank, world_size):
            assert dist.get_backend() == "nccl"
            assert torch.cuda.current_device() == rank
            x = torch.full((1 << 20,), float(rank + 1), device="cuda")
            dist.all_reduce(x)
            assert x[0].item() == 3.0
            print("rank", rank, "on", torch.cuda.get_device_name(), torch.cuda.current_device())
    """)
    result = pytester.runpytest_subprocess("-rP")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*rank 0 on * 0*", "*rank 1 on * 1*"])


def test_failure_and_crash_on_rank_1_under_nccl(pytester):
    pytester.makepyfile(test_nccl_fail="""
        import os, pytest, torch, torch.distributed as dist

        @pytest.mark.distributed(world_size=2)
        def test_assert_on_rank_1(rank):
            x = torch.ones(4, device="cuda")
            if rank == 1:
                assert x.sum().item() == 5, "rank one disagrees"
            dist.all_reduce(x)

        @pytest.mark.distributed(world_size=2)
        def test_exit_on_rank_1(rank):
            x = torch.ones(4, device="cuda")
            dist.all_reduce(x)
            if rank == 1:
                os._exit(7)
            dist.all_reduce(x)
    """)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    assert "rank one disagrees" in out
    assert "rank 1" in out and "7" in out
    assert "NCCL error" not in out and "DistBackendError" not in out


def test_xdist_workers_split_the_gpus(pytester):
    pytester.makepyfile(test_split="""
        import os, pytest, torch

        @pytest.mark.parametrize("i", range(4))
        @pytest.mark.distributed(world_size=1)
        def test_one_rank(i):
            name = torch.cuda.get_device_properties(torch.cuda.current_device()).uuid
            print("worker", os.environ.get("PYTEST_XDIST_WORKER"), "gpu", name)
    """)
    result = pytester.runpytest_subprocess("-n", "2", "-rP")
    result.assert_outcomes(passed=4)
    by_worker = {}
    for line in result.outlines:
        if line.startswith("worker gw"):
            _, worker, _, gpu = line.split(maxsplit=3)
            by_worker.setdefault(worker, set()).add(gpu)
    assert len(by_worker) == 2 and all(len(g) == 1 for g in by_worker.values())
    assert by_worker["gw0"] != by_worker["gw1"], by_worker
