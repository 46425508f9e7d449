"""The host as a party, on the virtual backend: pinned memory and non_blocking copies (stacks/stack_pinned_memory.py)
through pytest as users run it, with the C++ capture and with the pure-Python fallback, and the clean twins under
``--streamrace-latent=fail`` (no clean twin rests on an ordering the program did not ask for). test_stacks.py runs the
same file in the default mode; tests/gpu/test_host_party_gpu.py on real streams."""

import json
from pathlib import Path

import pytest
from test_stacks import racy_twins, tagged

STACK = Path(__file__).parent / "stacks" / "stack_pinned_memory.py"


@pytest.mark.parametrize("mode", ["fallback", "latent-fail", "no-register-helpers"])
def test_pinned_memory_twins(pytester, monkeypatch, mode):
    """no-register-helpers: a torch without ``torch.cuda._pin_memory_utils`` (2.4; DCP's cudaHostRegister helpers),
    whose model is then left out: the session starts and the twins give the same verdicts."""
    source = STACK.read_text()
    module = pytester.makepyfile(**{STACK.stem: source})
    args = ["--streamrace", "--streamrace-backend=virtual", "--streamrace-json", "races.json", "-p", "no:cacheprovider",
            "-rA", str(module)]
    if mode == "fallback":
        monkeypatch.setenv("STREAMRACE_NATIVE", "0")
    elif mode == "latent-fail":
        args.append("--streamrace-latent=fail")
    else:
        pytester.makeconftest("import sys\n\nsys.modules['torch.cuda._pin_memory_utils'] = None  # import fails\n")
    result = pytester.runpytest_subprocess(*args)
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == outcomes.get("error", 0) == 0, result.stdout.str()
    assert outcomes["passed"] >= 13
    races = json.loads((pytester.path / "races.json").read_text())["races"]
    tags = tagged(source)
    for test in racy_twins(source):
        mine = [r for r in races if r["test"].split("[")[0].endswith("::" + test)]
        lines = {f["line"] for race in mine for access in (race["earlier"], race["later"]) for f in access["frames"]
                 if Path(f["file"]).name == module.name}
        assert lines & tags[test], f"{test}: no race at its tagged line; races:\n" + "\n".join(map(json.dumps, mine))
        assert any(race["later"]["stream"] == "the host" for race in mine), mine  # it reads early or writes late
    clean = {r["test"] for r in races if r["test"].split("::")[-1].split("[")[0] not in racy_twins(source)}
    assert clean == set(), clean


def test_a_race_with_the_host_says_how_the_host_waits(pytester):
    pytester.makepyfile(test_host="""
        import torch

        def test_read_early(streamrace_device):
            host = torch.empty(256, pin_memory=True)
            host.copy_(torch.randn(256, device=streamrace_device), non_blocking=True)
            host.sum()
    """)
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*read-after-write*", "*earlier*write*aten::copy_*on default stream*",
                                 "*later*read*aten::sum*on the host*",
                                 "*make the host wait for 'default stream'*"])


def test_pinned_memory_works_under_the_virtual_backend_only(pytester):
    """CPU-only torch has no pinned allocator: under the virtual backend pinning works (and stays host memory);
    without the plugin's session it raises as torch does."""
    pytester.makepyfile(test_pin="""
        import pytest, torch

        def test_pin(request):
            if request.config.getoption("streamrace"):
                t = torch.zeros(8, pin_memory=True)
                assert t.is_pinned() and torch.ones(8).pin_memory().is_pinned()
                assert not torch.ones(8).is_pinned()
            elif not torch.cuda.is_available():
                with pytest.raises(RuntimeError):
                    torch.zeros(8, pin_memory=True)
    """)
    for args in (["--streamrace", "--streamrace-backend=virtual"], []):
        pytester.runpytest_subprocess(*args, "-p", "no:cacheprovider").assert_outcomes(passed=1)


CONFIRMED = ("test_device_to_host_read_before_sync", "test_side_stream_copy_read_after_syncing_the_default_stream",
             "test_staging_buffer_rewritten_while_a_copy_may_read_it", "test_prefetcher_without_events",
             "test_pinned_buffer_given_back_during_a_copy_and_handed_out_again", "test_device_to_host_numpy_before_sync")


