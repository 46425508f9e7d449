"""Rank processes that other harnesses start, on NCCL (cuda backend, one GPU a rank): PyTorch's MultiProcessTestCase
and torch.multiprocessing.spawn (tests/gpu/harness_cases.py), and DeepSpeed's own ZeRO tests (held out: code none of
us wrote), each run plain and under `--streamrace`, outcomes compared test by test; and the race found in DeepSpeed's
own test confirmed there under `--streamrace-confirm`."""

import os
import re
import shutil
import time
from pathlib import Path

import pytest
from gpu_support import PYTEST, ROOT, counts, framework_env, junit_outcomes, out_log, races, run

CLAIMS = {
    9: "Rank processes started by other harnesses (`MultiProcessTestCase`, `torch.multiprocessing.spawn`) on NCCL",
    12: "Held out, DeepSpeed's own ZeRO tests on NCCL",
    50: "`--streamrace-confirm` on a race in the rank processes another harness starts: in DeepSpeed 0.19.8's own "
        "`test_zero.py::TestZeroToFP32::test_2_param_groups[*-3]` (its `DistributedTest`, 2 ranks, NCCL), the ZeRO-3 "
        "parameter gather's read-after-write on the partition is confirmed",
    52: "`--streamrace-confirm` on NCCL ranks started by `MultiProcessTestCase` and `torch.multiprocessing.spawn`: "
        "each racy twin's race confirmed on both ranks, the clean twins not re-run",
}

pytestmark = pytest.mark.gpu(count=2)


@pytest.mark.validates(9)
def test_multiprocess_test_case_and_spawn_racy_twins_fail_only_under_streamrace(request, gpu_result):
    env = framework_env(request.config, expecttest=None)
    cases = str(ROOT / "tests" / "gpu" / "harness_cases.py")
    plain = run([*PYTEST, cases, "-n", "0", "-rA"], timeout=600, env=env)
    assert counts(plain.stdout) == {"passed": 4}, plain.stdout[-4000:]  # the races are silent
    checked = run([*PYTEST, cases, "-n", "0", "-rA", "--streamrace"], timeout=600, env=env)
    assert counts(checked.stdout) == {"passed": 2, "failed": 2}, checked.stdout[-4000:]
    failed = sorted(line.split("::")[-1].split(" ")[0] for line in checked.stdout.splitlines()
                    if line.startswith("FAILED "))
    assert failed == ["test_racy", "test_spawn_racy"], checked.stdout[-4000:]
    assert "stream race on ranks 0, 1: read-after-write" in checked.stdout
    gpu_result.record("plain", "4 passed")
    gpu_result.record("--streamrace", "2 clean passed, 2 racy failed")


@pytest.mark.validates(52)
def test_multiprocess_test_case_and_spawn_racy_twins_are_confirmed(request, tmp_path, gpu_result):
    env = framework_env(request.config, expecttest=None)
    cases = str(ROOT / "tests" / "gpu" / "harness_cases.py")
    done = run([*PYTEST, cases, "-n", "0", "-rA", "--streamrace", "--streamrace-confirm", "--streamrace-json",
                str(tmp_path / "races.json")], timeout=600, env=env)
    assert counts(done.stdout) == {"passed": 2, "failed": 2}, done.stdout[-4000:]
    found = races(tmp_path / "races.json")
    by_test: dict = {}
    for race in found:
        by_test.setdefault(race["test"].split("::")[-1], []).append(race["confirmation"])
    gpu_result.record("verdicts", {name: sorted(c["status"] for c in found) for name, found in by_test.items()})
    assert sorted(by_test) == ["test_racy", "test_spawn_racy"], sorted(by_test)  # the clean twins had none
    assert all(c["status"] == "confirmed" for found in by_test.values() for c in found), by_test
    best = max((c for found in by_test.values() for c in found), key=lambda c: c.get("max_abs_diff", 0.0))
    gpu_result.record("max |Δ|", best.get("max_abs_diff"))  # x read as 2 for 4
    gpu_result.record("elements", f'{best.get("differing")} of {best.get("elements")}')
    gpu_result.record("confirmation seconds", {name: found[0].get("test_seconds") for name, found in by_test.items()})


