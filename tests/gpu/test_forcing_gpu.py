"""Forcing on GPUs, with the plain API of pytest_streamrace.forcing (tests/gpu/forcing_frameworks.py): stock
DeepSpeed ZeRO-2 and megatron-core DDP compute exactly the reference's numbers until forced, then wrong ones. And
DeepSpeed ZeRO-3's parameter gather forced (tests/gpu/zero3_gather.py): forwards that used pre-step weights."""

import re
import socket

import pytest
from gpu_support import PYTHON, ROOT, framework_env, run

CLAIMS = {
    18: "Forcing makes stock frameworks compute wrong numbers",
    19: "ZeRO-3's parameter gather reads the partition before the step's copy on the device",
}

pytestmark = pytest.mark.gpu(count=2)


def _torchrun(script: str, *args: str, env: dict) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**env, "PYTHONPATH": ":".join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)}
    done = run([PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
                str(ROOT / "tests" / "gpu" / script), *args], timeout=600, env=env)
    return done.stdout


FRAMEWORKS = [pytest.param("deepspeed", {"deepspeed": "0.19.2"}, id="deepspeed"),
              pytest.param("megatron", {"megatron_core": "0.15.2"}, id="megatron")]


@pytest.mark.validates(18)
@pytest.mark.parametrize("framework, versions", FRAMEWORKS)
def test_forcing_turns_a_stock_framework_wrong(request, framework, versions, gpu_repeat, gpu_result):
    env = framework_env(request.config, **versions)
    output = _torchrun("forcing_frameworks.py", framework, "--repeats", str(gpu_repeat), env=env)
    rows = re.findall(r"^\| ([^|]+) \| ([^|]+) \| (\d+)/(\d+) (\w+) \| (\d+) \| ([^|]+) \|$", output, re.M)
    assert len(rows) >= 2, output[-4000:]
    for _, name, wrong, total, unit, _, worst in rows:
        gpu_result.record(name.strip(), f"{wrong}/{total} {unit} wrong, max relative error {worst.strip()}")
    for _, name, wrong, total, unit, _, _ in rows:
        # forced: wrong every time; on the default stream: never (the hooks are ordered). Megatron's DDP built on a
        # side stream unforced is the race itself, left to timing: how often it shows is recorded, not asserted
        # (0/12 on an idle host; 2/12 with four GPU jobs sharing it)
        if "forced" in name:
            assert int(wrong) == int(total), f"{name.strip()}: forced, only {wrong}/{total} {unit} wrong"
        elif "default stream" in name:
            assert int(wrong) == 0, f"{name.strip()}: {wrong}/{total} {unit} wrong without forcing"
    for key, version in versions.items():
        gpu_result.record(key.replace("_", "-"), version)


@pytest.mark.validates(19)
def test_zero3_gather_forced_reads_the_partition_before_the_step_copy(request, gpu_result):
    env = framework_env(request.config, deepspeed="0.19.8")
    output = _torchrun("zero3_gather.py", env=env)
    stale = {name.strip(): (int(s), int(n))
             for name, s, n in re.findall(r"^(.+?) stale forwards (\d+)/(\d+);", output, re.M)}
    assert len(stale) == 5, output[-4000:]
    for name, (s, n) in stale.items():
        gpu_result.record(name, f"{s}/{n} stale forwards")
    gpu_result.record("deepspeed", "0.19.8")
    assert stale["control: device synchronized after each step"][0] == 0
    assert stale["throughput timer unsynchronized"][0] > 0
