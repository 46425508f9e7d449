"""The C++ op capture (both backends' source of ops), run here on CPU tensors: it must hand the tracker what the
dispatch mode does — the same ops, the same byte ranges, the user's lines — and c10d ops to their model in order."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pytest_streamrace.detector import capture
from pytest_streamrace.detector import hb as hb_py
from pytest_streamrace.detector.hb import HappensBefore
from pytest_streamrace.detector.tracker import READ, WRITE, AccessTracker
from tagged_lines import line


@pytest.fixture(scope="module")
def extension():
    ext = capture.load()
    if ext is None:
        pytest.skip(f"the capture extension does not build here: {capture.failure()}")
    return ext


@pytest.fixture(autouse=True, params=["python", "native"])
def core(request, monkeypatch):
    """`capturing` feeds hb.py's core, then the C++ one (hb_native) where the extension builds."""
    if request.param == "native":
        from pytest_streamrace.detector.hb_native import NativeHappensBefore

        if capture.load() is None:
            pytest.skip(f"the C++ extension is not available here: {capture.failure()}")
        monkeypatch.setitem(globals(), "HappensBefore", NativeHappensBefore)
    return request.param


@contextlib.contextmanager
def capturing(extension, track_frees=False):
    """(hb, tracker) fed by the capture, on CPU tensors, while inside (one stream: the capture's CPU key, 0)."""
    hb = HappensBefore(trace=True)
    tracker = AccessTracker(hb, lambda: 0, "cpu", track_frees=track_frees)
    tracker.capture_with(extension, every_thread=True)  # as on cuda
    try:
        yield hb, tracker
    finally:
        tracker.stop_capture()


def _program(keep: list) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    x = torch.randn(4, 8)
    for _ in range(2):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        keep += [loss, *(p.grad for p in model.parameters())]
    keep.append(torch.cat([x, x.t().contiguous().t()]).sum())  # a strided read
    keep.append(x[1:3].mul_(2))  # a write to a slice
    x.data.copy_(x.data)  # onto itself: ATen launches nothing, so no access either way


def _ops(captured: bool, extension=None) -> list[tuple]:
    """(op, [(start, end, write, shape, dtype)]) per op the tracker launched, the storages kept alive throughout (so
    no address is reused: frees are the allocator callback's business, and CPU has none)."""
    seen: list[tuple] = []
    hb = hb_py.HappensBefore()  # hb.py's: the C++ core's records come from the capture's feed, not through record
    original = hb.record

    def record(stream, site, accesses=(), allocs=()):
        seen.append((site.op, [(s, e, w, tuple(d[0]), str(d[1]).removeprefix("torch.")) for _, s, e, w, d in accesses]))
        return original(stream, site, accesses, allocs)

    hb.record = record
    tracker = AccessTracker(hb, lambda: 0, "cpu", track_frees=False)
    keep: list = []
    if captured:
        tracker.capture_with(extension)
        try:
            _program(keep)
        finally:
            tracker.stop_capture()
    else:
        with tracker:
            _program(keep)
    return seen


def test_captured_ops_are_the_dispatch_modes(extension):
    mode = _ops(False)
    captured = _ops(True, extension)
    assert [op for op, _ in captured] == [op for op, _ in mode]
    assert captured == mode
    assert {"aten::addmm", "aten::mm", "aten::threshold_backward", "aten::_foreach_add_", "aten::cat"} <= \
        {op for op, _ in captured}
    assert "aten::t" not in {op for op, _ in captured}  # views touch no bytes


def test_captured_stacks_name_the_users_line(extension):
    with capturing(extension) as (hb, _):
        x = torch.ones(4)
        x.add_(1)  # captured-line
    (add,) = [op for op in hb.timeline if op.site.op == "aten::add_"]
    assert add.site.frames[0] == (__file__, line("captured-line"), "test_captured_stacks_name_the_users_line")


def _add_one(t):
    t.add_(1)  # helper-line


def test_a_stack_seen_before_is_reused_only_for_the_same_frames(extension):
    """The capture reuses a stack when every frame's code and instruction match: the same helper line reached from
    another caller is another stack."""
    with capturing(extension) as (hb, _):
        x = torch.ones(4)
        for _ in range(2):
            _add_one(x)  # first-caller
        _add_one(x)  # second-caller
    adds = [op.site.frames[:2] for op in hb.timeline if op.site.op == "aten::add_"]
    assert [[lineno for _, lineno, _ in frames] for frames in adds] == [
        [line("helper-line"), line("first-caller")], [line("helper-line"), line("first-caller")],
        [line("helper-line"), line("second-caller")]]


def _add_one_deeper(x):
    _add_one(x)  # deeper-call


def test_ops_alternating_between_stacks_each_name_their_own_caller(extension):
    """A loop's ops alternate between a few stacks, which the capture first looks for among the thread's latest ones,
    by their frames: each op still names its own caller, and a call a frame deeper is not taken for a shallower one."""
    with capturing(extension) as (hb, _):
        x = torch.ones(4)
        for _ in range(3):
            _add_one(x)  # alternating-a
            _add_one(x)  # alternating-b
            _add_one_deeper(x)  # alternating-deeper
    callers = [[lineno for _, lineno, _ in op.site.frames[1:3]] for op in hb.timeline if op.site.op == "aten::add_"]
    assert callers == 3 * [[line("alternating-a")], [line("alternating-b")],  # the test's frame is the last named
                           [line("deeper-call"), line("alternating-deeper")]]


