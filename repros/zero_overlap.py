"""DeepSpeed #8061: ZeRO-1/2 overlap_comm reduces the IPG bucket after waiting only on the current stream."""

from pytest_streamrace.repro.spec import Framework, Repro, Variant

from . import _zero


def run(ctx):
    # both variants carry the bucket-reuse fix, so that only this race is judged
    return _zero.run(ctx, producer_fix=ctx.variant == "patched", reuse_fix=True)


REPRO = Repro(
    name="zero_overlap",
    title="DeepSpeed ZeRO-2 overlap_comm: IPG bucket reduced before other streams' copies finished (DeepSpeed #8061)",
    description="""
With overlap_comm, each gradient hook copies its gradient into the IPG bucket on the stream the hook runs on, and
average_tensor makes reduction_stream wait on the *current* stream only before it reads the bucket. When the hooks
run on several streams (torch.compile, compiled autograd, AccumulateGrad nodes created on side streams), the reduction
can read, divide and all-reduce slices whose copies on the other streams have not run yet: gradients are silently
wrong (reported as NaN loss from step 1). DeepSpeed #8080 records every stream that copied into the bucket and waits on
all of them. The repro binds the parameters' AccumulateGrad nodes alternately to two side streams (one of them delayed
on a GPU), runs ZeRO-2 with overlap_comm and contiguous_gradients for a few steps on 2 ranks, and looks for the
reduction reading or writing bucket slices before the copies into them were ordered. Both variants carry the
bucket-reuse fix (see zero_bucket_reuse) so only this race is judged.""",
    references=("https://github.com/deepspeedai/DeepSpeed/issues/8061",
                "https://github.com/deepspeedai/DeepSpeed/pull/8080"),
    affected="deepspeed <= 0.19.2",
    fixed="deepspeed >= 0.19.3",
    framework=Framework("deepspeed", ">=0.19.2", extra="deepspeed"),
    variants=(
        Variant("unpatched", "reproduced", "the reduction waits on the current stream only (as <= 0.19.2)"),
        Variant("patched", "clean", "the reduction waits on every stream that copied into the bucket "
                "(DeepSpeed #8080)"),
    ),
    run=run,
    relevant=_zero.reduction_reads_unfinished_copy,
)
