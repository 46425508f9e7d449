"""Held out on one GPU: torch's own pinned-memory and `non_blocking` tests (`test/test_cuda.py`,
`test/test_dataloader.py`; not in the wheel: carried under .gpu/torch-tests/ with a one-line COMMIT file naming where
they came from), plain and under `--streamrace --streamrace-backend=cuda`, compared test by test
(scripts/stock/torch_multi_threaded_pg.py): the same outcomes, 0 races."""

import re

import pytest
from gpu_support import PYTHON, ROOT, framework_env, out_log, run

CLAIMS = {
    60: "Held out, torch's own pinned-memory tests on real streams: `test_dataloader.py`'s `pin_memory` tests (pin "
        "thread, workers, custom pinning), and `test_cuda.py`'s pinned-memory, host-allocator, `non_blocking` and "
        "`record_stream` tests where a copy that imports on the host's torch is carried: the same outcomes plain and "
        "under `--streamrace`, 0 races",
}

FOLDER = ROOT / ".gpu" / "torch-tests"
FILES = ["test_cuda.py", "test_dataloader.py"]
# by name: pinned memory and non_blocking copies; and test_dataloader.py's tests that pin when CUDA is available
SELECT = ("pin_memory or pinned or _pin or non_blocking or host_alloc or record_stream or partial_workers or "
          "dataset_not_reset or namedtuple or bulk_loading or nested_tensor_multiprocessing")


@pytest.mark.gpu(count=1)
@pytest.mark.validates(60)
def test_torch_pinned_memory_tests_same_outcomes_plain_and_under_streamrace(request, gpu_result):
    files = [FOLDER / name for name in FILES if (FOLDER / name).is_file()]
    if not files or not (FOLDER / "COMMIT").is_file():
        pytest.skip(f"torch's tests are not carried: put {' and '.join(FILES)} and a one-line COMMIT file in {FOLDER}")
    gpu_result.record("source", "; ".join((FOLDER / "COMMIT").read_text().split("\n")).strip("; "))
    gpu_result.record("files", [f.name for f in files])
    # torch's test utilities import expecttest, which setup.sh installs under the sites' common/
    done = run([PYTHON, str(ROOT / "scripts" / "stock" / "torch_multi_threaded_pg.py"), "--backend", "cuda",
                *map(str, files), "--", "-k", SELECT, "--continue-on-collection-errors"], timeout=1800, cwd=FOLDER,
               log=out_log("torch-pinned-tests"), env=framework_env(request.config))
    totals = dict(re.findall(r"^\s*(plain|--streamrace): (.*) \(\d+ s\)$", done.stdout, re.M))
    gpu_result.record("plain", totals.get("plain"))
    gpu_result.record("--streamrace", totals.get("--streamrace"))
    differ = re.findall(r"^DIFFERS (.*)$", done.stdout, re.M)
    found = re.findall(r"^RACE \[.*?\] (.*)$", done.stdout, re.M)
    gpu_result.record("outcomes that differ", len(differ))
    gpu_result.record("races", len(found))
    assert "passed" in totals.get("plain", ""), f"no test of the selection ran:\n{done.stdout[-4000:]}"
    assert done.returncode == 0, done.stdout[-6000:]