def test_a_stack_ends_at_the_test_harness_where_naming_stops(extension):
    """Frames beneath pytest's are never named (frames._user_only stops there), so the capture's identity of a stack
    ends at the first harness frame: calls that differ only beneath it share a stack, named as before."""
    namespace: dict = {}
    harness_file = os.path.join(os.sep, "site-packages", "_pytest", "streamrace_test_runner.py")
    exec(compile("def call(f, *args):\n    return f(*args)\n", harness_file, "exec"), namespace)
    via_harness = namespace["call"]
    with capturing(extension) as (hb, _):
        x = torch.ones(4)
        via_harness(_add_one, x)  # beneath-one
        via_harness(_add_one, x)  # beneath-two
        _add_one(x)  # no-harness
    adds = [op.site.frames for op in hb.timeline if op.site.op == "aten::add_"]
    helper = (__file__, line("helper-line"), "_add_one")
    assert adds[:2] == [(helper,), (helper,)]
    caller = (__file__, line("no-harness"), "test_a_stack_ends_at_the_test_harness_where_naming_stops")
    assert adds[2][:2] == (helper, caller)


def test_backward_ops_without_frames_of_their_own_name_the_forward_op_that_made_their_node(extension):
    """As on a GPU's engine threads: the backward runs where no line of the program is on the stack (a thread started
    on ``Tensor.backward`` itself). Its accesses name the node, the forward op and the line that created it."""
    import threading

    with capturing(extension) as (hb, _):
        w = torch.ones(4, requires_grad=True)
        y = (w * 3).sum()  # forward-line
        engine = threading.Thread(target=y.backward)
        engine.start()
        engine.join()
        w.grad.add_(1)  # a forward op again: its own line
    backward = [op for op in hb.timeline if op.site.op == "aten::mul"][1:]  # MulBackward0's grad * 3
    assert backward and all(op.site.frames[0] == (__file__, line("forward-line"),
                                                  "backward of MulBackward0, created by aten::mul in "
                                                  "test_backward_ops_without_frames_of_their_own_name_the_forward_op_"
                                                  "that_made_their_node") for op in backward)
    (add,) = [op for op in hb.timeline if op.site.op == "aten::add_"]
    assert add.site.frames[0][2] == "test_backward_ops_without_frames_of_their_own_name_the_forward_op_that_made_" \
        "their_node"


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class _Triple(_Double):
    @staticmethod
    def backward(ctx, grad):
        return grad * 3


def test_backward_ops_inside_python_functions_name_their_own_node(extension):
    """Node names are kept per node class, but a Python autograd Function's node (one C++ class for all of them) is
    named by its own Python class: each accumulation below runs inside the node of whichever Function's gradient came
    second, and names that one."""
    import threading

    def accumulation_node(first, second):
        with capturing(extension) as (hb, _):
            w = torch.ones(4, requires_grad=True)
            y = (first.apply(w) + second.apply(w)).sum()
            engine = threading.Thread(target=y.backward)  # no frames of the program's: the site names the node
            engine.start()
            engine.join()
        (add,) = [op for op in hb.timeline if op.site.op == "aten::add" and "backward of" in op.site.frames[0][2]]
        return add.site.frames[0][2].split(",")[0]

    assert accumulation_node(_Double, _Triple) == "backward of _DoubleBackward"
    assert accumulation_node(_Triple, _Double) == "backward of _TripleBackward"


def test_paused_tracker_captures_nothing(extension):
    with capturing(extension) as (hb, tracker):
        tracker.enabled = False
        torch.ones(4).add_(1)
        tracker.enabled = True
        torch.ones(4).mul_(2)
    assert [op.site.op for op in hb.timeline] == ["aten::ones", "aten::mul_"]


def test_other_threads_are_captured_and_a_pause_stays_on_its_thread(extension):
    """The capture sees every thread (as on cuda): a worker thread's ops arrive without any mode entered there. Pausing
    is per thread, as the tracker's is: a thread modelling its work by hand (a threaded rank inside its collective) must
    not silence the others."""
    import threading

    with capturing(extension) as (hb, tracker):
        tracker.enabled = False
        worker = threading.Thread(target=lambda: torch.ones(4).mul_(2))
        worker.start()
        worker.join()
        torch.ones(4).add_(1)  # paused here, on this thread only
        tracker.enabled = True
        tracker.drain()
    assert [op.site.op for op in hb.timeline] == ["aten::ones", "aten::mul_"]


