"""--streamrace-confirm through pytest as users run it (virtual backend; `tests/gpu/test_confirm_gpu.py` runs the same
cases on real streams): each racy twin is forced into its bad order in a re-run and confirmed with the values that
changed; a race that writes what was already there is not confirmed; a latent race is not tried, with the reason;
a clean test is never re-run; a gloo collective's buffer read before wait() is confirmed on both ranks."""

import json

import pytest

CASES = '''
import os

import pytest
import torch

race = pytest.mark.streamrace(expect="race")


@pytest.fixture(autouse=True)
def count_runs(request):
    """Each run of a test (the original, and its re-runs) leaves a line."""
    with open(os.path.join(str(request.config.rootpath), "runs.txt"), "a") as f:
        f.write(request.node.name + "\\n")


def side_stream():
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    return side


@race
def test_raw(streamrace_device):
    x = torch.ones(4096, device=streamrace_device)
    side = side_stream()
    with torch.cuda.stream(side):
        x.mul_(3)                                       # RAW-WRITE
    y = x + 1                                           # RAW-READ
    torch.cuda.synchronize()


@race
def test_war(streamrace_device):
    x = torch.ones(4096, device=streamrace_device)
    side = side_stream()
    with torch.cuda.stream(side):
        y = x * 2                                       # WAR-READ
    x.fill_(5.0)                                        # WAR-WRITE
    torch.cuda.synchronize()


@race
def test_waw(streamrace_device):
    x = torch.ones(4096, device=streamrace_device)
    side = side_stream()
    with torch.cuda.stream(side):
        x.fill_(7.0)                                    # WAW-FIRST
    x.fill_(9.0)                                        # WAW-SECOND
    torch.cuda.synchronize()


@race
def test_benign_write_of_the_same_values(streamrace_device):
    x = torch.ones(4096, device=streamrace_device)
    side = side_stream()
    with torch.cuda.stream(side):
        x.fill_(1.0)                                    # BENIGN-WRITE: what x holds already
    y = x + 1                                           # BENIGN-READ
    torch.cuda.synchronize()


def test_latent(streamrace_device):
    x = torch.ones(4096, device=streamrace_device)
    side = side_stream()
    with torch.cuda.stream(side):
        x.mul_(2)
        x.sum().item()                                  # the read-back is all that orders the next read
    y = x + 1                                           # LATENT-READ
    torch.cuda.synchronize()


def test_clean(streamrace_device):
    x = torch.ones(4096, device=streamrace_device)
    side = side_stream()
    with torch.cuda.stream(side):
        x.mul_(2)
    torch.cuda.current_stream().wait_stream(side)
    y = x + 1
    torch.cuda.synchronize()
'''

DISTRIBUTED = '''
import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed(world_size=2)
def test_allreduce_read_before_wait(rank, streamrace_device):
    x = torch.full((64,), float(rank + 1), device=streamrace_device)
    work = dist.all_reduce(x, async_op=True)
    y = x * 2                                           # read before wait()
    work.wait()
'''

BUCKET = '''
import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed(world_size=2)
def test_bucket_reduced_before_its_copy(rank, streamrace_device):
    grad = torch.full((64,), float(rank + 1), device=streamrace_device)
    bucket = torch.zeros(64, device=streamrace_device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        bucket.copy_(grad)                              # the bucket filled on a side stream
    dist.all_reduce(bucket)                             # reduced in place with no wait on it (DeepSpeed #8061)
    torch.cuda.current_stream().wait_stream(side)
'''


def _line(pytester, marker: str) -> int:
    for number, text in enumerate((pytester.path / "test_cases.py").read_text().splitlines(), 1):
        if marker in text:
            return number
    raise AssertionError(marker)


# The same race with the collective issued on a thread of the test's: its ops are counted on that thread, and the
# forced run looks for it there (on GPUs a backward hook's collective is issued on autograd's thread)
THREADED = '''
import threading

import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed(world_size=2)
def test_reduced_on_a_thread_read_before_wait(rank, streamrace_device):
    x = torch.full((64,), float(rank + 1), device=streamrace_device)
    works = []
    reducer = threading.Thread(target=lambda: works.append(dist.all_reduce(x, async_op=True)), name="reducer")
    reducer.start()
    reducer.join()
    y = x * 2                                           # read before wait()
    works[0].wait()
'''

