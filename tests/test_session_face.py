"""The Detector's public face: what callers take from it rather than from its happens-before core and tracker."""

import pytest
import torch
from tagged_lines import line

from pytest_streamrace.detector import session
from pytest_streamrace.detector.session import Detector


def _side_write_then_default_read(wait: bool) -> None:
    x = torch.zeros(16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1)
    if wait:
        torch.cuda.current_stream().wait_stream(side)
    x.sum()


@pytest.mark.parametrize("wait", [False, True], ids=["racy", "clean"])
def test_subscribers_hear_of_races_as_they_are_found(wait):
    heard = []
    with Detector() as d:
        d.subscribe(on_race=heard.extend)
        _side_write_then_default_read(wait)
        torch.cuda.synchronize()  # ops from the C++ capture are judged in batches, at the latest at such a point
        assert [r.kind for r in heard] == ([] if wait else ["read-after-write"])
    assert d.notes == []


def test_a_named_stream_is_reported_by_its_name_and_forgotten_races_recur():
    with Detector(trace=True) as d:
        x = torch.zeros(16)
        side = torch.cuda.Stream()
        d.name_stream(side, "prefetch stream")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.add_(1)
        x.sum()
        (race,) = d.races
        assert d.stream_name(race.earlier.op.stream) == "prefetch stream"
        assert d.is_virtual(side) and Detector.is_virtual(side)
        d.forget_races()
        assert d.races == []
        x.sum()
        assert [r.kind for r in d.races] == ["read-after-write"]
    assert [op.site.op for op in d.timeline if op.site.op != "free"][-3:] == ["aten::add_", "aten::sum", "aten::sum"]


def test_allocation_frames_name_the_line_that_allocated_the_storage():
    with Detector() as d:
        x = torch.empty(16)  # allocated-here
        frames = d.allocation_frames(x.untyped_storage())
        assert frames[0][:2] == (__file__, line("allocated-here"))
        assert d.allocation_frames(torch.empty(0).untyped_storage()) == ()


def test_one_session_is_active_at_a_time_and_none_after():
    with Detector() as d:
        assert session.active() is d
        with pytest.raises(RuntimeError, match="already active"):
            Detector().__enter__()
        assert session.active() is d
    assert session.active() is None
    with pytest.raises(RuntimeError, match="not active"):
        d.subscribe(on_race=print)


def _patched_attributes() -> dict:
    """What the sessions patch, as torch and threading hold them now (the objects themselves)."""
    import threading
    from concurrent.futures import thread as pool

    owners = {"torch": torch, "torch.cuda": torch.cuda, "torch.Tensor": torch.Tensor, "threading": threading,
              "Thread": threading.Thread, "Condition": threading.Condition, "Future": torch._C.Future,
              "WorkItem": pool._WorkItem}
    names = {"torch": ["ones", "zeros", "empty", "Stream", "Event"], "torch.cuda": ["Stream", "current_stream",
             "synchronize"], "torch.Tensor": ["to", "pin_memory", "is_pinned", "numpy", "tolist", "item", "cpu"],
             "threading": ["Lock", "RLock"], "Thread": ["start", "join", "_bootstrap_inner"],
             "Condition": ["wait", "notify"], "Future": ["wait", "then"], "WorkItem": ["run"]}
    return {(owner, name): vars(owners[owner]).get(name) for owner, found in names.items() for name in found}


def test_each_session_starts_afresh_and_leaves_torch_as_it_found_it():
    """Sessions reuse the patches an earlier one built (building them was most of a session's start), so a session
    after another must see nothing of it: not its races, streams, pinned memory or thread state; and each one, on
    exit, leaves every patched attribute the very object it was before."""
    before = _patched_attributes()
    with Detector() as first:
        _side_write_then_default_read(wait=False)
        pinned = torch.ones(4, pin_memory=True)
        assert pinned.is_pinned()
        kinds = [r.kind for r in first.races]
        assert "read-after-write" in kinds
    assert _patched_attributes() == before
    for _ in range(2):
        with Detector() as later:
            assert not pinned.is_pinned()  # pinned by the earlier session's tracker, unknown to this one
            fresh = torch.zeros(2, pin_memory=True)
            assert fresh.is_pinned()
            _side_write_then_default_read(wait=True)
            assert later.races == [] and later.notes == []
        assert _patched_attributes() == before
    assert [r.kind for r in first.races] == kinds  # the later sessions added nothing to it


