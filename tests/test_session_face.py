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
