"""The race corpus on real streams (cuda backend), and the same file under PyTorch's own sanitizer
(`TORCH_CUDA_SANITIZER=1`, without the plugin): each case's verdict against the one it carries."""

import re

import pytest
from gpu_support import PYTEST, ROOT, counts, junit_outcomes, run

CLAIMS = {
    1: "The race corpus (13 races, 13 clean twins), cuda backend",
    2: "The same corpus under PyTorch's sanitizer (`TORCH_CUDA_SANITIZER=1`)",
}
CORPUS = ROOT / "tests" / "corpus" / "corpus_cases.py"
# what the sanitizer cannot see: it keys accesses by data pointer, and knows no collective's wait or allocator reuse
SANITIZER_MISSES = {"test_overlapping_views_at_other_offsets",
                    "test_multi_producer_bucket_reduction_waits_on_one_producer",
                    "test_async_collective_output_read_before_wait", "test_free_while_another_stream_reads"}

pytestmark = pytest.mark.gpu


def expected() -> dict[str, str]:
    source = CORPUS.read_text(encoding="utf-8")
    return {name: verdict for verdict, name in re.findall(r"^@(race|clean)\ndef (test_\w+)", source, re.M)}


@pytest.mark.validates(1)
def test_corpus_on_the_cuda_backend_gets_every_verdict_right(tmp_path, gpu_result):
    done = run([*PYTEST, str(CORPUS), "--streamrace", "--streamrace-backend=cuda", "-q",
                "--junitxml", str(tmp_path / "ours.xml")], timeout=600)
    want, got = expected(), junit_outcomes(tmp_path / "ours.xml")
    wrong = sorted(name for name in want if got.get(name, ("missing",))[0] != "passed")  # a case passes on its verdict
    gpu_result.record("right", f"{len(want) - len(wrong)}/{len(want)}")
    assert len(want) == 26 and wrong == [], done.stdout[-3000:]
    assert counts(done.stdout) == {"passed": 26}


@pytest.mark.validates(2)
def test_the_sanitizer_misses_the_cases_it_cannot_key(tmp_path, gpu_result):
    done = run([*PYTEST, str(CORPUS), "-q", "--junitxml", str(tmp_path / "sanitizer.xml")], timeout=600,
               env={"TORCH_CUDA_SANITIZER": "1"})
    want, got = expected(), junit_outcomes(tmp_path / "sanitizer.xml")
    wrong = set()
    for name, verdict in want.items():
        outcome, message = got.get(name, ("missing", ""))
        seen = {"passed": "clean", "failed": "race" if re.search(r"CUDASanitizer|data race", message, re.I)
                else "error"}.get(outcome, outcome)
        if seen != verdict:
            wrong.add(name)
    gpu_result.record("right", f"{len(want) - len(wrong)}/{len(want)}")
    gpu_result.record("missed", sorted(name[5:] for name in wrong))
    assert wrong == SANITIZER_MISSES, done.stdout[-3000:]
