"""compile_mode: each mode really compiles (graphs counted through its backend), gives eager's gradients, and
combines with bound accumulators and delays under the detector. Few and small: compiling is slow on 2 cores."""

MODES = """
import pytest, torch
from pytest_streamrace.forcing import streams

def grads(model_fn, compile_mode=None, bind=None, delays=None):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 1)
    seen = []
    if bind:
        binding = bind(m, streams=2)
        if delays:
            delays.before_accumulate(binding)
        for p in m.parameters():
            p.register_post_accumulate_grad_hook(lambda p: seen.append(streams.label(torch.cuda.current_stream())))
    run = compile_mode.compile(m) if compile_mode else m
    loss = run(torch.arange(8.0).view(2, 4)).sum()
    if compile_mode:
        with compile_mode.backward():
            loss.backward()
    else:
        loss.backward()
    return [p.grad.clone() for p in m.parameters()], seen

EXPECTED = {"eager": {"forward": 0, "backward": 0}, "compile": {"forward": 1, "backward": 0},
            "compiled_autograd": {"forward": 1, "backward": 1}}

def test_mode_compiles_and_matches_eager(compile_mode):
    reference, _ = grads(None)
    got, _ = grads(None, compile_mode)
    assert all(torch.equal(a, b) for a, b in zip(got, reference))
    assert compile_mode.graphs == EXPECTED[compile_mode.name]

@pytest.mark.streamrace_compile(modes=("compile",))
def test_forgot_to_compile(compile_mode):
    pass

@pytest.mark.streamrace_compile(modes=("compile", "compiled_autograd"))
def test_hooks_stay_on_bound_streams(compile_mode, stream_bound_accumulators, injected_delays):
    _, seen = grads(None, compile_mode, stream_bound_accumulators, injected_delays)
    assert compile_mode.graphs["forward"] >= 1
    assert compile_mode.name != "compiled_autograd" or compile_mode.graphs["backward"] >= 1
    # compiled autograd runs the whole backward as one graph on the caller's stream (torch has no per-node streams
    # there): the hooks land on it, whatever stream their AccumulateGrad node was created on
    # (and the schedule delays only side streams)
    collapsed = compile_mode.name == "compiled_autograd"
    assert sorted(seen) == (["default"] * 2 if collapsed else ["side 0", "side 1"])
    assert [d.where for d in injected_delays.log] == ([] if collapsed else ["AccumulateGrad of weight"])
"""

INDUCTOR = """
import pytest, torch

@pytest.mark.streamrace_compile(modes=("compile",), backend="inductor")
def test_inductor(compile_mode):
    m = torch.nn.Linear(4, 1)
    out = compile_mode.compile(m)(torch.ones(1, 4))
    torch.testing.assert_close(out, m(torch.ones(1, 4)))  # inductor's kernel may round differently from addmm
    assert compile_mode.graphs["forward"] == 1
"""


def test_each_mode_compiles_and_a_mode_that_compiled_nothing_fails(pytester):
    pytester.makepyfile(test_modes=MODES)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "not bound", "-rfEP")
    result.assert_outcomes(passed=4, errors=1)
    out = result.stdout.str()
    # each test's report says which mode ran and what it compiled
    result.stdout.fnmatch_lines(["*streamrace compile mode*", "compiled_autograd (aot_eager): compiled 1 forward, "
                                 "1 backward graph(s), 0 graph break(s)"])
    assert "eager (nothing compiled)" in out
    assert "streamrace: compile mode compile (aot_eager) compiled no forward graph" in out
    assert "ERROR test_modes.py::test_forgot_to_compile[compile]" in out


def test_compile_modes_combine_with_bound_streams_and_delays_under_the_detector(pytester):
    pytester.makepyfile(test_modes=MODES)
    result = pytester.runpytest_subprocess(
        "--streamrace", "--streamrace-backend=virtual", "-p", "no:cacheprovider", "-k", "bound")
    result.assert_outcomes(passed=2)


def test_inductor_compiles_once(pytester):
    pytester.makepyfile(test_inductor=INDUCTOR)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_bad_compile_marker_is_one_line(pytester):
    pytester.makepyfile("""
        import pytest
        @pytest.mark.streamrace_compile(modes=("jit",))
        def test_x(compile_mode):
            pass
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["@pytest.mark.streamrace_compile: modes must be a tuple of some of eager, compile, "
                                 "compiled_autograd, got ('jit',)"])
