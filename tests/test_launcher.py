"""The distributed marker end to end: real pytest sessions (pytester subprocesses), real rank processes, gloo.

Scenarios are grouped into a few sessions to keep the suite fast. Every rank records its pid (and the pids of
what it started) so each test can check that no process outlived its item.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest

# Every test file below gets this conftest: each rank records its pid and its parent's (the fork server).
PID_CONFTEST = """
import os
import pytest

@pytest.fixture(autouse=True)
def _record_pid():
    if "STREAMRACE_RANK_SPEC" in os.environ:
        for pid in (os.getpid(), os.getppid()):
            open(os.path.join(os.environ["PIDS_DIR"], str(pid)), "w").close()
    yield
"""


@pytest.fixture
def run(pytester, monkeypatch, tmp_path):
    """Run pytest on a file in a subprocess, then assert that no rank, rank child or fork server survived."""
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    monkeypatch.setenv("PIDS_DIR", str(pids_dir))
    pytester.makeconftest(PID_CONFTEST)

    def run(source: str, *args: str) -> pytest.RunResult:
        pytester.makepyfile(source)
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args, timeout=120)
        assert_all_gone(pids_dir)
        return result

    return run


def recorded_pids(pids_dir) -> list[int]:
    return [int(p.name) for p in pids_dir.iterdir()]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, only not yet reaped
    except (FileNotFoundError, ProcessLookupError):
        return False


def assert_all_gone(pids_dir, wait: float = 5.0) -> None:
    pids = recorded_pids(pids_dir)
    deadline = time.monotonic() + wait
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if alive(p)] == []


FAILURES = """
import ctypes, os, subprocess, sys
import pytest, torch, torch.distributed as dist