# The same with the thread alive while the main thread reads: its records are applied by the main thread's drain, so
# the collective is named by the record's thread, not by the thread applying it (the autograd engine's device thread
# issuing a backward hook's collective on a GPU, applied by the main thread).
THREADED_ALIVE = '''
import threading
import time

import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed(world_size=2)
def test_reduced_on_a_live_thread_read_before_wait(rank, streamrace_device):
    x = torch.full((64,), float(rank + 1), device=streamrace_device)
    works, done = [], []

    def reduce():
        works.append(dist.all_reduce(x, async_op=True))
        while not done:                                 # alive, and nothing the detector models orders it
            time.sleep(0.001)

    reducer = threading.Thread(target=reduce, name="reducer")
    reducer.start()
    while not works:
        time.sleep(0.001)
    y = x * 2                                           # read before wait()
    done.append(True)
    reducer.join()
    works[0].wait()
'''


def run_cases(pytester, backend: str, *extra: str, files: dict | None = None):
    """The cases (or `files`) under --streamrace-confirm: (the run, {test name: [records]}, runs per test)."""
    pytester.makepyfile(**(files or {"test_cases": CASES}))
    result = pytester.runpytest_subprocess("--streamrace", f"--streamrace-backend={backend}", "--streamrace-confirm",
                                           "--streamrace-json=races.json", "-p", "no:cacheprovider", *extra)
    by_test: dict = {}
    for race in json.loads((pytester.path / "races.json").read_text())["races"]:
        by_test.setdefault(race["test"].split("::")[-1], []).append(race)
    runs: dict = {}
    for name in (pytester.path / "runs.txt").read_text().split():
        runs[name] = runs.get(name, 0) + 1
    return result, by_test, runs


def confirm_seconds(by_test: dict) -> float:
    """The time every test's re-runs took."""
    return round(sum({name: r[0]["confirmation"].get("test_seconds", 0.0) for name, r in by_test.items()
                      if "confirmation" in r[0]}.values()), 1)


def check_cases(pytester, result, by_test, runs) -> None:
    result.assert_outcomes(passed=6)

    def only(name, kind):
        found = [r for r in by_test[name] if r["kind"] == kind and not r.get("latent")]
        assert len(found) == 1, by_test[name]
        return found[0]

    raw = only("test_raw", "read-after-write")["confirmation"]
    assert raw["status"] == "confirmed", json.dumps(raw)
    assert (raw["differing"], raw["elements"], raw["max_abs_diff"]) == (4096, 4096, 2.0)  # 1 read instead of 3
    assert raw["held"] == f"test_cases.py:{_line(pytester, 'RAW-WRITE')}"
    assert raw["observed"] == f"test_cases.py:{_line(pytester, 'RAW-READ')}"
    war = only("test_war", "write-after-read")["confirmation"]
    assert (war["status"], war["differing"], war["max_abs_diff"]) == ("confirmed", 4096, 4.0)  # 5 read instead of 1
    waw = only("test_waw", "write-after-write")["confirmation"]
    assert (waw["status"], waw["differing"], waw["max_abs_diff"]) == ("confirmed", 4096, 2.0)  # 7 left, not 9
    benign = only("test_benign_write_of_the_same_values", "read-after-write")["confirmation"]
    assert (benign["status"], benign["differing"], benign["elements"]) == ("not-confirmed", 0, 4096)
    latent = [r for r in by_test["test_latent"] if r.get("latent")]
    assert latent and all(r["confirmation"]["status"] == "not-tried" for r in latent)
    assert "a latent race" in latent[0]["confirmation"]["reason"]
    assert "test_clean" not in by_test
    # a clean test and a latent-only one are not re-run; a racy one is re-run in one process: a warm-up pass, a
    # pass that finds its races, a pass per race
    assert runs["test_clean"] == 1 and runs["test_latent"] == 1
    assert runs["test_raw"] == 1 + 2 + len(by_test["test_raw"])
    result.stdout.fnmatch_lines([
        f"*confirmed: read-after-write test_cases.py:{_line(pytester, 'RAW-WRITE')} -> "
        f"test_cases.py:{_line(pytester, 'RAW-READ')}: with the write at *held back, the values read at * differed "
        "by max |Δ| = 2 in 4,096 of 4,096 elements",
        f"*not confirmed: read-after-write test_cases.py:{_line(pytester, 'BENIGN-WRITE')} -> *identical in 1 forced "
        "run*"])
    result.stdout.fnmatch_lines(["streamrace confirmations: * confirmed, * not confirmed, * not tried (re-runs took *"])


