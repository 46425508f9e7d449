"""Collectives on a communication stream: ordered after the current stream at launch, before it only at wait()."""

import pytest
import torch
import torch.distributed as dist
from tagged_lines import line

from pytest_streamrace.detector.hb import FREE, RAW, WAR, WAW
from pytest_streamrace.detector.session import Detector

DEFAULT_GROUP_STREAM = "communication stream of the default process group"
N = 8




@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A real one-rank gloo group in this process: the ordering model does not depend on the world size."""
    if dist.is_initialized():
        pytest.fail("a process group is already initialized in this test process", pytrace=False)
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def summary(d: Detector) -> list[tuple]:
    """(kind, earlier op, earlier stream, earlier line, later op, later stream, later line) per race."""
    return [(r.kind, r.earlier.op.site.op, d.hb.stream_name(r.earlier.op.stream), r.earlier.op.site.frames[0][1],
             r.later.op.site.op, d.hb.stream_name(r.later.op.stream), r.later.op.site.frames[0][1])
            for r in d.races]


def test_async_output_read_before_wait_races_on_the_communication_stream(group):
    with Detector() as d:
        x = torch.ones(N)
        work = dist.all_reduce(x, async_op=True)  # async-launch
        x.sum()  # read-early
        work.wait()
    assert summary(d) == [(RAW, "all_reduce", DEFAULT_GROUP_STREAM, line("async-launch"),
                           "aten::sum", "default stream", line("read-early"))]


def test_async_output_read_after_wait_and_sync_collectives_are_clean(group):
    with Detector() as d:
        x = torch.ones(N)
        work = dist.all_reduce(x, async_op=True)
        work.wait()
        x.sum()
        dist.all_reduce(x)  # synchronous: torch waits on the work itself
        x.add_(1)
        work = dist.all_reduce(x, async_op=True)
        work.synchronize()  # the NCCL spelling of "current stream waits"
        x.add_(1)
    assert d.races == []


def test_collective_waits_only_on_the_current_stream(group):
    """Written on the default stream, reduced from a side stream that did not wait for the write."""
    with Detector() as d:
        x = torch.zeros(N)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        x.add_(1)  # producer
        with torch.cuda.stream(side):
            dist.all_reduce(x)  # reduce-from-side
        torch.cuda.current_stream().wait_stream(side)
    assert summary(d) == [(WAW, "aten::add_", "default stream", line("producer"),
                           "all_reduce", DEFAULT_GROUP_STREAM, line("reduce-from-side"))]


def test_wait_orders_only_the_stream_that_waited(group):
    with Detector() as d:
        x = torch.ones(N)
        work = dist.all_reduce(x, async_op=True)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            work.wait()
            x.sum()  # ordered: side waited
        x.sum()  # read-on-unwaited-stream
    assert [(kind, later_line) for kind, *_, later_line in summary(d)] == [(RAW, line("read-on-unwaited-stream"))]


def test_inputs_are_read_outputs_written(group):
    """all_gather_into_tensor reads its input and writes its output: reading the input alongside is fine, writing it
    before wait() is a write-after-read, reading the output a read-after-write."""
    with Detector() as d:
        inp, out = torch.ones(N), torch.zeros(N)
        work = dist.all_gather_into_tensor(out, inp, async_op=True)  # gather
        inp.sum()
        inp.mul_(2)  # input-overwrite
        out.sum()  # output-read
        work.wait()
    assert [(kind, op, line_) for kind, op, _, line_, *_ in summary(d)] == [
        (WAR, "all_gather_into_tensor", line("gather")), (RAW, "all_gather_into_tensor", line("gather"))]
    assert [r.later.op.site.frames[0][1] for r in d.races] == [line("input-overwrite"), line("output-read")]


def test_root_of_broadcast_only_reads_root_of_reduce_writes(group):
    """On the root, broadcast reads its tensor (concurrent reads are fine) and reduce writes it."""
    with Detector() as d:
        x = torch.ones(N)
        work = dist.broadcast(x, src=0, async_op=True)
        x.sum()  # read alongside the root's send: no race
        work.wait()
        work = dist.reduce(x, dst=0, async_op=True)
        x.sum()  # reduce-read
        work.wait()
    assert [(kind, op, later) for kind, op, _, _, _, _, later in summary(d)] == [(RAW, "reduce", line("reduce-read"))]


COLLECTIVES = {
    "all_gather": lambda x, out: dist.all_gather([out], x, async_op=True),
    "reduce_scatter_tensor": lambda x, out: dist.reduce_scatter_tensor(out, x, async_op=True),
    "reduce_scatter": lambda x, out: dist.reduce_scatter(out, [x], async_op=True),
    "all_to_all_single": lambda x, out: dist.all_to_all_single(out, x, async_op=True),
}


@pytest.mark.parametrize("name", COLLECTIVES)
def test_every_collective_writes_its_output_on_the_communication_stream(group, name):
    with Detector() as d:
        x, out = torch.ones(N), torch.zeros(N)
        work = COLLECTIVES[name](x, out)
        out.sum()
        work.wait()
        out.sum()
    assert [(r.kind, r.earlier.op.site.op, d.hb.stream_name(r.earlier.op.stream)) for r in d.races] == [
        (RAW, name, DEFAULT_GROUP_STREAM)]


def test_coalesced_collectives_are_one_op_ordered_by_the_managers_wait(group):
    coalescing = dist.distributed_c10d._coalescing_manager
    with Detector() as d:
        a, b = torch.ones(N), torch.ones(N)
        with coalescing(async_ops=True) as cm:
            dist.all_reduce(a)
            dist.all_reduce(b)
        b.sum()  # coalesced-read-early
        cm.wait()
        a.sum()
        with coalescing():  # synchronous: waited at exit
            dist.all_reduce(a)
        a.sum()
    assert [(kind, op, later) for kind, op, _, _, _, _, later in summary(d)] == [
        (RAW, "all_reduce (coalesced)", line("coalesced-read-early"))]


def test_collectives_do_not_keep_their_tensors_alive(group):
    """The model holds no Work past its wait (a Work holds its tensors): the free is seen where the program drops
    the tensor, so a free while a side stream still reads it is reported there."""
    with Detector() as d:
        x = torch.ones(N)
        dist.all_reduce(x)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.sum()
        del x  # free-after-collective
        torch.empty(N)  # the next allocation on the default stream may reuse x's block
    assert [(r.kind, r.later.op.site.frames[0][1]) for r in d.races] == [(FREE, line("free-after-collective"))]


def test_work_methods_are_restored_after_the_session(group):
    from torch._C._distributed_c10d import Work

    originals = {name: vars(Work)[name] for name in ("wait", "synchronize")}
    with Detector():
        assert vars(Work)["wait"] is not originals["wait"]
    assert {name: vars(Work)[name] for name in originals} == originals
    x = torch.ones(N)
    dist.all_reduce(x, async_op=True).wait()  # still works untracked
    assert x.tolist() == [1.0] * N


def test_broadcast_races_only_where_it_receives(pytester):
    """Two real ranks: the receiving rank reads its tensor before wait() (a race); the root reads what it sends."""
    pytester.makepyfile(
        """
        import torch, torch.distributed as dist
        import pytest

        @pytest.mark.distributed(world_size=2)
        def test_broadcast(rank):
            x = torch.full((4,), float(rank))
            work = dist.broadcast(x, src=0, async_op=True)
            x.sum()
            work.wait()
            assert x.tolist() == [0.0] * 4
        """)
    result = pytester.runpytest_subprocess("--streamrace", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*failed on rank 1 of 2*",
                                 "stream race on rank 1: read-after-write on tensor float32[[]4[]]*",
                                 "*earlier*write*broadcast*on communication stream of the default process group*"])
    assert "rank 0:" not in result.stdout.str()


def test_collectives_torch_issues_and_waits_in_cpp_are_ordered_into_their_stream(group):
    """DDP's constructor and buffer sync: C++ issues the collective and waits on it where no patch sees it."""
    with Detector() as d:
        params = [torch.ones(N), torch.ones(3)]
        dist._verify_params_across_processes(group, params)  # all_gather of sizes, read by .item() in C++
        dist._broadcast_coalesced(group, params, 1 << 20, 0)
        params[0].add_(1)
        params[1].sum()
    assert d.races == []