@pytest.mark.distributed(world_size=2)
def test_fails_on_rank1(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert rank == 0, f"rank {rank} disagrees"

@pytest.mark.distributed(world_size=2)
def test_raises_before_collective(rank):
    if rank == 1:
        raise ValueError("rank one gave up early")
    dist.all_reduce(torch.ones(1))

@pytest.mark.distributed(world_size=2)
def test_exits(rank):
    if rank == 1:
        os._exit(3)
    dist.barrier()

@pytest.mark.distributed(world_size=2)
def test_segfaults(rank, tmp_path):
    # a grandchild that must not outlive the item
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    open(os.path.join(os.environ["PIDS_DIR"], str(child.pid)), "w").close()
    if rank == 1:
        ctypes.string_at(0)
    dist.barrier()
"""


def test_rank_failures_are_reported_per_rank(run):
    start = time.monotonic()
    result = run(FAILURES)
    result.assert_outcomes(failed=4)
    out = result.stdout.str()
    assert time.monotonic() - start < 90  # not the 300 s default timeout

    fails = section(out, "test_fails_on_rank1")
    assert "distributed test failed on rank 1 of 2" in fails
    assert "---- rank 1: failed in call ----" in fails
    assert "AssertionError: rank 1 disagrees" in fails
    assert "rank 0:" not in fails
    assert "gloo" not in fails.lower() and "connection" not in fails.lower()

    early = section(out, "test_raises_before_collective")
    assert "distributed test failed on rank 1 of 2 (rank 0 stopped while blocked)" in early
    assert "ValueError: rank one gave up early" in early
    assert "---- rank 0: stopped while blocked (during call); its Python stack then ----" in early
    stack = early.split("rank 0: stopped while blocked")[1]
    assert "in all_reduce" in stack and "in test_raises_before_collective" in stack
    assert "gloo" not in early.lower()

    exits = section(out, "test_exits")
    assert "distributed test rank 1 of 2 died: exit code 3" in exits
    assert "---- rank 1 died: exit code 3 (during call) ----" in exits

    segv = section(out, "test_segfaults")
    assert "distributed test rank 1 of 2 died: killed by signal SIGSEGV" in segv
    assert "Fatal Python error: Segmentation fault" in segv  # the tail of its output
    assert "in test_segfaults" in segv


OUTCOMES = """
import os
import pytest, torch, torch.distributed as dist

@pytest.fixture
def shard(rank, world_size):
    return torch.full((1,), float(rank + 1))

@pytest.mark.distributed(world_size=1)
def test_size_1(shard, world_size):
    dist.all_reduce(shard)
    assert (shard.item(), world_size) == (1, 1)

@pytest.mark.distributed(2)
def test_size_2(shard, rank):
    dist.all_reduce(shard)
    print(f"rank {rank} says hello; sum {shard.item():g}; ifname {os.environ['GLOO_SOCKET_IFNAME']}")
    assert shard.item() == 3

@pytest.mark.distributed(world_size=3, backend="gloo")
def test_size_3(shard):
    dist.all_reduce(shard)
    assert shard.item() == 6

@pytest.mark.distributed(world_size=4, backend="auto")
def test_size_4(shard, world_size):
    dist.all_reduce(shard)
    assert shard.item() == 10 and dist.get_world_size() == world_size == 4

@pytest.mark.distributed(world_size=2)
def test_skip_everywhere(rank):
    pytest.skip("nothing to do here")

@pytest.mark.distributed(world_size=2)
def test_skip_on_rank1(rank):
    if rank == 1:
        pytest.skip("rank one has no data")
    dist.barrier()

@pytest.mark.distributed(world_size=2, backend="nccl")
def test_nccl():
    pass

@pytest.mark.distributed(world_size=0)
def test_zero_ranks():
    pass

@pytest.mark.distributed(world_size=2, backend="mpi")
def test_unknown_backend():
    pass

@pytest.mark.distributed(world_size=2, timeout=-1)
def test_bad_timeout():
    pass

@pytest.mark.distributed(world_size=2)
@pytest.mark.xfail(reason="rank 1 is known to be wrong")
def test_xfail(rank):
    assert rank == 0
"""


def test_outcomes_world_sizes_output_and_bad_markers(run):
    result = run(OUTCOMES, "-rsxP")
    result.assert_outcomes(passed=4, failed=1, skipped=2, errors=3, xfailed=1)
    out = result.stdout.str()
    for rank in (0, 1):
        assert f"Captured stdout call (rank {rank})" in out
        assert f"rank {rank} says hello; sum 3; ifname lo" in out
    result.stdout.fnmatch_lines([
        "*SKIPPED*test_*.py:*: nothing to do here",
        "*SKIPPED*test_*.py:*: backend nccl needs 2 CUDA GPUs, this machine has 0",
        "*XFAIL*test_xfail*",
    ])
    partial = section(out, "test_skip_on_rank1")
    assert "distributed test skipped on rank 1 of 2 only (rank 0 stopped while blocked)" in partial
    assert "---- rank 1: skipped in call: rank one has no data" in partial
    assert "in barrier" in partial
    assert "@pytest.mark.distributed: world_size must be a positive integer, got 0" in out
    assert "@pytest.mark.distributed: unknown backend 'mpi' (expected gloo, nccl or auto)" in out
    assert "@pytest.mark.distributed: timeout must be a positive number of seconds, got -1" in out
    assert "Traceback" not in section(out, "test_zero_ranks")


HANGS = """
import time
import pytest, torch.distributed as dist

@pytest.mark.distributed(world_size=2, timeout=2.5)
def test_marker_timeout_beats_ini(rank):
    if rank == 1:
        time.sleep(600)
    dist.barrier()

@pytest.mark.distributed(world_size=2)
def test_ini_timeout(rank):
    dist.barrier()
    if rank == 0:
        time.sleep(600)
"""


def test_hang_times_out_with_every_ranks_stack(run, pytester):
    pytester.makeini("[pytest]\nstreamrace_timeout = 1.5\n")
    result = run(HANGS)
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    marker = section(out, "test_marker_timeout_beats_ini")
    assert "distributed test timed out after 2.5 s with ranks 0, 1 still running" in marker
    rank0, rank1 = marker.split("---- rank 0:")[1].split("---- rank 1:")
    assert "in barrier" in rank0 and "in test_marker_timeout_beats_ini" in rank0
    assert "in test_marker_timeout_beats_ini" in rank1 and "in barrier" not in rank1
    ini = section(out, "test_ini_timeout")
    assert "distributed test timed out after 1.5 s with rank 0 still running" in ini
    assert "---- rank 1" not in ini  # it had finished and was waiting to be released


XDIST = """
import pytest, torch, torch.distributed as dist

@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("i", range(6))
def test_sum(i, rank, record_property):
    t = torch.full((1,), float(i + rank))
    dist.all_reduce(t)
    record_property("sum", t.item())
    assert t.item() == 2 * i + 1

@pytest.mark.distributed(world_size=2)
def test_fails_on_rank1(rank):
    dist.barrier()
    assert rank == 0, "only rank 0 is right"
"""


def test_several_distributed_tests_under_xdist(run, pytester):
    pytester.makeini("[pytest]\naddopts = -n 2\n")  # ranks must not start workers of their own
    result = run(XDIST, "--junitxml=report.xml")
    result.assert_outcomes(passed=6, failed=1)
    result.stdout.fnmatch_lines(["*created: 2/2 workers*"])
    failure = section(result.stdout.str(), "test_fails_on_rank1")  # shipped from a worker as text
    assert "---- rank 1: failed in call ----" in failure and "AssertionError: only rank 0 is right" in failure
    junit = (pytester.path / "report.xml").read_text()  # every rank's record_property, once
    assert junit.count('<property name="sum" value="5.0" />') == 2  # test_sum[2] on ranks 0 and 1
    assert junit.count('<property name="sum"') == 12


INTERRUPTED = """
import os, time
import pytest, torch.distributed as dist

@pytest.mark.distributed(world_size=2)
def test_waits(rank):
    dist.barrier()
    open(os.path.join(os.environ["PIDS_DIR"], "ready-%d" % rank), "w").close()
    time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "parent-killed"])
