"""`pytest --streamrace` follows each test into the Python processes it starts (other harnesses' rank processes,
pools, subprocesses, torchrun) — through pytester, as users run it, on CPU (virtual streams, gloo)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest

BODY = """
import torch

def racy_body(racy=True):
    side = torch.cuda.Stream()
    x = torch.ones(64)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.mul_(2)                         # SIDE-WRITE
    if not racy:
        torch.cuda.current_stream().wait_stream(side)
    y = (x + 1).sum().item()              # MAIN-READ
    torch.cuda.current_stream().wait_stream(side)
    return y
"""


def _line(marker: str) -> int:
    return next(i for i, text in enumerate(BODY.lstrip("\n").splitlines(), 1) if marker in text)

MULTIPROCESS_TEST_CASE = """
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase
from body import racy_body

class TestRanks(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def _rank_body(self, racy):
        dist.init_process_group("gloo", store=dist.FileStore(self.file_name, self.world_size), rank=self.rank,
                                world_size=self.world_size)
        t = dist.all_reduce(__import__("torch").ones(4))
        racy_body(racy)
        dist.barrier()
        dist.destroy_process_group()

    def test_racy(self):
        self._rank_body(True)

    def test_clean(self):
        self._rank_body(False)
"""

KINDS = """
import multiprocessing as mp, os, subprocess, sys, time
import torch.multiprocessing as torch_mp
from body import racy_body

HERE = os.path.dirname(os.path.abspath(__file__))

def spawned(rank, racy):
    os.environ["RANK"] = str(rank)
    racy_body(racy)

def test_spawn_racy():
    torch_mp.spawn(spawned, args=(True,), nprocs=2)

def test_spawn_clean():
    torch_mp.spawn(spawned, args=(False,), nprocs=2)

def test_fork_racy():
    p = mp.get_context("fork").Process(target=racy_body)
    p.start()
    p.join()
    assert p.exitcode == 0

CHILD = '''
import os, sys
sys.path.insert(0, {here!r})
from body import racy_body
racy_body({racy})
if {hard}:
    os._exit(3)
'''

def child(tmp_path, racy=True, hard=False):
    path = tmp_path / "child.py"
    path.write_text(CHILD.format(here=HERE, racy=racy, hard=hard))
    return [sys.executable, str(path)]

def test_subprocess_racy(tmp_path):
    subprocess.run(child(tmp_path), check=True)

def test_subprocess_clean(tmp_path):
    subprocess.run(child(tmp_path, racy=False), check=True)

OPTED_OUT = '''
import sys, torch
assert "pytest_streamrace.children.child" not in sys.modules
try:
    torch.cuda.Stream()
except Exception:
    pass
else:
    raise AssertionError("virtual streams in an opted-out child")
'''

def test_subprocess_opted_out():
    subprocess.run([sys.executable, "-c", OPTED_OUT], check=True, env={**os.environ, "STREAMRACE_SUBPROCESS": "0"})

def test_os_exit_after_race(tmp_path):
    assert subprocess.run(child(tmp_path, hard=True)).returncode == 3

_pool = None

def pool_task(racy):
    return racy_body(racy)

def test_pool_first_clean():
    global _pool
    _pool = mp.get_context("forkserver").Pool(2)
    assert _pool.map(pool_task, [False, False]) == [192.0, 192.0]

def test_pool_second_racy():
    _pool.map(pool_task, [True, True])

def test_pool_third_racy_the_same_way():
    try:
        _pool.map(pool_task, [True, True])
    finally:
        _pool.close()
        _pool.join()

LATE = '''
import os, sys, time
sys.path.insert(0, {here!r})
from body import racy_body
while not os.path.exists("go"):
    time.sleep(0.01)
racy_body()
open("done", "w").close()
'''

def test_outlived_by_its_child(tmp_path):
    (tmp_path / "late.py").write_text(LATE.format(here=HERE))
    subprocess.Popen([sys.executable, str(tmp_path / "late.py")], cwd=HERE)

def test_next_one_runs_while_it_races():
    open(os.path.join(HERE, "go"), "w").close()
    while not os.path.exists(os.path.join(HERE, "done")):
        time.sleep(0.01)
    time.sleep(0.2)  # the child exits
"""

KINDS_OUTCOMES = {
    "test_spawn_racy": "failed", "test_spawn_clean": "passed", "test_fork_racy": "failed",
    "test_subprocess_racy": "failed", "test_subprocess_clean": "passed", "test_subprocess_opted_out": "passed",
    "test_os_exit_after_race": "failed", "test_pool_first_clean": "passed", "test_pool_second_racy": "failed",
    "test_pool_third_racy_the_same_way": "failed",
    "test_outlived_by_its_child": "passed", "test_next_one_runs_while_it_races": "passed",
}


def _outcomes(result) -> dict[str, str]:
    out = {}
    for line in result.outlines:
        for word in ("PASSED", "FAILED"):
            if line.startswith(word + " ") and "::" in line:
                out[line.split()[1].split("::")[-1]] = word.lower()
    return out


def _leftovers(marker: str) -> list[int]:
    """Processes (other than this one) whose environment carries `marker` — processes a run left behind."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if marker.encode() in environ:
            found.append(int(entry))
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


@pytest.fixture
def tmpdir_marker(monkeypatch):
    """Inner runs keep their temporary files (the children's data folder included) in a folder of their own, whose
    path then marks every process started in them: none may be left after the run. (Short: forkserver sockets live
    there, and AF_UNIX paths are short.)"""
    folder = tempfile.mkdtemp(prefix="sr-")
    monkeypatch.setenv("TMPDIR", folder)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield folder
    deadline = time.monotonic() + 10  # multiprocessing's resource tracker and forkserver exit on EOF, soon after
    while _leftovers(folder) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert {pid: _cmdline(pid) for pid in _leftovers(folder)} == {}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_multiprocess_test_case_racy_fails_clean_passes(pytester, tmpdir_marker):
    pytester.makepyfile(body=BODY, test_mptc=MULTIPROCESS_TEST_CASE)
    result = pytester.runpytest_subprocess("--streamrace", "-rA", "-p", "no:cacheprovider", "--streamrace-trace",
                                           "trace.json", "--streamrace-json", "races.json")
    result.assert_outcomes(passed=1, failed=1)
    assert _outcomes(result) == {"test_racy": "failed", "test_clean": "passed"}
    races = json.loads((pytester.path / "races.json").read_text())["races"]
    assert sorted((r["test"].split("::")[-1], r["rank"]) for r in races) == [("test_racy", 0), ("test_racy", 1)]
    # a trace process per rank process, named after its test, its pid and its rank; the race's flow arrow in each
    events = json.loads((pytester.path / "trace.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    children = {pid: name for pid, name in names.items() if "child pid" in name}
    assert sorted(name.split("::")[-1].split(" (")[0] for name in children.values()) == \
        ["test_clean", "test_clean", "test_racy", "test_racy"]
    assert sorted(name.rsplit(", ", 1)[-1] for name in children.values()) == ["rank 0)", "rank 0)", "rank 1)",
                                                                             "rank 1)"]
    racy = {pid for pid, name in children.items() if "test_racy" in name}
    assert {e["pid"] for e in events if e.get("cat") == "race"} == racy
    assert any(e.get("name") == "aten::mul_" and e["pid"] in racy for e in events)
    result.stdout.fnmatch_lines([
        "*_ TestRanks.test_racy _*",
        "1 stream race (unordered cross-stream accesses; deduplicated by location pair)",
        "",
        f"stream race on ranks 0, 1: read-after-write on tensor float32[[]64[]] (allocated at body.py:{_line('x =')})",
        f"*earlier*write*aten::mul_*on stream created at body.py:{_line('side =')}*at body.py:{_line('SIDE')} "
        "(racy_body)",
        f"*later*read*aten::add*on default stream*at body.py:{_line('MAIN')} (racy_body)",
        "*(in processes the test started: pid *, *)",
    ])


def _run_kinds(pytester, *args):
    pytester.makepyfile(body=BODY, test_kinds=KINDS)
    return pytester.runpytest_subprocess("--streamrace", "-rA", "-p", "no:cacheprovider", "--streamrace-json",
                                         "races.json", "-p", "no:randomly", *args)


def _check_kinds(pytester, result) -> None:
    assert _outcomes(result) == KINDS_OUTCOMES
    doc = json.loads((pytester.path / "races.json").read_text())
    by_test: dict[str, list] = {}
    for race in doc["races"]:
        by_test.setdefault(race["test"].split("::")[-1], []).append(race)
    assert sorted(by_test) == sorted(["test_spawn_racy", "test_fork_racy", "test_subprocess_racy",
                                      "test_os_exit_after_race", "test_pool_second_racy",
                                      "test_pool_third_racy_the_same_way", "test_outlived_by_its_child"])
    assert sorted(r["rank"] for r in by_test["test_spawn_racy"]) == [0, 1]
    # the first pool test had none; the same 2 workers racing the same way in the next two tests report each time
    # (once per worker that ran a task: the pool may hand both tasks to one worker)
    second, third = by_test["test_pool_second_racy"], by_test["test_pool_third_racy_the_same_way"]
    assert 1 <= len(second) == len({r["pid"] for r in second}) <= 2
    assert 1 <= len(third) == len({r["pid"] for r in third}) <= 2
    assert len({r["pid"] for r in second + third}) <= 2
    late = by_test["test_outlived_by_its_child"]
    assert [r.get("after_test") for r in late] == [True]
    assert all(not r.get("after_test") for name, races in by_test.items() if name != "test_outlived_by_its_child"
               for r in races)
    for races in by_test.values():
        assert {r["kind"] for r in races} == {"read-after-write"}
        assert {r["later"]["frames"][0]["line"] for r in races} == {_line("MAIN")}
    result.stdout.fnmatch_lines([
        "*= streamrace: races in processes after their test had finished =*",
        "from processes started by test_kinds.py::test_outlived_by_its_child, judged after that test had finished:",
        f"stream race: read-after-write on tensor float32[[]64[]] (allocated at body.py:{_line('x =')})",
    ])


def test_spawn_fork_pool_subprocess_os_exit_and_a_child_outliving_its_test(pytester, tmpdir_marker):
    result = _run_kinds(pytester)
    _check_kinds(pytester, result)
    result.stdout.fnmatch_lines(["*_ test_spawn_racy _*", "stream race on ranks 0, 1: read-after-write*"])


def test_same_under_xdist(pytester, tmpdir_marker):
    result = _run_kinds(pytester, "-n", "2", "--dist", "loadfile")
    _check_kinds(pytester, result)


TORCHRUN_SCRIPT = """
import torch, torch.distributed as dist
from body import racy_body
dist.init_process_group("gloo")
racy_body()
dist.barrier()
dist.destroy_process_group()
"""

TORCHRUN_TEST = """
import os, subprocess, sys

def test_torchrun_script():
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
                    "--master_addr", "127.0.0.1", "--master_port", "{port}", "script.py"],
                   check=True, env={{**os.environ, "CUDA_VISIBLE_DEVICES": ""}}, timeout=120)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_started_by_a_test(pytester, tmpdir_marker):
    pytester.makepyfile(body=BODY, script=TORCHRUN_SCRIPT, test_launch=TORCHRUN_TEST.format(port=_free_port()))
    result = pytester.runpytest_subprocess("--streamrace", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["stream race on ranks 0, 1: read-after-write on tensor float32[[]64[]]*"])


OFF = """
import os, subprocess, sys

PROBE = '''
import os, sys, torch
print("env", os.environ.get("STREAMRACE_SUBPROCESS"))
print("hook", "pytest_streamrace.children.child" in sys.modules)
try:
    torch.cuda.Stream()
    print("streams", "yes")
except Exception:
    print("streams", "no")
'''

def test_probe():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    print(out)
    assert out.split() == ["env", "None", "hook", "False", "streams", "no"]
"""


def test_without_streamrace_a_child_is_untouched(pytester, tmpdir_marker):
    pytester.makepyfile(test_off=OFF)
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


CUDA_CHILD = """
import torch
from pytest_streamrace.children import child
from pytest_streamrace.detector import session
assert not torch.cuda.is_initialized()
assert session.active() is None, "the cuda backend started before the child initialized CUDA"
assert [call for call, _ in torch.cuda._queued_calls if call is child._start_quietly]
print("waits for CUDA")
"""


def test_cuda_backend_starts_in_a_child_only_when_it_initializes_cuda(tmp_path):
    """A child on the cuda backend must not make a CUDA context at `import torch` (it would pin the device before the
    child's set_device and break children that fork later): the detector starts from CUDA's lazy initialization."""
    import subprocess
    import sys

    from pytest_streamrace.children.startup_hook import StartupHook

    hook = StartupHook()
    assert hook.install() is None
    env = {**os.environ, "STREAMRACE_SUBPROCESS": json.dumps({"dir": str(tmp_path), "backend": "cuda", "test": "t"})}
    try:
        out = subprocess.run([sys.executable, "-c", CUDA_CHILD], env=env, capture_output=True, text=True)
    finally:
        hook.remove()
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "waits for CUDA"


UNMODELLED_CHILD = '''
import os, subprocess, sys

CHILD = "import undescribable, torch; (torch.ones(7, 3) * 2).sum()"  # undescribable: the tracker fails on 7x3

def test_child_skips_an_op():
    subprocess.run([sys.executable, "-c", CHILD], check=True, env={**os.environ, "RANK": "1"})

def test_next_child_is_clean():
    subprocess.run([sys.executable, "-c", "import torch; (torch.ones(7, 3) * 2).sum()"], check=True)
'''


def test_what_a_child_could_not_model_is_said_in_its_test(pytester, tmpdir_marker, monkeypatch):
    """A child's detector skips what it cannot model as the test's own does: with a note, shown with the test that
    started the child (its rank named), not lost in the child and not raised into it."""
    from test_hints import UNDESCRIBABLE

    monkeypatch.setenv("STREAMRACE_NATIVE", "0")  # the fault is injected into the dispatch mode's Python

    pytester.makepyfile(test_note=UNMODELLED_CHILD, undescribable=UNDESCRIBABLE)
    result = pytester.runpytest_subprocess("--streamrace", "-rA", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    said = "is not checked: RuntimeError: cannot describe this tensor"
    notes = [line for line in result.stdout.lines if said in line]
    assert notes and all("(streamrace note, rank 1)" in line for line in notes), notes
    summary = [line for line in notes if line.startswith("test_note.py")]
    assert summary and all(line.startswith("test_note.py::test_child_skips_an_op: ") for line in summary), summary
    assert "Ops the detector could not model are skipped" in result.stdout.str()


HOOK_LIFE = """
import os, subprocess, sys, sysconfig, time

def test_hook_lives_with_the_session():
    path = os.path.join(sysconfig.get_paths()["purelib"], f"pytest-streamrace-{os.getpid()}.pth")
    print("HOOK", path)
    assert os.path.exists(path)
    probe = "import sys; print('pytest_streamrace.children.child' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.split() == ["True"]
    if os.environ.get("HANG_HERE"):
        open(os.environ["HANG_HERE"], "w").close()
        time.sleep(600)
"""


def _site_files(folder) -> set[str]:
    """Site-packages' files, less the hooks of pytest sessions alive now (other tests run in parallel)."""
    from pytest_streamrace.children.startup_hook import held

    return {n for n in os.listdir(folder) if not (n.startswith("pytest-streamrace-") and held(os.path.join(folder, n)))}


def test_a_session_leaves_nothing_in_site_packages(pytester, tmp_path, monkeypatch):
    """The start-up hook is there while a session runs (an exec'd child is followed) and gone when it ends; the hook
    of a session that was killed is removed by the next session."""
    import signal
    import subprocess
    import sys
    import sysconfig

    folder = sysconfig.get_paths()["purelib"]
    before = _site_files(folder)
    pytester.makepyfile(test_hook=HOOK_LIFE)
    result = pytester.runpytest_subprocess("--streamrace", "-s", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    hook = next(line.split("HOOK ")[1].strip() for line in result.stdout.lines if "HOOK " in line)
    assert not os.path.exists(hook)
    assert _site_files(folder) - before == set()

    hanging = tmp_path / "hanging"
    monkeypatch.setenv("HANG_HERE", str(hanging))
    killed = subprocess.Popen([sys.executable, "-m", "pytest", "--streamrace", "-p", "no:cacheprovider",
                               str(pytester.path / "test_hook.py")], cwd=pytester.path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not hanging.exists():
            assert killed.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    left = os.path.join(folder, f"pytest-streamrace-{killed.pid}.pth")
    assert os.path.exists(left)  # nothing runs in a process killed outright
    monkeypatch.delenv("HANG_HERE")
    pytester.runpytest_subprocess("--streamrace", "-p", "no:cacheprovider").assert_outcomes(passed=1)
    assert not os.path.exists(left)
    assert _site_files(folder) - before == set()


ENVIRONMENT_ARRAY = """
import ctypes, os, subprocess, sys

libc = ctypes.CDLL(None)
seen = []


def array():
    # the variable in the C environment that the threads of this process read (glibc's getenv, without a lock)
    libc.getenv.restype = ctypes.c_char_p
    return "present" if libc.getenv(b"STREAMRACE_SUBPROCESS") is not None else "absent"


def pytest_sessionstart(session):
    seen.append(("session start", array()))


def pytest_runtest_logfinish(nodeid):
    seen.append(("after " + nodeid.split("::")[-1], array()))


def pytest_sessionfinish(session):
    with open("arrays.txt", "w") as f:
        f.write("\\n".join(f"{when}: {state}" for when, state in seen))
"""

TESTS_OF_THE_ARRAY = """
import os, subprocess, sys
from conftest import array, seen


def test_first():
    seen.append(("in test_first", array()))
    assert os.environ["STREAMRACE_SUBPROCESS"].endswith('"test": "test_env.py::test_first"}')
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_second():
    seen.append(("in test_second", array()))
"""


def test_the_session_never_adds_or_removes_a_variable_while_tests_run(pytester):
    """A test names its owner in the environment of the processes it starts; adding or removing a variable can move
    the C environment's array while another thread reads it (NCCL's heartbeat monitor does, as it starts: ranks died
    of SIGSEGV in getenv). So the variable is there from the session's start to its end and only its value changes
    from test to test (pytest's own PYTEST_CURRENT_TEST comes and goes around each test, outside the item, where a
    rank has no thread of its process group yet)."""
    pytester.makeconftest(ENVIRONMENT_ARRAY)
    pytester.makepyfile(test_env=TESTS_OF_THE_ARRAY)
    result = pytester.runpytest_subprocess("--streamrace", "-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=2)
    assert (pytester.path / "arrays.txt").read_text().splitlines() == [
        "session start: present", "in test_first: present", "after test_first: present", "in test_second: present",
        "after test_second: present"]


def test_the_data_folder_is_listed_again_once_a_child_adds_a_file():
    """A stat stands in for the folder's listing at each judging point once the folder settled (it changed before
    the live file's last write): a child's file created after that listing is still read at the next point."""
    from pytest_streamrace.children.following import Following

    following = Following("virtual", False)
    try:
        assert following.read() == []
        time.sleep(0.02)  # past the clock's step: the live file's next write is later than the folder's change
        following.follow("t::a")
        assert following.read() == [] and following._listed[1]  # settled: the next look is a stat
        assert following.read() == []
        Path(following.dir, "child-1.jsonl").write_text(json.dumps({"kind": "note", "text": "x"}) + "\n")
        assert following.read() == [{"kind": "note", "text": "x"}]
    finally:
        following.close()


TEARDOWN_CHILD = '''
import os, subprocess, sys
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def racy_child_at_teardown():
    yield
    code = f"import sys; sys.path.insert(0, {HERE!r}); from body import racy_body; racy_body(True)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_child_races_in_teardown(racy_child_at_teardown):
    pass
'''


def test_a_child_s_race_in_teardown_is_judged_with_a_trace(pytester, tmpdir_marker):
    """A race in a process started by a fixture's teardown lands in the teardown phase's judging, with the test's
    own races and latent races, in the trace too."""
    pytester.makepyfile(body=BODY, test_teardown=TEARDOWN_CHILD)
    result = pytester.runpytest_subprocess("--streamrace", "-rA", "-p", "no:cacheprovider", "--streamrace-trace",
                                           "trace.json", "--streamrace-json", "races.json")
    result.assert_outcomes(passed=1, errors=1)  # the teardown's child race fails the teardown
    races = json.loads((pytester.path / "races.json").read_text())["races"]
    assert [r["test"].split("::")[-1] for r in races] == ["test_child_races_in_teardown"], races
    events = json.loads((pytester.path / "trace.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "race" for e in events)
