"""torch DCP's async staging: the dcp_async_staging repro end to end on CPU (virtual streams, gloo, 2 ranks), and the
orders a user's own DCP test can put staging and the optimizer step in, through pytest as users run it. DCP comes
with torch: nothing to install."""

import json
import os
import re

import pytest
from repro_cli import both_variants, repro

from pytest_streamrace import env

GPU = pytest.mark.skipif(not env.visible_gpus(), reason="needs a CUDA GPU")

REPRO = "dcp_async_staging.py"


def test_cli_verdicts_and_json_evidence(tmp_path):
    stdout, doc = both_variants("dcp_async_staging", tmp_path, confirm=True)
    # forced, the staging copy reads the parameters as they were before the step: every race confirmed
    assert {c["status"] for r in doc["runs"] for c in r["confirmations"]} == {"confirmed"}
    assert "[unpatched] step 2/2 checkpointed" in stdout
    assert doc["backend"] == "virtual" and doc["framework"] == "torch" and doc["world_size"] == 2
    runs = {r["variant"]: r for r in doc["runs"]}
    assert runs["patched"]["races"] == [] and runs["patched"]["verdict"] == "clean"
    races = runs["unpatched"]["races"]
    assert {r["rank"] for r in races} == {0, 1}
    for race in races:
        # the optimizer step's write on the default stream, read by the stager's copy on its staging stream
        assert race["kind"] == "read-after-write"
        assert race["tensor"]["name"].startswith("model."), race["tensor"]
        assert race["earlier"]["stream"] == "default stream" and race["later"]["stream"] == "DCP staging stream"
        assert race["later"]["op"] == "aten::copy_"
        assert any(f["file"].endswith(REPRO) and f["function"] == "run" for f in race["earlier"]["frames"])
        # torch's code on the stager's pool thread: no frame is the user's, so torch's own frame names the copy, and
        # the thread is named with the call that submitted the staging
        assert race["later"]["frames"][0]["file"].rsplit("/", 1)[-1] in {"staging.py", "_state_dict_stager.py"}
        assert race["later"]["thread"]["how"] == "work submitted", race["later"]


TORCH_2_11_STAGE = """
from torch.distributed.checkpoint.staging import DefaultStager

_stage = DefaultStager._stage


def _stage_then_close(self, state_dict, **kwargs):  # torch 2.11's _stage ends by closing its StateDictStager
    staged = _stage(self, state_dict, **kwargs)
    self._state_dict_stager.close()
    return staged


DefaultStager._stage = _stage_then_close
"""


