"""This project's own test files on a GPU host, each in a pytest of its own as a developer runs it: the launcher and
torchrun sessions on NCCL, the cuda backend's unit tests with the C++ capture built against the host's torch, and
the files whose GPU items re-create a row (DCP's async staging, `streamrace run`, the device-generic API)."""

from pathlib import Path

import pytest
from gpu_support import PYTEST, PYTHON, counts, framework_env, out_log, run

CLAIMS = {
    20: "The launcher and torchrun sessions on NCCL (one GPU a rank, failures on any rank reported)",
    21: "The cuda backend's own tests, and the C++ capture built against the GPU host's torch",
    31: "torch DCP's async staging (`DefaultStager`, pinned, non-blocking), cuda backend: staging right after the "
        "step reported; the next step issued before staging completes reported; the one-line fix clean; "
        "synchronize, stage, wait, step clean under `--streamrace-latent=fail`",
    32: "`streamrace run` on the cuda backend: a racy script exits 3 with its race, the clean twin exits 0",
    33: "The thread model's unit tests on a GPU host (cores, capture, virtual and cuda backends, thread twins, "
        "differential test of both cores)",
    34: "torch's device-generic API (`torch.Stream`, `torch.Event`, `torch.accelerator`) on the cuda backend: 17 "
        "racy and clean twins under `--streamrace-latent=fail`",
}


def _suite(gpu_result, *args: str, env: dict | None = None, workers: int = 0) -> dict[str, int]:
    """The files' session, each test's outcome in its log under $OUT/logs as it comes (where OUT is set), and the
    stacks of a test still running after 5 minutes (faulthandler), so that a stopped or timed-out run says where."""
    log = out_log("-".join(Path(a).stem for a in args if a.startswith("tests/"))[:80] or "suite")
    done = run([*PYTEST, "-n", str(workers), "-v", "-o", "faulthandler_timeout=300", *args], timeout=1200, env=env,
               log=log)
    got = counts(done.stdout)
    gpu_result.record("outcomes", ", ".join(f"{n} {k}" for k, n in got.items() if k != "deselected"))
    assert got.get("passed") and not (got.get("failed") or got.get("error")), done.stdout[-4000:]
    return got


@pytest.mark.gpu(count=2)
@pytest.mark.validates(20)
def test_launcher_and_torchrun_sessions_on_nccl(gpu_result):
    _suite(gpu_result, "tests/test_launcher_gpu.py", "tests/test_torchrun.py")


@pytest.mark.gpu
@pytest.mark.validates(21, 33)
def test_cuda_and_thread_model_unit_tests_with_the_capture_built_here(gpu_result, request):
    """Row 21's files (virtual, cuda backend, capture) are part of row 33's: one session serves both, in 4 xdist
    workers as CI runs them in 2 (one process took over 10 minutes beside other GPU checks). The thread rank twins
    import torch's test utilities, which need expecttest (a carried wheel on a GPU host)."""
    built = run([PYTHON, "-c", "from pytest_streamrace.detector import capture as c; e = c.load(); "
                 "print('built:', e is not None, c.failure() if e is None else '')"], timeout=600)
    assert "built: True" in built.stdout, built.stdout[-3000:]
    _suite(gpu_result, "tests/test_virtual.py", "tests/test_cuda_backend.py", "tests/test_capture.py",
           "tests/test_hb.py", "tests/test_thread_handoffs.py", "tests/test_threads.py",
           "tests/test_hb_differential.py", env=framework_env(request.config, expecttest=None), workers=4)


@pytest.mark.gpu
@pytest.mark.validates(31)
def test_dcp_async_staging_orders_on_the_cuda_backend(gpu_result):
    _suite(gpu_result, "-m", "gpu", "tests/test_repro_dcp.py", "-k", "orders")


@pytest.mark.gpu
@pytest.mark.validates(32)
def test_streamrace_run_on_the_cuda_backend(gpu_result):
    _suite(gpu_result, "-m", "gpu", "tests/test_run_command.py")


@pytest.mark.gpu
@pytest.mark.validates(34)
def test_device_generic_api_on_the_cuda_backend(gpu_result):
    _suite(gpu_result, "-m", "gpu", "tests/test_device_generic.py")
