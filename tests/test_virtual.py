"""Virtual CUDA streams on CPU: each ordering rule with a racy and a clean twin, autograd's stream rules, and a
session that leaves torch exactly as it found it."""

import threading

import pytest
import torch
from tagged_lines import line

from pytest_streamrace.detector.session import Detector, streamrace_device

REAL_CUDA = torch.cuda.is_available()  # before any session: the virtual model runs on GPU hosts too

RAW, WAR, WAW, FREE = "read-after-write", "write-after-read", "write-after-write", "free-while-in-use"




def where(access) -> tuple[str, int]:
    filename, lineno, _ = access.op.site.frames[0]
    return filename, lineno


def only_race(d: Detector, kind: str, earlier: str, later: str):
    races = d.races
    assert [r.kind for r in races] == [kind], races
    race = races[0]
    assert where(race.earlier) == (__file__, line(earlier))
    assert where(race.later) == (__file__, line(later))
    return race


def side_stream():
    """A new stream that has seen everything the current one did (the setup of every case)."""
    s = torch.cuda.Stream()  # helper-create
    s.wait_stream(torch.cuda.current_stream())
    return s


# ordering rules


def test_side_stream_write_then_default_read_without_wait_races():
    with Detector() as d:
        x = torch.zeros(16)
        s = side_stream()
        with torch.cuda.stream(s):
            x.add_(1)  # raw-write
        x.sum()  # raw-read
    race = only_race(d, RAW, "raw-write", "raw-read")
    assert d.hb.stream_name(race.earlier.op.stream) == f"stream created at test_virtual.py:{line('helper-create')}"
    assert d.hb.stream_name(race.later.op.stream) == "default stream"
    assert race.earlier.tensor.shape == (16,) and race.earlier.tensor.dtype == "float32"


def test_side_stream_write_then_wait_stream_is_clean():
    with Detector() as d:
        x = torch.zeros(16)
        s = side_stream()
        with torch.cuda.stream(s):
            x.add_(1)
        torch.cuda.current_stream().wait_stream(s)
        x.sum()
    assert d.races == []


def test_event_recorded_before_the_write_races():
    with Detector() as d:
        x = torch.zeros(16)
        s = side_stream()
        event = torch.cuda.Event()
        with torch.cuda.stream(s):
            event.record()
            x.mul_(2)  # early-event-write
        torch.cuda.current_stream().wait_event(event)
        x.sum()  # early-event-read
    only_race(d, RAW, "early-event-write", "early-event-read")


def test_event_recorded_after_the_write_is_clean():
    with Detector() as d:
        x = torch.zeros(16)
        s = side_stream()
        with torch.cuda.stream(s):
            x.mul_(2)
            event = s.record_event()
        event.wait()
        x.sum()
    assert d.races == []


def test_wait_on_the_wrong_stream_races():
    with Detector() as d:
        x = torch.zeros(16)
        producer, other = side_stream(), side_stream()
        with torch.cuda.stream(producer):
            x.fill_(3)  # wrong-write
        torch.cuda.current_stream().wait_stream(other)
        torch.cuda.set_stream(other)
        x.clone()  # wrong-read
        torch.cuda.set_stream(torch.cuda.default_stream())
    only_race(d, RAW, "wrong-write", "wrong-read")


def test_reader_stream_then_default_write_is_write_after_read():
    with Detector() as d:
        x = torch.zeros(16)
        s = side_stream()
        with torch.cuda.stream(s):
            x.sum()  # war-read
        x.zero_()  # war-write
    only_race(d, WAR, "war-read", "war-write")


def test_synchronize_orders_later_work_after_every_stream():
    with Detector() as d:
        x = torch.zeros(16)
        s = side_stream()
        with torch.cuda.stream(s):
            x.add_(1)
        torch.cuda.synchronize()
        x.sum()
    assert d.races == []


def _until_done(event):  # DeepSpeed pools buffers once their event queries done
    while not event.query():
        pass


