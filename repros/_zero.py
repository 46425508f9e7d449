"""What the two DeepSpeed ZeRO ``overlap_comm`` repros share: the training run, the forcing, and the two fixes.

ZeRO-1/2 with ``overlap_comm`` and ``contiguous_gradients`` copies each gradient, from its post-accumulate-grad hook,
into a double-buffered IPG bucket (``reduce_independent_p_g_buckets_and_remove_grads``); when the next gradient does
not fit it reduces the bucket on ``reduction_stream`` (``average_tensor``) and swaps buffers. Stock DeepSpeed is
correct while every hook runs on one stream. Binding the parameters' AccumulateGrad nodes to two side streams — what
torch.compile and multi-stream autograd do — makes the hooks copy from two streams, which exposes two races:

- DeepSpeed #8061 (fixed by DeepSpeed #8080 in 0.19.3): the reduction waits only on the current stream, not on every
  stream that copied into the bucket;
- bucket reuse (0.19.8 still): only the stream that triggers a flush waits for the reduction afterwards; another
  producer stream later copies into the buffer an earlier reduction still reads.

The fixes are applied or removed by wrapping two methods of ``DeepSpeedZeroOptimizer`` for one run, so both repros
work on whichever DeepSpeed is installed (0.19.2 lacks the DeepSpeed #8080 fix; 0.19.3+ have it).
"""

from __future__ import annotations

import contextlib

from pytest_streamrace.patching import patched
from pytest_streamrace.repro.evidence import in_frames

FILL = "reduce_independent_p_g_buckets_and_remove_grads"  # copies a gradient into the IPG bucket
ZERO_FILE = "stage_1_and_2.py"


def reduction_reads_unfinished_copy(race: dict) -> bool:
    """DeepSpeed #8061: the earlier access is a bucket copy on a producer stream, the later one the reduction's."""
    return in_frames(race["earlier"], FILL, ZERO_FILE) and not in_frames(race["later"], FILL, ZERO_FILE)


def copy_into_buffer_under_reduction(race: dict) -> bool:
    """Bucket reuse: the later access is a bucket copy into a buffer an earlier reduction still uses."""
    return in_frames(race["later"], FILL, ZERO_FILE) and not in_frames(race["earlier"], FILL, ZERO_FILE)


def has_producer_fix() -> bool:
    """Whether the installed DeepSpeed has DeepSpeed #8080 (the reduction waits on every stream that copied into the
    bucket)."""
    from deepspeed.runtime.zero.stage_1_and_2 import IPGBucket

    return "copy_streams" in getattr(IPGBucket, "__dataclass_fields__", {})


@contextlib.contextmanager
def zero_fixes(producer_fix: bool, reuse_fix: bool):
    """Run ZeRO with DeepSpeed #8080 on or off, and the bucket-reuse fix on or off, whatever DeepSpeed version is
    installed."""
    import torch
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Zero

    fill, average = Zero.reduce_independent_p_g_buckets_and_remove_grads, Zero.average_tensor
    native = has_producer_fix()

    def fill_patched(self, param, i):
        _name_buffers(self.ipg_buckets[self.get_param_comm_dtype(param)])
        if reuse_fix and self.overlap_comm:
            # the buffer this copy goes into was last read by a reduction on reduction_stream: wait for it
            torch.cuda.current_stream().wait_stream(self.reduction_stream)
        out = fill(self, param, i)
        if producer_fix and not native and self.overlap_comm:
            bucket = self.ipg_buckets[self.get_param_comm_dtype(param)]
            bucket.__dict__.setdefault("streamrace_producers", set()).add(torch.cuda.current_stream())
        return out

    def average_patched(self, tensor, communication_data_type):
        if self.overlap_comm:
            bucket = self.ipg_buckets[communication_data_type]
            if producer_fix and not native:  # DeepSpeed #8080, applied: wait on every producer stream
                for stream in bucket.__dict__.pop("streamrace_producers", ()):
                    self.reduction_stream.wait_stream(stream)
            if not producer_fix and native:  # DeepSpeed #8080, removed: wait on the current stream only, as <= 0.19.2
                bucket.copy_streams.clear()
        return average(self, tensor, communication_data_type)

    with patched(Zero, "reduce_independent_p_g_buckets_and_remove_grads", fill_patched), \
            patched(Zero, "average_tensor", average_patched):
        yield