def test_a_stager_that_stages_once_as_in_torch_2_11(tmp_path):
    """torch 2.11's DefaultStager empties its deep-copy table after each stage, so a second stage() fails with
    KeyError: <class 'type'> (what the repro's ranks hit on the GPU host). Every process here, the ranks included,
    gets 2.11's behaviour through a sitecustomize; the repro stages its second checkpoint with a new stager."""
    (tmp_path / "sitecustomize.py").write_text(TORCH_2_11_STAGE)
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    out = repro("dcp_async_staging", env=environ, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[unpatched] step 2/2 checkpointed" in out.stdout and "[patched] step 2/2 checkpointed" in out.stdout


def test_show_names_the_fix_and_the_torch_versions():
    out = repro("show", "dcp_async_staging")
    assert out.returncode == 0
    assert "affected: torch 2.11, 2.13" in out.stdout and "needs:    torch" in out.stdout
    assert "unpatched  expect reproduced" in out.stdout and "patched    expect clean" in out.stdout
    assert "dcp_async_staging" in repro("list").stdout


# The four orders of a step and its staging, as a user writes them: the same tests over a plain model (USER_TEST) and
# over FSDP2 ranks (FSDP2_TEST), each after its own `setup` fixture.
ORDERS = """

@pytest.mark.streamrace(expect="race")
def test_staging_right_after_the_step(setup):
    step, save = setup
    step()
    saved = save(0)
    saved.staging_completion.result()
    saved.upload_completion.result()


@pytest.mark.streamrace(expect="clean")
def test_staging_right_after_the_step_with_the_fix(setup):
    step, save = setup
    with staging_fix(True):
        step()
        saved = save(0)
        saved.staging_completion.result()
        saved.upload_completion.result()
        step()


@pytest.mark.streamrace(expect="race")
def test_next_step_before_staging_completes(setup, monkeypatch):
    step, save = setup
    gate = threading.Event()  # staging starts only once the next step was issued: this run's order, every time
    stage = DefaultStager._stage

    def gated(self, *args, **kwargs):
        gate.wait()
        return stage(self, *args, **kwargs)
    monkeypatch.setattr(DefaultStager, "_stage", gated)
    step()
    torch.accelerator.synchronize()
    saved = save(0)
    step()                                                      # NEXT-STEP
    gate.set()
    saved.staging_completion.result()
    saved.upload_completion.result()


@pytest.mark.streamrace(expect="clean")
def test_synchronize_stage_wait_then_step(setup):
    step, save = setup
    step()
    torch.accelerator.synchronize()
    saved = save(0)
    saved.staging_completion.result()
    step()
    saved.upload_completion.result()
"""

USER_TEST = """
import threading

import pytest, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from pytest_streamrace.frameworks.accelerator import accelerator_available
from pytest_streamrace.repros.dcp_async_staging import staging_fix


@pytest.fixture
def setup(tmp_path, streamrace_device):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16).to(streamrace_device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    if streamrace_device.type == "cpu":
        with accelerator_available():
            stager = DefaultStager(StagingOptions(True, True, True, True))  # STAGER
    else:
        stager = DefaultStager(StagingOptions(True, True, True, True))
    def step():
        model(torch.randn(4, 16, device=streamrace_device)).sum().backward()
        optimizer.step()                                        # STEP
        optimizer.zero_grad()
    def save(n):
        return dcp.async_save({"model": model.state_dict()}, checkpoint_id=tmp_path / str(n), async_stager=stager,
                              no_dist=True)
    yield step, save
    stager.close()


""" + ORDERS


def _outcomes(result) -> dict:
    return {m.group(2): m.group(1) for m in re.finditer(r"^(PASSED|FAILED|XFAIL|XPASS)\S* \S+::(\w+)",
                                                         result.stdout.str(), re.M)}


def run_user_orders(pytester, backend: str) -> list[dict]:
    """USER_TEST through pytest as users run it: the verdicts, and the races."""
    pytester.makepyfile(test_dcp=USER_TEST)
    result = pytester.runpytest_subprocess("--streamrace", f"--streamrace-backend={backend}",
                                           "--streamrace-latent=fail", "--streamrace-json", "races.json",
                                           "-p", "no:cacheprovider", "-rA", "-p", "no:logging")
    assert _outcomes(result) == {"test_next_step_before_staging_completes": "PASSED",
                                 "test_staging_right_after_the_step": "PASSED",
                                 "test_staging_right_after_the_step_with_the_fix": "PASSED",
                                 "test_synchronize_stage_wait_then_step": "PASSED"}, result.stdout.str()
    races = json.loads(pytester.path.joinpath("races.json").read_text())["races"]
    source = pytester.path.joinpath("test_dcp.py").read_text().splitlines()
    step_line, stager_line = (next(i for i, text in enumerate(source, 1) if text.endswith(tag))
                              for tag in ("# STEP", "# STAGER"))
    first = [r for r in races if r["test"].endswith("::test_staging_right_after_the_step")]
    assert first and "read-after-write" in {r["kind"] for r in first}
    if backend == "virtual":  # the line of the CPU branch; on GPUs the stager is made on the next line
        assert {r["later"]["stream"] for r in first} == {f"stream created at test_dcp.py:{stager_line}"}
    assert any(f"test_dcp.py:{step_line}" == f"{f['file'].rsplit('/', 1)[-1]}:{f['line']}"
               for r in first for f in r["earlier"]["frames"]), first
    # set_ points the staged tensor at its storage: no bytes move, no access
    assert not [r for r in races if "aten::set_" in (r["earlier"]["op"], r["later"]["op"])], races
    return races


@pytest.mark.parametrize("backend", ["virtual", pytest.param("cuda", marks=[pytest.mark.gpu, GPU])])
def test_user_tests_of_dcp_staging_orders(pytester, backend):
    """Reported: staging right after the step (read-after-write). Clean: the fix; the correct sequence (synchronize,
    stage, wait for staging, step), under --streamrace-latent=fail. Reported too: the next step issued before staging
    completes (write-after-read): the staging thread's synchronize orders only that thread."""
    run_user_orders(pytester, backend)


FSDP2_TEST = """
import threading

import pytest, torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from pytest_streamrace.frameworks.accelerator import accelerator_available
from pytest_streamrace.repros.dcp_async_staging import staging_fix

pytestmark = pytest.mark.distributed(world_size=2)


@pytest.fixture
def setup(tmp_path, streamrace_device):
    gloo = dist.new_group(backend="gloo")  # DCP's own collectives, beside the default group (NCCL on GPUs)
    root = [str(tmp_path)]
    dist.broadcast_object_list(root, src=0, group=gloo)  # one checkpoint folder for both ranks
    mesh = init_device_mesh(streamrace_device.type, (2,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    model.to(streamrace_device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    if streamrace_device.type == "cpu":
        with accelerator_available():
            stager = DefaultStager(StagingOptions(True, True, True, True))
    else:
        stager = DefaultStager(StagingOptions(True, True, True, True))
    def step():
        model(torch.randn(4, 16, device=streamrace_device)).sum().backward()
        optimizer.step()                                        # STEP
        optimizer.zero_grad()
    def save(n):
        return dcp.async_save({"model": model.state_dict()}, checkpoint_id=f"{root[0]}/{n}", async_stager=stager,
                              process_group=gloo)
    yield step, save
    stager.close()
    dist.barrier(group=gloo)


""" + ORDERS


def run_fsdp2_orders(pytester, backend: str):
    """FSDP2_TEST through pytest as users run it: each rank's verdicts, and its races in races.json."""
    pytester.makepyfile(test_dcp_fsdp2=FSDP2_TEST)
    result = pytester.runpytest_subprocess("--streamrace", f"--streamrace-backend={backend}",
                                           "--streamrace-latent=fail", "--streamrace-json", "races.json",
                                           "-p", "no:cacheprovider", "-rA", "-p", "no:logging")
    assert _outcomes(result) == {"test_next_step_before_staging_completes": "PASSED",
                                 "test_staging_right_after_the_step": "PASSED",
                                 "test_staging_right_after_the_step_with_the_fix": "PASSED",
                                 "test_synchronize_stage_wait_then_step": "PASSED"}, result.stdout.str()
    races = json.loads(pytester.path.joinpath("races.json").read_text())["races"]
    source = pytester.path.joinpath("test_dcp_fsdp2.py").read_text().splitlines()
    lines = {tag: next(i for i, text in enumerate(source, 1) if text.endswith(tag))
             for tag in ("# STEP", "# NEXT-STEP")}
    by_test = {}
    for race in races:
        by_test.setdefault(race["test"].rsplit("::", 1)[-1], []).append(race)
    assert set(by_test) == {"test_staging_right_after_the_step", "test_next_step_before_staging_completes"}, by_test

    def at(race, which, line):
        return any(f"test_dcp_fsdp2.py:{line}" == f"{f['file'].rsplit('/', 1)[-1]}:{f['line']}"
                   for f in race[which]["frames"])
    first, second = by_test["test_staging_right_after_the_step"], by_test["test_next_step_before_staging_completes"]
    # each rank's shards: the step's write, read by the staging copy; then the next step's write, issued before the
    # staging began, which the copy may read or not
    for races, line in ((first, lines["# STEP"]), (second, lines["# NEXT-STEP"])):
        assert {r["rank"] for r in races if r["kind"] == "read-after-write" and at(r, "earlier", line)} == {0, 1}, races
    return result


def test_fsdp2_dcp_staging_orders_on_two_gloo_ranks(pytester):
    """FSDP2 (device mesh, fully_shard) saved through dcp.async_save with DefaultStager on its own gloo group: staging
    right after the step reported, the next step before staging completes reported, the fix and the correct sequence
    clean under --streamrace-latent=fail. tests/gpu/test_dcp_fsdp2.py runs the same on 2 GPUs."""
    run_fsdp2_orders(pytester, "virtual")