def test_each_race_is_forced_and_shown_with_what_it_changed(pytester):
    check_cases(pytester, *run_cases(pytester, "virtual"))


def test_under_xdist_each_worker_confirms_its_tests_and_the_controller_reports_them(pytester):
    result, by_test, runs = run_cases(pytester, "virtual", "-n", "2")
    check_cases(pytester, result, by_test, runs)


def test_without_the_option_nothing_is_re_run(pytester):
    pytester.makepyfile(test_cases=CASES)
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual",
                                           "--streamrace-json=races.json", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=6)
    assert sorted(set((pytester.path / "runs.txt").read_text().split())) == sorted(
        (pytester.path / "runs.txt").read_text().split())  # every test ran once
    races = json.loads((pytester.path / "races.json").read_text())["races"]
    assert races and not any("confirmation" in r for r in races)
    assert "confirmations" not in result.stdout.str()


def _confirmed_on_both_ranks(pytester, backend: str, files: dict, kind: str | None = None):
    """The files' one distributed item under --streamrace-confirm: its race confirmed on both ranks, 64 of 64
    elements changed (and of `kind`, where given); the run."""
    pytester.makepyfile(**files)
    result = pytester.runpytest_subprocess("--streamrace", f"--streamrace-backend={backend}", "--streamrace-confirm",
                                           "--streamrace-json=races.json", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    races = json.loads((pytester.path / "races.json").read_text())["races"]
    assert sorted(r["rank"] for r in races) == [0, 1], races
    for race in races:
        if kind is not None:
            assert race["kind"] == kind, race["kind"]
        confirmation = race["confirmation"]
        assert confirmation["status"] == "confirmed", json.dumps(confirmation)
        assert confirmation["differing"] == 64
    return result


def check_collective(pytester, backend: str, source: str = DISTRIBUTED, thread: str | None = None) -> None:
    """1 + 2 = 3 after the all-reduce; the forced read sees the rank's own value. `thread`: the name the collective's
    access carries, where a thread of the test's issued it."""
    result = _confirmed_on_both_ranks(pytester, backend, {"test_dist": source})
    if thread is not None:
        races = json.loads((pytester.path / "races.json").read_text())["races"]
        assert {r["earlier"].get("thread", {}).get("name") for r in races} == {thread}, [r["earlier"] for r in races]
    result.stdout.fnmatch_lines(["*confirmed: read-after-write test_dist.py:*-> test_dist.py:*: with the write at "
                                 "*held back, the values read at * differed by max |Δ| = * in 64 of 64 elements"])


# A rank that says which process forked it: every run of the item, the first and the confirmation's, forks its ranks
# from the session's own fork server
SERVED = '''
import os

import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed(world_size=2)
def test_read_before_wait(rank, streamrace_device):
    with open("parents.txt", "a") as f:
        f.write(f"{os.getppid()}\\n")
    x = torch.full((64,), float(rank + 1), device=streamrace_device)
    work = dist.all_reduce(x, async_op=True)
    y = x * 2                                           # read before wait()
    work.wait()
'''


def test_a_distributed_item_s_re_runs_fork_their_ranks_from_the_session_s_own_server(pytester):
    """No pytest session, torch import and fork server of its own per re-run: the ranks of the run that found the race
    and of the two re-runs (finding its place, forcing it) all come from one fork server."""
    _confirmed_on_both_ranks(pytester, "virtual", {"test_served": SERVED})
    _forked_by_one_server(pytester)


def _forked_by_one_server(pytester) -> None:
    """SERVED's 2 ranks in each of its 3 runs (the first, the re-run finding the race, the forced one): one parent."""
    parents = (pytester.path / "parents.txt").read_text().split()
    assert len(parents) == 6 and len(set(parents)) == 1, parents


def test_under_xdist_each_worker_re_runs_its_distributed_items_ranks(pytester):
    """Each xdist worker has its own fork server: two distributed items on two workers, each race confirmed on both
    ranks, every item's runs from its worker's server."""
    pytester.makepyfile(test_served=SERVED, test_bucket=BUCKET)
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual", "--streamrace-confirm",
                                           "--streamrace-json=races.json", "-p", "no:cacheprovider", "-n", "2")
    result.assert_outcomes(failed=2)
    races = json.loads((pytester.path / "races.json").read_text())["races"]
    assert sorted((r["test"].split("::")[-1], r["rank"], r["confirmation"]["status"]) for r in races) == [
        ("test_bucket_reduced_before_its_copy", 0, "confirmed"), ("test_bucket_reduced_before_its_copy", 1, "confirmed"),
        ("test_read_before_wait", 0, "confirmed"), ("test_read_before_wait", 1, "confirmed")], races
    _forked_by_one_server(pytester)
    result.stdout.fnmatch_lines(["streamrace confirmations: 2 confirmed, 0 not confirmed, 0 not tried*"])


