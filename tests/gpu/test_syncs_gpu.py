"""Functional collectives compiled with Inductor's comm reordering on NCCL, values read back to the host, and user
threads, each on real streams (cuda backend): racy twins caught, clean twins clean."""

import importlib.util
import re

import pytest
from gpu_support import PYTEST, ROOT, counts, races, run

CLAIMS = {
    7: "Compiled functional collectives on NCCL; values read back to the host (`.item()`, `.cpu()`, `nonzero`, ...); "
       "threads on real streams",
}

pytestmark = [pytest.mark.gpu, pytest.mark.validates(7)]


def outcomes(output: str) -> dict[str, str]:
    """-rA's lines: test name (with its parameters) -> PASSED | FAILED | ERROR."""
    return {name: outcome for outcome, name in re.findall(r"^(PASSED|FAILED|ERROR) \S+?::(\S+)", output, re.M)}


def check_twins(output: str, racy: re.Pattern) -> tuple[int, int]:
    got = outcomes(output)
    assert got, output[-3000:]
    wrong = {n: o for n, o in got.items() if o != ("FAILED" if racy.search(n) else "PASSED")}
    assert wrong == {}, output[-4000:]
    caught = sum(1 for n in got if racy.search(n))
    return len(got) - caught, caught


def test_compiled_functional_collectives(tmp_path, gpu_result):
    done = run([*PYTEST, str(ROOT / "tests" / "compile" / "funcol_cuda_cases.py"), "--streamrace",
                "--streamrace-backend=cuda", "-rA", "--streamrace-json", str(tmp_path / "races.json")], timeout=600)
    clean, racy = check_twins(done.stdout, re.compile(r"test_racy_"))
    found = races(tmp_path / "races.json")
    assert {r["test"].split("::")[-1] for r in found} == {n for n in outcomes(done.stdout) if "racy" in n}, found
    gpu_result.record("collectives", f"{clean} clean passed, {racy} racy caught ({len(found)} races)")


def test_host_read_backs(gpu_result):
    done = run([*PYTEST, str(ROOT / "tests" / "gpu" / "host_sync_cases.py"), "--streamrace",
                "--streamrace-backend=cuda", "-rA"], timeout=600)
    clean, racy = check_twins(done.stdout, re.compile(r"test_racy_"))
    gpu_result.record("read-backs", f"{clean} clean passed, {racy} racy caught")


def test_user_threads(tmp_path, gpu_result):
    spec = importlib.util.spec_from_file_location("thread_cases", ROOT / "tests" / "test_threads.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (tmp_path / "test_user_threads_cuda.py").write_text(module.USER_THREADS)
    done = run([*PYTEST, "test_user_threads_cuda.py", "--streamrace", "--streamrace-backend=cuda", "-rA"],
               timeout=600, cwd=tmp_path)
    racy_names = re.compile(r"without_stream_wait|started_before_the_test|serves_a_later_test")
    clean, racy = check_twins(done.stdout, racy_names)
    gpu_result.record("threads", f"{clean} passed, {racy} failed, each as expected")
    assert counts(done.stdout).get("failed") == racy