@pytest.mark.parametrize("host_waits", [lambda event: event.synchronize(), _until_done], ids=["synchronize", "query"])
def test_an_event_the_host_saw_done_orders_it_after_that_events_work_only(host_waits):
    """Event.synchronize(), or Event.query() returning True (host_sync_cases.py has the GPU twins)."""
    with Detector() as d:
        x, y = torch.zeros(4), torch.zeros(4)
        s = side_stream()
        with torch.cuda.stream(s):
            x.add_(1)
            event = s.record_event()
            y.add_(1)
        host_waits(event)
        x.sum()  # ordered: the host saw the event done
        y.sum()  # sync-read
    assert [r.kind for r in d.races] == [RAW]
    assert where(d.races[0].later) == (__file__, line("sync-read"))


def test_a_stream_queried_done_orders_the_host():
    with Detector() as d:
        x = torch.zeros(4)
        s = side_stream()
        with torch.cuda.stream(s):
            x.add_(1)
        assert s.query() is True
        x.sum()
    assert d.races == []


# a bucket filled by hooks on two streams, reduced on a third (DeepSpeed #8061)


def _bucket(wait_on_all: bool):
    with Detector() as d:
        params = [torch.randn(4, requires_grad=True) for _ in range(2)]
        producers = [side_stream(), side_stream()]
        for p, s in zip(params, producers):
            with torch.cuda.stream(s):
                p.grad_acc = p.expand_as(p).grad_fn.next_functions[0][0]  # binds the node to s
        bucket = torch.zeros(8)
        reduction = side_stream()
        copy_streams = []

        def hook(i):
            def copy_into_bucket(p):
                bucket.narrow(0, 4 * i, 4).copy_(p.grad.view(-1))  # bucket-copy
                copy_streams.append(torch.cuda.current_stream())
            return copy_into_bucket

        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(hook(i))
        (params[0] * params[1]).sum().backward()
        for s in (copy_streams if wait_on_all else copy_streams[-1:]):
            reduction.wait_stream(s)
        with torch.cuda.stream(reduction):
            bucket.mul(0.5)  # bucket-reduce
        torch.cuda.current_stream().wait_stream(reduction)
        assert set(copy_streams) == set(producers)
    return d


def test_bucket_reduced_after_waiting_one_producer_races():
    d = _bucket(wait_on_all=False)
    race = only_race(d, RAW, "bucket-copy", "bucket-reduce")
    assert race.earlier.start >= 0 and race.earlier.end - race.earlier.start == 16  # one 4-float slice


def test_bucket_reduced_after_waiting_every_producer_is_clean():
    assert _bucket(wait_on_all=True).races == []


# autograd's stream rules


def test_backward_on_side_stream_then_grad_read_on_default_races():
    with Detector() as d:
        w = torch.randn(8, requires_grad=True)
        s = side_stream()
        with torch.cuda.stream(s):
            (w * 3).sum().backward()  # side-backward
        w.grad.sum()  # grad-read
    only_race(d, RAW, "side-backward", "grad-read")


def test_backward_on_side_stream_then_wait_is_clean():
    with Detector() as d:
        w = torch.randn(8, requires_grad=True)
        s = side_stream()
        with torch.cuda.stream(s):
            (w * 3).sum().backward()
        torch.cuda.current_stream().wait_stream(s)
        w.grad.sum()
    assert d.races == []


def test_backward_node_runs_on_its_forward_stream():
    with Detector() as d:
        x = torch.randn(4, requires_grad=True)
        s = side_stream()
        seen = []
        with torch.cuda.stream(s):
            y = x * 2
        torch.cuda.current_stream().wait_stream(s)
        y.grad_fn.register_prehook(lambda grads: seen.append(torch.cuda.current_stream()))
        z = y.sum()
        z.backward()
        assert seen == [s]
        assert torch.cuda.current_stream() is torch.cuda.default_stream()
    assert d.races == []  # the side stream waited on the default one's gradient; the caller joined it


