"""The suite's warm sessions (warm_pytest.py) against fresh interpreters: what a session can see of how it started."""

import os
import subprocess
import sys
import time

import pytest
import warm_pytest

FACTS = r"""
import os, sys, tempfile
def pytest_sessionfinish(session, exitstatus):
    print("\nFACT cwd", os.getcwd())
    print("FACT path0", sys.path[0])
    print("FACT argv", sys.argv[1:])
    print("FACT env", os.environ.get("WARM_CHECK"))
    print("FACT tmp", tempfile.gettempdir())
    print("FACT plugin-fresh", "pytest_streamrace.plugin" in sys.modules)
    print("FACT main", sys.modules["__main__"].__spec__.name)
"""


def _facts(result) -> list[str]:
    return [line for line in result.outlines if line.startswith("FACT ")]


@pytest.mark.cold_start
def test_a_warm_session_sees_what_a_fresh_one_sees(pytester, monkeypatch, tmp_path):
    pytester.makeconftest(FACTS)
    pytester.makepyfile("def test_ok(): pass\ndef test_bad(): assert False")
    monkeypatch.setenv("WARM_CHECK", "yes")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    cold = pytester.runpytest_subprocess("-s", "-p", "no:cacheprovider")
    pytester.popen = warm_pytest.popen_for(pytester)
    warm = pytester.runpytest_subprocess("-s", "-p", "no:cacheprovider")
    assert cold.ret == warm.ret == 1
    warm.assert_outcomes(passed=1, failed=1)
    cold_facts, warm_facts = _facts(cold), _facts(warm)
    assert len(cold_facts) == 7 and "FACT env yes" in cold_facts and f"FACT tmp {tmp_path}" in cold_facts
    # --basetemp differs between the two runs (pytester numbers them); all else is the same
    assert [f for f in warm_facts if "argv" not in f] == [f for f in cold_facts if "argv" not in f]
    assert [f.split("runpytest-")[0] for f in warm_facts] == [f.split("runpytest-")[0] for f in cold_facts]


def test_a_hung_warm_session_is_killed_at_its_timeout(pytester):
    pytester.makepyfile("import time\ndef test_hang(): time.sleep(600)")
    with pytest.raises(pytester.TimeoutExpired):
        pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=3)
    # the server serves the next session (it reaped the killed one)
    pytester.makepyfile("def test_ok(): pass")
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_the_server_exits_with_the_process_that_started_it(tmp_path):
    code = ("import sys, os; sys.path.insert(0, %r); import warm_pytest as w; s = w.Server(); print(s.proc.pid)"
            % str(warm_pytest.__file__.rsplit("/", 1)[0]))
    pid = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                return
            if state == "Z":
                return
            time.sleep(0.1)
        pytest.fail(f"warm server {pid} outlived the process that started it")
    finally:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