def test_a_queued_collective_reaches_the_model_with_the_callers_own_tensors(extension, tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        handed = []
        with capturing(extension) as (_, tracker):
            tracker.namespace_handlers["c10d"] = lambda func, args, kwargs, out, phase, stream, frames: handed.append(
                (phase, func.name(), [a for a in args if isinstance(a, list)], out))
            t = torch.ones(4)
            work = dist.all_reduce(t, async_op=True)
            work.wait()
            tracker.drain()
        # not queued at issue: as it returned, with its Work, once
        assert [(phase, name, out is None) for phase, name, _, out in handed] == [("end", "c10d::allreduce_", False)]
        assert handed[0][2] and handed[0][2][0][0] is t  # the caller's own tensor, not a copy
    finally:
        dist.destroy_process_group()


def test_queued_c10d_ops_reach_the_model_once_in_order_from_the_records(extension, tmp_path):
    """A handled namespace's op is not handed over while it runs: it is queued with the issuing thread's stream and
    stack and reaches the handler once, at the next drain, after the ops before it and before those after it. A c10d
    op (``queued_at_issue``) torch's C++ issues comes as of its start (no outputs); one Python issues (``issuing``) as
    it returned, with its Work; a functional collective and its wait (a namespace not queued at issue) as they
    returned, with their outputs."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        handed = []
        with capturing(extension) as (hb, tracker):
            def handler(func, args, kwargs, out, phase, stream=None, frames=None):
                applied = [op.site.op for op in hb.timeline]
                handed.append((phase, func.name(), out is None, stream, frames.resolve()[0][1], applied))
            for namespace in ("c10d", "_c10d_functional"):
                tracker.namespace_handlers[namespace] = handler
            tracker.queued_at_issue.add("c10d")
            t = torch.ones(4)
            tracker.drain()
            t.mul_(2)
            # not marked as Python's: as torch's C++ issues one
            dist.all_reduce(t, async_op=True).wait()  # queued-start
            assert handed == []  # nothing in Python until the next drain
            t.add_(1)
            tracker.issuing(True)
            work = dist.all_reduce(t, async_op=True)  # python-issued
            tracker.issuing(False)
            work.wait()
            out = torch.ops._c10d_functional.all_reduce(t, "sum", dist.group.WORLD.group_name)  # functional
            out.sub_(1)
            torch.ops._c10d_functional.wait_tensor(out)  # functional-wait
            assert handed == []  # the functional ones too wait for the next drain
            tracker.drain()
        ops = ["aten::ones", "aten::mul_", "aten::add_"]
        assert handed == [
            ("start", "c10d::allreduce_", True, 0, line("queued-start"), ops[:2]),
            ("end", "c10d::allreduce_", False, 0, line("python-issued"), ops),
            ("end", "_c10d_functional::all_reduce", False, 0, line("functional"), ops),
            ("end", "_c10d_functional::wait_tensor", False, 0, line("functional-wait"), ops + ["aten::sub_"])]
    finally:
        dist.destroy_process_group()


def test_the_collectives_model_judges_captured_ops(extension, tmp_path):
    """An async all_reduce read before wait() races, after wait() it does not: hand-off, Work identity, the patched
    wait and the draining order, together."""
    import torch.distributed as dist

    from pytest_streamrace.detector.models.collectives import Collectives

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with capturing(extension) as (hb, tracker):
            patches = Collectives(hb, tracker, lambda: 0).patches()
            for patch in patches:
                patch.install()
            try:
                t = torch.ones(4)
                work = dist.all_reduce(t, async_op=True)
                t.sum()  # read-before-wait
                work.wait()
                t.sum()
            finally:
                for patch in reversed(patches):
                    patch.uninstall()
        (race,) = hb.races
        assert (race.kind, race.earlier.op.site.op) == ("read-after-write", "all_reduce")
        assert race.later.op.site.frames[0][1] == line("read-before-wait")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case, expected", [
    ("all_reduce, then read", ("read-after-write", "all_reduce", "aten::sum")),
    ("all_reduce, then write", ("write-after-write", "all_reduce", "aten::mul_")),
    ("all_reduce, then read ordered", None),
    ("broadcast from here, then read", None),  # the root only reads its tensor
    ("broadcast from here, then write", ("write-after-read", "broadcast", "aten::mul_")),
    ("write, then all_gather", ("write-after-write", "aten::mul_", "all_gather")),  # its outputs: a list of lists
])
def test_a_collective_torchs_cpp_issues_is_judged_by_the_models_rules(extension, core, tmp_path, case, expected):
    """A c10d op nobody issues from Python (DDP's reducer, `_broadcast_coalesced`) runs on its group's communication
    stream, after the issuing stream, which is ordered after it at once. The python core's drain hands it to
    models.collectives in Python; the native one applies the model's fixed rule in C++ (`capture_rule`): the same
    verdicts, names and lines. Another stream touching its tensors without a wait races with it."""
    import torch.distributed as dist

    from pytest_streamrace.detector.models.collectives import Collectives

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with capturing(extension) as (hb, tracker):
            model = Collectives(hb, tracker, lambda: 0)
            model.install()  # not its patches: nothing marks the collectives as Python's
            in_python = []
            tracker.namespace_handlers["c10d"] = lambda *args, **kwargs: (in_python.append(args[0]),
                                                                          model.on_op(*args, **kwargs))
            try:
                tensor, gathered = torch.ones(4), torch.zeros(4)
                tracker.drain()
                hb.wait_stream(1, 0)  # their making ordered before stream 1; what follows is not
                if case.startswith("write"):
                    extension.set_stream(1)
                    gathered.mul_(2)  # other-stream-write-first
                    extension.set_stream(0)
                    dist.all_gather([gathered], tensor)
                elif case.startswith("all_reduce"):
                    dist.all_reduce(tensor)
                else:
                    dist.broadcast(tensor, src=0)
                tracker.drain()
                if case.endswith("ordered"):
                    hb.wait_stream(1, 0)
                if not case.startswith("write"):
                    extension.set_stream(1)
                    if case.endswith("write"):
                        tensor.mul_(2)  # other-stream-write
                    else:
                        tensor.sum()  # other-stream-read
                    extension.set_stream(0)
                tracker.drain()
            finally:
                model.uninstall()
        assert len(in_python) == (0 if core == "native" else 1)  # the native core's feed applied the rule
        found = {(race.kind, race.earlier.op.site.op, race.later.op.site.op): race for race in hb.races}
        if expected is None:
            assert found == {}
            return
        race = found[expected]
        collective, user = (race.earlier, race.later) if race.earlier.op.site.op[:4] != "aten" else (race.later,
                                                                                                    race.earlier)
        assert hb.stream_name(collective.op.stream) == "communication stream of the default process group"
        tag = "read" if "sum" in user.op.site.op else "write-first" if case.startswith("write") else "write"
        assert user.op.site.frames[0][1] == line(f"other-stream-{tag}")
    finally:
        dist.destroy_process_group()


def test_a_failed_build_is_one_line_and_leaves_none(tmp_path):
    """Without a working compiler the cuda backend falls back to the dispatch mode; `failure()` says why."""
    script = textwrap.dedent("""
        from pytest_streamrace.detector import capture
        real = capture.sources()
        capture.sources = lambda: [code.replace("#include <atomic>", "#include <no_such_header_here>") for code in real]
        print(capture.load() is None)
        print(capture.failure())
    """)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    env.pop("STREAMRACE_NATIVE", None)  # a run of the suite without the capture: this case builds one all the same
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "True", out.stderr[-2000:]
    assert len(lines) == 2 and "Error" in lines[1]
    assert "RuntimeWarning: streamrace: the C++ op capture and core did not build (" in out.stderr


def test_work_recorded_by_hand_lands_after_the_captured_ops_before_it(extension):
    """Collectives and the backend's own calls go through tracker.run: the ops captured before must come first."""
    with capturing(extension) as (hb, tracker):
        t = torch.ones(4)
        t.add_(1)
        tracker.run("all_reduce", "communication", reads=[t])
    assert [op.site.op for op in hb.timeline] == ["aten::ones", "aten::add_", "all_reduce"]
    assert [r.kind for r in hb.races] == ["read-after-write"]  # the comm stream never waited on the add_


def test_a_kernel_launch_no_op_reports_is_queued_in_order_with_the_captured_ops(extension):
    """Compiled code's kernels (tracker.launch) go into the capture's buffer between the ops around them, on their
    stream, with the user's line, without a drain."""
    with capturing(extension) as (hb, tracker):
        hb.add_stream(7, "side")
        t = torch.ones(4)
        tracker.drain()
        t.mul_(2)  # captured, not applied yet
        # an in-out pointer and a size, as Inductor passes them
        tracker.launch("triton_poi_fused_0", 7, (t, 4), (READ | WRITE, 0))  # LAUNCH
        t.add_(1)  # no stream waits for the other: the kernel races with the op before it and the one after
        tracker.drain()
    assert [op.site.op for op in hb.timeline][-3:] == ["aten::mul_", "triton_poi_fused_0", "aten::add_"]
    assert {(r.earlier.op.site.op, r.later.op.site.op) for r in hb.races} == {
        ("aten::mul_", "triton_poi_fused_0"), ("triton_poi_fused_0", "aten::add_")}
    kernel = next(r.earlier for r in hb.races if r.earlier.op.site.op == "triton_poi_fused_0")
    assert kernel.op.site.frames[0][:2] == (__file__, line("LAUNCH"))


def test_a_host_storage_reports_its_own_free_in_order_with_the_ops(extension):
    """On host memory a storage of the default CPU allocator gets the capture's deleter when first recorded: its free
    is queued as it happens, between the ops it came between, and nothing holds the storage until the next drain
    (a held storage's free would land after every op of the drain window)."""
    with capturing(extension, track_frees=True) as (hb, tracker):
        t = torch.ones(4)
        del t
        kept = torch.zeros(2).add_(1)
        tracker.drain()
    assert [op.site.op for op in hb.timeline] == ["aten::ones", "free", "aten::zeros", "aten::add_"]
    assert kept.sum().item() == 2


def test_the_feeds_tables_answer_as_the_trackers_dicts_did(extension, core):
    """Where the feed runs, the tracker's storage tables are C++ maps behind a dict's face: what the Python paths read
    and write through it (a stream key comes back as the same object), what the feed's records put there, and what
    was there before the capture and is there after it."""
    if core == "python":
        pytest.skip("the C++ feed's tables")
    side, default = object(), object()  # stream keys: the virtual model's are objects compared by identity
    hb = HappensBefore(trace=True)
    tracker = AccessTracker(hb, lambda: 0, "cpu", track_frees=False)
    tracker.names[12345] = "before the capture"
    tracker.capture_with(extension, every_thread=True)
    try:
        watched, last_writer, redirect, names = tracker.watched, tracker.last_writer, tracker.redirect, tracker.names
        assert not isinstance(watched, dict) and names[12345] == "before the capture"
        last_writer[8] = side
        assert last_writer.get(8) is side and 8 in last_writer and last_writer.get(9) is None
        last_writer[8] = default
        assert last_writer[8] is default and len(last_writer) == 1
        redirect[8] = side
        assert redirect and redirect.pop(8) is side and not redirect and redirect.pop(8, None) is None
        with pytest.raises(KeyError):
            redirect.pop(8)
        with pytest.raises(KeyError):
            names[99]
        watched[8] = None
        assert 8 in watched and watched.get(8) is None and watched.pop(8, False) is None
        assert watched.pop(8, False) is False
        t = torch.ones(4)
        t.add_(1)
        tracker.drain()
        key = t.untyped_storage().data_ptr()
        assert key in watched and last_writer[key] == 0  # the capture's records: the stream the feed wrote on
        names[key] = "t"
    finally:
        tracker.stop_capture()
    assert isinstance(tracker.watched, dict) and tracker.names == {12345: "before the capture", key: "t"}
    assert tracker.last_writer == {8: default, key: 0} and key in tracker.watched


def test_an_op_that_raises_leaves_capture_working(extension):
    with capturing(extension) as (hb, _):
        with pytest.raises(RuntimeError):
            torch.mm(torch.ones(2, 3), torch.ones(2, 3))
        torch.ones(4).add_(1)
    assert [op.site.op for op in hb.timeline][-2:] == ["aten::ones", "aten::add_"]


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_only_the_syncs_the_tracker_judges_keep_a_record_from_the_applier(device_type):
    """A record whose plan marks a host sync waits for a drain, with Python (the applier thread stops at it). On a
    GPU a conditional sync (a copy to the host, t[mask]) is reported from inside the op by the GPU trace, so those
    ops' records (a device-to-device copy_: DDP's buckets, every step) are applied without Python; .item() is judged
    by the tracker everywhere. On host memory every sync is judged, on the arguments the capture keeps."""
    from pytest_streamrace.detector.hb import HappensBefore

    tracker = AccessTracker(HappensBefore(), lambda: 0, device_type)
    copy, item = tracker._capture_plan("aten::copy_", ""), tracker._capture_plan("aten::_local_scalar_dense", "")
    keep_args, judged = 3, 4
    assert item[judged] and not item[keep_args]
    assert copy[judged] is (device_type == "cpu") and copy[keep_args] is (device_type == "cpu")
    assert not tracker._capture_plan("aten::add", "Tensor")[judged]


def test_a_plan_that_raises_never_reaches_the_users_op(extension, monkeypatch):
    """Whatever the tracker's plan raises stays out of the op that asked for it (the kernel entry drops it): the op
    computes its result, and the ops after it are captured."""
    original = AccessTracker._capture_plan

    def plan(self, name, overload):
        if name == "aten::mul":
            raise TypeError("a bug in the plan")
        return original(self, name, overload)

    monkeypatch.setattr(AccessTracker, "_capture_plan", plan)
    with capturing(extension) as (hb, tracker):
        product = torch.full((2,), 2.0) * 3
        torch.ones(4).add_(1)
        tracker.drain()
    assert product.tolist() == [6.0, 6.0]
    assert [op.site.op for op in hb.timeline][-2:] == ["aten::ones", "aten::add_"]


def test_factory_ops_are_recorded_by_name_and_build_what_they_build_in_a_session_and_after(extension):
    """The kernel entry takes over torch's BackendSelect kernel of a factory op, picking the backend from dtype,
    layout, device and any tensor arguments as torch's does: in a session and after it (the kernels stay), each factory
    builds what it builds without the capture, and a session records it under its own name, as the dispatch mode
    does."""
    def factories():
        generator = torch.Generator().manual_seed(0)
        indices = torch.tensor([[0, 2]])
        return {
            "aten::zeros": torch.zeros(2, 3, dtype=torch.float64),
            "aten::full": torch.full((2,), 7, dtype=torch.int32),
            "aten::arange": torch.arange(5),
            "aten::eye": torch.eye(3),
            "aten::randn": torch.randn(4, generator=generator),
            "sparse": torch.zeros(2, 2, layout=torch.sparse_coo),
            "with tensor arguments": torch.sparse_coo_tensor(indices, torch.ones(2), (3,), dtype=torch.float16,
                                                              check_invariants=True),
            "meta": torch.empty(3, device="meta"),
        }

    def described(made):
        return {k: (t.dtype, t.layout, t.device.type, t.shape,
                    None if t.is_meta else t.to_dense().tolist()) for k, t in made.items()}

    expected = described(factories())
    with capturing(extension) as (hb, tracker):
        made = described(factories())
        tracker.drain()
    assert made == expected and described(factories()) == expected
    recorded = {op.site.op for op in hb.timeline}
    assert {"aten::zeros", "aten::full", "aten::arange", "aten::eye", "aten::randn"} <= recorded


def test_an_op_defined_after_a_session_is_recorded_in_the_next(extension):
    """The kernel entry is added for every op there is when a session starts: one defined later (a custom op in a
    test) is added at the next session's start."""
    import uuid

    with capturing(extension):
        torch.ones(1).add_(1)
    name = f"streamrace_test::bump_{uuid.uuid4().hex[:8]}"

    @torch.library.custom_op(name, mutates_args=("x",))
    def bump(x: torch.Tensor) -> None:
        x.add_(1)

    with capturing(extension) as (hb, tracker):
        t = torch.zeros(3)
        bump(t)
        tracker.drain()
    assert t.tolist() == [1.0, 1.0, 1.0]
    (op,) = [op for op in hb.timeline if op.site.op == name]  # its add_ inside is the op's own, not recorded apart
    assert "aten::add_" not in {op.site.op for op in hb.timeline}


def test_an_op_whose_kernel_comes_after_its_definition_is_recorded_from_the_next_session(extension):
    """A session's start looks again only at ops defined since the last look and at those that had no kernel a call
    reaches: an op defined in one session and given its CPU kernel after it (with no op defined in between) is
    recorded in the next session."""
    import uuid

    name = f"streamrace_test::late_{uuid.uuid4().hex[:8]}"
    namespace, op_name = name.split("::")
    library = torch.library.Library(namespace, "FRAGMENT")
    library.define(f"{op_name}(Tensor(a!) x) -> ()")
    with capturing(extension):  # the op is there, with no kernel yet
        torch.ones(1).add_(1)

    def late(x):
        x.add_(1)

    library.impl(op_name, late, "CPU")  # a kernel, no definition: the dispatcher's listener is not told
    with capturing(extension) as (hb, tracker):
        t = torch.zeros(2)
        getattr(getattr(torch.ops, namespace), op_name)(t)
        tracker.drain()
    assert t.tolist() == [1.0, 1.0]
    assert [op.site.op for op in hb.timeline].count(name) == 1


def test_an_op_defined_inside_a_session_is_recorded_in_it(extension):
    """A custom op a test defines while a session runs is captured from its first call in that session: the kernel
    entry hooks it at the next captured op's start (the dispatcher tells the capture an op was defined)."""
    import uuid

    name = f"streamrace_test::bump_{uuid.uuid4().hex[:8]}"
    with capturing(extension) as (hb, tracker):
        torch.ones(1).add_(1)

        @torch.library.custom_op(name, mutates_args=("x",))
        def bump(x: torch.Tensor) -> None:
            x.add_(1)

        t = torch.zeros(3)
        bump(t)
        tracker.drain()
    assert t.tolist() == [1.0, 1.0, 1.0]
    assert [op.site.op for op in hb.timeline].count(name) == 1


def _profiled_ops(step) -> set:
    """The op names torch's profiler records over `step()`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return {event.name for event in prof.events()}


def _linear_step():
    model = torch.nn.Linear(4, 3)
    model(torch.ones(2, 4)).sum().backward()


def test_a_profiler_under_capture_sees_the_ops_it_sees_without(extension):
    """The capture's kernels leave torch's RecordFunction alone: a profiler on beside it records the same ops as
    without it, the calls nested in other ops included (aten::linear's t and transpose)."""
    expected = _profiled_ops(_linear_step)
    assert {"aten::t", "aten::addmm", "aten::transpose"} <= expected  # nested calls, not only the outer ops
    with capturing(extension) as (hb, _):
        seen = _profiled_ops(_linear_step)
    assert seen == expected
    assert "aten::addmm" in {op.site.op for op in hb.timeline}


def test_compiling_under_capture_records_no_fake_tensors(extension):
    """Dynamo traces with fake tensors (a tensor subclass, no memory): their ops must not become accesses."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = torch.nn.Linear(4, 2)
    expected = model(torch.ones(3, 4))
    with capturing(extension) as (hb, tracker):
        with FakeTensorMode():
            torch.ones(2).add_(1)
        tracker.drain()
        assert "aten::add_" not in {op.site.op for op in hb.timeline} and hb.history_size() == 0  # no launch
        got = torch.compile(model, backend="aot_eager")(torch.ones(3, 4))
    assert torch.equal(got, expected)
    assert "aten::addmm" in {op.site.op for op in hb.timeline}  # the compiled graph's ops are real, and recorded


@pytest.mark.parametrize("stream", [7, 0], ids=["side stream", "legacy default stream"])
def test_a_host_sync_inside_an_op_lands_right_after_that_op(extension, stream):
    """On a GPU torch reports a read-back's synchronize from inside the op (a copy to the host, t[mask]), before the
    capture has recorded it: the sync is kept on the op's record, so the host is ordered after the op itself. The
    legacy default stream's handle is 0, DeepSpeed's trace check reads back on it: a sync on stream 0 counts too."""
    synced = []

    @torch.library.custom_op(f"streamrace_tests::read_back_{stream}", mutates_args=())
    def read_back(x: torch.Tensor) -> torch.Tensor:
        synced.append(tracker.sync_inside_op(stream))  # what the cuda model does with the trace's stream sync
        return x.clone()

    with capturing(extension) as (hb, tracker):
        hb.add_stream(stream, "the read-back's")
        learnt = []
        tracker.host_synced = lambda sync, stream, frames=None: learnt.append((sync.name, stream))
        read_back(torch.ones(4))
        tracker.drain()
        outside = tracker.sync_inside_op(stream)
    assert synced == [True] and not outside
    assert learnt == [(f"streamrace_tests::read_back_{stream}", stream)]


@contextlib.contextmanager
def free_shortcut(extension, how: str, fallback=None, busy=None):
    """(registry, fire) of the cuda model's shortcut for the allocator's frees, installed while inside. "in place": a C
    function as a registry's ``fire_callbacks``, which torch's Python interpreter calls per event (`fire` does); the
    registry is one of the test's own. "interpreter": the GPU trace's own interpreter (``gpu_trace.cpp``) on torch's
    trace registry, `fire` calling it as torch's CUDA code does. `busy`: a callback registered before."""
    from torch._utils import CallbackRegistry

    from pytest_streamrace.detector.models.cuda import TraceShortcut, _in_place, _routed, native_trace

    if how == "in place":
        registry = CallbackRegistry("test frees")
        patches, fire = [TraceShortcut(registry, _in_place(registry, extension.traced_free), fallback)], None
    else:
        native = capture.load_trace()
        if native is None:
            pytest.skip(f"the GPU trace's interpreter does not build here: {capture.trace_failure()}")
        import torch.cuda._gpu_trace as trace

        torch._C._activate_gpu_trace()  # for good in this process: on CPU no CUDA code reports to it
        registry = trace.MemoryDeallocationCallbacks
        assert not registry.callback_list
        patches = [native_trace(native, extension),
                   TraceShortcut(registry, _routed(native, "free"), fallback)]
        fire = lambda ptr: native.emit("free", [ptr])  # noqa: E731
    if busy is not None:
        registry.add_callback(busy)
    for patch in patches:
        patch.install()
    try:
        yield registry, fire or (lambda ptr: registry.fire_callbacks(ptr))
    finally:
        for patch in reversed(patches):
            patch.uninstall()
        if busy is not None:
            registry.callback_list.remove(busy)


@pytest.mark.parametrize("how", ["in place", "interpreter"])
@pytest.mark.parametrize("waited", [False, True])
def test_a_traced_free_lands_between_the_captured_ops_it_came_between(extension, waited, how):
    """A free the allocator reports (through the shortcut, no Python frame) is judged where it happened: the side
    stream's read not ordered before it races with the next allocation on the block's stream, unless it waited."""
    with free_shortcut(extension, how) as (_, fire), capturing(extension) as (hb, tracker):
        hb.add_stream(7, "side")
        t = torch.ones(4)
        tracker.drain()
        hb.wait_stream(7, 0)  # the side stream reads it properly
        tracker.run("side_read", 7, reads=[t])
        if waited:
            hb.wait_stream(0, 7)
        torch.ones(2).add_(1)  # captured, not yet applied: the free lands after it, before the next one
        fire(t.untyped_storage().data_ptr())
        torch.zeros(8)  # the block's stream allocates again
        tracker.drain()
        assert t.untyped_storage().data_ptr() not in tracker.watched
    assert [r.kind for r in hb.races] == ([] if waited else ["free-while-in-use"]), hb.races


@contextlib.contextmanager
def event_shortcut(extension):
    """`fire(event, args)`: torch's CUDA code reporting an event record or wait to the trace, which the cuda model's
    shortcut (``gpu_trace.cpp``'s interpreter) queues in the capture, while inside."""
    import torch.cuda._gpu_trace as trace

    from pytest_streamrace.detector.models.cuda import TraceShortcut, _routed, native_trace

    native = capture.load_trace()
    if native is None:
        pytest.skip(f"the GPU trace's interpreter does not build here: {capture.trace_failure()}")
    torch._C._activate_gpu_trace()
    patches = [native_trace(native, extension)]
    for registry, kind in [(trace.EventRecordCallbacks, "event_record"), (trace.EventWaitCallbacks, "event_wait")]:
        assert not registry.callback_list
        patches.append(TraceShortcut(registry, _routed(native, kind), fallback=lambda *args: pytest.fail("Python")))
    for patch in patches:
        patch.install()
    try:
        yield native.emit
    finally:
        for patch in reversed(patches):
            patch.uninstall()
        native.route("event_record", False)
        native.route("event_wait", False)


@pytest.mark.parametrize("recorded", ["after the write", "before the write"])
def test_traced_event_records_and_waits_land_between_the_captured_ops_they_came_between(extension, recorded):
    """An event recorded on the program's stream and waited on by a side stream, taken in C++ (no Python per event),
    orders the side stream after what the program's stream ran before the record: the write before it is ordered
    before the side stream's read; a write captured after the record (still unapplied when the record came) is not."""
    with event_shortcut(extension) as fire, capturing(extension) as (hb, tracker):
        hb.add_stream(7, "side")
        t = torch.zeros(4)
        tracker.drain()
        if recorded == "before the write":
            fire("event_record", [11, 0])
        t.add_(1)  # captured on stream 0, not yet applied
        if recorded == "after the write":
            fire("event_record", [11, 0])
        fire("event_wait", [11, 7])
        fire("event_wait", [12, 7])  # an event never recorded: no wait, and no error
        tracker.run("side_read", 7, reads=[t])
    assert [r.kind for r in hb.races] == ([] if recorded == "after the write" else ["read-after-write"]), hb.races


@pytest.mark.parametrize("how", ["in place", "interpreter"])
def test_a_trace_shortcut_gives_way_to_other_listeners(extension, how):
    """Someone registering on the registry gets the events back in Python, the model's own callback first; uninstall
    leaves the registry (and the trace) as it found it, their callback included."""
    seen = []
    theirs = lambda ptr: seen.append(("theirs", ptr))  # noqa: E731
    with free_shortcut(extension, how, fallback=lambda ptr: seen.append(("model", ptr))) as (registry, fire):
        fire(4)  # taken without Python: no callback runs
        assert seen == []
        registry.add_callback(theirs)
        fire(5)
        assert seen == [("model", 5), ("theirs", 5)]
    try:
        fire(6)
        assert seen[2:] == [("theirs", 6)]
        assert "fire_callbacks" not in vars(registry) and "add_callback" not in vars(registry)
    finally:
        registry.callback_list.remove(theirs)

    seen.clear()

    with free_shortcut(extension, how, fallback=lambda ptr: seen.append(("model", ptr)),
                       busy=lambda ptr: seen.append(("first", ptr))) as (registry, fire):
        fire(7)  # someone listened already: the usual way, the model's callback added after theirs
        assert seen == [("first", 7), ("model", 7)]
        assert "add_callback" not in vars(registry)

    from torch._utils import CallbackRegistry

    from pytest_streamrace.detector.models.cuda import TraceShortcut

    unbuilt = TraceShortcut(CallbackRegistry("test frees"), None, fallback=lambda ptr: seen.append(ptr))
    unbuilt.install()  # no extension: the model's callback the usual way
    unbuilt.registry.fire_callbacks(8)
    unbuilt.uninstall()
    assert seen[2:] == [8] and not unbuilt.registry.callback_list


def test_the_trace_interpreter_hands_torch_every_event_it_does_not_take(extension):
    """Only the kinds a shortcut took stay in C++; the rest reach torch's Python registries as they did, during the
    session and after it (the interpreter stays in the trace, which torch cannot switch off)."""
    import torch.cuda._gpu_trace as trace

    from pytest_streamrace.detector.models.cuda import native_trace

    native = capture.load_trace()
    if native is None:
        pytest.skip(f"the GPU trace's interpreter does not build here: {capture.trace_failure()}")
    torch._C._activate_gpu_trace()
    seen = []
    listeners = [(trace.EventRecordCallbacks, lambda event, stream: seen.append(("record", event, stream))),
                 (trace.MemoryAllocationCallbacks, lambda ptr: seen.append(("allocation", ptr))),
                 (trace.StreamSynchronizationCallbacks, lambda stream: seen.append(("stream sync", stream)))]
    for registry, listener in listeners:
        registry.add_callback(listener)
    patch = native_trace(native, extension)
    try:
        patch.install()
        assert native.installed()
        native.route("allocation", True)
        for event, args in [("event_record", [3, 9]), ("allocation", [64]), ("stream_synchronization", [9])]:
            native.emit(event, args)
        assert seen == [("record", 3, 9), ("stream sync", 9)]
        patch.uninstall()
        native.route("allocation", False)
        for event, args in [("event_record", [4, 9]), ("allocation", [128])]:
            native.emit(event, args)
        assert seen[2:] == [("record", 4, 9), ("allocation", 128)] and native.installed()
    finally:
        patch.uninstall()
        native.route("allocation", False)
        for registry, listener in listeners:
            registry.callback_list.remove(listener)


def test_between_sessions_the_trace_keeps_out_of_python_what_nobody_listens_to(extension, monkeypatch):
    """torch's trace stays on after a session. A shortcut nobody displaced stays taken (no call into torch's Python
    interpreter per allocation); whoever registers later (torch's sanitizer, say) gets the events; the next session
    takes the shortcut over, or gives it back to one who listens without registering."""
    import torch.cuda._gpu_trace as trace

    from pytest_streamrace.detector.models.cuda import TraceShortcut, _routed, native_trace

    native = capture.load_trace()
    if native is None:
        pytest.skip(f"the GPU trace's interpreter does not build here: {capture.trace_failure()}")
    torch._C._activate_gpu_trace()
    registry = trace.MemoryAllocationCallbacks
    assert not registry.callback_list
    fired = []  # what torch's Python interpreter hands the registry (it looks the method up per event)
    fire = type(registry).fire_callbacks

    def counted(self, *args):
        if self is registry:
            fired.append(args)
        fire(self, *args)
    monkeypatch.setattr(type(registry), "fire_callbacks", counted)

    def session():
        return [native_trace(native, extension), TraceShortcut(registry, _routed(native, "allocation"))]

    def run(patches, *then):
        for patch in patches:
            patch.install()
        for patch in reversed(patches):
            patch.uninstall()
        for step in then:
            step()

    try:
        run(session())
        native.emit("allocation", [64])
        assert fired == [] and native.installed()
        run(session())  # taken over, then left again
        native.emit("allocation", [65])
        assert fired == []
        seen = []
        registry.add_callback(lambda ptr: seen.append(ptr))  # someone listens: back to Python
        native.emit("allocation", [66])
        assert seen == [66] and fired == [(66,)] and "add_callback" not in vars(registry)
        registry.callback_list.clear()
        fired.clear()
        run(session())  # nobody listens again: a new session takes it, and leaves it taken
        native.emit("allocation", [67])
        assert fired == []
        registry.callback_list.append(lambda ptr: seen.append(ptr))  # listening without add_callback
        run(session())  # the next session gives it back instead of taking it over
        native.emit("allocation", [68])
        assert fired == [(68,)] and seen == [66, 68]
    finally:
        vars(registry).pop("add_callback", None)
        native.route("allocation", False)
        registry.callback_list.clear()


def test_the_trace_interpreters_stubs_are_every_pure_virtual_but_the_traces():
    header = """
struct C10_API PyInterpreterVTable {
  virtual ~PyInterpreterVTable() = default;

  // Report the name of this interpreter
  virtual std::string name() const = 0;
  virtual void python_dispatcher(
      const c10::OperatorHandle& op,
      c10::DispatchKeySet,
      torch::jit::Stack* stack) const = 0;  // a comment; with a semicolon
  virtual void trace_gpu_event_creation(
      c10::DeviceType device_type,
      uintptr_t event) const = 0;
};
"""
    stubs = capture.interpreter_stubs(header).splitlines()
    assert stubs == [
        '  std::string name() const override { unreachable("name"); }',
        '  void python_dispatcher( const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) const '
        'override { unreachable("python_dispatcher"); }']
    with pytest.raises(RuntimeError, match="no PyInterpreterVTable methods"):
        capture.interpreter_stubs("struct C10_API PyInterpreterVTable {\n};")


def test_plans_outlive_a_session_only_while_their_inputs_and_the_ops_stay(extension):
    """The capture asks Python for an op's plan once across sessions of the same plan inputs; another device, or an op
    defined between two sessions (a removed op's name may be reused), makes it ask again."""
    from pytest_streamrace.detector.session import Detector, Resident

    asked: list[str] = []
    original = AccessTracker._capture_plan

    def counting(self, name, overload):
        asked.append(name)
        return original(self, name, overload)

    resident = Resident()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(AccessTracker, "_capture_plan", counting)

            def session():
                asked.clear()
                with Detector(backend="virtual", resident=resident):
                    a = torch.ones(8, 8)
                    (a @ a).sum()
                return list(asked)

            session()
            session()  # the plans made from here on are kept (the dispatcher's listener counted every op as it began)
            assert session() == []
            library = torch.library.Library("streamrace_plans_test", "DEF")
            library.define("noop(Tensor x) -> Tensor")
            assert "aten::mm" in session()  # an op defined: every plan asked again
            assert session() == []
            del library
    finally:
        resident.close()
