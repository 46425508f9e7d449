"""`--confirm` on real streams (cuda backend, NCCL): every shipped repro that runs on GPUs, its unpatched variant's
races forced and confirmed, agreeing with the numeric referee, its patched variant with nothing to confirm; and
`streamrace run --confirm` on a racy script."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from gpu_support import extensions_dir, framework_env, gist, repro

CLAIMS = {
    49: '`--confirm` on the repros on GPUs (cuda backend, NCCL): each unpatched variant confirmed, agreeing '
        'with the numeric referee, each patched one clean; `streamrace run --confirm` confirms a racy script '
        'on real streams',
}

pytestmark = pytest.mark.gpu

# each repro's framework as the referee rows run it (test_repros_gpu.py): the version, and a JIT cache of its own
REPROS = {"zero_overlap": {"deepspeed": "0.19.8"}, "zero_bucket_reuse": {"deepspeed": "0.19.8"},
          "zero3_param_gather": {"deepspeed": "0.19.8"}, "megatron_instances": {"megatron_core": "0.15.2"},
          "deepcompile_zero1": {"deepspeed": "0.19.8"}, "dcp_async_staging": {}}


@pytest.mark.gpu(count=2)
@pytest.mark.validates(49)
@pytest.mark.parametrize("name", list(REPROS))
def test_each_repro_is_confirmed_on_gpus_agreeing_with_its_referee(request, tmp_path, name, gpu_result):
    from pytest_streamrace.repro import registry

    if torch.cuda.device_count() < registry.get(name).world_size:
        pytest.skip(f"{name} needs {registry.get(name).world_size} GPUs")
    env = framework_env(request.config, **REPROS[name])
    for framework, version in REPROS[name].items():
        env["TORCH_EXTENSIONS_DIR"] = extensions_dir(framework.replace("_", "-"), version)
        gpu_result.record(framework.replace("_", "-"), version)
    data = repro(name, "--confirm", config=request.config, timeout=1800, env=env, json_path=tmp_path / "out.json")
    runs = {r["variant"]: r for r in data["runs"]}
    assert data["returncode"] == 0 and set(runs) == {"unpatched", "patched"}, gist(data["output"])
    unpatched, patched = runs["unpatched"], runs["patched"]
    said = [c["line"] for c in unpatched["confirmations"]]
    # the numbers first: a failing item's row says them too
    gpu_result.record("unpatched", unpatched["confirmed"]["summary"])
    gpu_result.record("confirmations", said)
    gpu_result.record("run s", round(unpatched["seconds"], 1))
    gpu_result.record("confirmation s", round(unpatched["confirmed"]["seconds"], 1))
    gpu_result.record("hold ms", [c.get("delay_ms") for c in unpatched["confirmations"] if "delay_ms" in c])
    gpu_result.record("lead ms", [c.get("lead_ms") for c in unpatched["confirmations"] if "lead_ms" in c])
    # a bug whose evidence is a buffer's lifetime (DeepSpeed #8036) has no race to force: its referee stands alone
    agrees = None if registry.get(name).relevant is None else True
    assert unpatched["verdict"] == "reproduced" and unpatched["confirmed"]["agrees"] is agrees, \
        f"unpatched {unpatched['verdict']}, {unpatched['confirmed']['summary']}: {'; '.join(said)}"
    assert patched["verdict"] == "clean" and patched["confirmed"]["agrees"] is agrees, \
        f"patched {patched['verdict']}, {patched['confirmed']['summary']}"


@pytest.mark.validates(49)
def test_streamrace_run_confirms_a_racy_script_on_real_streams(tmp_path, gpu_result):
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
    confirmation = race["confirmation"]
    gpu_result.record("streamrace run --confirm", f"{confirmation['status']}, max |Δ| "
                      f"{confirmation.get('max_abs_diff')} in {confirmation.get('differing')} of "
                      f"{confirmation.get('elements')} elements, hold ms "
                      f"{confirmation.get('delay_ms')}, re-runs s {confirmation.get('test_seconds')}")
    assert confirmation["status"] == "confirmed", confirmation
