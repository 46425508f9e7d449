"""Host-synchronizing ops: a value read back to the host on the stream that produced it orders whatever the host
issues next (clean on a GPU, so clean here); a read-back that does not wait (non_blocking into pinned memory), or
waits for another stream, leaves the race."""

import re

import pytest
import torch

from pytest_streamrace.detector.host_sync import METHODS, OPS

CASES = """
import pytest, torch

def produced_on_a_side_stream():
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x = torch.ones(8) * 2
    return side, x

@pytest.mark.parametrize("read_back", [
    lambda x: x.cpu(), lambda x: x.tolist(), lambda x: x.numpy(force=True), lambda x: x.cpu().numpy(),
    lambda x: x.sum().item(), lambda x: bool(x[0]), lambda x: x[x > 1], lambda x: x.nonzero(),
    lambda x: torch.unique(x), lambda x: torch.equal(x, x),
], ids=["cpu", "tolist", "numpy_force", "cpu_numpy", "item", "bool", "mask_index", "nonzero", "unique", "equal"])
def test_clean_read_back_on_the_producing_stream(read_back):
    side, x = produced_on_a_side_stream()
    with torch.cuda.stream(side):
        read_back(x)
    x.add_(1)  # ordered: the host waited for the side stream

def test_racy_no_read_back():
    side, x = produced_on_a_side_stream()
    x.add_(1)  # no-wait

def test_racy_non_blocking_copy_to_pinned_memory():
    side, x = produced_on_a_side_stream()
    with torch.cuda.stream(side):
        host = x.to("cpu", non_blocking=True)  # the output is pinned: the host does not wait
    x.add_(1)  # pinned-copy

def test_racy_read_back_on_another_stream():
    side, x = produced_on_a_side_stream()
    x.tolist()  # other-stream
"""


def test_read_backs_order_the_host_after_their_stream(pytester):
    pytester.makepyfile(test_reads=CASES)
    result = pytester.runpytest_subprocess("--streamrace", "-p", "no:cacheprovider", "-rA")
    out = result.stdout.str()
    result.assert_outcomes(passed=10, failed=3)
    assert re.search(r"FAILED test_reads.py::test_racy_no_read_back\b", out)
    assert re.search(r"FAILED test_reads.py::test_racy_non_blocking_copy_to_pinned_memory\b", out)
    for test, kind, tag in (("test_racy_no_read_back", "write-after-write", "no-wait"),
                            ("test_racy_non_blocking_copy_to_pinned_memory", "write-after-write", "pinned-copy"),
                            ("test_racy_read_back_on_another_stream", "read-after-write", "other-stream")):
        assert f"test_reads.py::{test}: {kind} on a tensor at test_reads.py:{case_line(tag)}\n" in out
    # the read-back itself is an access: a copy on the default stream that did not wait for the producer
    assert re.search(rf"later\s+read\s+\.tolist\(\)\s+on default stream\s+at test_reads.py:{case_line('other-stream')} "
                     r"\(test_racy_read_back_on_another_stream\)\n  the later", out)


def case_line(tag: str) -> int:
    """The line of CASES (as written to test_reads.py) that ends with `# tag`."""
    return next(n for n, text in enumerate(CASES.splitlines()) if text.endswith(f"# {tag}"))


META = "meta"  # stands in for the GPU: a device type other than the host's, with real tensors on it


@pytest.mark.parametrize("op, args, kwargs, syncs", [
    ("aten::_to_copy", (torch.empty(2, device=META),), {"device": torch.device("cpu")}, True),
    ("aten::_to_copy", (torch.empty(2, device=META),), {"device": torch.device("cpu"), "non_blocking": True}, False),
    ("aten::_to_copy", (torch.empty(2),), {"device": torch.device(META)}, False),  # host to device
    ("aten::_to_copy", (torch.empty(2, device=META),), {"dtype": torch.half}, False),  # stays on the device
    ("aten::copy_", (torch.empty(2), torch.empty(2, device=META)), {}, True),
    ("aten::copy_", (torch.empty(2), torch.empty(2, device=META), True), {}, True),  # non-blocking into pageable
    ("aten::copy_", (torch.empty(2, device=META), torch.empty(2)), {}, True),  # blocking, host to device
    ("aten::copy_", (torch.empty(2, device=META), torch.empty(2), True), {}, False),
    ("aten::index", (torch.empty(4, device=META), [torch.ones(4, dtype=torch.bool, device=META)]), {}, True),
    ("aten::index", (torch.empty(4, device=META), [torch.arange(2, device=META)]), {}, False),
    ("aten::index", (torch.empty(4, device=META), [torch.ones(4, dtype=torch.bool)]), {}, False),  # a host mask
    ("aten::index_put_", (torch.empty(4, device=META), [torch.ones(4, dtype=torch.bool, device=META)],
                          torch.tensor(1.0)), {}, False),  # a masked_fill
    ("aten::index_put_", (torch.empty(4, device=META), [torch.ones(4, dtype=torch.bool, device=META)],
                          torch.ones(4, device=META)), {}, True),
    ("aten::repeat_interleave", (torch.ones(3, dtype=torch.long, device=META),), {}, True),
    ("aten::repeat_interleave", (torch.ones(3, dtype=torch.long, device=META),), {"output_size": 3}, False),
    ("aten::histc", (torch.empty(4, device=META), 10), {}, True),
    ("aten::histc", (torch.empty(4, device=META), 10, 0.0, 1.0), {}, False),
    ("aten::_local_scalar_dense", (torch.empty(1, device=META),), {}, True),
])
def test_the_table_rules_on_a_device_other_than_the_host(op, args, kwargs, syncs):
    assert OPS[op].applies(args, kwargs, META) is syncs


def test_under_virtual_streams_only_method_calls_copy_to_the_host():
    """Every CPU tensor is on the virtual device: copy ops between them never reach the host."""
    assert not OPS["aten::_to_copy"].applies((torch.empty(2),), {"device": torch.device("cpu")}, "cpu")
    assert not OPS["aten::copy_"].applies((torch.empty(2), torch.empty(2)), {}, "cpu")
    assert METHODS["numpy"].applies((), {"force": True}, "cpu") and not METHODS["numpy"].applies((), {}, "cpu")
    assert all(name for name in [s.name for s in OPS.values()] + [s.name for s in METHODS.values()])