def confirm_host_races(pytester, backend: str) -> dict:
    """The stack's host races under --streamrace-confirm on `backend`: each forced (the copy's write held back from
    the host's read, or the copy's read held back past the host's rewrite) and confirmed with the values the host
    read or the copy carried, a host read that runs no op (.numpy()) too: it takes a place on its thread as an op
    does. Returns each race's confirmation by test."""
    module = pytester.makepyfile(**{STACK.stem: STACK.read_text()})
    result = pytester.runpytest_subprocess(str(module), "--streamrace", f"--streamrace-backend={backend}",
                                           "--streamrace-confirm", "--streamrace-json", "races.json",
                                           "-p", "no:cacheprovider", "-k", " or ".join(CONFIRMED))
    result.assert_outcomes(passed=len(CONFIRMED))
    out = result.stdout.str()
    for test in CONFIRMED:
        assert f"{test}: confirmed:" in out, out
    assert f"streamrace confirmations: {len(CONFIRMED)} confirmed, 0 not confirmed, 0 not tried" in out
    races = json.loads((pytester.path / "races.json").read_text())["races"]
    found = {r["test"].rsplit("::", 1)[-1]: r["confirmation"] for r in races
             if r.get("confirmation", {}).get("status") == "confirmed"}
    for test, confirmation in found.items():
        assert confirmation["differing"] > 0 and confirmation["backend"] == backend, (test, confirmation)
    return found


def test_host_races_are_confirmed(pytester):
    confirm_host_races(pytester, "virtual")


def test_torchscript_compiles_the_factories_the_virtual_backend_wraps(pytester):
    """Under the virtual backend torch's factories take pin_memory=True through a wrapper; TorchScript, which
    compiles a call to torch.zeros by the function's identity, still sees the op (PyTorch's distributed test base
    scripts such functions in its tests)."""
    pytester.makepyfile(test_script="""
        import torch

        def test_script(streamrace_device):
            @torch.jit.script
            def make(n: int):
                return torch.zeros(n) + torch.ones(n)

            assert make(3).tolist() == [1.0, 1.0, 1.0]
    """)
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


BLOCKING_COPY_TO_THE_DEVICE = """
import pytest
import torch


def _copied_then_read_on_a_side_stream(device, non_blocking):
    pinned = torch.randn(4096, pin_memory=True)
    on_device = torch.empty(4096, device=device)
    on_device.copy_(pinned, non_blocking=non_blocking)  # copy
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        on_device.mul_(2)  # side
    torch.cuda.current_stream().wait_stream(side)


def test_blocking(streamrace_device):
    _copied_then_read_on_a_side_stream(streamrace_device, non_blocking=False)


def test_blocking_to(streamrace_device):
    on_device = torch.randn(4096, pin_memory=True).to(streamrace_device)  # copy
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        on_device.mul_(2)  # side
    torch.cuda.current_stream().wait_stream(side)


def test_non_blocking(streamrace_device):
    _copied_then_read_on_a_side_stream(streamrace_device, non_blocking=True)
"""


@pytest.mark.parametrize("latent", ["report", "fail"])
def test_a_blocking_copy_from_pinned_memory_to_the_device_waits_for_its_stream(pytester, latent):
    """torch synchronizes a blocking copy's stream after a copy between host and device, either way: work issued
    after a blocking copy from pinned memory is ordered after it, as a read-back orders it (latent: an ordering the
    program did not ask for), as on a GPU, where the GPU trace reports that sync; a non_blocking copy orders nothing."""
    pytester.makepyfile(test_copies=BLOCKING_COPY_TO_THE_DEVICE)
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual", "-p", "no:cacheprovider",
                                           f"--streamrace-latent={latent}", "--streamrace-json", "races.json")
    if latent == "report":
        result.assert_outcomes(passed=2, failed=1)
    else:
        result.assert_outcomes(failed=3)
    races = json.loads((pytester.path / "races.json").read_text())["races"]
    by_test = {r["test"].split("::")[-1]: r for r in races}
    assert sorted(by_test) == ["test_blocking", "test_blocking_to", "test_non_blocking"], races
    for name in ("test_blocking", "test_blocking_to"):
        assert by_test[name]["latent"]["op"] == "copy_ to or from host memory", by_test[name]
    assert not by_test["test_non_blocking"].get("latent")
    assert {by_test[t]["earlier"]["op"] for t in by_test} == {"aten::copy_"}
