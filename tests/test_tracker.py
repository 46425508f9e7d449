"""The access tracker: which bytes each ATen op reads and writes, where in user code, and when storages die."""

import os

import torch
from tagged_lines import line

from pytest_streamrace.detector.frames import user_frames
from pytest_streamrace.detector.session import Detector
from pytest_streamrace.detector.tracker import byte_range, plain_storage


def side_stream():
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    return s


def race_after_side_write(write_view, read):
    """Write `write_view` on a side stream, then run `read()` on the default stream without a wait."""
    with Detector() as d:
        s = side_stream()
        with torch.cuda.stream(s):
            write_view().add_(1)
        read()
    return d.races


def test_byte_range_is_the_span_a_view_touches():
    base = torch.zeros(4, 6)  # float32: 4 bytes
    assert byte_range(base) == (0, 96)
    assert byte_range(base[1]) == (24, 48)
    assert byte_range(base[:, 2]) == (8, 8 + 3 * 24 + 4)  # strided column: first to last element
    assert byte_range(base.t()) == (0, 96)
    assert byte_range(base[2:2]) is None  # no elements, no bytes
    assert byte_range(base.view(torch.float64)[1, 1]) == (32, 40)


def test_overlapping_views_at_other_offsets_race():
    buf = torch.zeros(16)
    races = race_after_side_write(lambda: buf[0:10], lambda: buf[8:16].sum())
    assert [r.kind for r in races] == ["read-after-write"]
    assert (races[0].earlier.start, races[0].earlier.end) == (0, 40)
    assert (races[0].later.start, races[0].later.end) == (32, 64)


def test_disjoint_slices_of_one_buffer_do_not_race():
    buf = torch.zeros(16)
    assert race_after_side_write(lambda: buf[0:8], lambda: buf[8:16].sum()) == []
    # spans, not element sets: interleaved columns of one matrix are (conservatively) taken to overlap
    mat = torch.zeros(4, 2)
    assert [r.kind for r in race_after_side_write(lambda: mat[:, 0], lambda: mat[:, 1].sum())] == ["read-after-write"]


def test_views_and_metadata_factories_touch_nothing():
    buf = torch.zeros(16)
    no_access = lambda: (buf.view(4, 4), buf[3:], buf.t() if buf.dim() == 2 else buf.unsqueeze(0),  # noqa: E731
                         torch.empty_like(buf), buf.new_empty(3), buf.detach(), buf.reshape(2, 8))
    assert race_after_side_write(lambda: buf, no_access) == []
    # but a fill factory writes its fresh output on the current stream: reading it elsewhere unsynchronized races
    with Detector() as d:
        z = torch.zeros_like(buf)  # fill-write
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            z.sum()  # fill-read
    assert [(r.kind, r.earlier.op.site.frames[0][1], r.later.op.site.frames[0][1]) for r in d.races] == [
        ("read-after-write", line("fill-write"), line("fill-read"))]


def test_ops_on_metadata_only_touch_nothing():
    """In-place ops on a tensor's metadata (`set_` and the like) and questions about it (`is_pinned`, asked by DeepSpeed
    ZeRO-3 of a buffer its copy may still fill) move no bytes; a question about the values (`is_nonzero`) reads them."""
    buf = torch.zeros(16)
    no_access = lambda: (torch.empty(()).set_(buf.untyped_storage(), 0, (16,), (1,)),  # noqa: E731
                         buf.view(16).unsqueeze_(0).squeeze_(0).t_(), torch.ops.aten.is_pinned.default(buf),
                         buf.is_same_size(buf), buf.is_set_to(buf), buf.is_complex(), buf.is_floating_point())
    assert race_after_side_write(lambda: buf, no_access) == []
    assert race_after_side_write(lambda: buf, lambda: buf[:1].is_nonzero()) != []


def test_out_arguments_and_in_place_ops_are_writes_inputs_are_reads():
    a, b, c = torch.ones(4), torch.ones(4), torch.zeros(4)
    with Detector() as d:
        s = side_stream()
        with torch.cuda.stream(s):
            a.sum()  # read-a
            b.sum()
        torch.add(a, b, out=c)  # out= writes c, reads a and b: no conflict with the side stream's reads
        c.sum()
        a.mul_(2)  # inplace-write
    assert [(r.kind, r.earlier.op.site.frames[0][1], r.later.op.site.frames[0][1]) for r in d.races] == [
        ("write-after-read", line("read-a"), line("inplace-write"))]


