"""`--confirm` on real streams (cuda backend, NCCL): every shipped repro that runs on GPUs, its unpatched variant's
races forced and confirmed, agreeing with the numeric referee, its patched variant with nothing to confirm; and
`streamrace run --confirm` on a racy script."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from repro_cli import repro

CLAIMS = {
    49: '`--confirm` on the repros on GPUs (cuda backend, NCCL): each unpatched variant confirmed, agreeing '
        'with the numeric referee, each patched one clean; `streamrace run --confirm` confirms a racy script '
        'on real streams',
}

pytestmark = pytest.mark.gpu

REPROS = ["zero_overlap", "zero_bucket_reuse", "zero3_param_gather", "megatron_instances", "deepcompile_zero1",
          "dcp_async_staging"]


@pytest.mark.gpu(count=2)
@pytest.mark.validates(49)
@pytest.mark.parametrize("name", REPROS)
def test_each_repro_is_confirmed_on_gpus_agreeing_with_its_referee(tmp_path, name):
    from pytest_streamrace.repro import registry

    spec = registry.get(name)
    problem = spec.framework.problem() if spec.framework else None
    if problem:
        pytest.skip(problem)
    if torch.cuda.device_count() < spec.world_size:
        pytest.skip(f"{name} needs {spec.world_size} GPUs")
    path = tmp_path / "out.json"
    out = repro(name, "--backend", "cuda", "--confirm", "--json", str(path), timeout=1800)
    assert out.returncode == 0, out.stdout + out.stderr
    runs = {r["variant"]: r for r in json.loads(path.read_text())["runs"]}
    unpatched, patched = runs["unpatched"], runs["patched"]
    assert unpatched["verdict"] == "reproduced" and unpatched["confirmed"]["agrees"] is True, unpatched["confirmed"]
    assert patched["verdict"] == "clean" and patched["confirmed"]["agrees"] is True, patched["confirmed"]
    print(name, unpatched["confirmed"]["summary"], [c["line"] for c in unpatched["confirmations"]])


@pytest.mark.validates(49)
def test_streamrace_run_confirms_a_racy_script_on_real_streams(tmp_path):
    (tmp_path / "racy.py").write_text(textwrap.dedent("""
        import torch

        x = torch.ones(1 << 20, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.mul_(3)
        y = x + 1
        torch.cuda.synchronize()
    """))
    command = [sys.executable, "-m", "pytest_streamrace", "run", "--backend", "cuda", "--confirm", "--json",
               "races.json", "--", sys.executable, "racy.py"]
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 3, out.stderr
    [race] = json.loads((tmp_path / "races.json").read_text())["races"]
    assert race["confirmation"]["status"] == "confirmed", race["confirmation"]