def test_interrupted_session_leaves_no_rank_behind(pytester, monkeypatch, tmp_path, sig):
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    monkeypatch.setenv("PIDS_DIR", str(pids_dir))
    pytester.makeconftest(PID_CONFTEST)
    path = pytester.makepyfile(INTERRUPTED)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(path)],
                            cwd=pytester.path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # Waits as long as the session takes to start its ranks: on a loaded 2-core machine that passed the 60 s this
        # test once allowed. The session bounds the wait (the fork server's start, the item's timeout); the deadline
        # is only a backstop against a hang.
        deadline = time.monotonic() + 900
        while not all((pids_dir / f"ready-{r}").exists() for r in (0, 1)):
            assert proc.poll() is None, "the session ended before its ranks were ready"
            assert time.monotonic() < deadline, "the ranks were not ready after 900 s"
            time.sleep(0.05)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=300)  # a backstop too: it exits at once (SIGKILL) or within ~15 s (Ctrl-C)
    finally:
        proc.kill()
    if sig == signal.SIGINT:
        assert "KeyboardInterrupt" in out
    for ready in pids_dir.glob("ready-*"):
        ready.unlink()
    assert len(recorded_pids(pids_dir)) >= 2
    assert_all_gone(pids_dir, wait=60)  # SIGKILLed processes take a moment to die under load


def section(out: str, test_name: str) -> str:
    """The failure/error block pytest printed for one test: from its "___ name ___" header to the next header or
    "===" line (the short summary's one-liners are not part of it)."""
    header = re.compile(rf"^_+ (?:ERROR at \w+ of )?{re.escape(test_name)} _+$")
    lines = out.splitlines()
    start = next((i for i, text in enumerate(lines) if header.match(text)), None)
    assert start is not None, f"no report block for {test_name}"
    end = next((i for i in range(start + 1, len(lines))
                if re.match(r"^(_{3,} .* _{3,}|={3,}.*)$", lines[i])), len(lines))
    return "\n".join(lines[start:end])


TB_LINE = """
import pytest

@pytest.mark.distributed(world_size=2)
def test_fails_on_rank1(rank):
    assert rank == 0, f"rank {rank} disagrees"

@pytest.mark.distributed(world_size=2)
def test_passes(rank):
    assert rank in (0, 1)
"""


