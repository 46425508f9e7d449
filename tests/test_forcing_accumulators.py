"""stream_bound_accumulators and built_on_side_stream: gradient hooks really run on the bound streams, and the
detector sees what that does to a bucket the hooks share."""

BOUND = """
import pytest, torch
from pytest_streamrace.forcing import streams
from pytest_streamrace.forcing.accumulators import built_on_side_stream

def model(dev):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1)).to(dev)

def hook_streams(m):
    seen = {}
    for name, p in m.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: seen.__setitem__(name, streams.label(torch.cuda.current_stream())))
    return seen

@pytest.mark.parametrize("policy, expected", [
    ("round_robin", {"0.weight": "side 0", "0.bias": "side 1", "2.weight": "side 2", "2.bias": "side 0"}),
    ("per_module", {"0.weight": "side 0", "0.bias": "side 0", "2.weight": "side 1", "2.bias": "side 1"}),
    ("one_stream", dict.fromkeys(["0.weight", "0.bias", "2.weight", "2.bias"], "side 0")),
    ({"2.bias": 2}, {"0.weight": "default", "0.bias": "default", "2.weight": "default", "2.bias": "side 2"}),
])
def test_hooks_run_on_bound_streams(stream_bound_accumulators, streamrace_device, policy, expected):
    m = model(streamrace_device)
    binding = stream_bound_accumulators(m, streams=3, policy=policy)
    seen = hook_streams(m)  # registered after binding, as a framework would
    m(torch.ones(2, 4, device=streamrace_device)).sum().backward()
    assert seen == expected
    assert binding.record == {k: v for k, v in expected.items() if v != "default"}

def test_unknown_parameter_in_mapping(stream_bound_accumulators, streamrace_device):
    stream_bound_accumulators(model(streamrace_device), policy={"nope.weight": 0})

class Framework:
    \"\"\"Registers gradient hooks on AccumulateGrad nodes it creates itself, as Megatron's DDP does.\"\"\"
    def __init__(self, module):
        self.seen, self.grad_accs = [], []
        for p in module.parameters():
            acc = p.expand_as(p).grad_fn.next_functions[0][0]
            acc.register_hook(lambda *a: self.seen.append(streams.label(torch.cuda.current_stream())))
            self.grad_accs.append(acc)

def test_built_on_side_stream(streamrace_device):
    m = model(streamrace_device)
    ddp, stream = built_on_side_stream(lambda: Framework(m))
    m(torch.ones(2, 4, device=streamrace_device)).sum().backward()
    assert ddp.seen == ["build side"] * 4

def bucket_step(dev, bind):
    # hooks copy gradients into one bucket; the last one flushes it on a reduction stream that waits only on the
    # flushing hook's stream (DeepSpeed #8061's wait)
    m = model(dev)
    if bind:
        bind(m, streams=2)
    params = list(m.parameters())
    bucket = torch.zeros(sum(p.numel() for p in params), device=dev)
    offsets = dict(zip(params, [sum(q.numel() for q in params[:i]) for i in range(len(params))]))
    reduction, copied = torch.cuda.Stream(), []

    def copy(p):
        bucket[offsets[p]:offsets[p] + p.numel()].copy_(p.grad.view(-1))
        copied.append(p)
        if len(copied) == len(params):
            reduction.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(reduction):
                bucket.div_(2)

    for p in params:
        p.register_post_accumulate_grad_hook(copy)
    m(torch.ones(2, 4, device=dev)).sum().backward()
    torch.cuda.current_stream().wait_stream(reduction)

@pytest.mark.streamrace(expect="clean")
def test_hooks_on_the_default_stream_are_clean(streamrace_device):
    bucket_step(streamrace_device, None)

def test_bound_hooks_race_with_the_reduction(stream_bound_accumulators, streamrace_device):
    bucket_step(streamrace_device, stream_bound_accumulators)
"""


def test_bound_accumulators_through_the_detector(pytester):
    pytester.makepyfile(test_bound=BOUND)
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=6, failed=2)
    result.stdout.fnmatch_lines([
        "*ValueError: streamrace: bind_accumulators mapping names unknown parameters: nope.weight",
    ])
    report = result.stdout.str()
    section = report[report.index("_ test_bound_hooks_race_with_the_reduction _"):]
    assert "stream race: write-after-write" in section
    assert "aten::copy_  on side 1 (streamrace forcing)" in section  # the bound hook's copy, named by its label
    assert "aten::div_   on stream created at" in section
    assert "FAILED test_bound.py::test_hooks_on_the_default_stream_are_clean" not in report


def test_fixture_without_streams_fails_in_one_line(pytester):
    pytester.makepyfile("def test_bind(stream_bound_accumulators):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*streamrace: stream_bound_accumulators needs CUDA streams: run on a GPU, or on "
                                 "CPU with --streamrace (virtual backend)"])
    assert "Traceback" not in result.stdout.str()