def test_a_collective_read_before_wait_is_confirmed_on_gloo_ranks(pytester):
    check_collective(pytester, "virtual")


@pytest.mark.parametrize("source", [THREADED, THREADED_ALIVE], ids=["joined", "alive"])
def test_a_collective_issued_on_another_thread_is_found_there_in_the_forced_run(pytester, source):
    check_collective(pytester, "virtual", source, thread="reducer")


def check_bucket(pytester, backend: str) -> None:
    """A write-after-write whose later write, an in-place all-reduce, reads what it writes: confirmed on both gloo
    ranks (in order the bucket holds 1 + 2 = 3; forced, the copy lands last and leaves the rank's own value)."""
    result = _confirmed_on_both_ranks(pytester, backend, {"test_bucket": BUCKET}, kind="write-after-write")
    result.stdout.fnmatch_lines(["*confirmed: write-after-write test_bucket.py:*-> test_bucket.py:*: with the write "
                                 "at *held back, the values * at * differed by max |Δ| = * in 64 of 64 elements"])


def test_a_bucket_reduced_before_its_copy_is_confirmed_on_gloo_ranks(pytester):
    check_bucket(pytester, "virtual")


@pytest.mark.parametrize("confirm", ["--streamrace-confirm", "-ostreamrace_confirm=true"])
def test_the_ini_key_and_the_option_both_turn_it_on(pytester, confirm):
    pytester.makepyfile(test_cases=CASES)
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual", confirm,
                                           "-p", "no:cacheprovider", "-k", "test_raw")
    result.assert_outcomes(passed=1, deselected=5)
    result.stdout.fnmatch_lines(["streamrace confirmations: 1 confirmed, 0 not confirmed, 0 not tried*"])


# The corpus: every racy case forced, on both backends. Not confirmed only where the collective runs on a world of one
# rank (an all-reduce of one rank leaves the bytes it reads), with that reason; none is not tried.
CORPUS_BENIGN = {"test_async_collective_output_read_before_wait", "test_sync_collective_output_read_on_another_stream",
                 "test_collective_on_stream_that_waited_on_the_wrong_stream"}
ONE_RANK = "a collective over a world of one rank leaves the bytes it reads"


def check_corpus(pytester, backend: str) -> dict:
    """The corpus under --streamrace-confirm: each racy case's verdict right; {test: confirmation} of its races."""
    from test_corpus import CORPUS, RACY

    result = pytester.runpytest_subprocess(str(CORPUS), "--streamrace", f"--streamrace-backend={backend}",
                                           "--streamrace-confirm", "--streamrace-json", "races.json",
                                           "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2 * len(RACY))
    verdicts: dict = {}
    confirmations: dict = {}
    for race in json.loads((pytester.path / "races.json").read_text())["races"]:
        test = race["test"].rsplit("::", 1)[1]
        verdicts.setdefault(test, set()).add(race["confirmation"]["status"])
        confirmations[test] = race["confirmation"]
    assert set(verdicts) == set(RACY)  # no clean twin was re-run: it had no race to confirm
    benign = set(CORPUS_BENIGN)
    for test, found in verdicts.items():
        want = "not-confirmed" if test in CORPUS_BENIGN else "confirmed"
        assert found == {want}, (test, found, confirmations[test])
        if want == "not-confirmed":
            assert confirmations[test]["reason"] == ONE_RANK, confirmations[test]
    assert confirmations[FREED]["freed"]
    result.stdout.fnmatch_lines([f"streamrace confirmations: {len(RACY) - len(benign)} confirmed, "
                                 f"{len(benign)} not confirmed, 0 not tried*"])
    return confirmations


FREED = "test_free_while_another_stream_reads"


def test_every_racy_case_of_the_corpus_is_confirmed_or_shown_benign(pytester):
    check_corpus(pytester, "virtual")


def test_the_trace_carries_each_race_s_confirmation(pytester):
    pytester.makepyfile(test_cases=CASES)
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual", "--streamrace-confirm",
                                           "--streamrace-trace=trace.json", "-p", "no:cacheprovider", "-k",
                                           "test_raw or test_benign")
    result.assert_outcomes(passed=2, deselected=4)
    events = json.loads((pytester.path / "trace.json").read_text())["traceEvents"]
    verdicts = sorted(e["args"]["confirmation"].split(":")[0] for e in events
                      if e.get("ph") == "s" and "confirmation" in e.get("args", {}))
    assert verdicts == ["confirmed", "not confirmed"]


