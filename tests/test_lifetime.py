"""The lifetime checker's API on real CPU tensors: weak references to storages, phases, reports, peaks."""

import pytest
import torch

from pytest_streamrace.lifetime import LifetimeChecker, LifetimeError


class Optimizer:
    """Stands for an optimizer whose step the test marks (a plain object: the marking is what is tested)."""

    def __init__(self):
        self.calls = 0

    def step(self, scale=1):
        self.calls += scale
        return self.calls


def test_a_buffer_alive_at_its_phase_is_reported_with_name_size_and_site():
    checker = LifetimeChecker()
    grads = torch.zeros(4096, dtype=torch.bfloat16)
    checker.track(grads, "grad target layer0", by="optimizer.step")  # registered here
    checker.phase("optimizer.step")
    assert [v.buffer.name for v in checker.violations] == ["grad target layer0"]
    text = checker.problems()
    assert "grad target layer0: 8.0 KiB (storage of bfloat16[4096] on cpu) still alive at 'optimizer.step' (#1)" in text
    assert "registered at tests/test_lifetime.py:" in text and "test_a_buffer_alive_at_its_phase" in text
    with pytest.raises(LifetimeError, match="1 buffer\\(s\\), 8.0 KiB, outlived"):
        checker.check()


def test_a_buffer_freed_or_resized_to_zero_before_its_phase_passes():
    checker = LifetimeChecker()
    freed, emptied = torch.zeros(100), torch.zeros(100)
    checker.track(freed, "freed", by="optimizer.step")
    checker.track(emptied, "emptied", by="optimizer.step")
    del freed
    emptied.untyped_storage().resize_(0)  # how ZeRO-3 / FSDP release memory while keeping the tensor
    checker.phase("optimizer.step")
    assert checker.violations == [] and checker.checked == 2
    assert checker.problems() == ""
    checker.check()


def test_a_view_keeps_its_storage_alive():
    checker = LifetimeChecker()
    flat = torch.zeros(1000)
    view = flat[10:20]
    checker.track(flat, "flat partition", by="step")
    del flat
    checker.phase("step")
    assert [v.nbytes for v in checker.violations] == [4000]  # the whole storage, not the view's 40 bytes
    del view


def test_a_buffer_is_checked_at_the_first_mark_of_its_phase_after_tracking():
    checker = LifetimeChecker()
    t = torch.zeros(10)
    checker.phase("optimizer.step")  # before tracking: not its check
    checker.track(t, "t", by="optimizer.step")
    checker.phase("backward")  # another phase: not its check
    assert checker.violations == [] and checker.checked == 0
    checker.phase("optimizer.step")
    assert [(v.phase, v.occurrence) for v in checker.violations] == [("optimizer.step", 2)]
    checker.phase("optimizer.step")  # checked once: not reported again
    assert len(checker.violations) == 1


def test_a_buffer_whose_phase_never_comes_is_a_problem_not_a_pass():
    checker = LifetimeChecker()
    t = torch.zeros(10)
    checker.track(t, "grads", by="optimiser.step")  # misspelt
    del t
    checker.phase("optimizer.step")
    text = checker.problems()
    assert "1 buffer(s) were never checked" in text and "grads: due by 'optimiser.step'" in text
    assert "phases marked: 'optimizer.step'" in text
    with pytest.raises(LifetimeError):
        checker.check()


def test_at_call_marks_the_phase_and_after_it_and_close_restores():
    checker = LifetimeChecker()
    opt = Optimizer()
    before, after = torch.zeros(10), torch.zeros(10)
    checker.track(before, "before", by="optimizer.step")
    checker.track(after, "after", by="after optimizer.step")
    checker.at_call(opt, "step", phase="optimizer.step")
    assert opt.step(scale=3) == 3  # arguments and result pass through
    assert [v.phase for v in checker.violations] == ["optimizer.step", "after optimizer.step"]
    checker.close()
    assert "step" not in vars(opt) and opt.step() == 4
    assert [s.phase for s in checker.peaks.segments] == ["start", "optimizer.step", "after optimizer.step"]


def test_at_call_restores_an_instance_attribute_and_defaults_the_phase_to_its_name():
    checker = LifetimeChecker()
    opt = Optimizer()
    own = opt.step
    opt.step = own  # the object's own attribute, as a framework that wraps methods leaves it
    with checker:
        checker.at_call(opt, "step")
        opt.step()
    assert vars(opt)["step"] is own
    assert [s.phase for s in checker.peaks.segments][1:] == ["step", "after step"]


def test_cpu_peaks_are_the_bytes_of_live_tracked_storages_per_phase():
    checker = LifetimeChecker()
    a = torch.zeros(1024, dtype=torch.uint8)
    checker.track(a, "a", by="end")
    checker.phase("backward")
    b = torch.zeros(4096, dtype=torch.uint8)
    checker.track(b, "b", by="end")
    checker.track(b[:16], "b again", by="end")  # the same storage counts once
    checker.phase("optimizer.step")
    del a, b
    checker.phase("end")
    assert checker.peaks.by_phase() == {"start": 1024, "backward": 5120, "optimizer.step": 5120, "end": 0}
    assert "peak memory per phase (live tracked storages):" in checker.peak_report()
    assert "  backward        5.0 KiB" in checker.peak_report()


def test_the_detectors_allocation_site_is_reported_when_it_saw_the_allocation():
    from pytest_streamrace.detector.session import Detector

    with Detector("virtual"):
        checker = LifetimeChecker()
        source = torch.ones(64)
        grads = source * 2  # allocated here, under the detector
        checker.track(grads, "grads", by="step")
        checker.phase("step")
        text = checker.problems()
    line = next(l for l in text.splitlines() if "allocated at" in l)
    assert "tests/test_lifetime.py:" in line and "test_the_detectors_allocation_site" in line


@pytest.mark.parametrize("call, error", [
    (lambda c: c.track([1, 2], "list", by="x"), "track() takes a tensor or an UntypedStorage, got list"),
    (lambda c: c.track(torch.zeros(2), "t", by=""), "track(..., by=PHASE) needs a phase name, got ''"),
    (lambda c: c.track(torch.zeros(0), "empty", by="x"), "empty holds no memory"),
    (lambda c: c.phase(None), "phase() needs a phase name, got None"),
    (lambda c: c.at_call(Optimizer(), "calls"), "Optimizer.calls is not callable"),
])
def test_bad_input_is_a_clear_error(call, error):
    with pytest.raises((TypeError, ValueError)) as info:
        call(LifetimeChecker())
    assert error in str(info.value)