def test_a_resident_keeps_the_shared_patches_between_sessions_and_close_takes_them_out():
    """pytest's sessions (one a test) share a Resident: the patches built once per process stay installed from one
    session to the next, each session still starts afresh (nothing of the one before), and `close()` leaves every
    patched attribute the very object it was before the first."""
    before = _patched_attributes()
    resident = session.Resident()
    try:
        with Detector(resident=resident) as first:
            _side_write_then_default_read(wait=False)
            pinned = torch.ones(4, pin_memory=True)
        assert "read-after-write" in [r.kind for r in first.races]
        between = _patched_attributes()
        assert between != before and session.active() is None
        with pytest.raises(RuntimeError, match="only while a streamrace Detector"):
            torch.cuda.Stream()  # the virtual API, with no session: as outside any session
        for _ in range(2):
            with Detector(resident=resident) as later:
                assert _patched_attributes() == between
                assert not pinned.is_pinned()
                _side_write_then_default_read(wait=True)
                assert later.races == []
    finally:
        resident.close()
    assert _patched_attributes() == before


def test_no_patch_kept_installed_touches_an_attribute_a_session_patches_itself():
    """A Resident installs the shared patches before a session's own ones, and leaves them in when the session's go:
    that keeps the order of every attribute's wrappers only if the two touch different attributes."""
    def attributes(patches):
        return {(id(p.obj), p.name) for p in patches if hasattr(p, "obj") and hasattr(p, "name")}

    resident = session.Resident()
    try:
        with Detector(resident=resident) as d:
            own = attributes(d._patches)
            shared = attributes(resident._held)
        assert shared and not own & shared
    finally:
        resident.close()


def test_a_detector_without_the_resident_takes_the_held_patches_out_first():
    """The patches a resident holds are the very objects every session installs: a standalone detector (or another
    resident) started meanwhile takes them out first, so no patch is installed over itself and torch comes back whole."""
    before = _patched_attributes()
    resident = session.Resident()
    try:
        with Detector(resident=resident):
            pass
        with Detector() as alone:
            _side_write_then_default_read(wait=False)
        assert "read-after-write" in [r.kind for r in alone.races]
        assert _patched_attributes() == before
        other = session.Resident()
        with Detector(resident=resident):
            pass
        with Detector(resident=other):
            pass
        other.close()
        assert _patched_attributes() == before
    finally:
        resident.close()
    assert _patched_attributes() == before


def test_a_finished_session_is_freed_as_its_last_reference_goes_not_by_the_collector():
    """pytest's sessions (one a test) are let go at each test's end: their core, tracker and models hold no cycle, so
    they are freed as the last reference goes (once the next session is bound to the kept models), and a suite's
    sessions leave nothing for the collector to walk and promote to its oldest generation."""
    import gc
    import weakref

    resident = session.Resident()
    with Detector(resident=resident):  # the process's earliest session: what is built once per process holds it
        pass
    gc.collect()
    gc.disable()
    try:
        with Detector(resident=resident) as first:
            _side_write_then_default_read(wait=False)
            w = torch.ones(8, requires_grad=True)
            (w * 2).sum().backward()
            torch.ones(4, pin_memory=True).sum()
            assert first.races
        parts = [weakref.ref(part) for part in (first, first.hb, first.tracker, first.streams)]
        del first
        with Detector(resident=resident):  # the kept models bound to this one: nothing holds the first
            pass
        assert [part() for part in parts] == [None] * len(parts)
    finally:
        gc.enable()
        resident.close()
