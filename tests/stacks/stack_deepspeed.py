"""DeepSpeed ZeRO as users train with it: stock ZeRO-1/2/3 with ``overlap_comm`` clean, racy twins caught.

On CPU under ``--streamrace`` DeepSpeed runs on ``deepspeed_on_virtual_streams()``: its reduction, all-gather and
copy streams are virtual streams, so ZeRO's real ``overlap_comm`` stream logic runs on gloo under the detector. On
GPUs the same module runs on DeepSpeed's CUDA accelerator. Without ``--streamrace`` on CPU DeepSpeed uses its own CPU
accelerator (no streams): the stock cases still train, the cases that need streams are skipped.
"""

import contextlib

import pytest

deepspeed = pytest.importorskip("deepspeed")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from deepspeed.utils import safe_get_local_fp32_param  # noqa: E402

pytestmark = pytest.mark.distributed(world_size=2)

WIDTH, DEPTH, BATCH = 16, 6, 4
BUCKET = 2 * WIDTH * WIDTH  # two weights a bucket: every backward flushes, swaps and refills the IPG buffers


def _virtual():
    from pytest_streamrace.detector.session import active

    detector = active()
    return detector is not None and detector.backend == "virtual"


def _accelerator():
    """DeepSpeed's streams: the virtual ones under --streamrace on CPU, its own accelerator otherwise."""
    if _virtual():
        from pytest_streamrace.frameworks.deepspeed_accelerator import deepspeed_on_virtual_streams

        return deepspeed_on_virtual_streams()
    return contextlib.nullcontext()


@pytest.fixture
def needs_streams():
    """Skips where torch.cuda has no streams: CPU without --streamrace."""
    if not (_virtual() or torch.cuda.is_available()):
        pytest.skip("needs CUDA streams: a GPU, or --streamrace on CPU")


def _model(device):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)]).to(device)


def _config(stage):
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET}
    if stage == 3:  # partition every parameter (none stays whole) and fetch them in small buckets
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=BUCKET,
                    stage3_max_live_parameters=BUCKET, stage3_max_reuse_distance=0)
    return {"train_micro_batch_size_per_gpu": BATCH, "zero_optimization": zero,
            "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30}


def _engine(model, stage):
    engine, _, _, _ = deepspeed.initialize(model=model, config=_config(stage),
                                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    return engine


def _batches(device, rank, steps=2):
    generator = torch.Generator(device=device).manual_seed(1 + rank)
    return [torch.randn(BATCH, WIDTH, device=device, generator=generator) for _ in range(steps)]


@pytest.mark.streamrace(expect="clean")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_overlap_comm(streamrace_device, rank, stage):
    with _accelerator():
        engine = _engine(_model(streamrace_device), stage)
        for x in _batches(streamrace_device, rank, steps=3):
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
        assert torch.isfinite(loss).item()


def _weights(engine, stage):
    """What an EMA tracks: the full weights (ZeRO-1/2 all-gather them after each step), or ZeRO-3's local fp32
    partitions (its full weights exist only inside a forward)."""
    if stage == 3:
        return [safe_get_local_fp32_param(p) for p in engine.module.parameters()]
    return [p.detach() for p in engine.module.parameters()]


@pytest.mark.streamrace(expect="clean")
@pytest.mark.parametrize("stage", [1, 3])
def test_ema_on_side_stream(streamrace_device, rank, needs_streams, stage):
    """An EMA of the weights, updated on a side stream after each step (off the training stream's critical path)."""
    with _accelerator():
        engine = _engine(_model(streamrace_device), stage)
        ema = [w.clone() for w in _weights(engine, stage)]
        side = torch.cuda.Stream()
        for x in _batches(streamrace_device, rank):
            engine.backward(engine(x).pow(2).mean())
            engine.step()
            side.wait_stream(torch.cuda.current_stream())  # the step's update is done before the EMA reads it
            with torch.cuda.stream(side):
                torch._foreach_lerp_(ema, _weights(engine, stage), 0.1)
            torch.cuda.current_stream().wait_stream(side)  # the next step's update waits for the EMA's reads


@pytest.mark.streamrace(expect="race")
@pytest.mark.parametrize("stage", [1, 3])
def test_ema_on_side_stream_without_wait(streamrace_device, rank, needs_streams, stage):
    """The same EMA, but its stream does not wait for the step: it can read the weights before the update lands
    (ZeRO-1/2: the all-gather of the updated partitions; ZeRO-3: the optimizer's write of the fp32 partition)."""
    with _accelerator():
        engine = _engine(_model(streamrace_device), stage)
        ema = [w.clone() for w in _weights(engine, stage)]
        side = torch.cuda.Stream()
        for x in _batches(streamrace_device, rank):
            engine.backward(engine(x).pow(2).mean())
            engine.step()
            with torch.cuda.stream(side):
                torch._foreach_lerp_(ema, _weights(engine, stage), 0.1)  # race: test_ema_on_side_stream_without_wait
            torch.cuda.current_stream().wait_stream(side)


@pytest.mark.streamrace(expect="race")
def test_zero2_gradient_hooks_on_two_streams(streamrace_device, rank, needs_streams, request):
    """Gradient hooks on two streams, as torch.compile / multi-stream autograd can put them. ZeRO-2 0.19.8 waits on
    every stream that copied into an IPG bucket before reducing it (DeepSpeed #8080), but only the stream that triggers
    a flush waits for the reduction: the other one refills the double buffer while an earlier reduction still uses
    it."""
    with _accelerator():
        model = _model(streamrace_device)
        request.getfixturevalue("stream_bound_accumulators")(model, streams=2)  # before DeepSpeed's hooks exist
        engine = _engine(model, 2)
        for x in _batches(streamrace_device, rank):
            # loss.backward() rather than engine.backward(loss) (DeepSpeed supports both): the race's stack then
            # reaches this line within the 5 frames a report keeps (DeepSpeed's hook is 4 frames deep)
            engine(x).pow(2).mean().backward()  # race: test_zero2_gradient_hooks_on_two_streams
            engine.step()