def test_rank_tracebacks_keep_their_structure(run, pytester):
    """A rank's traceback reaches the parent as pytest's structured report: `--tb=line` gives the failing rank's
    own crash line, and junit's failure message is that crash, not the first 50 characters of a text blob."""
    result = run(TB_LINE, "--tb=line", "--junitxml=report.xml")
    result.assert_outcomes(passed=1, failed=1)
    crash = "rank 1: AssertionError: rank 1 disagrees"
    result.stdout.fnmatch_lines([f"*test_rank_tracebacks_keep_their_structure.py:5: {crash}"])
    junit = (pytester.path / "report.xml").read_text()
    assert f'message="{crash}' in junit


WARMING = """
import sys
import pytest, torch

@pytest.mark.distributed(world_size=2)
def test_first_needs_no_optimizer():
    assert "torch._dynamo" not in sys.modules  # the fork server did not import it for nothing

@pytest.mark.distributed(world_size=2)
def test_builds_an_optimizer():
    torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)  # every optimizer's constructor imports dynamo
    assert "torch._dynamo" in sys.modules

@pytest.mark.distributed(world_size=2)
def test_later_ranks_start_with_it():
    assert "torch._dynamo" in sys.modules  # forked after the server imported what the ranks before needed
"""


def test_the_fork_server_imports_what_ranks_needed_for_the_ranks_after_them(run):
    """dynamo (~1.7 s a rank) is imported by the server once a rank has needed it, not up front for every session."""
    result = run(WARMING)
    result.assert_outcomes(passed=3)


SINGLE_THREADED = """
import ctypes, os, sys, threading, time
import pytest, torch, torch.distributed as dist

def server_threads():
    return len(os.listdir("/proc/%d/task" % os.getppid()))  # the fork server's, idle while its ranks run

def deep(n):
    return deep(n - 1) if n else ctypes.string_at(0)

@pytest.mark.distributed(world_size=2)
def test_builds_an_optimizer():
    assert server_threads() == 1
    torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)

@pytest.mark.distributed(world_size=2)
def test_after_the_warm_up(rank):
    assert "torch._dynamo" in sys.modules and server_threads() == 1
    if rank == 1:
        for _ in range(4):
            threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        deep(40)
    dist.barrier()
"""


def test_ranks_fork_from_a_single_threaded_server_and_print_their_stack_when_they_crash(run):
    """numpy's OpenBLAS pool runs in the server once torch is imported; it is stopped before any rank forks, and
    nothing restarts it, warm-up imports included. A rank killed by a signal prints its stacks even where pytest's
    own faulthandler is off."""
    result = run(SINGLE_THREADED, "-p", "no:faulthandler")
    result.assert_outcomes(passed=1, failed=1)
    segv = section(result.stdout.str(), "test_after_the_warm_up")
    assert "distributed test rank 1 of 2 died: killed by signal SIGSEGV" in segv
    assert "Fatal Python error: Segmentation fault" in segv and "in test_after_the_warm_up" in segv
    # the whole dump, not its last lines: the crash's innermost frames come first, other threads' stacks after them
    assert "Current thread" in segv and "in string_at" in segv and segv.count("in deep") == 41
    assert "Extension modules:" not in segv


NATIVE_THREAD_CRASH = """
import pytest, torch.distributed as dist

@pytest.mark.distributed(world_size=2)
def test_a_library_thread_crashes(rank):
    if rank == 1:
        from pytest_streamrace.detector import capture

        capture.load().crash_on_a_native_thread()  # SIGSEGV on a thread that runs no Python, as NCCL's would
    dist.barrier()
"""


def test_a_rank_that_crashes_on_a_native_thread_under_the_detector_shows_that_thread_s_native_stack(run):
    """faulthandler's dump names no frame of a thread without Python; under the detector the crashing thread's native
    frames come first, then faulthandler's Python stacks."""
    result = run(NATIVE_THREAD_CRASH, "--streamrace", "--streamrace-backend=virtual")
    result.assert_outcomes(failed=1)
    segv = section(result.stdout.str(), "test_a_library_thread_crashes")
    assert "distributed test rank 1 of 2 died: killed by signal SIGSEGV" in segv
    native = segv.index("streamrace: native stack of the thread that got signal 11 (Segmentation fault), thread id ")
    assert '"sr-native-test", innermost first:' in segv[native:]
    frames = segv[native:].split("innermost first:", 1)[1].split("Fatal Python error", 1)[0].strip().splitlines()
    assert frames and all("[0x" in frame for frame in frames), frames
    assert segv.index("Fatal Python error: Segmentation fault") > native
    assert "in test_a_library_thread_crashes" in segv  # the main thread's Python stack, from faulthandler


