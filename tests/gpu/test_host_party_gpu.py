"""The host as a party on real streams: pinned memory and non_blocking copies (tests/stacks/stack_pinned_memory.py) on
one GPU, plain and under `--streamrace`, and the clean twins again under `--streamrace-latent=fail`."""

import importlib.util
import os

import pytest
import test_host_party
from gpu_support import stack_twins

CLAIMS = {
    55: "The host as a party on real streams: a device-to-host copy read before the sync, a staging buffer rewritten "
        "while a copy may read it, a side stream's copy read after syncing the default stream, a prefetcher without "
        "its events caught; their clean twins, the prefetcher with events and a `DataLoader(pin_memory=True)` loop "
        "clean, also under `--streamrace-latent=fail`; a pinned buffer freed during its copy and allocated again "
        "clean (torch's pinned allocator waits for the copy), one given back to a program's own pool during its copy "
        "caught; torch DCP's `DefaultStager` (pinned, async, non-blocking staging) in one process: staging right after the "
        "step and the next step before staging completes reported, the fix and the correct sequence clean under "
        "`--streamrace-latent=fail`, no report on the stager's `set_`; under `--streamrace-confirm` the racy twins "
        "confirmed with the values the host read or the copy carried, a `.numpy()` read (which runs no op) too",
}


@pytest.mark.gpu(count=1)
@pytest.mark.validates(55)
@pytest.mark.parametrize("latent", ["report", "fail"])
def test_pinned_memory_twins_on_real_streams(latent, gpu_result, tmp_path):
    stack_twins("pinned_memory", gpu_result, tmp_path, {}, log=f"host-party-{latent}",
                extra=[f"--streamrace-latent={latent}"])


@pytest.mark.gpu(count=1)
@pytest.mark.validates(55)
def test_dcp_staging_orders_on_one_gpu(pytester, gpu_result):
    """tests/test_repro_dcp.py's orders of a step and its staging, one process on one GPU (the stager pins its new
    memory in place, and points each staged tensor at it with ``set_``)."""
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "test_repro_dcp.py")
    spec = importlib.util.spec_from_file_location("dcp_cpu_cases", path)
    cases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cases)
    races = cases.run_user_orders(pytester, "cuda")
    gpu_result.record("DCP races by test", "; ".join(sorted(
        f"{test} {sum(r['test'].endswith('::' + test) for r in races)}"
        for test in {r["test"].rsplit("::", 1)[-1] for r in races})))


@pytest.mark.gpu(count=1)
@pytest.mark.validates(55)
def test_host_races_are_confirmed_on_real_streams(pytester, gpu_result):
    """The copy's stream held by a sleep kernel: the host's read runs before the copy lands, or its rewrite before the
    copy reads (tests/test_host_party.py's cases)."""
    found = test_host_party.confirm_host_races(pytester, "cuda")
    gpu_result.record("confirmed", len(found))
    gpu_result.record("differing elements", "; ".join(
        f"{test} {c['differing']} of {c['elements']}" for test, c in sorted(found.items())))
