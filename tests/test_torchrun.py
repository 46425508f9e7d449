"""torchrun-launched sessions: real `torch.distributed.run` with 2 gloo ranks on loopback, each running pytest.

Each launch costs seconds, so one launch runs a file of many cases and several tests read its output.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

RECORD_EXIT = """
import os
from pathlib import Path

def pytest_sessionfinish(session, exitstatus):
    Path(f"exit-{os.environ['RANK']}").write_text(str(int(exitstatus)))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(path: Path, *args: str, timeout: float = 120, gpus: bool = False,
             cache: bool = False) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc_per_node 2 -m pytest ARGS` in path; stdout and stderr merged. Without `gpus` the
    ranks see no GPU, so the session is on gloo (CPU tensors) on GPU machines too."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "240"}
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop("PYTEST_XDIST_WORKER", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           "-m", "pytest", *([] if cache else ["-p", "no:cacheprovider"]), "-p", "no:xdist", *args]
    return subprocess.run(cmd, cwd=path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)


def write(path: Path, **files: str) -> None:
    for name, text in files.items():
        (path / f"{name}.py").write_text(textwrap.dedent(text))


def exit_codes(path: Path) -> list[str]:
    return [(path / f"exit-{r}").read_text() for r in (0, 1)]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


CASES = """
import os

import pytest
import torch
import torch.distributed as dist

RANK = int(os.environ["RANK"])


@pytest.mark.distributed(world_size=2)
def test_all_reduce_gives_world_size(rank, world_size):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world_size == 2


@pytest.mark.distributed(world_size=2)
def test_fails_on_rank_1(rank):
    dist.barrier()
    assert rank != 1, "rank one disagrees"


@pytest.mark.distributed(world_size=4)
def test_needs_four_ranks():
    raise AssertionError("must not run")


def test_plain_fails_on_rank_1():
    assert RANK == 0, "plain test broke on rank 1"


def test_skips_on_rank_1_only():
    if RANK == 1:
        pytest.skip("no accelerator on this rank")


def test_skips_everywhere():
    pytest.skip("nothing to do")


def test_plain_passes():
    print(f"output of rank {RANK}")


@pytest.mark.distributed(world_size="two")
def test_bad_world_size():
    pass
"""


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """One torchrun launch of CASES (the process group is the plugin's own), shared by the xdist workers."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is None:
        path = tmp_path_factory.mktemp("torchrun")
        return SimpleResult(path, *_launch_cases(path))
    path = tmp_path_factory.getbasetemp().parent / f"torchrun-cases-{run_id}"
    path.mkdir(exist_ok=True)
    with open(path / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first worker launches; the others read what it recorded
        if not (path / "result.json").exists():
            (path / "result.json").write_text(json.dumps(_launch_cases(path)))
    return SimpleResult(path, *json.loads((path / "result.json").read_text()))


# Files every rank would write: rank 1 finishes last on purpose, so had it written them, its writes would stand.
FILES_BY_RANK = """
import os
import time
from pathlib import Path

import pytest

@pytest.fixture(scope="session", autouse=True)
def _rank_in_junit(record_testsuite_property):
    record_testsuite_property("rank", os.environ["RANK"])

def pytest_sessionfinish(session, exitstatus):
    Path(f"exit-{os.environ['RANK']}").write_text(str(int(exitstatus)))
    session.config.cache.set("probe/rank", os.environ["RANK"])
    if os.environ["RANK"] == "1":
        time.sleep(1)
"""


def _launch_cases(path: Path) -> tuple[int, str]:
    write(path, conftest=FILES_BY_RANK, test_cases=CASES)
    proc = torchrun(path, "-rA", "-v", "--junitxml=junit.xml", cache=True)
    return proc.returncode, proc.stdout


class SimpleResult:
    def __init__(self, path: Path, ret: int, out: str):
        self.path, self.ret, self.out = path, ret, out

    def outcome(self, name: str) -> str:
        """The verbose result line of a test ("PASSED", "SKIPPED (reason)", ...), which only rank 0 prints."""
        found = re.findall(rf"^\S+::{name} (.*?)\s*\[ *\d+%\]$", self.out, re.M)
        assert len(found) == 1, f"{name}: {found}\n{self.out}"
        return found[0]

    def section(self, name: str) -> str:
        """The failure section of a test in rank 0's report."""
        m = re.search(rf"_{{3,}} (?:ERROR at \w+ of )?{name} _{{3,}}\n(.*?)(?=\n_{{3,}} |\n={{3,}} )", self.out, re.S)
        assert m, f"no failure section for {name}\n{self.out}"
        return m.group(1)


def test_distributed_test_passes_with_all_reduce(session):
    assert session.outcome("test_all_reduce_gives_world_size").startswith("PASSED")


def test_failure_on_rank_1_fails_item_and_rank_0_shows_rank_1_traceback(session):
    assert session.outcome("test_fails_on_rank_1").startswith("FAILED")
    text = session.section("test_fails_on_rank_1")
    assert re.search(r"-+ rank 1 -+", text)
    assert "AssertionError: rank one disagrees" in text
    assert "rank 0" not in text  # rank 0 passed: it is not listed as failing
    assert session.ret != 0
    assert exit_codes(session.path) == ["1", "1"]


def test_world_size_mismatch_skips_with_both_numbers(session):
    line = session.outcome("test_needs_four_ranks")
    assert line == "SKIPPED (distributed(world_size=4) needs 4 ranks; this torchrun session has 2)"
    assert re.search(r"SKIPPED \[1\] test_cases.py:\d+: distributed\(world_size=4\)", session.out)
    assert "must not run" not in session.out


def test_non_distributed_failure_on_one_rank_fails_everywhere(session):
    assert session.outcome("test_plain_fails_on_rank_1").startswith("FAILED")
    text = session.section("test_plain_fails_on_rank_1")
    assert "rank 1" in text and "plain test broke on rank 1" in text


def test_partial_skip_fails_naming_ranks_and_reason(session):
    assert session.outcome("test_skips_on_rank_1_only").startswith("FAILED")
    text = session.section("test_skips_on_rank_1_only")
    assert "outcomes differ across ranks" in text
    assert "skipped on rank 1: Skipped: no accelerator on this rank" in text
    assert "passed on rank 0" in text


def test_skip_on_every_rank_is_a_skip(session):
    assert session.outcome("test_skips_everywhere") == "SKIPPED (nothing to do)"
    assert session.outcome("test_plain_passes").startswith("PASSED")


def test_bad_marker_fails_with_one_line_on_every_rank(session):
    assert session.outcome("test_bad_world_size") == "ERROR"
    assert "ERROR test_cases.py::test_bad_world_size - ranks 0, 1: Failed: @pytest.mark.distributed" in session.out
    text = session.section("test_bad_world_size")
    assert re.search(r"-+ ranks 0, 1 -+\n@pytest.mark.distributed: world_size must be a positive integer, "
                     r"got 'two'\n*$", text), text


def test_only_rank_0_prints(session):
    summaries = re.findall(r"=+ 3 failed, 2 passed, 2 skipped, 1 error in [\d.]+s", session.out)
    assert len(summaries) == 1, session.out
    assert "torchrun session, rank 0 of 2" in session.out
    assert "torchrun session, rank 1 of 2" not in session.out
    assert "output of rank 0" in session.out  # -rA shows rank 0's captured output once
    assert session.out.count("short test summary info") == 1


def test_only_rank_0_writes_junit_xml_and_the_cache(session):
    import xml.etree.ElementTree as ET

    suite = ET.parse(session.path / "junit.xml").getroot().find("testsuite")
    assert suite.find("properties/property[@name='rank']").get("value") == "0"
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped")) == \
        ("8", "3", "1", "2")
    assert json.loads((session.path / ".pytest_cache/v/probe/rank").read_text()) == "0"


def _record_pid(extra: str = "") -> str:
    return RECORD_EXIT + textwrap.dedent(f"""
        def pytest_configure(config):
            Path(f"pid-{{os.environ['RANK']}}").write_text(str(os.getpid()))
            {extra}
        """)


@pytest.mark.parametrize("hung", [1, 0])
def test_hang_on_one_rank_reports_missing_rank_and_stops(tmp_path, hung):
    # The user's conftest initializes the group: the plugin joins it instead of failing on a second init.
    write(tmp_path, conftest=_record_pid("import torch.distributed as dist; dist.init_process_group('gloo')"),
          test_hang=f"""
        import time

        import pytest


        @pytest.mark.distributed(world_size=2, timeout=1)
        def test_sleeps_on_one_rank(rank):
            if rank == {hung}:
                time.sleep(600)


        def test_after_the_hang():
            pass
        """)
    proc = torchrun(tmp_path, "-rA")
    out = proc.stdout
    assert proc.returncode != 0
    text = SimpleResult(tmp_path, proc.returncode, proc.stdout).section("test_sleeps_on_one_rank")
    assert f"rank {hung} did not report within 1 s; its stacks at the timeout:" in text
    assert re.search(r"test_hang.py\", line \d+ in test_sleeps_on_one_rank", text)  # posted by its watchdog
    assert f"Interrupted: rank {hung} did not report within 1 s" in out
    assert out.count("short test summary info") == 1  # rank 0, or rank 1 when rank 0 is the one missing
    assert "test_after_the_hang" not in out
    assert (tmp_path / f"exit-{1 - hung}").read_text() == "2"
    assert not [pid for pid in _pids(tmp_path) if alive(pid)]


def test_all_ranks_stuck_rank_0_dumps_every_stack_and_exits(tmp_path):
    write(tmp_path, conftest=_record_pid(), test_stuck="""
        import time

        import pytest
        import torch.distributed as dist


        @pytest.mark.distributed(world_size=2, timeout=1)
        def test_blocks_in_barrier(rank):
            if rank == 1:
                time.sleep(600)
            dist.barrier()
        """)
    proc = torchrun(tmp_path)
    out = proc.stdout
    assert proc.returncode != 0
    assert "test_stuck.py::test_blocks_in_barrier still running on rank 0 after 1 s" in out
    rank0, rank1 = out.split("---- rank 0 ----", 1)[1].split("---- rank 1 ----", 1)
    assert "in test_blocks_in_barrier" in rank0 and "barrier" in rank0
    assert "in test_blocks_in_barrier" in rank1
    assert not [pid for pid in _pids(tmp_path) if alive(pid)]


def _pids(path: Path) -> list[int]:
    pids = [int((path / f"pid-{r}").read_text()) for r in (0, 1)]
    assert len(set(pids)) == 2
    return pids


def test_ranks_that_collect_differently_stop_before_running(tmp_path):
    write(tmp_path, conftest=RECORD_EXIT, test_a="""
        import os

        def test_everywhere():
            pass

        if os.environ["RANK"] == "1":
            def test_only_on_rank_1():
                pass
        """, test_b="""
        import os

        if os.environ["RANK"] == "1":
            raise ImportError("cannot import on rank 1")

        def test_b():
            pass
        """)
    proc = torchrun(tmp_path)
    out = proc.stdout
    assert proc.returncode != 0
    assert "rank 1 collected differently from rank 0" in out
    assert "only on rank 1: test_a.py::test_only_on_rank_1" in out
    assert "not on rank 1: test_b.py::test_b" in out
    assert "ImportError: cannot import on rank 1" in out
    assert "Interrupted: ranks collected different tests (rank 1 differs from rank 0)" in out
    assert "test_everywhere PASSED" not in out and " passed" not in out
    assert exit_codes(tmp_path) == ["2", "2"]


def test_xdist_inside_torchrun_is_a_usage_error(pytester):
    pytester.makepyfile("def test_ok(): pass")
    env = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    for name, value in env.items():
        pytester._monkeypatch.setenv(name, value)
    result = pytester.runpytest_subprocess("-n", "2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: pytest-xdist (-n) cannot run inside a torchrun session*"])
    assert "Traceback" not in result.stderr.str()


NCCL_CASES = """
import pytest, torch, torch.distributed as dist

@pytest.mark.distributed(world_size=2)
def test_nccl_all_reduce(rank):
    assert dist.get_backend() == "nccl"
    assert torch.cuda.current_device() == rank
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    assert x[0].item() == 2.0

@pytest.mark.distributed(world_size=2)
def test_nccl_fails_on_rank_1(rank):
    x = torch.ones(4, device="cuda")
    dist.all_reduce(x)
    assert rank == 0, "rank one saw " + str(x.sum().item())
"""


@pytest.mark.skipif(len(__import__("pytest_streamrace.env").env.visible_gpus()) < 2,
                    reason="needs 2 CUDA GPUs")
def test_torchrun_on_nccl(tmp_path):
    write(tmp_path, test_nccl=NCCL_CASES)
    out = torchrun(tmp_path, "-rA", "test_nccl.py", gpus=True).stdout
    assert "1 failed, 1 passed" in out, out
    assert "rank one saw 8.0" in out and "rank 1" in out, out
