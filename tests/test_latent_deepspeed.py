"""DeepSpeed 0.19.8 ZeRO-3's parameter gather after a step (docs/upstream/zero3-param-gather.md) in the stock
configuration — default timers, no gradient accumulation — as a latent race: today only host syncs order the next
all-gather after the step's copy into the partitions. On CPU (virtual streams, 2 gloo ranks) under
``pytest --streamrace``:

- by default the trace check's read-back (``.cpu()`` of ``assert_ints_same_as_other_ranks``) is what a latent report
  names; the throughput timer's ``torch.cuda.synchronize()`` orders the later steps, and it is explicit;
- with ``incidental-sync:deepspeed/utils/timer.py`` those steps are latent too, named after the timer's sync. A
  report is one per location pair, named after the first sync that hid it — the trace check's — so the timer's name
  shows where the trace check covers nothing: with gradient accumulation 2 (DeepSpeed's own test_2_param_groups
  configuration), whose first step is a real race and whose later steps only the timer orders.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")

STOCK = """
import os, pytest, torch
import deepspeed

pytestmark = pytest.mark.distributed(world_size=2)

def test_zero3_stock(streamrace_device, rank):
    from pytest_streamrace.frameworks.deepspeed_accelerator import deepspeed_on_virtual_streams

    with deepspeed_on_virtual_streams():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)]).to(streamrace_device)
        config = {"train_micro_batch_size_per_gpu": 4,
                  "gradient_accumulation_steps": int(os.environ.get("ACCUMULATION", "1")),
                  "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_param_persistence_threshold": 0},
                  "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30}
        engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                               optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        generator = torch.Generator(device=streamrace_device).manual_seed(1 + rank)
        for _ in range(6):  # micro-batches
            loss = engine(torch.randn(4, 16, device=streamrace_device, generator=generator)).pow(2).mean()
            engine.backward(loss)
            engine.step()
"""

COPY = ("stage3.py", "_reassign_or_swap_out_partitioned_parameters")
GATHER = ("partition_parameters.py", "_all_gather_dtype")


def _in(access: dict, where: tuple[str, str]) -> bool:
    return any(f["file"].endswith(where[0]) and f["function"] == where[1] for f in access["frames"])


def _gather_after_copy(race: dict) -> bool:
    return _in(race["earlier"], COPY) and _in(race["later"], GATHER)


def _run(pytester, *args):
    pytester.makepyfile(test_zero3=STOCK)
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual", "--streamrace-json",
                                           "races.json", "-p", "no:cacheprovider", "-rA", *args, timeout=600)
    return result, json.loads((pytester.path / "races.json").read_text())["races"]


def test_stock_zero3_gather_after_step_is_latent(pytester):
    result, races = _run(pytester)
    result.assert_outcomes(passed=1)
    assert not [r for r in races if not r.get("latent")], "no real race in the stock configuration"
    found = [r for r in races if _gather_after_copy(r)]
    assert found and {r["rank"] for r in found} == {0, 1}, races
    for race in found:
        assert race["kind"] == "read-after-write"
        assert race["earlier"]["frames"][0]["file"].endswith("deepspeed/runtime/zero/stage3.py")
        assert race["later"]["stream"] == "stream created at parameter_offload.py:195"
        assert race["latent"]["op"] == ".cpu()"  # the trace check's read-back
        assert any(f["function"] == "assert_ints_same_as_other_ranks" or f["file"].endswith("zero/utils.py")
                   for f in race["latent"]["frames"]), race["latent"]
    result, races = _run(pytester, "--streamrace-latent=fail")
    result.assert_outcomes(failed=1)
    assert "ordered today only by .cpu() at deepspeed/runtime/zero/utils.py:" in result.stdout.str()


def test_timer_sync_is_incidental_under_the_rule(pytester, monkeypatch):
    monkeypatch.setenv("ACCUMULATION", "2")
    pytester.path.joinpath("s.supp").write_text("incidental-sync:deepspeed/utils/timer.py\n")
    result, races = _run(pytester, "--streamrace-suppress", "s.supp", "--streamrace-report-only")
    result.assert_outcomes(passed=1)
    assert [r for r in races if not r.get("latent") and _gather_after_copy(r)], "the first step: a real race"
    timer = [r for r in races if r.get("latent") and _gather_after_copy(r)]
    assert timer and {r["rank"] for r in timer} == {0, 1}, races
    for race in timer:
        assert race["latent"]["op"] == "torch.cuda.synchronize() (incidental)"
        assert race["latent"]["at"].startswith("deepspeed/utils/timer.py:"), race["latent"]
