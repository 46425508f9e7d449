"""Once a rank's process group is up, nothing this project runs adds a variable to its environment: adding one can
move glibc's environment array while torch's NCCL heartbeat thread, started with the group, reads it in getenv
(SIGSEGV). pytest's per-test variable is in a rank's environment from the start, and so are NCCL's configuration
files' variables (pytest_streamrace/launcher/nccl_conf.py), in a rank of a `distributed` item, a program under
`streamrace run`, and a session under --streamrace."""

import os
import subprocess
import sys
import textwrap

import pytest

from pytest_streamrace.launcher import nccl_conf

CONF = "# a comment=ignored\nNCCL_STREAMRACE_PROBE=from the file=1\nno equals sign\nNCCL_ALREADY_SET=file\n=nameless\n"


def test_the_files_nccl_reads_and_what_they_add(tmp_path):
    own, system = tmp_path / "own.conf", tmp_path / "system.conf"
    own.write_text(CONF)
    system.write_text("NCCL_STREAMRACE_PROBE=system\nNCCL_SYSTEM_ONLY=2")
    assert nccl_conf.files({"NCCL_CONF_FILE": str(own)}) == [str(own), "/etc/nccl.conf"]
    assert nccl_conf.files({})[0].endswith("/.nccl.conf") and nccl_conf.files({})[1] == "/etc/nccl.conf"
    added = nccl_conf.variables({"NCCL_ALREADY_SET": "env"}, [str(own), str(tmp_path / "missing"), str(system)])
    # the first file to name a variable wins; set ones, comments, lines without a name or '=' add nothing
    assert added == {"NCCL_STREAMRACE_PROBE": "from the file=1", "NCCL_SYSTEM_ONLY": "2"}


PROBE = """
import os, pytest

@pytest.mark.distributed(world_size=2)
def test_rank_has_it(rank):
    assert os.environ.get("NCCL_STREAMRACE_PROBE") == "from the file=1"
    assert os.environ["NCCL_ALREADY_SET"] == "env"

def test_session_has_it():
    assert os.environ.get("NCCL_STREAMRACE_PROBE") == "from the file=1"
"""


def test_ranks_and_a_session_under_the_detector_start_with_them_set(pytester, monkeypatch, tmp_path):
    (tmp_path / "nccl.conf").write_text(CONF)
    monkeypatch.setenv("NCCL_CONF_FILE", str(tmp_path / "nccl.conf"))
    monkeypatch.setenv("NCCL_ALREADY_SET", "env")
    monkeypatch.delenv("NCCL_STREAMRACE_PROBE", raising=False)
    pytester.makepyfile(test_probe=PROBE)
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    plain = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "rank")  # the launcher's ranks, plain
    plain.assert_outcomes(passed=1, deselected=1)


def test_a_program_under_streamrace_run_starts_with_them_set(tmp_path):
    (tmp_path / "nccl.conf").write_text(CONF)
    (tmp_path / "show.py").write_text(textwrap.dedent("""
        import os, sys
        sys.exit(0 if os.environ.get("NCCL_STREAMRACE_PROBE") == "from the file=1" else 9)
    """))
    environ = {**os.environ, "NCCL_CONF_FILE": str(tmp_path / "nccl.conf"), "CUDA_VISIBLE_DEVICES": ""}
    environ.pop("NCCL_STREAMRACE_PROBE", None)
    done = subprocess.run([sys.executable, "-m", "pytest_streamrace", "run", "--", sys.executable, "show.py"],
                          cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]


ADDS = """
import os, sys

import pytest
import torch.distributed as dist

ADDED = []


def _audit(event, args):  # os.environ's writes are os.putenv's: a name not in it yet is an addition
    if event == "os.putenv" and dist.is_initialized():
        name = args[0].decode() if isinstance(args[0], bytes) else args[0]
        if name not in os.environ:
            ADDED.append(name)


sys.addaudithook(_audit)


@pytest.mark.distributed(world_size=2)
def test_nothing_is_added_once_the_group_is_up(rank):
    assert dist.is_initialized()
    import torch._dynamo  # its first import sets inductor's cache folder (FSDP2 and torch.compile import it)

    assert ADDED == []
"""


@pytest.mark.parametrize("mode", [[], ["--streamrace", "--streamrace-backend=virtual"]], ids=["plain", "streamrace"])
def test_a_rank_s_environment_gains_no_variable_once_its_group_is_up(pytester, mode):
    pytester.makepyfile(test_adds=ADDS)
    result = pytester.runpytest_subprocess(*mode, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
