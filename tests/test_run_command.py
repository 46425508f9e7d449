"""`streamrace run [options] -- PROGRAM`: real programs in real subprocesses — a 2-rank torchrun job on gloo, plain
scripts, signals — on CPU (virtual streams), as users run the command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_subprocesses import tmpdir_marker  # noqa: F401  (a fixture: no process of a run is left behind)

from pytest_streamrace import env

STREAMRACE = [str(Path(sys.executable).with_name("streamrace"))]  # the console script
MODULE = [sys.executable, "-m", "pytest_streamrace"]  # python -m pytest_streamrace, the same command

STEP = """
import torch

def step(racy):
    side = torch.cuda.Stream()
    x = torch.ones(64)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.mul_(2)                         # SIDE-WRITE
    if not racy:
        torch.cuda.current_stream().wait_stream(side)
    y = x + 1                             # MAIN-READ
    torch.cuda.current_stream().wait_stream(side)
    return y
"""

RANKS = """
import sys
import torch, torch.distributed as dist
from step import step

dist.init_process_group("gloo")
for _ in range(3):
    dist.all_reduce(step("--clean" not in sys.argv))
dist.barrier()
dist.destroy_process_group()
"""

SCRIPT = """
import os, sys, time
from step import step

racy = "--clean" not in sys.argv
for _ in range(int(os.environ.get("STEPS", "2"))):
    step(racy)
if "--wait" in sys.argv:                  # until the test has seen the race said (or signals this process)
    print("raced", flush=True)
    deadline = time.monotonic() + 100
    while not os.path.exists("go") and time.monotonic() < deadline:
        time.sleep(0.05)
sys.exit(int(os.environ.get("STATUS", "0")))
"""

LATENT = """
import torch

side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    x = torch.ones(64) * 2
    x.sum().item()                        # ordered only by this read-back