def test_a_latent_race_ordered_by_an_incidental_sync_is_forced_with_that_sync_skipped(pytester):
    """A framework timer's synchronize (an incidental-sync rule's file) is all that orders the pair: the forced pass
    skips syncs made from that file, and the race comes out confirmed; a read-back's latent race is not tried."""
    from test_latent import CASES as LATENT, TIMER, line

    pytester.makepyfile(test_cases=LATENT, timer=TIMER)
    (pytester.path / "s.supp").write_text("incidental-sync:timer.py\n")
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual", "--streamrace-confirm",
                                           "--streamrace-suppress", "s.supp", "--streamrace-json", "races.json",
                                           "-p", "no:cacheprovider", "-k", "test_timer or test_read_back")
    result.assert_outcomes(passed=3, deselected=2)
    races = json.loads((pytester.path / "races.json").read_text())["races"]
    timed = [r["confirmation"] for r in races if r["test"].endswith("test_timer")]
    assert timed and all(c["status"] == "confirmed" for c in timed), timed
    assert {c["skipped_sync"] for c in timed} == {f"timer.py:{line(TIMER, 'TIMER-SYNC')}"}
    read_back = [r["confirmation"] for r in races if "test_read_back" in r["test"]]
    assert read_back and all(c["status"] == "not-tried" and "that the program needs" in c["reason"]
                             for c in read_back)
    result.stdout.fnmatch_lines(["*confirmed: latent write-after-write *held back and the incidental sync at "
                                 "timer.py:* skipped, the values left behind at * differed*"])


def test_a_later_write_that_reads_what_it_writes_is_judged_by_what_each_order_leaves():
    """GPU snapshots of a forced write-after-write whose later write read the bytes before the held write: exact where
    the held write wrote what was there, benign where the later write is an identity, else what it read differs."""
    import torch

    from pytest_streamrace.detector.forced_order import left_behind

    ones, twos = torch.ones(4), torch.full((4,), 2.0)
    assert left_behind(None, ones, ones) is None
    ordered, forced, how = left_behind(twos, twos, ones)  # x.copy_(x) held; x.div_(2) left 1s; in order, the same 1s
    assert how == "left behind" and torch.equal(ordered, ones) and torch.equal(forced, twos)
    ordered, forced, how = left_behind(ones, twos, ones)  # x.mul_(1), or an all-reduce whose peers held zeros
    assert how == "identity" and torch.equal(ordered, forced)
    zeros = torch.zeros(4)
    assert left_behind(zeros, twos, zeros, one_rank=True)[2] == "identity"  # an all-reduce in a world of one
    ordered, forced, how = left_behind(zeros, twos, zeros)  # an all-reduce of zero buckets: it tells nothing
    assert how == "read" and torch.equal(ordered, twos) and torch.equal(forced, zeros)
    ordered, forced, how = left_behind(ones, twos, torch.full((4,), 0.5))  # div_ ran on the old bytes
    assert how == "read" and torch.equal(ordered, twos) and torch.equal(forced, ones)


