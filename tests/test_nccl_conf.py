"""NCCL's configuration files are in the environment of every process this project starts, before it starts a
thread: NCCL's own setenv of them at its first communicator then adds nothing, which is what lets torch's NCCL
heartbeat thread crash in getenv (pytest_streamrace/nccl_conf.py). Checked on a rank of a `distributed` item, a
program under `streamrace run`, and a session under --streamrace, through NCCL_CONF_FILE."""

import os
import subprocess
import sys
import textwrap

from pytest_streamrace import nccl_conf

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
