"""torch DCP's async staging through FSDP2 on 2 GPUs (NCCL ranks, DCP on a gloo group): the orders a user's test can
put staging and the optimizer step in, as tests/test_repro_dcp.py runs them on gloo ranks."""

import importlib.util
import json
import os

import pytest


CLAIMS = {
    40: "torch DCP's async staging through FSDP2 (`init_device_mesh`, `fully_shard`; NCCL ranks, DCP on a "
        'gloo group), cuda backend: staging right after the step reported; the next step issued before '
        'staging completes reported; the fix and the correct sequence (synchronize, stage, wait, step) clean '
        'under `--streamrace-latent=fail`',
}

pytestmark = [pytest.mark.gpu(count=2), pytest.mark.validates(40)]


def _cpu_module():
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "test_repro_dcp.py")
    spec = importlib.util.spec_from_file_location("dcp_cpu_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fsdp2_dcp_staging_orders_on_two_gpus(pytester, gpu_result):
    _cpu_module().run_fsdp2_orders(pytester, "cuda")
    races = json.loads(pytester.path.joinpath("races.json").read_text())["races"]
    found: dict[str, set] = {}
    for race in races:
        found.setdefault(race["test"].rsplit("::", 1)[-1], set()).add(race["rank"])
    gpu_result.record("races on ranks", "; ".join(f"{test} {sorted(ranks)}" for test, ranks in sorted(found.items())))
