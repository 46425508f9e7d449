"""Compiled code on real GPUs (cuda backend): each case of tests/compile/cuda_cases.py has a racy twin that must be
caught and a clean twin that must stay clean (each passes on its expected verdict)."""

import pytest
from gpu_support import PYTEST, ROOT, counts, junit_outcomes, run

CLAIMS = {
    6: "Compiled twins on real GPUs: Inductor Triton kernels (pointwise, max-autotune templates), a `triton_op` user "
       "kernel, compiled backward, compiled autograd, CUDA-graph replay, a compiled function's first call",
}


@pytest.mark.gpu
@pytest.mark.validates(6)
def test_compiled_twins_racy_caught_clean_clean(tmp_path, gpu_result):
    done = run([*PYTEST, str(ROOT / "tests" / "compile" / "cuda_cases.py"), "--streamrace",
                "--streamrace-backend=cuda", "-rA", "-q", "--junitxml", str(tmp_path / "ours.xml")], timeout=600)
    got = junit_outcomes(tmp_path / "ours.xml")
    racy = {n: o for n, (o, _) in got.items() if n.startswith("test_racy[")}
    clean = {n: o for n, (o, _) in got.items() if n.startswith("test_clean[")}
    gpu_result.record("racy caught", f"{sum(o == 'passed' for o in racy.values())}/{len(racy)}")
    gpu_result.record("clean clean", f"{sum(o == 'passed' for o in clean.values())}/{len(clean)}")
    assert racy and len(racy) == len(clean), done.stdout[-3000:]
    assert set(counts(done.stdout)) == {"passed"}, done.stdout[-4000:]