x.add_(1)                                 # LATENT-USE
"""


def _line(text: str, marker: str) -> int:
    return next(i for i, line in enumerate(textwrap.dedent(text).lstrip("\n").splitlines(), 1) if marker in line)


@pytest.fixture
def job(tmp_path, tmpdir_marker):  # noqa: F811
    """A folder with the scripts, and a function running `streamrace run ARGS` there (stdout, stderr apart)."""
    for name, text in {"step": STEP, "ranks": RANKS, "script": SCRIPT, "latent": LATENT}.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(text).lstrip("\n"))
    environ = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "COLUMNS": "200"}

    def run(*args, command=STREAMRACE, extra_env=None, timeout=240):
        return subprocess.run([*command, "run", *args], cwd=tmp_path, env={**environ, **(extra_env or {})},
                              capture_output=True, text=True, timeout=timeout)

    run.path, run.env = tmp_path, environ
    return run


def _races(path: Path) -> list[dict]:
    doc = json.loads(path.read_text())
    assert doc["version"] == 1
    return doc["races"]


def _torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]


def test_torchrun_job_with_a_race_exits_3_and_its_json_holds_both_ranks(job):
    out = job("--backend", "virtual", "--json", "races.json", "--trace", "trace.json", "--", *_torchrun("ranks.py"))
    assert out.returncode == 3, out.stderr
    races = _races(job.path / "races.json")
    assert sorted(r["rank"] for r in races) == [0, 1]
    for race in races:
        assert race["kind"] == "read-after-write" and race["status"] == "new" and race["test"] == "run:ranks.py"
        assert race["earlier"]["frames"][0]["line"] == _line(STEP, "SIDE-WRITE")
        assert race["later"]["frames"][0]["line"] == _line(STEP, "MAIN-READ")
        assert race["count"] == 3  # one a step, counted when the rank ended
    err = out.stderr
    # said when found, prefixed by its rank; then the merged report, pytest's text, closing with the summary
    assert sum(line.startswith("streamrace [rank ") for line in err.splitlines()) == 1, err
    assert "stream race on ranks 0, 1: read-after-write on tensor float32[64] (allocated at step.py:" in err
    assert "(seen 6 times)" in err
    assert "streamrace: the program exited with status 0; 3 Python processes followed (ranks 0, 1)" in err
    assert "streamrace: 1 program checked, 1 race found: 0 suppressed, 0 in baseline, 1 new" in err
    assert err.rstrip().endswith("streamrace: exit status 3: new races (--report-only reports them without failing)")
    events = json.loads((job.path / "trace.json").read_text())["traceEvents"]
    assert len({e["pid"] for e in events if e.get("cat") == "race"}) == 2  # a flow arrow in each rank's process


def test_its_clean_twin_exits_0(job):
    out = job("--backend", "virtual", "--json", "races.json", "--", *_torchrun("ranks.py", "--clean"))
    assert out.returncode == 0, out.stderr
    assert _races(job.path / "races.json") == []
    assert "streamrace [" not in out.stderr
    assert "streamrace: 1 program checked, 0 races found: 0 suppressed, 0 in baseline, 0 new" in out.stderr


def test_the_programs_own_status_without_a_new_race(job):
    out = job("--", sys.executable, "script.py", "--clean", command=MODULE, extra_env={"STATUS": "5"})
    assert (out.returncode, out.stdout) == (5, ""), out.stderr  # the program's stdout is its own
    assert "the program exited with status 5; 1 Python process followed" in out.stderr


def test_new_races_win_over_the_programs_status(job):
    """(The program run as a module this time: `python -m script`.)"""
    out = job("--json", "races.json", "--", sys.executable, "-m", "script", extra_env={"STATUS": "5"})
    assert out.returncode == 3, out.stderr
    assert "the program exited with status 5" in out.stderr
    assert [r["test"] for r in _races(job.path / "races.json")] == ["run:script"]


@pytest.mark.parametrize("args, said", [
    (["script.py"], "expected -- before the program"),
    (["--"], "no program after --"),
    (["--bogus", "--", "python"], "unrecognized arguments: --bogus"),
    (["--backend", "gpu", "--", "python"], "argument --backend: invalid choice: 'gpu'"),
    (["--baseline-update", "--", "python"], "--baseline-update needs --baseline FILE (the file to write)"),
    (["--suppress", "missing.txt", "--", "python"], "cannot read suppression file missing.txt: No such file"),
])
def test_bad_usage_exits_2_with_one_line(job, args, said):
    out = job(*args)
    assert out.returncode == 2, out.stderr
    assert said in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.splitlines()) <= 2, out.stderr  # the usage line where it is usage, and why


def test_no_command_or_an_unknown_one_exits_2():
    for args in ([], ["walk"]):
        out = subprocess.run([*STREAMRACE, *args], capture_output=True, text=True)
        assert out.returncode == 2 and out.stderr.startswith("usage: streamrace run"), out.stderr


def test_help_exits_0():
    out = subprocess.run([*MODULE, "run", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--report-only" in out.stdout and "--baseline-update" in out.stdout


def test_a_program_that_cannot_be_found_exits_127_with_one_line(job):
    out = job("--", "no-such-program-anywhere", "x")
    assert out.returncode == 127
    assert out.stderr == "streamrace run: no-such-program-anywhere: command not found\n"
    (job.path / "data.txt").write_text("not a program\n")
    out = job("--", "./data.txt")
    assert out.returncode == 126 and len(out.stderr.splitlines()) == 1, out.stderr


def test_a_race_is_said_while_the_program_runs(job):
    """The program waits until the test has read its race on stderr: a long job shows its races as it runs."""
    proc = subprocess.Popen([*STREAMRACE, "run", "--json", "races.json", "--", sys.executable, "script.py", "--wait"],
                            cwd=job.path, env=job.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        while line and not line.startswith("streamrace ["):  # anything the program's start says on stderr
            line = proc.stderr.readline()
        assert line.startswith("streamrace [pid "), line
        assert f"read-after-write on a tensor at step.py:{_line(STEP, 'MAIN-READ')}" in line
        assert proc.poll() is None
        (job.path / "go").touch()
        assert proc.wait(timeout=120) == 3
    finally:
        proc.kill()
        proc.communicate()


@pytest.mark.parametrize("signo", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_run_leaves_the_report_and_the_json(job, signo):
    """A launcher's SIGTERM (or a kill -INT) reaches the program through the command, which still reports what the
    program's processes had found."""
    proc = subprocess.Popen([*STREAMRACE, "run", "--json", "races.json", "--", sys.executable, "script.py", "--wait"],
                            cwd=job.path, env=job.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "raced\n"
        time.sleep(0.2)
        proc.send_signal(signo)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 3, err
    assert f"stopped by {signo.name}, the program exited with status {128 + signo}" in err, err
    assert [r["kind"] for r in _races(job.path / "races.json")] == ["read-after-write"]
    assert "1 race found: 0 suppressed, 0 in baseline, 1 new" in err


def test_a_torchrun_job_stopped_by_sigterm_leaves_both_ranks_races(job):
    (job.path / "waits.py").write_text(RANKS.replace("dist.barrier()", "dist.barrier()\nprint('raced', flush=True)\n"
                                                     "import os, time\nwhile not os.path.exists('go'):\n"
                                                     "    time.sleep(0.05)"))
    proc = subprocess.Popen([*STREAMRACE, "run", "--json", "races.json", "--", *_torchrun("waits.py")],
                            cwd=job.path, env=job.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        said = ""
        while said.count("raced") < 2:  # both ranks past the barrier (their lines may interleave)
            line = proc.stdout.readline()
            assert line, said
            said += line
        time.sleep(1)  # their races written
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 3, err
    assert sorted(r["rank"] for r in _races(job.path / "races.json")) == [0, 1]
    assert "stopped by SIGTERM" in err and "stream race on ranks 0, 1" in err


def test_report_only_reports_and_keeps_the_programs_status(job):
    out = job("--report-only", "--json", "races.json", "--", sys.executable, "script.py")
    assert out.returncode == 0, out.stderr
    assert [r["status"] for r in _races(job.path / "races.json")] == ["new"]
    assert "new races (report-only, not failing):" in out.stderr
    assert out.stderr.rstrip().endswith("0 in baseline, 1 new (report-only)")


def test_ini_defaults_are_pytests(job):
    (job.path / "pytest.ini").write_text("[pytest]\nstreamrace_report_only = true\nstreamrace_json = ini.json\n")
    out = job("--", sys.executable, "script.py")
    assert out.returncode == 0, out.stderr
    assert len(_races(job.path / "ini.json")) == 1


def test_baseline_then_suppression(job):
    out = job("--baseline", "known.json", "--baseline-update", "--", sys.executable, "script.py")
    assert out.returncode == 0, out.stderr
    assert "baseline written: known.json (1 race)" in out.stderr
    entries = json.loads((job.path / "known.json").read_text())["races"]
    assert [(e["test"], e["kind"], e["later"]) for e in entries] == [("run:script.py", "read-after-write",
                                                                     ["step", "aten::add"])]
    out = job("--baseline", "known.json", "--", sys.executable, "script.py")
    assert out.returncode == 0, out.stderr
    assert "in the baseline (reported, not failing):" in out.stderr
    assert "1 race found: 0 suppressed, 1 in baseline, 0 new" in out.stderr
    (job.path / "rules.txt").write_text("file:step.py kind:raw\n")
    out = job("--suppress", "rules.txt", "--", sys.executable, "script.py")
    assert out.returncode == 0, out.stderr
    assert "streamrace [" not in out.stderr and "stream race:" not in out.stderr  # suppressed: not said
    assert "1 race found: 1 suppressed, 0 in baseline, 0 new" in out.stderr


def test_latent_races_are_listed_and_fail_with_latent_fail(job):
    out = job("--json", "races.json", "--", sys.executable, "latent.py")
    assert out.returncode == 0, out.stderr
    assert "latent stream races (ordered today only by a host sync the program did not ask for" in out.stderr
    races = _races(job.path / "races.json")
    assert sorted(r["kind"] for r in races) == ["write-after-read", "write-after-write"]  # x.add_ after both
    assert all(r["latent"]["op"] == ".item()" and r["later"]["frames"][0]["line"] == _line(LATENT, "LATENT-USE")
               for r in races)
    assert "0 races found: 0 suppressed, 0 in baseline, 0 new; 2 latent: 0 suppressed, 0 in baseline, 2 new" \
        in out.stderr
    out = job("--latent", "fail", "--", sys.executable, "latent.py")
    assert out.returncode == 3, out.stderr
    out = job("--latent", "off", "--json", "races.json", "--", sys.executable, "latent.py")
    assert out.returncode == 0 and _races(job.path / "races.json") == []


@pytest.mark.gpu
@pytest.mark.skipif(not env.visible_gpus(), reason="needs a GPU")
def test_on_a_gpu_the_cuda_backend_sees_the_race_and_its_twin_clean(job):
    environ = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"}
    gpu = SCRIPT.replace("from step import step", "import torch\ntorch.set_default_device('cuda')\nfrom step import step")
    (job.path / "gpu.py").write_text(gpu)
    out = job("--backend", "cuda", "--", sys.executable, "gpu.py", extra_env=environ)
    assert out.returncode == 3, out.stderr
    assert "read-after-write" in out.stderr
    out = job("--backend", "cuda", "--", sys.executable, "gpu.py", "--clean", extra_env=environ)
    assert out.returncode == 0, out.stderr


def test_options_take_the_ini_defaults_relative_to_its_folder(tmp_path):
    """Found as pytest finds its ini, from the working directory up; its paths are relative to its folder, the
    command line's to the working directory, and suppression files add up."""
    from pytest_streamrace.run import options

    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\nstreamrace_latent = "fail"\n'
                                             'streamrace_suppressions = ["ci/rules.txt"]\n'
                                             'streamrace_baseline = "ci/known.json"\n')
    work = tmp_path / "jobs"
    work.mkdir()
    settings = options.parse(["--suppress", "mine.txt", "--report-only", "--", "python", "-m", "x"], cwd=str(work))
    assert (settings.latent, settings.report_only, settings.backend) == ("fail", True, "auto")
    assert settings.suppress == [str(tmp_path / "ci/rules.txt"), str(work / "mine.txt")]
    assert settings.baseline == str(tmp_path / "ci/known.json") and settings.rootdir == str(tmp_path)
    assert settings.program == ["python", "-m", "x"]
    (work / "tox.ini").write_text("[pytest]\nstreamrace_report_only = maybe\n")
    with pytest.raises(options.UsageError, match="ini streamrace_report_only = 'maybe': expected true or false"):
        options.parse(["--", "python"], cwd=str(work))


def test_the_programs_name_in_the_baseline():
    from pytest_streamrace.run.report import label

    assert label(["torchrun", "--nproc_per_node", "8", "train.py", "--lr", "3"]) == "run:train.py"
    assert label(["python", "-m", "torch.distributed.run", "-m", "pkg.train"]) == "run:pkg.train"
    assert label(["/usr/bin/deepspeed"]) == "run:deepspeed"
