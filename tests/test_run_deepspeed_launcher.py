"""`streamrace run` on a launcher nobody here wrote, on CPU: a DeepSpeed ZeRO-3 script started by the `deepspeed`
launcher (2 ranks, gloo, virtual streams), racy and stock, as tests/gpu/test_run_trainers.py runs it on 2 GPUs."""

from __future__ import annotations

import importlib.util

import pytest
import trainer_jobs as jobs
from test_subprocesses import tmpdir_marker  # noqa: F401  (a fixture: no process of a run is left behind)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")

CPU = {"CUDA_VISIBLE_DEVICES": ""}
SMALL = ("--width", "16", "--steps", "3")


def _zero3(tmp_path, *script_args):
    path = tmp_path / "races.json"
    command = [*jobs.STREAMRACE_RUN, "--backend", "virtual", "--json", path, "--", *jobs.zero3_command(*script_args)]
    out = jobs.run(command, tmp_path, jobs.environ(**CPU), timeout=600)
    return out, jobs.races(path), jobs.account(out, path)


def test_zero3_under_the_deepspeed_launcher_reports_the_gather_race(tmp_path, tmpdir_marker):  # noqa: F811
    """Accumulation 2, the throughput timer unsynchronized: the step's copy into the partitions and the next
    all-gather's read, unordered on both ranks (docs/upstream/zero3-param-gather.md)."""
    out, found, said = _zero3(tmp_path, *SMALL, "--accumulation", "2", "--unsynchronized-timer")
    assert out.returncode == 3, said
    races = [r for r in found if not r.get("latent")]
    assert races and all(jobs.zero3_gather_race(r) for r in races), said  # that pair, and no other race
    assert {r["rank"] for r in races} == {0, 1} and {r["kind"] for r in races} == {"read-after-write"}, said
    assert "stream race on ranks 0, 1: read-after-write" in out.stderr, said
    assert "Python processes followed (ranks 0, 1)" in out.stderr, said  # the launcher and its two ranks
    assert "step 3 loss" in out.stdout, said  # the program's own output, its own


def test_its_stock_configuration_reports_the_gather_as_latent(tmp_path, tmpdir_marker):  # noqa: F811
    """Accumulation 1 and DeepSpeed's default timers: the same pair, ordered only by the module-trace check's
    `.cpu()`: exit 0, latent on both ranks."""
    out, found, said = _zero3(tmp_path, *SMALL)
    assert out.returncode == 0, said
    assert found and all(jobs.zero3_gather_race(r) and r.get("latent") for r in found), said
    assert {r["rank"] for r in found} == {0, 1}, said
    assert {r["latent"]["op"] for r in found} == {".cpu()"}, said
    assert all(r["latent"]["frames"][0]["file"].endswith("deepspeed/runtime/zero/utils.py") for r in found), said
