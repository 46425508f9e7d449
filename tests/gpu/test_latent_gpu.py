"""Latent races on real streams (cuda backend): work ordered only by a host read-back or an incidental sync is
reported as latent (`--streamrace-latent=report`), fails under `fail`, names the sync that hid it, and is off under
`off`; a real race is reported in every mode. Then DeepSpeed ZeRO-3's parameter gather after a step, stock
configuration on NCCL, as such a latent race."""

import json

import pytest
from gpu_support import PYTEST, framework_env, run

CLAIMS = {8: "Latent races on real streams (ordered only by a read-back or an incidental sync)"}

TIMER = """
import torch

def time_step():
    torch.cuda.synchronize()  # a framework timer's sync
"""

CASES = """
import pytest, torch
from timer import time_step

def produced():
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the side stream is still busy when the host moves on
        x = torch.ones(1 << 20, device="cuda") * 2
    return side, x

@pytest.mark.parametrize("read_back", ["item", "cpu", "nonzero"])
def test_read_back(read_back):
    side, x = produced()
    with torch.cuda.stream(side):
        {"item": lambda: x.sum().item(), "cpu": lambda: x.cpu(), "nonzero": lambda: x.nonzero()}[read_back]()
    x.add_(1)  # latent: ordered only by the read-back

@pytest.mark.parametrize("how", ["wait_stream", "synchronize", "event_synchronize"])
def test_clean(how):
    side, x = produced()
    with torch.cuda.stream(side):
        x.sum().item()
        event = torch.cuda.Event()
        event.record()
    if how == "wait_stream":
        torch.cuda.current_stream().wait_stream(side)
    elif how == "synchronize":
        torch.cuda.synchronize()
    else:
        event.synchronize()
    x.add_(1)

def test_timer():
    side, x = produced()
    time_step()
    x.add_(1)

def test_real():
    side, x = produced()
    x.add_(1)
"""

READ_BACKS = {"test_read_back[item]", "test_read_back[cpu]", "test_read_back[nonzero]"}
CLEAN = {"test_clean[wait_stream]", "test_clean[synchronize]", "test_clean[event_synchronize]"}
MODES = {  # mode: (its options, the tests that fail, the tests with a latent record)
    "report": ([], {"test_real"}, READ_BACKS),
    "fail": (["--streamrace-latent=fail"], {"test_real"} | READ_BACKS, READ_BACKS),
    "incidental": (["--streamrace-suppress", "s.supp"], {"test_real"}, READ_BACKS | {"test_timer"}),
    "off": (["--streamrace-latent=off"], {"test_real"}, set()),
}


def _session(tmp_path, name, *args, timeout=600, env=None):
    done = run([*PYTEST, "--streamrace", "--streamrace-backend=cuda", "-rA", "--streamrace-json",
                str(tmp_path / f"{name}.json"), *args], timeout=timeout, cwd=tmp_path, env=env)
    try:
        with open(tmp_path / f"{name}.json", encoding="utf-8") as f:
            found = json.load(f)["races"]
    except OSError:
        found = []
    return done.stdout, found


@pytest.mark.gpu
@pytest.mark.validates(8)
@pytest.mark.parametrize("mode", list(MODES))
def test_latent_races_on_real_streams(tmp_path, mode, gpu_result):
    (tmp_path / "timer.py").write_text(TIMER)
    (tmp_path / "test_latent_gpu.py").write_text(CASES)
    (tmp_path / "s.supp").write_text("incidental-sync:timer.py\n")
    options, failing, latent = MODES[mode]
    output, found = _session(tmp_path, mode, *options, "test_latent_gpu.py")
    failed = {line.split("::")[1].split(" ")[0] for line in output.splitlines() if line.startswith("FAILED ")}
    assert failed == failing, output[-4000:]
    name = lambda r: r["test"].split("::")[-1]
    assert {name(r) for r in found if r.get("latent")} == latent, found
    assert {name(r) for r in found if not r.get("latent")} == {"test_real"}, found
    hidden_by = {name(r): r["latent"]["op"] for r in found if r.get("latent")}
    assert "implicit host sync" not in " ".join(hidden_by.values()), hidden_by  # the op the sync came from, named
    gpu_result.record("latent", sum(1 for r in found if r.get("latent")))
    gpu_result.record("failed", sorted(failed))


ZERO3 = """
import os, pytest, torch
import deepspeed

pytestmark = pytest.mark.distributed(world_size=2)

def test_zero3_stock(streamrace_device, rank):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).to(streamrace_device)
    config = {"train_micro_batch_size_per_gpu": 4,
              "gradient_accumulation_steps": int(os.environ.get("ACCUMULATION", "1")),
              "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    generator = torch.Generator(device=streamrace_device).manual_seed(1 + rank)
    for _ in range(6):  # micro-batches
        loss = engine(torch.randn(4, 256, device=streamrace_device, generator=generator)).pow(2).mean()
        engine.backward(loss)
        engine.step()
"""


@pytest.mark.gpu(count=2)
@pytest.mark.validates(8)
def test_zero3_parameter_gather_after_a_step_is_a_latent_race(request, tmp_path, gpu_result):
    """The step's partition copy and the next all-gather's read of it are ordered only by host syncs: no race, a
    latent read-after-write per rank; with the timer's sync marked incidental and accumulation 2, named too."""
    env = framework_env(request.config, deepspeed="0.19.8")
    (tmp_path / "test_zero3_gpu.py").write_text(ZERO3)
    (tmp_path / "s.supp").write_text("incidental-sync:deepspeed/utils/timer.py\n")
    output, found = _session(tmp_path, "report", "test_zero3_gpu.py", env=env)
    assert "1 passed" in output and found, output[-4000:]
    assert all(r.get("latent") and r["kind"] == "read-after-write" for r in found), found
    assert {r.get("rank") for r in found} == {0, 1}, found
    output, _ = _session(tmp_path, "fail", "--streamrace-latent=fail", "test_zero3_gpu.py", env=env)
    assert "1 failed" in output, output[-4000:]
    output, found = _session(tmp_path, "incidental", "--streamrace-suppress", "s.supp",
                             "--streamrace-report-only", "test_zero3_gpu.py", env={**env, "ACCUMULATION": "2"})
    ops = sorted({r["latent"]["op"] for r in found if r.get("latent")})
    gpu_result.record("zero3 latent, hidden by", ops)
    gpu_result.record("deepspeed", "0.19.8")
    assert any("incidental" in op for op in ops), output[-4000:]
