"""torch.compile under --streamrace: compiled code compiles for real (no graph break of ours, dynamo's counters say so)
and Inductor's kernels are seen as launches on the stream current at the call. Racy/clean twins, one pytester run (one
Inductor compile per function: slow on 2 cores, so the models are tiny). The same cases run on CUDA in
tests/gpu/test_compiled_gpu.py."""

import json

import pytest

from pytest_streamrace.detector import capture
from pytest_streamrace.detector.models.compiled import READ, WRITE, _loaded, cpp_roles

CASES = """
import pytest, torch
from torch._dynamo import compiled_autograd
from torch._dynamo.utils import counters

def f(x, y):
    return (x * 2 + y).sin()

def bump(x):
    x.mul_(2).add_(1)

cf, cbump = torch.compile(f), torch.compile(bump)

def compiled_without_breaks():
    assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
    assert not counters["graph_break"], dict(counters["graph_break"])

def side_stream():
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # inputs made on the default stream are ready there
    return side

def functional(wait):
    x, y = torch.ones(64), torch.ones(64)
    side = side_stream()
    with torch.cuda.stream(side):
        out = cf(x, y)
    if wait:
        torch.cuda.current_stream().wait_stream(side)
    out.sum()
    compiled_without_breaks()

def in_place(wait):
    x = torch.ones(64)
    side = side_stream()
    with torch.cuda.stream(side):
        cbump(x)
    if wait:
        torch.cuda.current_stream().wait_stream(side)
    x.sum()
    compiled_without_breaks()

model = torch.nn.Linear(8, 4)
cmodel = torch.compile(model)

def backward(wait):
    model.zero_grad(set_to_none=True)
    x = torch.ones(2, 8)
    side = side_stream()
    with torch.cuda.stream(side):
        cmodel(x).sum().backward()
    if wait:
        torch.cuda.current_stream().wait_stream(side)
    model.weight.grad.sum()
    compiled_without_breaks()

def hook_model():
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 4)
    def double(p):
        p.grad.mul_(2)
    m.weight.register_post_accumulate_grad_hook(double)
    return m

def compiled_autograd_hook(wait):
    m = hook_model()
    x = torch.ones(2, 8)
    side = side_stream()
    with torch.cuda.stream(side):
        loss = m(x).sum()
        with compiled_autograd._enable(torch.compile):
            loss.backward()
    if wait:
        torch.cuda.current_stream().wait_stream(side)
    m.weight.grad.sum()
    assert counters["compiled_autograd"]["captures"] >= 1
    compiled_without_breaks()

def switch_inside(x):
    with torch.cuda.stream(SIDE):  # the virtual API graph-breaks, so the switch happens when the program runs
        y = x * 2
    return y

SIDE = None

@pytest.mark.streamrace(expect="race")
def test_stream_switch_inside_compiled_code_racy():
    global SIDE
    SIDE = side_stream()
    x = torch.ones(64)
    torch.compile(switch_inside)(x).sum()
    breaks = list(counters["graph_break"])
    assert breaks and all("streamrace: virtual CUDA stream API" in b for b in breaks), breaks
    counters["graph_break"].clear()  # ours, and said: the other cases assert none

@pytest.mark.streamrace(expect="race")
def test_functional_racy(): functional(False)

@pytest.mark.streamrace(expect="clean")
def test_functional_clean(): functional(True)

@pytest.mark.streamrace(expect="race")
def test_in_place_racy(): in_place(False)

@pytest.mark.streamrace(expect="clean")
def test_in_place_clean(): in_place(True)

@pytest.mark.streamrace(expect="race")
def test_backward_racy(): backward(False)

@pytest.mark.streamrace(expect="clean")
def test_backward_clean(): backward(True)

@pytest.mark.streamrace(expect="race")
def test_compiled_autograd_hook_racy(): compiled_autograd_hook(False)

@pytest.mark.streamrace(expect="clean")
def test_compiled_autograd_hook_clean(): compiled_autograd_hook(True)
"""


def test_compiled_twins_under_the_virtual_backend(pytester):
    pytester.makepyfile(test_cases=CASES)
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual", "-p", "no:cacheprovider",
                                           "--streamrace-json=races.json")
    result.assert_outcomes(passed=9)
    races = json.loads((pytester.path / "races.json").read_text())["races"]
    by_test: dict = {}
    for race in races:
        by_test.setdefault(race["test"].split("::")[-1], []).append(race)
    assert sorted(by_test) == ["test_backward_racy", "test_compiled_autograd_hook_racy", "test_functional_racy",
                               "test_in_place_racy", "test_stream_switch_inside_compiled_code_racy"]
    # the writes that race are the compiled code's own: Inductor's generated kernels, named, with the user's line
    functional = by_test["test_functional_racy"]
    assert any(r["earlier"]["op"].startswith("cpp_fused") for r in functional), functional
    in_place = by_test["test_in_place_racy"]
    assert any(r["earlier"]["op"].startswith("cpp_fused") and r["earlier"]["rw"] != "read" for r in in_place)
    frames = [f for r in functional for f in r["earlier"]["frames"]]
    assert any(f["file"].endswith("test_cases.py") and f["function"] == "functional" for f in frames), frames
    assert not any("torchinductor" in f["file"] for f in frames), frames


def test_cpp_kernel_roles_follow_inductors_argument_names():
    source = '''#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(float* in_out_ptr0,
                       const float* in_ptr0,
                       float* out_ptr0,
                       const int64_t ks0)
{ }'''
    assert cpp_roles(source) == (READ | WRITE, READ, WRITE, 0)
    assert cpp_roles("no kernel here") is None