def test_accumulate_grad_node_bound_to_side_stream_runs_its_hooks_there():
    with Detector() as d:
        w = torch.randn(4, requires_grad=True)
        s = side_stream()
        with torch.cuda.stream(s):
            acc = w.expand_as(w).grad_fn.next_functions[0][0]
        seen = {}

        def note(where):
            def hook(*args):
                seen.setdefault(where, torch.cuda.current_stream())
            return hook

        acc.register_prehook(note("node pre-hook"))
        acc.register_hook(note("node post-hook"))
        w.register_post_accumulate_grad_hook(note("post-accumulate"))
        for _ in range(2):  # the second step accumulates in place on s
            (w * 2).sum().backward()
            w.grad.sum()  # clean: the end of backward made the caller's stream wait on s
        assert seen == {"node pre-hook": s, "node post-hook": s, "post-accumulate": s}
        assert torch.cuda.current_stream() is torch.cuda.default_stream()
    assert d.races == []


def test_accumulate_grad_hook_inside_stream_context_but_node_on_default_runs_on_default():
    with Detector():
        w = torch.randn(4, requires_grad=True)
        acc = w.expand_as(w).grad_fn.next_functions[0][0]
        seen = []
        with torch.cuda.stream(side_stream()):
            w.register_post_accumulate_grad_hook(lambda p: seen.append(torch.cuda.current_stream()))
        (w * 2).sum().backward()
        assert seen == [torch.cuda.default_stream()] and acc is not None


def test_a_view_node_runs_on_the_stream_of_the_op_that_made_the_view():
    with Detector() as d:
        w = torch.randn(4, 4, requires_grad=True)
        s = side_stream()
        with torch.cuda.stream(s):
            wt = w.t()  # TBackward0 belongs to s, though the matmul reading the view runs on the default stream
        seen = []
        wt.grad_fn.register_prehook(lambda grads: seen.append(torch.cuda.current_stream()))
        (torch.randn(2, 4) @ wt).sum().backward()
        assert seen == [s]
    assert d.races == []


def test_a_node_hook_registered_while_one_stream_existed_runs_on_the_node_stream():
    """The model's pre-hook runs before any hook a user registers on the node: with the C++ binding, from the op's
    end. (The function-mode fallback registers it at the first backward after a second stream appears.)"""
    with Detector() as d:
        if d.op_source != "capture":
            pytest.skip("the function-mode fallback binds nodes at the next backward, not at the op's end")
        x = torch.randn(4, requires_grad=True)
        y = x * 2  # the default stream is the only one yet
        seen = []
        y.grad_fn.register_prehook(lambda grads: seen.append(torch.cuda.current_stream()))
        s = side_stream()
        with torch.cuda.stream(s):
            y.sum().backward()  # SumBackward0 on s, then MulBackward0 on the default stream
        assert seen == [torch.cuda.default_stream()]
    assert d.races == []


def test_a_node_bound_in_an_earlier_session_is_bound_again():
    w = torch.randn(4, requires_grad=True)
    acc = w.expand_as(w).grad_fn.next_functions[0][0]  # lives across sessions, as a DDP wrapper's do
    with Detector():
        (w * 2).sum().backward()  # bound to this session's default stream
    with Detector() as d:
        s = side_stream()
        with torch.cuda.stream(s):
            y = w * 2  # binds the AccumulateGrad node to s, this session's stream
        torch.cuda.current_stream().wait_stream(s)
        seen = []
        acc.register_prehook(lambda grads: seen.append(torch.cuda.current_stream()))
        y.sum().backward()
        assert seen == [s]
        w.grad.sum()  # the end of backward made the caller's stream wait on s
    assert d.races == []


def test_autograd_grad_joins_the_caller_stream():
    with Detector() as d:
        w = torch.randn(4, requires_grad=True)
        s = side_stream()
        with torch.cuda.stream(s):
            y = (w * w).sum()
        (g,) = torch.autograd.grad(y, w)
        g.sum()
    assert d.races == []


def _engine_run_backward(loss):
    """A backward as Megatron's pipeline schedules run it (``custom_backward``): the engine called directly."""
    from torch.autograd.variable import Variable

    Variable._execution_engine.run_backward(tensors=(loss,), grad_tensors=(torch.ones_like(loss),), keep_graph=False,
                                            create_graph=False, inputs=(), allow_unreachable=True,
                                            accumulate_grad=True)