def test_a_hold_the_host_waited_out_is_not_tried_longer_and_a_gpu_re_run_loads_its_kernels_up_front():
    """A host that spent the hold itself between the two accesses (it synchronized with the held stream) gets no
    longer hold, which would only make it wait longer; a host that was merely slow (a communicator's first use) does.
    A forced GPU re-run without a warm-up loads every kernel as its context is made (a lazy load at the later access's
    first launch waits for the held stream), and connects its NCCL peers as each communicator is made (unless the user
    set NCCL otherwise)."""
    from pytest_streamrace.detector.forced_order import host_waited
    from pytest_streamrace.races.confirmation import MAX_HOLD_MS, _grew_with_hold, _longer_hold, forcing_environ

    assert host_waited(200.0, 200.1) and host_waited(10_000.0, 10_003.2)
    assert not host_waited(200.0, 735.0) and not host_waited(200.0, 17.7)
    slow = {"status": "not-tried", "reason": "a 200 ms hold did not invert the order", "delay_ms": 200.0,
            "host_gap_ms": 735.0}
    assert _longer_hold(slow) == 2 * (735.0 + 200.0)
    assert _longer_hold(dict(slow, host_gap_ms=200.1, host_waited=True)) is None
    assert _longer_hold(dict(slow, delay_ms=MAX_HOLD_MS)) is None
    # a gap that grows with the hold: the host waits for the held stream, whatever the hold (no third try)
    second = dict(slow, delay_ms=1870.0, host_gap_ms=2390.0)
    waited = _grew_with_hold(slow, dict(second))
    assert waited["host_waited"] and _longer_hold(waited) is None
    assert waited["reason"].startswith("the host's gap between the two accesses grew with the hold (735 ms at a 200 ms "
                                       "hold, 2390 ms at 1870 ms): something between the two waits for the held "
                                       "stream, so no hold inverts them (a 200 ms hold did not invert the order")
    merely_slow = _grew_with_hold(slow, dict(second, host_gap_ms=760.0))  # the same slow host, not waiting
    assert "host_waited" not in merely_slow and _longer_hold(merely_slow) == 2 * (760.0 + 1870.0)
    assert _grew_with_hold(None, dict(second)) == second
    assert _grew_with_hold(slow, {"status": "confirmed", "delay_ms": 1870.0, "host_gap_ms": 2390.0}).get(
        "host_waited") is None
    assert forcing_environ({"CUDA_MODULE_LOADING": "LAZY"}, "cuda") == {"CUDA_MODULE_LOADING": "EAGER",
                                                                         "NCCL_RUNTIME_CONNECT": "0"}
    assert forcing_environ({"NCCL_RUNTIME_CONNECT": "1"}, "cuda")["NCCL_RUNTIME_CONNECT"] == "1"
    assert forcing_environ({}, "virtual") == {}


def test_a_thread_python_did_not_start_has_its_own_place_in_a_forced_run():
    """Ops are counted per thread, and a forced re-run names an op by its thread and its place there: a thread Python
    did not start (autograd's device thread, where a GPU backward runs DDP's and ZeRO's hooks) is "native", apart
    from the main thread, whose n-th op is another op. Its record carries that name; its report line adds nothing."""
    import _thread
    import threading

    from pytest_streamrace.detector.forced_order import thread_key
    from pytest_streamrace.detector.hb import NATIVE_THREAD, Access, Op, Race, Site, TensorInfo
    from pytest_streamrace.races.confirmation import plan_of
    from pytest_streamrace.races.record import format_race, from_race, to_race

    keys = []
    _thread.start_new_thread(lambda: keys.append(thread_key(threading.get_ident())), ())
    started = threading.Thread(target=lambda: keys.append(thread_key(threading.get_ident())))
    started.start()
    started.join()
    while len(keys) < 2:
        threading.Event().wait(0.01)
    assert thread_key(threading.get_ident()) == "main" and sorted(keys) == ["main", "native"]

    tensor = TensorInfo((64,), "float32")
    write = Access(Op(1, 0, 1, Site("aten::mul_", (("t.py", 3, "test"),), None, 5)), None, 0, 256, True, tensor)
    read = Access(Op(0, 0, 2, Site("aten::add", (("t.py", 7, "hook"),), NATIVE_THREAD, 5)), None, 0, 256, False,
                  tensor)
    race = Race("read-after-write", write, read, None)
    data = from_race(race)
    assert data["later"]["thread"]["name"] == "native" and "thread" not in data["earlier"]
    plan = plan_of(data)
    assert (plan["earlier"]["thread_key"], plan["later"]["thread_key"]) == (None, "native")
    assert "on thread" not in format_race(race) and "on thread" not in format_race(to_race(data))