def test_generated_modules_are_listed_from_either_shape_of_inductors_code_cache():
    """PyCodeCache lists its loaded modules (``modules``), or (torch 2.4) keeps them in a dict by key (``cache``): the
    model reads both in load order, and an unknown shape as none, never raising into a session's start."""
    import types

    first, second = types.ModuleType("first"), types.ModuleType("second")

    class Listed:
        modules = [first, second]

    class Keyed:
        cache = {"k1": first, "k2": second}

    assert _loaded(Listed) == [first, second]
    assert _loaded(Keyed) == [first, second]
    assert _loaded(object) == []


def test_compiled_code_keeps_its_graph_and_stays_quiet_without_streams(pytester):
    """aot_eager: the compiled graph runs its ATen ops, seen by the dispatch mode; one stream is never a race."""
    pytester.makepyfile("""
        import torch
        from torch._dynamo.testing import CompileCounter
        from torch._dynamo.utils import counters

        def test_one_stream():
            counter = CompileCounter()
            g = torch.compile(lambda x: (x + 1).relu().sum(), backend=counter)
            assert g(torch.ones(4)).item() == 8
            assert counter.frame_count == 1 and counter.op_count == 3
            assert not counters["graph_break"]
    """)
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


@pytest.mark.parametrize("native", ["1", "0"])
def test_triton_launches_and_cuda_graph_replays_are_accesses_on_their_stream(native, monkeypatch):
    """The cuda backend's hooks, on stand-ins with the attributes Inductor's CachingAutotuner and cudagraph-tree
    nodes have (CPU has neither): a launch reads its in_ptr* arguments and writes its out_ptr* and mutated ones. The
    same with the capture (the launch recorded in C++) and without it (the dispatch mode's fallback)."""
    import types

    if native == "0":  # as STREAMRACE_NATIVE=0 at the process's start: no capture
        monkeypatch.setattr(capture, "_extension", None)
        monkeypatch.setattr(capture, "_failure", "STREAMRACE_NATIVE=0")

    import torch

    from pytest_streamrace.detector.models import compiled
    from pytest_streamrace.detector.session import Detector

    class CachingAutotuner:
        def __init__(self, names, mutated):
            self.fn = types.SimpleNamespace(arg_names=names, __name__="triton_poi_fused_add_0")
            self.mutated_arg_names = mutated
            self.launched = []

        def run(self, *args, stream, **kwargs):
            if not self.launched:  # Inductor's first call autotunes: benchmarks, then synchronizes, then launches
                torch.cuda.synchronize()
            self.launched.append(args)

    class CUDAGraphNode:
        def __init__(self, outputs):
            self.outputs = outputs

        def run(self, new_inputs):
            new_inputs.clear()
            return self.outputs

    fake = types.SimpleNamespace(CachingAutotuner=CachingAutotuner, CUDAGraphNode=CUDAGraphNode)
    with Detector("virtual") as d:
        patches = compiled._triton_patches(fake) + compiled._cudagraph_patches(fake)
        for patch in patches:
            patch.install()
        try:
            side = torch.cuda.Stream()
            x, y, out, acc, graph_out = torch.ones(8), torch.ones(8), torch.empty(8), torch.zeros(8), torch.empty(8)
            side.wait_stream(torch.cuda.current_stream())
            kernel = CachingAutotuner(["in_ptr0", "out_ptr0", "acc_ptr", "xnumel"], ["acc_ptr"])
            with torch.cuda.stream(side):
                kernel.run(x, out, acc, 8, stream=None)
                CUDAGraphNode([graph_out]).run([y])
            assert kernel.launched == [(x, out, acc, 8)]
            x.add_(1)     # writes after the side stream's reads: race with the kernel's and the replay's reads
            y.add_(1)
            out.sum()     # read of the kernel's output
            acc.sum()     # read of the mutated argument
            graph_out.sum()  # read of the replay's output
        finally:
            for patch in reversed(patches):
                patch.uninstall()
        races = [(r.earlier.op.site.op, r.later.op.site.op) for r in d.races]
        assert (d.op_source == "capture") == (native == "1" and capture.load() is not None)
    assert CachingAutotuner.run.__name__ == "run"  # the stand-in's own method is back
    ops = set(races)
    assert ("triton_poi_fused_add_0", "aten::sum") in ops
    assert ("cudagraph replay", "aten::sum") in ops
    assert {("triton_poi_fused_add_0", "aten::add_"), ("cudagraph replay", "aten::add_")} <= ops
    assert races.count(("triton_poi_fused_add_0", "aten::sum")) == 2  # out and acc, the mutated argument


def test_compiling_is_the_compilers_work_not_the_programs(pytester):
    """While a graph compiles, host syncs are the compiler's (stream models skip them, so a compiled function's first
    call does not order the program's earlier work); before and after, they are the program's."""
    pytester.makepyfile(test_scope="""
        import torch
        from pytest_streamrace.detector import compile_time

        seen = []

        def backend(gm, example_inputs):
            seen.append(compile_time.active())
            return gm.forward

        def test_scope():
            assert not compile_time.active()
            fn = torch.compile(lambda x: x * 2, backend=backend)
            fn(torch.ones(4))
            assert seen == [True]
            assert not compile_time.active()
    """)
    # in a subprocess: an in-process run drops the compiler's modules it imported from sys.modules afterwards, and
    # torch's cache registry refuses their second import in this worker (a later in-process import of Inductor fails)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--streamrace", "--streamrace-backend=virtual")
    result.assert_outcomes(passed=1)
