"""torch's device-generic stream API (torch.Stream, torch.Event, torch.accelerator, torch.get_device_module) through
pytest as users run it: each way to pick a stream or order one, with a racy and a clean twin. The same file runs on
the virtual backend here and on the cuda backend on a GPU (marked gpu), under --streamrace-latent=fail, so that a
clean twin ordered only by a sync the model took for an incidental one fails too."""

import re

import pytest

from pytest_streamrace import env

TWINS = """
import pytest, torch

acc = torch.accelerator


def side():
    s = torch.Stream()                              # SIDE
    s.wait_stream(acc.current_stream())
    return s


def written_on_side(device, enter):
    x = torch.zeros(1 << 16, device=device)
    s = side()
    with enter(s):
        x.add_(1)                                   # SIDE-WRITE
    return x, s


@pytest.mark.streamrace(expect="race")
def test_with_stream_then_read(streamrace_device):
    x, s = written_on_side(streamrace_device, lambda s: s)
    x.sum()                                         # READ-AFTER-WITH


@pytest.mark.streamrace(expect="clean")
def test_with_stream_wait_stream_then_read(streamrace_device):
    x, s = written_on_side(streamrace_device, lambda s: s)
    acc.current_stream().wait_stream(s)
    x.sum()


@pytest.mark.streamrace(expect="race")
def test_cuda_stream_context_on_a_torch_stream(streamrace_device):
    x, s = written_on_side(streamrace_device, torch.cuda.stream)
    x.sum()


@pytest.mark.streamrace(expect="clean")
def test_cuda_stream_context_then_torch_event(streamrace_device):
    x, s = written_on_side(streamrace_device, torch.cuda.stream)
    done = torch.Event()
    done.record(s)
    done.wait()
    x.sum()


class set_stream:
    def __init__(self, s):
        self.s = s

    def __enter__(self):
        self.previous = acc.current_stream()
        acc.set_stream(self.s)

    def __exit__(self, *exc):
        acc.set_stream(self.previous)


@pytest.mark.streamrace(expect="race")
def test_accelerator_set_stream(streamrace_device):
    x, s = written_on_side(streamrace_device, set_stream)
    x.sum()


@pytest.mark.streamrace(expect="clean")
def test_accelerator_set_stream_then_wait_event(streamrace_device):
    x, s = written_on_side(streamrace_device, set_stream)
    acc.current_stream().wait_event(s.record_event())
    x.sum()


@pytest.mark.streamrace(expect="race")
def test_event_recorded_before_the_write(streamrace_device):
    x = torch.zeros(1 << 16, device=streamrace_device)
    s = side()
    early = torch.Event()
    with s:
        early.record()
        x.add_(1)
    acc.current_stream().wait_event(early)
    x.sum()


@pytest.mark.streamrace(expect="race")
def test_host_waits_for_an_event_recorded_before_the_write(streamrace_device):
    x = torch.zeros(1 << 16, device=streamrace_device)
    s = side()
    early = torch.Event()
    with s:
        early.record()
        x.add_(1)
    early.synchronize()
    x.sum()


@pytest.mark.parametrize("host_waits", ["event.synchronize", "event.query", "stream.synchronize", "stream.query",
                                        "accelerator.synchronize", "elapsed_time"])
@pytest.mark.streamrace(expect="clean")
def test_host_waits_then_reads(streamrace_device, host_waits):
    x = torch.zeros(1 << 16, device=streamrace_device)
    s = side()
    timing = host_waits == "elapsed_time"  # a timing event stays torch's own type on a GPU: only elapsed_time needs it
    start, done = torch.Event(enable_timing=timing), torch.Event(enable_timing=timing)
    with s:
        start.record()
        x.add_(1)
        done.record()
    if host_waits == "event.synchronize":
        done.synchronize()
    elif host_waits == "event.query":
        while not done.query():
            pass
    elif host_waits == "stream.synchronize":
        s.synchronize()
    elif host_waits == "stream.query":
        while not s.query():
            pass
    elif host_waits == "accelerator.synchronize":
        acc.synchronize()
    else:
        done.synchronize()
        assert start.elapsed_time(done) >= 0
    x.sum()


@pytest.mark.streamrace(expect="race")
def test_device_module_stream(streamrace_device):
    cuda = torch.get_device_module("cuda")
    x, s = written_on_side(streamrace_device, cuda.stream)
    x.sum()


@pytest.mark.streamrace(expect="clean")
def test_device_module_stream_then_wait(streamrace_device):
    cuda = torch.get_device_module("cuda")
    x, s = written_on_side(streamrace_device, cuda.stream)
    cuda.current_stream().wait_stream(s)
    x.sum()


@pytest.mark.streamrace(expect="clean")
def test_accelerator_calls_answer(streamrace_device):
    assert acc.current_device_index() == streamrace_device.index or streamrace_device.type == "cpu"
    with acc.device_index(acc.current_device_index()):
        acc.set_device_index(acc.current_device_index())
    assert acc.is_available() == torch.cuda.is_available()
    assert acc.device_count() == torch.cuda.device_count()
    assert isinstance(acc.current_stream(), torch.Stream)
    assert torch.Event(enable_timing=True) is not None
"""

