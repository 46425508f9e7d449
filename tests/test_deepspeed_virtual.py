"""DeepSpeed's real ZeRO-2 ``overlap_comm`` stream logic on CPU: 2 gloo ranks, virtual streams, the race detector.

The DeepSpeed #8061 race (fixed upstream by DeepSpeed #8080 in 0.19.3): gradient hooks bound to two streams copy into
the IPG bucket, and a reduction that waits only on the current stream reads copies the other stream has not finished.
Binding each parameter's AccumulateGrad node to a side stream puts its post-accumulate-grad hook there (what
torch.compile does).
"""

import importlib.util
import os

import pytest
import torch
import torch.nn as nn

from pytest_streamrace.detector.hb import RAW, WAR, WAW
from pytest_streamrace.races.record import format_races
from pytest_streamrace.detector.session import Detector


D = 16  # 6 Linear(D, D) weights; two of them fill a bucket, so every backward flushes, swaps and reuses buffers
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": 2 * D * D, "allgather_bucket_size": 2 * D * D},
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 1000,
}
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
ZERO = "stage_1_and_2.py"
FILL = "reduce_independent_p_g_buckets_and_remove_grads"  # copies a gradient into the IPG bucket


def train_zero2(hooks_on_two_streams: bool, steps: int = 2):
    """Train a tiny model with ZeRO-2 overlap_comm under the virtual backend; returns (detector, ZeRO optimizer)."""
    import deepspeed

    from pytest_streamrace.frameworks.deepspeed_accelerator import deepspeed_on_virtual_streams

    with Detector() as detector, deepspeed_on_virtual_streams():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(D, D, bias=False) for _ in range(6)])
        nodes = []  # AccumulateGrad nodes live as long as the graph needs them, and their streams with them
        if hooks_on_two_streams:
            streams = [torch.cuda.Stream(), torch.cuda.Stream()]
            for i, p in enumerate(model.parameters()):
                with torch.cuda.stream(streams[i % 2]):
                    nodes.append(p.expand_as(p).grad_fn.next_functions[0][0])
        engine, _, _, _ = deepspeed.initialize(model=model, config=CONFIG,
                                               optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        detector.name(engine.module)
        generator = torch.Generator().manual_seed(1 + int(os.environ.get("RANK", 0)))
        for _ in range(steps):
            loss = engine(torch.randn(2, D, generator=generator)).pow(2).mean()
            engine.backward(loss)
            engine.step()
        assert torch.isfinite(loss)
    return detector, engine.optimizer


def frame(access) -> tuple[str, str]:
    """(file name, function) of an access's innermost user frame."""
    filename, _, function = access.op.site.frames[0]
    return os.path.basename(filename), function


def text(detector, races) -> str:
    return format_races([(None, r) for r in races], detector.hb.stream_name)


def check_hooks_on_one_stream_are_race_free():
    detector, _ = train_zero2(hooks_on_two_streams=False)
    races = detector.races
    assert races == [], text(detector, races)


def check_reduction_waiting_on_the_current_stream_only_races_with_bucket_copies(monkeypatch):
    """The DeepSpeed #8080 fix removed (as <= 0.19.2 behaved): average_tensor waits on the current stream only."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    average_tensor = DeepSpeedZeroOptimizer.average_tensor

    def average_tensor_before_8080(self, tensor, communication_data_type):
        self.ipg_buckets[communication_data_type].copy_streams.clear()
        return average_tensor(self, tensor, communication_data_type)

    with monkeypatch.context() as patch:
        patch.setattr(DeepSpeedZeroOptimizer, "average_tensor", average_tensor_before_8080)
        detector, optimizer = train_zero2(hooks_on_two_streams=True)
    races = detector.races
    unsynced_reads = [r for r in races if r.kind == RAW and frame(r.earlier) == (ZERO, FILL)
                      and r.later.op.stream is optimizer.reduction_stream]
    assert unsynced_reads, text(detector, races)
    for race in unsynced_reads:
        assert race.earlier.op.site.op == "aten::copy_"
        assert race.alloc_site.frames[0][2] == "setup_buckets"  # the IPG bucket's buffers
        assert frame(race.later)[0] == ZERO


def check_stock_release_waits_on_every_producer_but_buffer_reuse_still_races():
    """0.19.8 as released: no bucket copy races with the reduction (DeepSpeed #8080 works). But only the stream that
    triggers a flush waits on the reduction stream: the other producer stream later copies into the double buffer that
    an earlier reduction still reads (copy_grads_in_partition) or writes (the in-place all-reduce, the copy back)."""
    detector, optimizer = train_zero2(hooks_on_two_streams=True)
    races = detector.races
    assert not [r for r in races if frame(r.earlier) == (ZERO, FILL)], text(detector, races)
    assert races, "the buffer-reuse race went unreported"
    for race in races:
        assert race.kind in (WAR, WAW)
        assert (race.later.op.site.op, frame(race.later)) == ("aten::copy_", (ZERO, FILL))
        reduction = race.earlier.op.stream
        assert reduction is optimizer.reduction_stream or "communication" in detector.hb.stream_name(reduction)
        assert any(os.path.basename(f) == ZERO for f, _, _ in race.earlier.op.site.frames)
        assert race.alloc_site.frames[0][2] == "setup_buckets"


@needs_deepspeed
@pytest.mark.distributed(world_size=2)
def test_zero2_overlap_comm_on_virtual_streams(monkeypatch):
    """One item for the three runs: importing DeepSpeed's ZeRO costs each rank seconds (it imports inductor)."""
    check_hooks_on_one_stream_are_race_free()
    check_reduction_waiting_on_the_current_stream_only_races_with_bucket_copies(monkeypatch)
    check_stock_release_waits_on_every_producer_but_buffer_reuse_still_races()


@needs_deepspeed
def test_accelerator_has_virtual_streams_only_inside_a_virtual_detector():
    from deepspeed.accelerator import get_accelerator, real_accelerator

    from pytest_streamrace.frameworks.deepspeed_accelerator import deepspeed_on_virtual_streams

    with pytest.raises(RuntimeError, match=r"needs an active Detector\(backend='virtual'\)"):
        with deepspeed_on_virtual_streams():
            pass
    before = real_accelerator.ds_accelerator
    with Detector(), deepspeed_on_virtual_streams() as accelerator:
        assert get_accelerator() is accelerator
        assert not accelerator.is_synchronized_device() and not accelerator.resolves_data_dependency()
        side = accelerator.Stream()
        with accelerator.stream(side):
            assert accelerator.current_stream() is side is torch.cuda.current_stream()
        assert accelerator.communication_backend_name() == "gloo"
        assert accelerator.get_op_builder("ShareMemCommBuilder") is None
    assert real_accelerator.ds_accelerator is before
