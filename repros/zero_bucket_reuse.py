"""New: ZeRO-1/2 overlap_comm copies into an IPG buffer that an earlier reduction still reads (deepspeed 0.19.8)."""

from pytest_streamrace.repro.spec import Framework, Repro, Variant

from . import _zero


def run(ctx):
    # both variants carry DeepSpeed #8080 (the reduction waits on every producer), so that only this race is judged
    return _zero.run(ctx, producer_fix=True, reuse_fix=ctx.variant == "patched")


REPRO = Repro(
    name="zero_bucket_reuse",
    title="DeepSpeed ZeRO-2 overlap_comm: gradient copied into an IPG buffer a reduction still uses",
    description="""
The IPG bucket is double-buffered: a flush reduces buffer i on reduction_stream and the next copies go to buffer 1-i,
so buffer i is written again two flushes later. After a flush only the stream that triggered it waits for the
reduction (average_tensor: current_stream().wait_stream(reduction_stream)). When gradient hooks run on several
streams, another producer stream is never ordered after that reduction: two flushes later it copies a new gradient
into the buffer while the earlier reduction may still read it (copy_grads_in_partition, the division and the
all-reduce / reduce-scatter, the copy back), so that reduction sends a mix of two steps' gradients. DeepSpeed 0.19.8
has per-buffer reuse events that make every producer wait, but only on its CPU-offload gradient-safety path. The
repro runs stock ZeRO-2 (with DeepSpeed #8080) with the hooks bound to two streams; the patched variant makes every
producer stream wait for the reduction stream before it copies into the bucket.""",
    references=("https://github.com/deepspeedai/DeepSpeed/issues/8061 (same buffers; this race is not that one)",
                "docs/upstream/zero-bucket-reuse.md (write-up for upstream)"),
    affected="deepspeed 0.19.2 .. 0.19.8 (every release with the double-buffered IPG bucket; outside CPU offload)",
    fixed="not fixed upstream as of 0.19.8",
    framework=Framework("deepspeed", ">=0.19.2", extra="deepspeed"),
    variants=(
        Variant("unpatched", "reproduced", "stock: only the flushing stream waits for the reduction"),
        Variant("patched", "clean", "every producer stream waits for reduction_stream before copying into the bucket"),
    ),
    run=run,
    relevant=_zero.copy_into_buffer_under_reduction,
)