def _name_buffers(bucket) -> None:
    """Reports say "IPG bucket buffer 1" rather than "tensor float32[768]"."""
    from pytest_streamrace.detector import session

    detector = session.active()
    if detector is not None and not bucket.__dict__.get("streamrace_named"):
        for i, buffer in enumerate(bucket.buffer):
            detector.name(buffer, f"IPG bucket buffer {i}")
        bucket.__dict__["streamrace_named"] = True


def _model(ctx):
    import torch

    # 12 weights, 3 per bucket: 4 flushes per backward, so each buffer is refilled while a reduction may use it
    width, depth = (512, 12) if ctx.backend == "cuda" else (16, 12)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(depth)]).to(ctx.device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, width ** -0.5)
    return model, width


def _train(ctx, overlap: bool, forced: bool) -> dict:
    """Train ctx.steps steps of ZeRO-2; returns the final parameters by name (on CPU)."""
    import deepspeed
    import torch

    from pytest_streamrace.forcing.accumulators import bind_accumulators
    from pytest_streamrace.forcing.delays import Delays, one_slow

    model, width = _model(ctx)
    binding = delays = None
    if forced:
        binding = bind_accumulators(model, streams=2)  # before DeepSpeed registers its gradient hooks
        delays = Delays(one_slow(binding.labels[0], ms=5.0))
        delays.before_accumulate(binding)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": {"stage": 2, "overlap_comm": overlap, "contiguous_gradients": True,
                              "reduce_bucket_size": 3 * width * width, "allgather_bucket_size": 3 * width * width},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ctx.detector.name(engine.module)
    generator = torch.Generator(device=ctx.device).manual_seed(1 + ctx.rank)
    for step in range(ctx.steps):
        x = torch.randn(8, width, device=ctx.device, generator=generator)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        ctx.progress(f"{'forced' if forced else 'reference'} run: step {step + 1}/{ctx.steps}, loss {loss.item():.6f}")
    if delays is not None:
        delays.restore()
    if binding is not None:
        binding.release()
    if ctx.backend == "cuda":
        torch.cuda.synchronize()
    return {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}


def referee_run(ctx, train) -> dict | None:
    """One rank of a ZeRO overlap_comm repro. On a GPU ``train(overlap=True, forced=True)`` is compared with
    ``train(overlap=False, forced=False)`` (one stream, so ordered; run with the detector paused); on the virtual
    backend the detector is the evidence."""
    import contextlib as _cl

    from pytest_streamrace.frameworks.deepspeed_accelerator import deepspeed_on_virtual_streams

    with deepspeed_on_virtual_streams() if ctx.backend == "virtual" else _cl.nullcontext():
        reference = None
        if ctx.backend == "cuda":
            with ctx.detector.paused():
                reference = train(overlap=False, forced=False)
        forced = train(overlap=True, forced=True)
    if reference is None:
        return None
    from pytest_streamrace.forcing.referee import compare

    verdict = compare(forced, reference)
    return {"max_rel_err": verdict.max_rel_error, "first_param": verdict.first_difference,
            "nan": bool(verdict.nonfinite), "compared": verdict.compared, "against": "overlap_comm=False"}


def run(ctx, producer_fix: bool, reuse_fix: bool) -> dict | None:
    """ZeRO-2 with the hooks forced onto two streams, with DeepSpeed #8080 and the bucket-reuse fix on or off."""

    def train(overlap: bool, forced: bool) -> dict:
        if not forced:
            return _train(ctx, overlap, forced)
        with zero_fixes(producer_fix, reuse_fix):
            return _train(ctx, overlap, forced)

    return referee_run(ctx, train)