def test_a_copy_onto_the_same_bytes_is_no_access():
    """``p.data.copy_(p.data)`` (DeepSpeed ZeRO-3's master-weight copy when the weights are fp32 already) returns
    before launching anything; a copy between different bytes is a write."""
    x, y = torch.zeros(4), torch.ones(4)
    with Detector() as d:
        s = side_stream()
        with torch.cuda.stream(s):
            x.data.copy_(x.data)
            x[2:].copy_(x[:2])  # copy-write
        x.sum()  # copy-read
        y.sum()
    assert [(r.kind, r.earlier.op.site.frames[0][1], r.later.op.site.frames[0][1]) for r in d.races] == [
        ("read-after-write", line("copy-write"), line("copy-read"))]


def test_tensor_lists_are_read_and_written():
    xs = [torch.zeros(4), torch.zeros(4)]
    with Detector() as d:
        s = side_stream()
        with torch.cuda.stream(s):
            torch._foreach_add_(xs, 1.0)  # foreach-write
        torch.cat(xs)  # cat-read
    # both elements race; one report per location pair, counted twice
    assert [(r.kind, r.count) for r in d.races] == [("read-after-write", 2)]
    assert d.races[0].earlier.op.site.frames[0][1] == line("foreach-write")
    assert d.races[0].later.op.site.frames[0][1] == line("cat-read")


def test_user_frames_skip_torch_pytest_and_this_package():
    frames = user_frames()  # frames-here
    assert frames[0] == (__file__, line("frames-here"), "test_user_frames_skip_torch_pytest_and_this_package")
    torch_dir = os.path.dirname(torch.__file__)
    assert not any(f[0].startswith(torch_dir) or "_pytest" in f[0] or "pluggy" in f[0] for f in frames)


def test_backward_ops_are_tracked_with_the_calling_line():
    with Detector(trace=True) as d:
        w = torch.randn(4, requires_grad=True)
        (w * 3).sum().backward()  # backward-call
    backward_ops = [op for op in d.hb.timeline if op.site.frames and op.site.frames[0][1] == line("backward-call")]
    assert {"aten::mul", "aten::sum", "aten::ones_like"} <= {op.site.op for op in backward_ops}


def test_free_forgets_history_so_a_reused_address_starts_clean():
    with Detector() as d:
        x = torch.randn(1024)
        key = x.untyped_storage().data_ptr()
        s = side_stream()
        with torch.cuda.stream(s):
            x.sum()
        torch.cuda.current_stream().wait_stream(s)
        assert d.hb.history_size(key) >= 1
        del x
        d.tracker.drain()
        assert d.hb.history_size(key) == 0
        y = torch.randn(1024)  # may reuse the address: must not inherit x's accesses
        y.add_(1)
    assert d.races == []


def test_tensors_named_after_the_session_started_keep_their_names_until_freed():
    with Detector() as d:
        t = torch.zeros(4)
        d.name(t, "ipg bucket")
        key = t.untyped_storage().data_ptr()
        assert d.tracker.names[key] == "ipg bucket"
        del t
        d.tracker.drain()
        assert key not in d.tracker.names


def test_the_stacks_kept_per_op_hold_no_locals():
    """Every op keeps where it ran; holding frames would keep their locals (tensors) alive and move their frees."""
    import weakref

    def local_work():
        t = torch.ones(4)
        t.add_(1)
        return weakref.ref(t)

    with Detector(trace=True) as d:
        dead = local_work()
        assert dead() is None
        (add,) = [op for op in d.timeline if op.site.op == "aten::add_"]
        assert add.site.frames[0][2] == "local_work"


def test_fake_tensors_have_no_storage_to_read_and_are_not_asked_for_one():
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when a fake storage's data pointer is read
        assert plain_storage(fake) is None
    assert plain_storage(torch.empty(4)) is not None


# PyTorch's LocalTensor test classes (test_tp_style.py's ...WithLocalTensor): DTensor's sharding propagation makes fake
# tensors inside the ops the detector sees
LOCAL_TENSOR_TP = """
import torch, torch.nn as nn, torch.distributed as dist
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore


def test_colwise_on_local_tensors():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        with LocalTensorMode(frozenset(range(2))):
            mod = parallelize_module(nn.Linear(16, 16), mesh, ColwiseParallel())
            mod(torch.rand(8, 16)).sum().backward()
    finally:
        dist.destroy_process_group()
"""


def test_tensor_parallel_on_local_tensors_runs_clean_and_quiet(pytester):
    pytester.makepyfile(test_local_tp=LOCAL_TENSOR_TP)
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    out = result.stdout.str()
    assert "1 test checked, 0 races found" in out
    assert "FakeTensor" not in out and "streamrace note" not in out, out