def _deepspeed_tests(config, gpu_result) -> Path:
    """DeepSpeed's tests/ folder; the commit it came from is recorded where a COMMIT file beside it names it."""
    tests = Path(config.getoption("deepspeed_tests", default=".gpu/ds-tests/tests"))
    tests = tests if tests.is_absolute() else ROOT / tests
    if not (tests / "unit").is_dir():
        pytest.skip(f"DeepSpeed's own tests are not under {tests} (its repository's tests/ folder; --deepspeed-tests)")
    commit = tests.parent / "COMMIT"
    if commit.is_file():
        gpu_result.record("DeepSpeed's tests from", commit.read_text().strip())
    return tests


def _both_ways(tmp_path, tests: Path, env, name, *args) -> tuple[dict, dict, list]:
    """The selection plain and under --streamrace: outcomes by test each way, and the races found."""
    env = {**env, "OMP_NUM_THREADS": "4"}
    first = run([*PYTEST, *args, "-q", "--junitxml", str(tmp_path / f"{name}-plain.xml")], timeout=600, env=env,
                cwd=tests)
    second = run([*PYTEST, *args, "-q", "--streamrace", "--junitxml", str(tmp_path / f"{name}-streamrace.xml"),
                  "--streamrace-json", str(tmp_path / f"{name}-races.json")], timeout=600, env=env, cwd=tests)
    plain = {k: v[0] for k, v in junit_outcomes(tmp_path / f"{name}-plain.xml", qualified=True).items()}
    checked = {k: v[0] for k, v in junit_outcomes(tmp_path / f"{name}-streamrace.xml", qualified=True).items()}
    assert plain and checked, first.stdout[-3000:] + second.stdout[-3000:]
    kept = out_log(f"{name}-{re.sub(r'[^A-Za-z0-9]+', '_', args[-1])[:40]}-races", ".json")  # beside the logs
    if kept and (tmp_path / f"{name}-races.json").is_file():
        os.makedirs(os.path.dirname(kept), exist_ok=True)
        shutil.copy(tmp_path / f"{name}-races.json", kept)
    return plain, checked, races(tmp_path / f"{name}-races.json")


@pytest.mark.validates(12)
def test_deepspeed_coalesce_tests_the_same_both_ways_without_a_race(request, tmp_path, gpu_result):
    env = framework_env(request.config, deepspeed="0.19.8")
    tests = _deepspeed_tests(request.config, gpu_result)
    plain, checked, found = _both_ways(
        tmp_path, tests, env, "coalesce", "unit/v1/zero/test_zero_coalesce_grad_reduction.py",
        "-k", "TestCoalesceCorrectness or TestCoalesceFP16 or TestCoalesceCollectiveCount")
    gpu_result.record("test_zero_coalesce_grad_reduction.py", f"{sum(o == 'passed' for o in plain.values())} passed "
                      f"plain, {sum(o == 'passed' for o in checked.values())} under --streamrace, {len(found)} races")
    gpu_result.record("deepspeed", "0.19.8")
    assert plain == checked and found == []


@pytest.mark.validates(12)
def test_a_race_planted_in_a_deepspeed_distributed_test_is_caught_in_its_own_test(request, gpu_result):
    env = framework_env(request.config, deepspeed="0.19.8")
    tests = _deepspeed_tests(request.config, gpu_result)
    planted = tests / "unit" / "test_streamrace_planted.py"
    shutil.copy(ROOT / "tests" / "gpu" / "ds_planted_race.py", planted)
    try:
        done = run([*PYTEST, "unit/test_streamrace_planted.py", "-rA", "--streamrace"], timeout=600,
                   env={**env, "OMP_NUM_THREADS": "4"}, cwd=tests)
    finally:
        planted.unlink()
    assert counts(done.stdout) == {"passed": 1, "failed": 1}, done.stdout[-4000:]
    assert "FAILED unit/test_streamrace_planted.py::TestPlantedRace::test_b_racy" in done.stdout
    gpu_result.record("planted race", "the clean test passed, the racy one failed")


