"""The megatron_instances repro end to end on CPU (virtual streams, gloo) with whichever megatron-core is installed:
the CLI's verdicts and JSON evidence, and the shipped pytest items with their stream hints."""

import importlib.util

import pytest
from repro_cli import both_variants

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")

BUFFER = "megatron/core/distributed/param_and_grad_buffer.py"
DDP = "megatron/core/distributed/distributed_data_parallel.py"


def _functions(access: dict, file: str) -> set:
    return {f["function"] for f in access["frames"] if f["file"].endswith(file)}


def test_cli_verdicts_and_json_evidence(tmp_path):
    stdout, doc = both_variants("megatron_instances", tmp_path, confirm=True)
    # forced, the reduce-scatter reads the gradient buffer before the hook's accumulation: confirmed (the hook's and
    # the collective's writes of it leave the same values either way on this model, which the report says)
    confirmations = {r["variant"]: r for r in doc["runs"]}["unpatched"]["confirmations"]
    assert any(c["status"] == "confirmed" and c["kind"] == "read-after-write" for c in confirmations), confirmations
    assert "[unpatched] overlapped run: iteration 2/2" in stdout  # >= 2 iterations, progress while ranks run
    assert doc["backend"] == "virtual" and doc["framework"].startswith("megatron-core ") and doc["world_size"] == 2
    runs = {r["variant"]: r for r in doc["runs"]}
    assert runs["patched"]["races"] == [] and runs["patched"]["verdict"] == "clean"
    races = runs["unpatched"]["races"]
    assert {r["rank"] for r in races} == {0, 1}
    assert any(r["kind"] == "read-after-write" and r["later"]["op"].startswith("reduce_scatter") for r in races)
    for race in races:
        # the collective in start_grad_sync, on a communication stream, after a write on the hook stream made from
        # DDP's gradient hook: the bug, located inside megatron-core
        assert "start_grad_sync" in _functions(race["later"], BUFFER), race["later"]
        assert race["later"]["stream"].startswith("communication stream of process group")
        assert "hook" in _functions(race["earlier"], DDP), race["earlier"]
        assert race["earlier"]["stream"] == "hook stream (streamrace forcing)"
        assert race["tensor"]["name"] == "grad buffer 0 (main_grad)"


def test_shipped_items_pass_and_show_the_hook_stream_hint(pytester):
    result = pytester.runpytest_subprocess("--streamrace", "--pyargs", "pytest_streamrace.repros", "-k", "megatron",
                                           "-p", "no:cacheprovider", "-v", timeout=600)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([
        "*test_repro?megatron_instances-unpatched? PASSED*",
        "*test_repro?megatron_instances-patched? PASSED*",
        "*= streamrace hints =*",
        "*test_repro?megatron_instances-unpatched?: AccumulateGrad on hook stream (streamrace forcing), gradient "
        "from default stream (streamrace virtual model warning, ranks 0, 1)",
    ])
