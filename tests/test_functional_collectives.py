"""Functional collectives (``torch.ops._c10d_functional``) on real gloo ranks: the collective reads its input and
writes its output on the communication stream; only ``wait_tensor`` (also reached from ``AsyncCollectiveTensor``)
orders the waiting stream after it."""

import re

CASES = """
import pytest, torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol

def group_name():
    return dist.group.WORLD.group_name

@pytest.mark.distributed(world_size=2)
def test_output_read_before_wait(rank):
    x = torch.full((8,), float(rank + 1))
    out = torch.ops._c10d_functional.all_reduce(x, "sum", group_name())
    early = out.sum()  # read-early
    torch.ops._c10d_functional.wait_tensor(out)

@pytest.mark.distributed(world_size=2)
def test_input_overwritten_before_wait(rank):
    x = torch.full((8,), float(rank + 1))
    out = torch.ops._c10d_functional.all_gather_into_tensor(x, 2, group_name())
    x.mul_(2)  # overwrite-early
    torch.ops._c10d_functional.wait_tensor(out)

@pytest.mark.distributed(world_size=2)
def test_wait_on_a_side_stream_orders_only_that_stream(rank):
    x = torch.full((8,), float(rank + 1))
    out = torch.ops._c10d_functional.reduce_scatter_tensor(x, "sum", 2, group_name())
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.ops._c10d_functional.wait_tensor(out)
        out.sum()
    out.sum()  # unwaited-stream

@pytest.mark.distributed(world_size=2)
def test_broadcast_received_read_before_wait(rank):
    x = torch.full((8,), float(rank + 1))
    out = torch.ops._c10d_functional.broadcast(x, 0, group_name())
    if rank == 1:  # the receiver's copy is written on the communication stream; the source's only read there
        out.sum()
    torch.ops._c10d_functional.wait_tensor(out)
    assert out.tolist() == [1.0] * 8

@pytest.mark.distributed(world_size=2)
def test_waited_ops_are_clean(rank):
    x = torch.full((8,), float(rank + 1))
    out = torch.ops._c10d_functional.all_reduce(x, "sum", group_name())
    torch.ops._c10d_functional.wait_tensor(out)
    assert out.tolist() == [3.0] * 8
    x.mul_(2)
    gathered = torch.ops._c10d_functional.all_gather_into_tensor_coalesced([x, x + 1], 2, group_name())
    torch.ops._c10d_functional.wait_tensor(gathered[0])  # one work for the coalesced op
    assert [g.shape[0] for g in gathered] == [16, 16] and gathered[1].sum().item() > 0
    torch.ops._c10d_functional.all_reduce_(x, "max", group_name())
    torch.ops._c10d_functional.wait_tensor(x)
    assert x.tolist() == [4.0] * 8
    sent = torch.ops._c10d_functional.broadcast(x * (rank + 1), 1, group_name())
    torch.ops._c10d_functional.wait_tensor(sent)
    assert sent.tolist() == [8.0] * 8

@pytest.mark.distributed(world_size=2)
def test_async_collective_tensors_used_normally(rank):
    x = torch.full((8,), float(rank + 1))
    y = funcol.all_reduce(x, "sum", dist.group.WORLD)
    assert isinstance(y, funcol.AsyncCollectiveTensor)
    z = (y * 2).sum()  # first use waits
    x.add_(1)
    g = funcol.all_gather_single(x, 0, dist.group.WORLD)
    assert g.view(2, 8)[rank].tolist() == x.tolist()
    parts = funcol.reduce_scatter_tensor(torch.ones(8), "sum", 0, dist.group.WORLD)
    parts.add_(1)
    assert z.item() == 48.0

@pytest.mark.distributed(world_size=2)
def test_dtensor_redistribute(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(16.0).reshape(4, 4)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    replicated = sharded.redistribute(mesh, [Replicate()])
    assert torch.equal(replicated.to_local(), full)
    resharded = replicated.redistribute(mesh, [Shard(1)])
    assert resharded.to_local().shape == (4, 2)
    (sharded * 2).full_tensor().sum().item()
"""


def _section(out: str, test: str) -> str:
    """The failure section of one test in the run's output."""
    match = re.search(rf"_+ {test} _+\n(.*?)(?=\n_{{5,}} test_|\n=+ )", out, re.S)
    assert match, f"no failure section for {test}"
    return match.group(1)


def test_functional_collectives_race_until_waited_and_are_clean_when_waited(pytester):
    pytester.makepyfile(test_funcol=CASES)
    result = pytester.runpytest_subprocess("--streamrace", "-p", "no:cacheprovider", "-rA")
    out = result.stdout.str()
    result.assert_outcomes(passed=3, failed=4)
    for clean in ("test_waited_ops_are_clean", "test_async_collective_tensors_used_normally",
                  "test_dtensor_redistribute"):
        assert re.search(rf"PASSED test_funcol.py::{clean}\b", out), clean

    read = _section(out, "test_output_read_before_wait")
    assert re.search(r"read-after-write on tensor float32\[8\]", read)
    assert re.search(r"earlier\s+write\s+all_reduce\s+on communication stream of the default process group", read)
    assert re.search(r"later\s+read\s+aten::sum\s+on default stream\s+at test_funcol.py:\d+", read)

    overwrite = _section(out, "test_input_overwritten_before_wait")
    assert re.search(r"write-after-read on tensor float32\[8\]", overwrite)
    assert re.search(r"earlier\s+read\s+all_gather_into_tensor\s+on communication stream", overwrite)
    assert re.search(r"later\s+write\s+aten::mul_\s+on default stream", overwrite)

    received = _section(out, "test_broadcast_received_read_before_wait")
    assert re.search(r"stream race on rank 1\b", received), received  # the source only reads its own
    assert re.search(r"earlier\s+write\s+broadcast\s+on communication stream of the default process group", received)
    assert re.search(r"later\s+read\s+aten::sum\s+on default stream", received)

    side = _section(out, "test_wait_on_a_side_stream_orders_only_that_stream")
    assert re.search(r"^1 stream race", side, re.M)  # the side stream waited: its read is ordered
    assert re.search(r"earlier\s+write\s+reduce_scatter_tensor\s+on communication stream", side)
    assert re.search(r"later\s+read\s+aten::sum\s+on default stream", side)