STRAY_THREAD = """
import sys, threading, time
if sys.argv[0].endswith("forkserver.py"):
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
"""


def test_a_fork_server_with_a_thread_alive_refuses_to_fork(run, pytester, monkeypatch):
    """A thread besides the forking one (here a sitecustomize's) could hold a lock the rank then never gets: the item
    fails in one line instead of forking ranks that may hang or crash."""
    site = pytester.mkdir("site")
    (site / "sitecustomize.py").write_text(STRAY_THREAD)
    monkeypatch.setenv("PYTHONPATH", str(site))
    result = run("import pytest\n\n@pytest.mark.distributed(world_size=2)\ndef test_ranks():\n    pass\n")
    result.assert_outcomes(errors=1)
    out = section(result.stdout.str(), "test_ranks")
    assert "could not start the ranks: the rank fork server refused: forking a rank from it is unsafe: 1 thread(s) " \
           "besides the forking one" in out
    assert "Traceback" not in out


THREAD_ON_WARM_UP = """
import builtins, os, sys, threading, time
if sys.argv[0].endswith("forkserver.py"):
    server, original = os.getpid(), builtins.__import__

    def importing(name, *args, **kwargs):
        module = original(name, *args, **kwargs)
        if name == "torch._dynamo" and os.getpid() == server:
            threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
        return module

    builtins.__import__ = importing
"""

WARM_UP_UNDONE = """
import os, sys
import pytest, torch

@pytest.mark.distributed(world_size=2)
def test_builds_an_optimizer():
    torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)

@pytest.mark.distributed(world_size=2)
def test_after_the_warm_up():
    assert "torch._dynamo" not in sys.modules  # the server re-executed without it
    assert len(os.listdir("/proc/%d/task" % os.getppid())) == 1
    torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)

@pytest.mark.distributed(world_size=2)
def test_later_still():
    assert "torch._dynamo" not in sys.modules  # and does not warm it again
"""


def test_a_warm_up_import_that_starts_a_thread_is_undone(run, pytester, monkeypatch):
    """A module the server imports between forks that leaves a thread behind (Inductor's import initializes the CUDA
    driver, which starts one): the server re-executes itself without it, and the ranks after it import it themselves."""
    site = pytester.mkdir("site")
    (site / "sitecustomize.py").write_text(THREAD_ON_WARM_UP)
    monkeypatch.setenv("PYTHONPATH", str(site))
    run(WARM_UP_UNDONE).assert_outcomes(passed=3)


TWO_SESSIONS = """
import pytest

test = '''
import os, sys
import pytest, torch

@pytest.mark.distributed(world_size=2)
def test_rank():
    with open(os.path.join(os.environ["PIDS_DIR"], "session-%d-%d" % (os.getppid(), os.getpid())), "w") as f:
        f.write(str("torch._dynamo" in sys.modules))
    torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
'''
open("test_rank.py", "w").write(test)
codes = [int(pytest.main(["-p", "no:cacheprovider", "-q", "test_rank.py"])) for _ in range(2)]
print("CODES", codes)
"""


def test_a_process_running_two_sessions_keeps_one_fork_server(pytester, monkeypatch, tmp_path):
    """The repro CLI runs a session per variant: the second one's ranks come from the same server, warmed by the first's."""
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    monkeypatch.setenv("PIDS_DIR", str(pids_dir))
    script = pytester.makepyfile(two_sessions=TWO_SESSIONS)
    result = pytester.run(sys.executable, str(script), timeout=120)
    assert "CODES [0, 0]" in result.outlines, result.outlines + result.errlines
    seen = sorted(p.name.split("-")[1:] + [p.read_text()] for p in pids_dir.iterdir())
    assert len(seen) == 4 and len({server for server, _, _ in seen}) == 1, seen
    assert sorted(dynamo for _, _, dynamo in seen) == ["False", "False", "True", "True"]
    assert not alive(int(seen[0][0]))  # the server ended with the process