RACY = {"test_with_stream_then_read", "test_cuda_stream_context_on_a_torch_stream", "test_accelerator_set_stream",
        "test_event_recorded_before_the_write", "test_host_waits_for_an_event_recorded_before_the_write",
        "test_device_module_stream"}


def _run(pytester, backend):
    pytester.makepyfile(test_twins=TWINS)
    result = pytester.runpytest_subprocess("--streamrace", f"--streamrace-backend={backend}",
                                           "--streamrace-latent=fail", "--streamrace-json", "races.json",
                                           "-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=17)
    import json

    source = pytester.path.joinpath("test_twins.py").read_text().splitlines()
    lines = {tag: next(i for i, text in enumerate(source, 1) if text.endswith(f"# {tag}"))
             for tag in ("SIDE", "SIDE-WRITE", "READ-AFTER-WITH")}
    races = json.loads(pytester.path.joinpath("races.json").read_text())["races"]
    by_test = {}
    for race in races:
        by_test.setdefault(re.sub(r"\[.*", "", race["test"].rsplit("::", 1)[1]), []).append(race)
    assert set(by_test) == RACY, sorted(by_test)
    race = by_test["test_with_stream_then_read"][0]
    assert race["kind"] == "read-after-write"
    assert race["earlier"]["stream"] == f"stream created at test_twins.py:{lines['SIDE']}"
    assert race["later"]["stream"] == "default stream"
    return result


def test_device_generic_api_on_virtual_streams(pytester):
    _run(pytester, "virtual")


@pytest.mark.gpu
@pytest.mark.skipif(not env.visible_gpus(), reason="needs a CUDA GPU")
def test_device_generic_api_on_the_cuda_backend(pytester):
    _run(pytester, "cuda")


def test_accelerator_queries_answer_as_torch_does_on_this_machine():
    """Device queries stay what torch says without a session (code that picks a device by them keeps its device);
    the stream calls work on the virtual streams, of device 0; torch comes back as it was."""
    import torch

    from pytest_streamrace.detector.session import Detector

    acc = torch.accelerator
    before = {name: getattr(acc, name) for name in ("current_stream", "set_stream", "synchronize",
                                                    "current_device_index", "set_device_index", "device_index")}
    stream, event = torch.Stream, torch.Event
    answers = (acc.is_available(), acc.device_count(), acc.current_accelerator())
    with Detector(backend="virtual"):
        assert (acc.is_available(), acc.device_count(), acc.current_accelerator()) == answers
        assert acc.current_stream() is torch.cuda.default_stream() and acc.current_device_index() == 0
        for device in (0, -1, "cuda", "cuda:0", torch.device("cuda", 0)):
            acc.set_device_index(device)
        for device in (1, "cuda:1", torch.device("cuda", 1)):
            with pytest.raises(RuntimeError, match="invalid device ordinal"):
                acc.set_device_index(device)
        assert torch.get_device_module("cuda").Stream is torch.Stream is torch.cuda.Stream
    assert {name: getattr(acc, name) for name in before} == before
    assert (torch.Stream, torch.Event) == (stream, event)
