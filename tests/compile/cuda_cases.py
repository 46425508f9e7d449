"""Compiled code on CUDA under --streamrace (cuda backend): Inductor's Triton kernels, a user Triton kernel through
torch.library.triton_op / wrap_triton, a CUDA-graph replay (mode="reduce-overhead") and max-autotune, as racy/clean
twins. Run by tests/gpu/test_compiled_gpu.py:

    python -m pytest tests/compile/cuda_cases.py --streamrace --streamrace-backend=cuda

Skipped without a GPU (CI). Each case asserts dynamo compiled it without a graph break.
"""

import pytest
import torch
from torch._dynamo.utils import counters

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA cases: tests/gpu/test_compiled_gpu.py")

N = 1 << 20


def compiled_without_breaks():
    assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
    assert not counters["graph_break"], dict(counters["graph_break"])


def side_stream():
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    return side


def join(side, wait):
    if wait:
        torch.cuda.current_stream().wait_stream(side)


def f(x, y):
    return (x * 2 + y).sin()


def bump(x):
    x.mul_(2).add_(1)


cf, cbump = torch.compile(f), torch.compile(bump)
cf_graphs = torch.compile(f, mode="reduce-overhead")
cmm = torch.compile(lambda a, b: (a @ b).relu(), mode="max-autotune-no-cudagraphs")


def functional(wait):
    x, y = torch.ones(N, device="cuda"), torch.ones(N, device="cuda")
    side = side_stream()
    with torch.cuda.stream(side):
        out = cf(x, y)
    join(side, wait)
    out.sum()
    compiled_without_breaks()


def in_place(wait):
    x = torch.ones(N, device="cuda")
    side = side_stream()
    with torch.cuda.stream(side):
        cbump(x)
    join(side, wait)
    x.sum()
    compiled_without_breaks()


def first_call(wait):
    """WAR/WAW on a compiled function's first call: compiling and autotuning synchronize the device, and those syncs
    are not the program's, so they must not order the default stream's earlier work before the side stream's update
    (a test that calls the function once would pass otherwise)."""
    torch._dynamo.reset()  # this call compiles

    def bump3(x):
        x.mul_(3).add_(1)
    fn = torch.compile(bump3)
    x = torch.ones(N, device="cuda")
    x.sum()  # the default stream reads x
    side = torch.cuda.Stream()
    if wait:
        side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(x)  # first call: compiles, autotunes, then writes x on the side stream
    torch.cuda.current_stream().wait_stream(side)
    x.sum()
    compiled_without_breaks()


_compiled_models: dict = {}


def compiled_model():
    """One model compiled once for both twins (compiling is the slow part)."""
    if not _compiled_models:
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 256, device="cuda")
        _compiled_models["model"] = (model, torch.compile(model))
    model, cmodel = _compiled_models["model"]
    model.zero_grad(set_to_none=True)
    return model, cmodel


def backward(wait):
    model, cmodel = compiled_model()
    x = torch.ones(64, 256, device="cuda")
    side = side_stream()
    with torch.cuda.stream(side):
        cmodel(x).sum().backward()
    join(side, wait)
    model.weight.grad.sum()
    compiled_without_breaks()


def compiled_autograd_hook(wait):
    from torch._dynamo import compiled_autograd

    torch.manual_seed(0)
    m = torch.nn.Linear(256, 256, device="cuda")

    def double(p):
        p.grad.mul_(2)
    m.weight.register_post_accumulate_grad_hook(double)
    x = torch.ones(64, 256, device="cuda")
    side = side_stream()
    with torch.cuda.stream(side):
        loss = m(x).sum()
        with compiled_autograd._enable(torch.compile):
            loss.backward()
    join(side, wait)
    m.weight.grad.sum()
    compiled_without_breaks()


def cuda_graph_replay(wait):
    x, y = torch.ones(N, device="cuda"), torch.ones(N, device="cuda")
    for _ in range(3):  # warm-up and recording on the default stream
        cf_graphs(x, y)
    torch.cuda.synchronize()
    side = side_stream()
    with torch.cuda.stream(side):
        out = cf_graphs(x, y)  # a replay
    join(side, wait)
    out.sum()
    compiled_without_breaks()


def max_autotune(wait):
    a, b = torch.randn(512, 512, device="cuda"), torch.randn(512, 512, device="cuda")
    side = side_stream()
    with torch.cuda.stream(side):
        out = cmm(a, b)
    join(side, wait)
    out.sum()
    compiled_without_breaks()


def _triton_add():
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton

    @triton.jit
    def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)

    @triton_op("streamrace_cases::add", mutates_args={})
    def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        n = x.numel()
        wrap_triton(add_kernel)[(triton.cdiv(n, 1024),)](x, y, out, n, BLOCK=1024)
        return out
    return add


_add = None


def _call_add(x, y):
    return _add(x, y)


_compiled_add = torch.compile(_call_add)


def triton_op_case(wait, compiled=True):
    """The user kernel's output is read as it is: no other kernel writes it, so a race reported here is the user
    kernel's launch (compiled: Inductor's launch of `add_kernel`; eager: the `streamrace_cases::add` op)."""
    global _add
    if _add is None:
        _add = _triton_add()
    fn = _compiled_add if compiled else _call_add
    x, y = torch.ones(N, device="cuda"), torch.ones(N, device="cuda")
    side = side_stream()
    with torch.cuda.stream(side):
        out = fn(x, y)
    join(side, wait)
    out.sum()
    if compiled:
        compiled_without_breaks()


CASES = {"functional": functional, "in_place": in_place, "first_call": first_call, "backward": backward,
         "compiled_autograd_hook": compiled_autograd_hook, "cuda_graph_replay": cuda_graph_replay,
         "max_autotune": max_autotune, "triton_op": triton_op_case,
         "triton_op_eager": lambda wait: triton_op_case(wait, compiled=False)}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.streamrace(expect="race")
def test_racy(case):
    CASES[case](False)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.streamrace(expect="clean")
def test_clean(case):
    CASES[case](True)
