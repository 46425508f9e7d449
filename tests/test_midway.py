"""Where the threads are halfway through a forced run's hold: the line a confirmation adds when the host waited a hold
out, so that the call that synchronizes with the held stream is named."""

from __future__ import annotations

import ctypes
import threading
import time

from pytest_streamrace.detector.forced_order import ForcedOrder
from pytest_streamrace.detector.midway import MidwaySample, parse_dump, thread_places


def blocked_in_here(release: threading.Event) -> None:
    release.wait()  # the thread's innermost frame outside the standard library is this line


def _blocked_thread():
    release = threading.Event()
    thread = threading.Thread(target=blocked_in_here, args=(release,), name="stager")
    thread.start()
    time.sleep(0.05)
    return thread, release


def test_a_blocked_thread_is_found_at_its_own_call_and_the_main_thread_comes_first():
    thread, release = _blocked_thread()
    try:
        places = thread_places()
    finally:
        release.set()
        thread.join()
    assert places[0].startswith("thread 'MainThread' at ") and "test_midway.py" in places[0]
    stager = [p for p in places if p.startswith("thread 'stager'")]
    line = blocked_in_here.__code__.co_firstlineno + 1
    assert stager == [f"thread 'stager' at {__file__}:{line} in blocked_in_here (in wait, threading.py)"], places
    assert not [p for p in thread_places(skip=threading.main_thread().ident) if "MainThread" in p]


def test_a_sample_is_taken_once_its_time_comes_and_not_when_cancelled_first():
    thread, release = _blocked_thread()
    try:
        taken = MidwaySample(0.05)
        deadline = time.monotonic() + 5
        while taken.places is None and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        release.set()
        thread.join()
    assert any("in blocked_in_here" in p for p in taken.places)
    assert not any(p.endswith("no Python frame") for p in taken.places)  # the sampler's own (all its frames ours)
    cancelled = MidwaySample(0.2)
    cancelled.cancel()
    cancelled.cancel()  # twice: harmless
    time.sleep(0.4)
    assert cancelled.places is None


def test_a_hold_the_host_waited_out_says_where_the_threads_were_halfway_through_it():
    side = {"ordinal": 3, "op": "aten::addcdiv_", "rw": "write", "start": 0, "end": 64}
    forced = ForcedOrder("read-after-write", side, dict(side, op="aten::copy_", rw="read"), "cuda")
    out = forced._waited_out({"host_gap_ms": 210.0}, "", "the held one", "the held stream")
    assert out["reason"].endswith("so no hold inverts them")  # nothing sampled: nothing said
    thread, release = _blocked_thread()
    try:
        forced.midway = MidwaySample(0.05)
        time.sleep(0.3)
        out = forced._waited_out({"host_gap_ms": 210.0}, "", "the held one", "the held stream")
    finally:
        release.set()
        thread.join()
    assert out["status"] == "not-tried" and out["host_waited"] is True
    said = out["reason"].split("so no hold inverts them; halfway through the hold, ", 1)[1]
    assert said.startswith("thread 'MainThread' at ") and "thread 'stager' at " in said and "blocked_in_here" in said
    assert out["threads_midway"] == forced.midway.where()


def test_a_hold_waited_out_names_the_call_that_waited_and_a_sync_the_program_did_not_ask_for_makes_it_latent():
    """The thread that issued the later access, sampled halfway through the hold, is the call that waited: named as
    such; made from a file an incidental-sync rule names (a framework's timer), the race is latent, ordered by it."""
    side = {"ordinal": 3, "op": "aten::addcdiv_", "rw": "write", "start": 0, "end": 64}
    for rules, latent in (((), False), (("*/test_midway.py",), True)):
        forced = ForcedOrder("read-after-write", side, dict(side, op="aten::copy_", rw="read"), "cuda",
                             incidental=rules)
        thread, release = _blocked_thread()
        try:
            forced.later_thread = thread.ident  # the thread that issued the later access, once its wait was over
            forced.midway = MidwaySample(0.05)
            time.sleep(0.3)
            out = forced._waited_out({"host_gap_ms": 210.0}, "", "the held one", "the held stream")
        finally:
            release.set()
            thread.join()
        line = blocked_in_here.__code__.co_firstlineno + 1
        call = f"{__file__}:{line} in blocked_in_here (in wait, threading.py)"
        assert out["waited_at"] == call and f"; the call that waited: {call}" in out["reason"], out
        assert (out.get("latent_sync") == call) is latent, out
        assert ("a sync the program did not ask for" in out["reason"]) is latent