@pytest.mark.parametrize("reader", ["node stream", "other stream"])
def test_a_backward_run_by_the_engine_directly_runs_each_node_on_its_stream(reader):
    """The graph made on s runs on s (its nodes read x, written on s, cleanly; s reads the gradient cleanly after it)
    and the caller joins s at the end; a stream that waited on nothing races with the gradient's write."""
    with Detector() as d:
        w = torch.randn(4, requires_grad=True)
        s, other = side_stream(), side_stream()
        with torch.cuda.stream(s):
            x = w * 2
            loss = (x * x).sum()
        _engine_run_backward(loss)
        w.grad.sum()  # the caller joined every stream the backward used
        with torch.cuda.stream(s if reader == "node stream" else other):
            w.grad.sum()
    assert len(d.races) == (0 if reader == "node stream" else 1), d.races


def _fan_in(read_on_producer_stream: bool):
    """x feeds ops on two streams: their gradients meet in x's input, added on the consumer's stream."""
    with Detector() as d:
        x = torch.randn(4, requires_grad=True)
        s1, s2 = side_stream(), side_stream()
        with torch.cuda.stream(s1):
            y1 = (x * 2).sum()  # x's AccumulateGrad is created here: it runs on s1
        with torch.cuda.stream(s2):
            y2 = (x * 3).sum()
        torch.cuda.current_stream().wait_stream(s1)
        torch.cuda.current_stream().wait_stream(s2)
        (y1 + y2).backward()  # fan-in-backward
        if read_on_producer_stream:
            with torch.cuda.stream(s2):
                x.grad.sum()  # fan-in-read
        else:
            x.grad.sum()
    return d


def test_gradients_from_two_streams_meet_on_the_consumer_stream_cleanly():
    assert _fan_in(read_on_producer_stream=False).races == []


def test_gradient_accumulated_on_consumer_stream_read_on_another_without_wait_races():
    only_race(_fan_in(read_on_producer_stream=True), RAW, "fan-in-backward", "fan-in-read")


def test_reading_a_grad_written_in_a_hook_on_a_side_stream_without_join_races():
    # the join covers backward's streams; a hook that switches streams itself must sync itself
    with Detector() as d:
        w = torch.randn(4, requires_grad=True)
        out = torch.zeros(4)
        s = side_stream()

        def hook(p):
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                out.copy_(p.grad)  # hook-write

        w.register_post_accumulate_grad_hook(hook)
        (w * 2).sum().backward()
        out.sum()  # hook-read
    only_race(d, RAW, "hook-write", "hook-read")


# frees


def test_free_while_another_stream_still_reads_races():
    with Detector() as d:
        x = torch.randn(64)  # free-alloc
        s = side_stream()
        with torch.cuda.stream(s):
            x.sum()  # free-read
        del x  # free-del
        torch.empty(64)  # the next allocation on the default stream may get x's block
    race = only_race(d, FREE, "free-read", "free-del")
    assert race.later.op.site.op == "free"
    assert race.alloc_site is not None and race.alloc_site.frames[0][1] == line("free-alloc")


def test_free_after_record_stream_is_clean():
    with Detector() as d:
        x = torch.randn(64)
        s = side_stream()
        with torch.cuda.stream(s):
            x.sum()
        x.record_stream(s)
        del x
        torch.empty(64)
    assert d.races == []


def test_free_after_the_allocation_stream_waited_is_clean():
    with Detector() as d:
        x = torch.randn(64)
        s = side_stream()
        with torch.cuda.stream(s):
            x.sum()
        torch.cuda.current_stream().wait_stream(s)
        del x
        torch.empty(64)
    assert d.races == []


def test_free_is_judged_when_the_block_can_be_reused():
    """Freed while a side stream still reads it, but the allocation stream waits for that stream before it
    allocates again: on a GPU the block cannot be reused under the read, so this is clean."""
    with Detector() as d:
        x = torch.randn(64)
        s = side_stream()
        with torch.cuda.stream(s):
            x.sum()
        del x
        torch.cuda.current_stream().wait_stream(s)
        torch.empty(64)
    assert d.races == []


# the API itself