def test_a_collective_s_model_name_matches_only_a_collective():
    """A race names a collective by its model's name; a forced run must not hold back another op at its place."""
    from pytest_streamrace.detector.forced_order import same_op

    assert same_op("all_reduce", "c10d::allreduce_") and same_op("all_gather_into_tensor", "_c10d_functional::"
                                                                                           "all_gather_into_tensor")
    assert same_op("aten::copy_", "aten::copy_") and not same_op("aten::copy_", "aten::add_")
    assert not same_op("all_reduce", "aten::mm")


def test_a_hold_that_did_not_invert_says_how_long_it_slept_and_how_long_the_later_call_took(monkeypatch):
    """A GPU hold that did not invert the order is not tried; its reason tells a hold that slept less than asked from
    a later call that waited out the hold inside it (for which a longer hold is not tried). The three timing events'
    GPU times stand in for a GPU here (this CPU machine has none): in ms, as ``elapsed_time`` gives them."""
    from pytest_streamrace.detector import forced_order
    from pytest_streamrace.races.confirmation import _longer_hold, verdict

    class At:
        def __init__(self, ms: float):
            self.ms = ms

        def elapsed_time(self, end) -> float:
            return end.ms - self.ms

    monkeypatch.setattr(forced_order, "_CYCLES", [1.98e6])
    side = {"ordinal": 3, "op": "aten::copy_", "rw": "write", "start": 0, "end": 256}
    order = forced_order.ForcedOrder("write-after-write", side, dict(side, ordinal=4, op="all_reduce"), "cuda")
    # [the held access starts, the later access ended, the hold starts]: a hold of 200 ms that slept 0.2
    order.events, order.host = [At(0.2), At(8.0), At(0.0)], {"earlier": 0.0, "later": 0.0078, "later_done": 0.0079}
    out = order._not_inverted({"delay_ms": 200.0, "host_gap_ms": 7.8}, lead=-7.8)
    assert out["status"] == "not-tried" and out["slept_ms"] == 0.2 and out["later_call_ms"] == 0.1
    assert out["reason"].endswith("; the held stream slept 0.2 ms of the 200 asked)") and "host_waited" not in out
    assert _longer_hold(out) == 2 * (7.8 + 200.0)
    # a hold that slept, and a later call that waited it out on the host
    order.events, order.host = [At(200.0), At(201.0), At(0.0)], {"earlier": 0.0, "later": 0.001, "later_done": 0.2}
    out = order._not_inverted({"delay_ms": 200.0, "host_gap_ms": 1.0}, lead=-1.0)
    assert out["host_waited"] and "its own call took 199.0 ms: it waited for the held stream inside" in out["reason"]
    assert "slept" not in out["reason"] and _longer_hold(out) is None
    # the same from a distributed item's ranks, as their files come back: what the next hold is decided on
    kept = verdict({}, [{"forced": out, "outcome": "failed"}], None, "failed")
    assert kept["host_waited"] and kept["later_call_ms"] == 199.0 and _longer_hold(kept) is None


def test_a_held_stream_s_snapshots_use_memory_taken_before_the_hold():
    """On a GPU the snapshots taken after the hold (before the held access, and after it) go into memory allocated
    before the hold was queued: an allocation issued between the hold and the later access would keep the two from
    running at once. Here on host tensors, what the copy does and where it lands."""
    import torch

    from pytest_streamrace.detector import forced_order

    side = {"ordinal": 1, "op": "aten::mul_", "rw": "write", "start": 2, "end": 6}
    order = forced_order.ForcedOrder("read-after-write", side, dict(side, ordinal=2, rw="read"), "virtual")
    spare = torch.zeros(4, dtype=torch.uint8)
    entry = {"view": torch.arange(8, dtype=torch.uint8), "spare": [spare]}
    taken = order._snapshot(entry)
    assert taken.data_ptr() == spare.data_ptr() and taken.tolist() == [2, 3, 4, 5] and entry["spare"] == []
    again = order._snapshot(entry)  # none left: a copy of its own
    assert again.data_ptr() != spare.data_ptr() and again.tolist() == [2, 3, 4, 5]