def _hold_the_gil(seconds: float) -> None:
    """A C call that waits without releasing the GIL (ctypes.PyDLL keeps it), as a CUDA call made under it would."""
    ctypes.PyDLL(None).usleep(int(seconds * 1e6))


def test_a_wait_that_holds_the_gil_is_found_by_faulthandler_s_dump_and_said_to_hold_it():
    thread, release = _blocked_thread()
    try:
        taken = MidwaySample(0.1)
        _hold_the_gil(0.4)  # the Python sampler cannot run by its time
        time.sleep(0.05)
    finally:
        release.set()
        thread.join()
    places = taken.where()
    assert taken.places is None and taken.gil_held_ms is not None and taken.gil_held_ms > 200
    here = _hold_the_gil.__code__.co_firstlineno + 2
    assert places[0] == f"thread 'MainThread' at {__file__}:{here} in _hold_the_gil", places
    line = blocked_in_here.__code__.co_firstlineno + 1
    assert f"thread 'stager' at {__file__}:{line} in blocked_in_here (in wait, threading.py)" in places, places


def test_a_sample_cancelled_before_its_time_leaves_faulthandler_disarmed_and_says_nothing():
    taken = MidwaySample(0.1)
    taken.cancel()
    time.sleep(0.2)
    assert taken.where() is None and taken.gil_held_ms is None


def test_parse_dump_reads_each_thread_s_frames_innermost_first():
    text = ("Timeout (0:00:01)!\nThread 0x00007f3142eef6c0 (most recent call first):\n"
            '  File "/lib/threading.py", line 327 in wait\n  File "/w/stage.py", line 9 in run\n\n'
            "Current thread 0x000000000000002a (most recent call first):\n  <no Python frame>\n")
    assert parse_dump(text) == {0x7F3142EEF6C0: [("/lib/threading.py", 327, "wait"), ("/w/stage.py", 9, "run")],
                                42: []}


def test_a_forced_order_made_while_a_session_runs_orders_no_threads_by_its_own_lock():
    """The forced run's own lock is taken by each thread that reaches one of the race's ops: a modelled lock (one made
    with threading.Lock while a session runs) would add a handoff between those threads to the program's model."""
    from pytest_streamrace.detector import session
    from pytest_streamrace.detector.models.host_handoffs import _Handoff

    side = {"ordinal": 3, "op": "aten::addcdiv_", "rw": "write", "start": 0, "end": 64}
    with session.Detector("virtual"):
        assert isinstance(threading.Lock(), _Handoff)  # what a lock made now would be
        forced = ForcedOrder("read-after-write", side, dict(side, op="aten::copy_", rw="read"), "virtual")
    assert not isinstance(forced._lock, _Handoff)


def test_a_process_forked_during_the_hold_can_use_faulthandler_s_timer_and_the_parent_still_gets_its_dump():
    """faulthandler's timer is copied by a fork without its thread: a child that cancels or sets one would wait for
    that thread forever. The sample's timer is off while the process forks, and set again after."""
    import faulthandler
    import os
    import signal

    taken = MidwaySample(0.5)
    pid = os.fork()
    if pid == 0:  # the child: what pytest's faulthandler_timeout, or the inherited sample, would do
        signal.alarm(5)
        taken.cancel()
        faulthandler.dump_traceback_later(30)
        faulthandler.cancel_dump_traceback_later()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    _hold_the_gil(0.8)  # past the sample's time, the Python sampler kept out: the places come from the dump
    places = taken.where()
    assert places and places[0].startswith("thread 'MainThread' at ") and "_hold_the_gil" in places[0], places