def test_sleep_is_recorded_on_the_current_stream_without_delay():
    with Detector(trace=True) as d:
        s = side_stream()
        with torch.cuda.stream(s):
            torch.cuda._sleep(10**12)  # would spin for minutes on a GPU
    sleeps = [op for op in d.hb.timeline if op.site.op == "torch.cuda._sleep"]
    assert [op.stream for op in sleeps] == [s]
    assert sleeps[0].site.frames[0][:2] == (__file__, line("would spin for minutes on a GPU"))


def test_current_stream_is_thread_local():
    with Detector():
        s = torch.cuda.Stream()
        seen = []
        with torch.cuda.stream(s):
            thread = threading.Thread(target=lambda: seen.append(torch.cuda.current_stream()))
            thread.start()
            thread.join()
            assert torch.cuda.current_stream() is s
        assert seen == [torch.cuda.default_stream()]
        assert torch.cuda.is_available() is REAL_CUDA  # the model does not pretend a device


def test_stream_names_and_events():
    with Detector() as d:
        s = torch.cuda.Stream()  # side-create
        assert d.hb.stream_name(s) == f"stream created at test_virtual.py:{line('side-create')}"
        assert d.hb.stream_name(torch.cuda.default_stream()) == "default stream"
        assert isinstance(s, torch.cuda.Stream) and isinstance(torch.cuda.Event(), torch.cuda.Event)
        assert d.current_stream() is torch.cuda.current_stream() is torch.cuda.default_stream()
        with pytest.raises(RuntimeError, match="Both events must be recorded"):
            torch.cuda.Event(enable_timing=True).elapsed_time(torch.cuda.Event())
        with pytest.raises(TypeError, match="expected a torch.cuda.Stream"):
            s.wait_stream("default")
        assert streamrace_device() == torch.device("cpu")


def test_elapsed_time_is_host_time_and_orders_the_host_after_both_events():
    """As on CUDA, elapsed_time answers only once both events completed: timing code (DeepSpeed's timers) that reads
    it has learnt that the work before the end event is done."""
    x = torch.zeros(4)
    with Detector() as d:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            start.record()
            x.add_(1)
            end.record()
        assert start.elapsed_time(end) >= 0.0
        x.sum()  # ordered: the host learnt that end completed
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            x.add_(1)  # timed-write
        x.sum()  # untimed-read
    assert [(r.kind, r.earlier.op.site.frames[0][1], r.later.op.site.frames[0][1]) for r in d.races] == [
        ("read-after-write", line("timed-write"), line("untimed-read"))]


def test_reading_a_value_back_orders_the_host_after_its_stream():
    """``.item()`` of a device tensor waits for the stream that computed it (CUDA copies the value out and
    synchronizes): whatever the host launches next, on any stream, comes after that stream's work so far."""
    x, flag = torch.zeros(4), torch.zeros(1)
    with Detector() as d:
        s = torch.cuda.Stream()
        x.add_(1)
        flag.add_(1)
        assert flag.item() == 1.0  # the host waits for the default stream here
        with torch.cuda.stream(s):
            x.sum()  # ordered by the item() above
        torch.cuda.current_stream().wait_stream(s)
        x.mul_(2)  # unsynced-write
        with torch.cuda.stream(s):
            x.sum()  # unsynced-read
    assert [(r.kind, r.earlier.op.site.frames[0][1], r.later.op.site.frames[0][1]) for r in d.races] == [
        ("read-after-write", line("unsynced-write"), line("unsynced-read"))]


def test_module_names_reach_the_race():
    with Detector() as d:
        model = torch.nn.Linear(4, 4)
        d.name(model, "model")
        s = side_stream()
        with torch.cuda.stream(s):
            model.weight.data.mul_(2)
        model.weight.sum()
    assert [r.earlier.tensor.name for r in d.races] == ["model.weight"]