# 20 of test_zero.py's 99 tests (each starts fresh rank processes, ~10 s a test), in two items of ~5 minutes
ZERO_CLASSES = ["TestZeroUnbalancedGradients or TestZero3RepeatForwardLoop or TestZeroToFP32",
                "TestPartitionNcclAlignment or TestZeroFrozenWeights or TestZero3DictFwd"]


@pytest.mark.validates(12)
@pytest.mark.parametrize("classes", ZERO_CLASSES, ids=["to_fp32", "others"])
def test_deepspeed_zero_tests_differ_only_where_zero3_gathers_too_early(request, tmp_path, classes, gpu_result):
    env = framework_env(request.config, deepspeed="0.19.8")
    tests = _deepspeed_tests(request.config, gpu_result)
    plain, checked, found = _both_ways(tmp_path, tests, env, "zero", "unit/v1/zero/test_zero.py", "-k", classes)
    differ = sorted(name.split("::")[-1] for name in plain if checked.get(name) != plain[name])
    gpu_result.record("test_zero.py", f"{len(plain) - len(differ)} of {len(plain)} the same both ways")
    gpu_result.record("differ", differ)
    gpu_result.record("deepspeed", "0.19.8")
    raced = sorted({r["test"].split("::")[-1] for r in found})
    gpu_result.record("races in", raced)
    # what differs is ZeRO-3 tests failing on races, and every race is the gather's (a new race or a false report
    # would show here as another kind or place)
    assert differ == raced and all(name.endswith("-3]") for name in differ), (differ, raced)
    assert all(_zero3_gather(r) for r in found), [(r["test"], r.get("kind"), r.get("earlier")) for r in found]


def _zero3_gather(race: dict) -> bool:
    """The race of docs/upstream/zero3-param-gather.md: the step's copy into the partition (stage3.py), then the
    next forward's all-gather reading it."""
    frames = race.get("earlier", {}).get("frames") or []
    return race.get("kind") == "read-after-write" and any(f["file"].endswith("runtime/zero/stage3.py")
                                                          for f in frames)


@pytest.mark.validates(50)
def test_the_zero3_gather_race_in_deepspeed_s_own_test_is_confirmed(request, tmp_path, gpu_result):
    env = framework_env(request.config, deepspeed="0.19.8")
    tests = _deepspeed_tests(request.config, gpu_result)
    started = time.perf_counter()
    done = run([*PYTEST, "unit/v1/zero/test_zero.py", "-k", "TestZeroToFP32 and test_2_param_groups", "-q", "-rA",
                "--streamrace", "--streamrace-confirm", "--streamrace-json", str(tmp_path / "races.json")],
               timeout=600, env={**env, "OMP_NUM_THREADS": "4"}, cwd=tests)
    seconds = round(time.perf_counter() - started, 1)
    found = [r for r in races(tmp_path / "races.json") if r["test"].endswith("-3]") and _zero3_gather(r)]
    assert found, done.stdout[-4000:]
    confirmed = [r["confirmation"] for r in found if r["confirmation"]["status"] == "confirmed"]
    gpu_result.record("verdicts", sorted({f'{r["test"].split("::")[-1]} rank {r.get("rank")}: '
                                          f'{r["confirmation"]["status"]}' for r in found}))
    gpu_result.record("deepspeed", "0.19.8")
    gpu_result.record("test seconds", seconds)
    assert confirmed, [(r["test"], r["confirmation"]) for r in found]
    best = max(confirmed, key=lambda c: c.get("max_abs_diff", 0.0))
    gpu_result.record("max |Δ|", best.get("max_abs_diff"))
    gpu_result.record("elements", f'{best.get("differing")} of {best.get("elements")}')
    gpu_result.record("confirmation seconds", best.get("test_seconds"))