def test_a_future_orders_its_waiter_and_its_callbacks_after_the_collective(group):
    with Detector() as d:
        x = torch.ones(N)
        doubled = dist.all_reduce(x, async_op=True).get_future().then(lambda fut: fut.value()[0] * 2)
        doubled.wait().sum()
        y = torch.ones(N)
        fut = dist.all_reduce(y, async_op=True).get_future()
        fut.wait()
        y.sum()
    assert d.races == []


def test_a_future_read_before_its_wait_races(group):
    with Detector() as d:
        x = torch.ones(N)
        fut = dist.all_reduce(x, async_op=True).get_future()  # future-launch
        x.sum()  # read-before-future
        fut.wait()
    assert summary(d) == [(RAW, "all_reduce", DEFAULT_GROUP_STREAM, line("future-launch"),
                           "aten::sum", "default stream", line("read-before-future"))]


def test_a_callbacks_result_is_ordered_only_for_those_that_wait_on_its_future(group):
    with Detector() as d:
        x = torch.ones(N)
        out = torch.zeros(N)
        done = dist.all_reduce(x, async_op=True).get_future().then(lambda fut: out.copy_(fut.value()[0]))  # cb
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            out.sum()  # side-read
            done.wait()
            out.sum()
    assert [(r.kind, r.later.op.site.frames[0][1]) for r in d.races] == [(RAW, line("side-read"))]


def test_a_group_is_named_once_for_every_collective_torchs_cpp_issues_on_it(group, monkeypatch):
    """C++ boxes a ProcessGroup into a new object around it at every call it issues (DDP's reducer, each bucket's
    all-reduce): the capture's feed knows the group by the group, so the model names its stream once, and the
    records after it are applied without Python (where the applier thread takes them, without stalling it)."""
    from pytest_streamrace.detector import capture
    from pytest_streamrace.detector.models.collectives import Collectives

    if capture.load() is None:
        pytest.skip("the C++ capture does not build here")
    asked = []
    real = Collectives.rule_stream
    monkeypatch.setattr(Collectives, "rule_stream", lambda self, value: asked.append(1) or real(self, value))
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(N, N), torch.nn.ReLU()),
                                                      process_group=group)
    with Detector() as d:
        for _ in range(10):
            model(torch.ones(2, N)).sum().backward()
    assert d.races == []
    assert len(asked) == 1
