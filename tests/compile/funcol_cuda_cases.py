"""Functional collectives in compiled graphs on CUDA + NCCL (cuda backend): Inductor emits
``_c10d_functional`` ops and their ``wait_tensor`` in its generated wrapper, and with
``reorder_for_compute_comm_overlap`` moves the waits as late as it can. Run by tests/gpu/test_syncs_gpu.py on 1 or 2
GPUs (1 GPU: one NCCL rank, the collective still runs on its own stream):

    python -m pytest tests/compile/funcol_cuda_cases.py --streamrace --streamrace-backend=cuda -rA

Expected: the ``clean_*`` cases pass, the ``racy_*`` cases fail with one race each on the communication stream of
the default process group. Skipped without a GPU (CI).
"""

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU cases: tests/gpu/test_syncs_gpu.py")
WORLD = min(2, torch.cuda.device_count()) or 1
RANK_SUM = WORLD * (WORLD + 1) // 2  # of each rank's x = rank + 1

N = 1 << 20


def _reordering():
    import torch._inductor.config as config

    config.reorder_for_compute_comm_overlap = True


def step(x, w):
    """Compute overlapping an all-reduce: Inductor may sink the wait below the matmul."""
    reduced = funcol.all_reduce(x * 2, "sum", dist.group.WORLD)
    local = (w @ w).relu()
    return reduced + 1, local


def unwaited(x):
    """Issues the collective and lets the raw output escape without its wait."""
    return torch.ops._c10d_functional.all_reduce(x * 2, "sum", dist.group.WORLD.group_name)


@pytest.mark.distributed(world_size=WORLD, backend="nccl")
def test_clean_compiled_allreduce_with_comm_reordering(rank):
    _reordering()
    compiled = torch.compile(step)
    x = torch.full((N,), float(rank + 1), device="cuda")
    w = torch.randn(512, 512, device="cuda")
    for _ in range(3):
        out, local = compiled(x, w)
    assert out[0].item() == 2.0 * RANK_SUM + 1 and local.shape == (512, 512)


@pytest.mark.distributed(world_size=WORLD, backend="nccl")
def test_clean_compiled_output_waited_in_eager(rank):
    compiled = torch.compile(unwaited)
    x = torch.full((N,), float(rank + 1), device="cuda")
    out = compiled(x)
    torch.ops._c10d_functional.wait_tensor(out)
    assert out[0].item() == 2.0 * RANK_SUM


@pytest.mark.distributed(world_size=WORLD, backend="nccl")
def test_racy_compiled_output_read_before_wait(rank):
    compiled = torch.compile(unwaited)
    x = torch.full((N,), float(rank + 1), device="cuda")
    out = compiled(x)
    total = out.sum()  # read before the wait: the racy twin
    torch.ops._c10d_functional.wait_tensor(out)
    total.item()


@pytest.mark.distributed(world_size=WORLD, backend="nccl")
def test_racy_compiled_input_overwritten_before_wait(rank):
    compiled = torch.compile(lambda x: torch.ops._c10d_functional.all_gather_into_tensor(
        x, WORLD, dist.group.WORLD.group_name))
    x = torch.full((N,), float(rank + 1), device="cuda")
    out = compiled(x)
    x.mul_(2)  # overwrites what NCCL may still be sending: the racy twin
    torch.ops._c10d_functional.wait_tensor(out)
