"""torch DCP's async staging: the dcp_async_staging repro end to end on CPU (virtual streams, gloo, 2 ranks), and the
orders a user's own DCP test can put staging and the optimizer step in, through pytest as users run it. DCP comes
with torch: nothing to install."""

import json
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


def test_show_names_the_fix_and_the_torch_versions():
    out = repro("show", "dcp_async_staging")
    assert out.returncode == 0
    assert "affected: torch 2.11, 2.13" in out.stdout and "needs:    torch" in out.stdout
    assert "unpatched  expect reproduced" in out.stdout and "patched    expect clean" in out.stdout
    assert "dcp_async_staging" in repro("list").stdout


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
        with accelerator_available(), pytest.warns(UserWarning, match="pin_memory"):
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


def _outcomes(result) -> dict:
    return {m.group(2): m.group(1) for m in re.finditer(r"^(PASSED|FAILED|XFAIL|XPASS)\S* \S+::(\w+)",
                                                         result.stdout.str(), re.M)}


@pytest.mark.parametrize("backend", ["virtual", pytest.param("cuda", marks=[pytest.mark.gpu, GPU])])
def test_user_tests_of_dcp_staging_orders(pytester, backend):
    """Reported: staging right after the step (read-after-write). Clean: the fix; the correct sequence (synchronize,
    stage, wait for staging, step), under --streamrace-latent=fail. Reported too: the next step issued before staging
    completes (write-after-read): the staging thread's synchronize orders only that thread."""
    pytester.makepyfile(test_dcp=USER_TEST)
    result = pytester.runpytest_subprocess("--streamrace", f"--streamrace-backend={backend}",
                                           "--streamrace-latent=fail", "--streamrace-json", "races.json",
                                           "-p", "no:cacheprovider", "-rA", "-p", "no:logging")
    assert _outcomes(result) == {"test_next_step_before_staging_completes": "PASSED",
                        "test_staging_right_after_the_step": "PASSED",
                        "test_staging_right_after_the_step_with_the_fix": "PASSED",
                        "test_synchronize_stage_wait_then_step": "PASSED"}
    races = json.loads(pytester.path.joinpath("races.json").read_text())["races"]
    source = pytester.path.joinpath("test_dcp.py").read_text().splitlines()
    step_line, stager_line = (next(i for i, text in enumerate(source, 1) if text.endswith(tag))
                              for tag in ("# STEP", "# STAGER"))
    first = [r for r in races if r["test"].endswith("::test_staging_right_after_the_step")]
    # the dispatch-mode fallback also counts the stager's set_ as a write (write-after-write on the same pair)
    assert first and "read-after-write" in {r["kind"] for r in first}
    if backend == "virtual":  # the line of the CPU branch; on GPUs the stager is made on the next line
        assert {r["later"]["stream"] for r in first} == {f"stream created at test_dcp.py:{stager_line}"}
    assert any(f"test_dcp.py:{step_line}" == f"{f['file'].rsplit('/', 1)[-1]}:{f['line']}"
               for r in first for f in r["earlier"]["frames"]), first


@pytest.mark.gpu
@pytest.mark.skipif(len(env.visible_gpus()) < 2, reason="needs 2 CUDA GPUs (run with -n 0)")
@pytest.mark.xfail(strict=False, reason="on 2xH200 with torch 2.11 the repro's ranks fail inside DefaultStager's "
                                        "deepcopy (_state_dict_stager.py: KeyError: <class 'type'>), both variants; "
                                        "not understood yet (the user-test twins on cuda pass)")
def test_on_gpus_the_referee_sees_the_pre_step_checkpoint(tmp_path):
    """2 ranks on NCCL with a gloo group for DCP, 3 runs a variant: the step delayed on its stream, the checkpoint
    holds pre-step values unpatched (about one AdamW step, lr 0.01) and the model's exactly with the fix."""
    path = tmp_path / "out.json"
    out = repro("dcp_async_staging", "--backend", "cuda", "--repeat", "3", "--json", str(path), timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    runs = json.loads(path.read_text())["runs"]
    assert len(runs) == 6
    for run in runs:
        errors = [n["max_abs_err"] for n in run["numeric"]]
        assert len(errors) == 2, run["numeric"]
        if run["variant"] == "patched":
            assert errors == [0.0, 0.0] and run["races"] == []
        else:
            assert max(errors) > 1e-3 and run["races"], run