def test_session_leaves_torch_as_it_was():
    import torch.autograd.graph

    before = {name: getattr(torch.cuda, name) for name in
              ("Stream", "Event", "stream", "StreamContext", "current_stream", "default_stream", "set_stream",
               "synchronize", "_sleep")}
    from torch.autograd.variable import Variable

    run_backward = torch.autograd.graph._engine_run_backward
    engine = Variable._execution_engine
    record_stream = torch.Tensor.record_stream
    from torch._dynamo.output_graph import OutputGraph
    call_user_compiler = OutputGraph.call_user_compiler
    with Detector() as d:
        assert torch.cuda.Stream is not before["Stream"]
        assert Variable._execution_engine is not engine
        # graph nodes are bound in C++ with the capture; by a function mode with the dispatch mode
        assert torch._C._len_torch_function_stack() == (0 if d.op_source == "capture" else 1)
        w = torch.randn(2, requires_grad=True)
        (w * 2).sum().backward()
    assert {name: getattr(torch.cuda, name) for name in before} == before
    assert torch.cuda.streams.Stream is before["Stream"]
    assert torch.autograd.graph._engine_run_backward is run_backward is torch.autograd._engine_run_backward
    assert Variable._execution_engine is engine
    assert torch.Tensor.record_stream is record_stream and "record_stream" not in vars(torch.Tensor)
    assert OutputGraph.call_user_compiler is call_user_compiler
    assert torch._C._len_torch_function_stack() == 0
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    assert _get_current_dispatch_mode_stack() == []
    if not REAL_CUDA:
        with pytest.raises(RuntimeError, match="requires CUDA support"):
            torch.cuda.Stream()
    (w * 2).sum().backward()  # the graph's leftover hooks are inert


def test_one_detector_at_a_time_and_clear_errors():
    with Detector():
        with pytest.raises(RuntimeError, match="another Detector is already active"):
            Detector().__enter__()
    with pytest.raises(ValueError, match="unknown backend 'gpu'"):
        Detector(backend="gpu")
    if not REAL_CUDA:
        with pytest.raises(RuntimeError, match="backend 'cuda' needs a CUDA device"):
            with Detector(backend="cuda"):
                pass
    assert torch.cuda.Stream.__module__ == "torch.cuda.streams"
    with pytest.raises(RuntimeError, match="only while a streamrace Detector"):
        from pytest_streamrace.detector.models import virtual_streams
        virtual_streams.Stream()


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 2 * x


@pytest.mark.parametrize("root", ["op's node", "custom Function's node"])
def test_a_backward_from_gradient_edges_binds_the_graph_behind_them(root):
    """torch.autograd.grad from GradientEdges (as pipeline schedules split a backward): the graph behind the edge's
    node is bound like a tensor's. Its nodes, made on s, read x (written on s) there: clean. Were they left unbound,
    they would run on the caller's stream, which never waited on s."""
    from torch.autograd.graph import get_gradient_edge

    with Detector() as d:
        w = torch.randn(4, requires_grad=True)
        s = side_stream()
        with torch.cuda.stream(s):
            x = w * 2
            y = x * x if root == "op's node" else _Square.apply(x)
        (g,) = torch.autograd.grad([get_gradient_edge(y)], [w], grad_outputs=[torch.ones_like(y)])
        g.sum()  # the caller joined s at the end
    assert d.races == []


@pytest.mark.parametrize("reader", ["caller", "other stream"])
def test_nodes_made_on_another_thread_run_on_the_stream_current_there(reader):
    """A worker thread builds the graph on s (its own stream switches and autograd numbers); the main thread, which
    switched streams itself, runs the backward. The nodes run on s, where x was written: clean; the caller joins s at
    the end. A stream that waited on nothing races with the gradient's write."""
    with Detector() as d:
        w = torch.randn(4, requires_grad=True)
        s, other = side_stream(), side_stream()
        made = {}

        def forward():
            with torch.cuda.stream(s):
                x = w * 2
                made["loss"] = (x * x).sum()

        worker = threading.Thread(target=forward)
        worker.start()
        worker.join()
        with torch.cuda.stream(other):
            torch.ones(1)  # the main thread's own switches, at its own autograd numbers
        made["loss"].backward()
        if reader == "caller":
            w.grad.sum()
        else:
            with torch.cuda.stream(other):
                w.grad.sum()
    assert len(d.races) == (0 if reader == "caller" else 1), d.races
