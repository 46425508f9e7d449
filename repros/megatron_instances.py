"""Megatron-LM #3670 (megatron-core): with several distributed-optimizer instances the gradient reduce-scatter waits
on the default stream, not on the stream of the gradient hooks that wrote the bucket."""

from pytest_streamrace.repro.spec import Framework, Repro, Variant

from . import _megatron


def run(ctx):
    return _megatron.run(ctx, wait="default" if ctx.variant == "unpatched" else "current")


REPRO = Repro(
    name="megatron_instances",
    title="Megatron-core DDP overlap_grad_reduce with num_distributed_optimizer_instances > 1: "
          "reduce-scatter not ordered after the gradient hooks (Megatron-LM #3670)",
    description="""
Megatron's training script builds DistributedDataParallel inside `with torch.cuda.stream(torch.cuda.Stream()):`,
so the parameters' AccumulateGrad nodes, and DDP's gradient hooks on them, run on that side stream: each hook adds
param.grad into main_grad and, when a bucket is complete, start_grad_sync scales the bucket there. With
overlap_grad_reduce and num_distributed_optimizer_instances > 1, start_grad_sync then makes its communication stream
wait on torch.cuda.default_stream() — not on the hook's stream — and runs the reduce-scatter and the inter-instance
all-reduce on it; finish_grad_sync makes the default stream wait for the communication stream. Nothing orders the
collectives after the hook stream's writes: the reduce-scatter can read unscaled, half-accumulated gradients.
Invisible without a delay; on H200 a 1 ms delay on the hook stream made 4/4 iterations wrong. The fix
(Megatron-LM #3693, in 0.17) waits on torch.cuda.current_stream() in both places. The repro builds DDP on a side stream (nDOI = 2,
distributed optimizer, grad_reduce_in_fp32), trains a few iterations on 2 ranks (intra-instance groups of 1; 4 ranks:
of 2) and looks for the collectives reading the bucket before the hook stream's writes to it were ordered; on a GPU
each iteration's local reduce-scatter shard is also compared with an overlap_grad_reduce=False run. Which wait the
installed megatron-core makes is read from its code; the other one is switched in for the run (see
repros/_megatron.py), so both variants run on any version.""",
    references=("https://github.com/NVIDIA/Megatron-LM/issues/3670",
                "https://github.com/NVIDIA/Megatron-LM/pull/3693 (commit 3548385ac3)"),
    affected="megatron-core 0.10 .. 0.16.1",
    fixed="megatron-core >= 0.17.0",
    framework=Framework("megatron-core", ">=0.10", extra="megatron"),
    variants=(
        Variant("unpatched", "reproduced", "the communication stream waits on the default stream (as <= 0.16.1)"),
        Variant("patched", "clean", "it waits on the hook's current stream, and the caller's stream on it "
                "(Megatron-LM #3693)"),
    ),
    run=run,
    relevant=_megatron.collective_reads_hook_write,
)
