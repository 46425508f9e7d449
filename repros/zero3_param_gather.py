"""New: ZeRO-3 all-gathers parameter partitions that the optimizer step's copy is still writing (deepspeed 0.19.8)."""

from __future__ import annotations

import contextlib

from pytest_streamrace.patching import patched
from pytest_streamrace.repro.evidence import in_frames
from pytest_streamrace.repro.spec import Framework, Repro, Variant

from . import _zero

COPY = ("_reassign_or_swap_out_partitioned_parameters", "stage3.py")  # the step writes the partitions
GATHER = ("_all_gather_dtype", "partition_parameters.py")  # the next fetch reads them
DELAY_MS = 50.0  # before the step's copy: it then lands after the next prefetch's read


def gather_reads_partition_under_copy(race: dict) -> bool:
    return in_frames(race["earlier"], *COPY) and in_frames(race["later"], *GATHER)


@contextlib.contextmanager
def _patched(gather_waits: bool, delay: bool):
    """The fix (every all-gather first waits for the stream that issues it) and, on GPUs, the forcing: a delay on the
    step's stream just before its copy into the partitions, so that the copy is still queued when the prefetch runs."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coordinator
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    from pytest_streamrace.forcing import streams
    from pytest_streamrace.forcing.delays import Delays, one_slow

    gather_name = "_PartitionedParameterCoordinator__all_gather_params"
    gather = getattr(Coordinator, gather_name)

    def gather_after_issuer(self, params, forward):
        stream = self._PartitionedParameterCoordinator__allgather_stream
        if stream is not None:
            stream.wait_stream(get_accelerator().current_stream())
        return gather(self, params, forward)

    delays = Delays(one_slow(streams.DEFAULT, ms=DELAY_MS))
    with contextlib.ExitStack() as undo:
        if gather_waits:
            undo.enter_context(patched(Coordinator, gather_name, gather_after_issuer))
        undo.callback(delays.restore)
        if delay:
            delays.around(Stage3, COPY[0])
        yield


def _train(ctx, overlap: bool, fix: bool, forced: bool) -> dict:
    """ctx.steps optimizer steps of ZeRO-3 (2 micro-batches each); returns the final fp32 partitions by name."""
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_local_fp32_param

    width = 256 if ctx.backend == "cuda" else 16
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)]).to(ctx.device)
    config = {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 3, "overlap_comm": overlap, "stage3_param_persistence_threshold": 0},
        # stock option; with the default (synchronized) the timer's device sync hides the race after step 1
        "timers": {"throughput": {"enabled": True, "synchronized": False}},
        "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30,
    }
    with _patched(gather_waits=fix, delay=forced and ctx.backend == "cuda"):
        engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                               optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        generator = torch.Generator(device=ctx.device).manual_seed(1 + ctx.rank)
        for step in range(ctx.steps):
            for _ in range(2):
                x = torch.randn(4, width, device=ctx.device, generator=generator)
                loss = engine(x).pow(2).mean()
                engine.backward(loss)
                engine.step()
            # no loss.item() here: a host sync after the step would order the next all-gather after the copy
            ctx.progress(f"{'forced' if forced else 'reference'} run: step {step + 1}/{ctx.steps}")
        if ctx.backend == "cuda":
            torch.cuda.synchronize()
        return {n: safe_get_local_fp32_param(p).detach().float().cpu().clone()
                for n, p in engine.module.named_parameters()}


def run(ctx) -> dict | None:
    fix = ctx.variant == "patched"
    return _zero.referee_run(ctx, lambda overlap, forced: _train(ctx, overlap, fix, forced))


REPRO = Repro(
    name="zero3_param_gather",
    title="DeepSpeed ZeRO-3: the next all-gather reads parameter partitions the optimizer step is still writing",
    description="""
At the end of a step ZeRO-3 copies the updated fp32 partition into each parameter's partition (stage3.py
_reassign_or_swap_out_partitioned_parameters, on the current stream). The next forward's first fetch prefetches the
parameters on the coordinator's all-gather stream (partitioned_param_coordinator.py __all_gather_params), whose
torch.cat in partition_parameters.py _all_gather_dtype reads those partitions. Nothing makes the all-gather stream wait
for the step's stream: only incidental host syncs order them (the module-trace check while the trace is recorded, and
the throughput timer's synchronize from global step 2 with timers.throughput.synchronized, the default). With
gradient accumulation the first step is exposed; with synchronized: false every step is. On the device the prefetch
then gathers pre-step values and the next micro-batch computes with them (docs/upstream/zero3-param-gather.md). Found by
pytest --streamrace in DeepSpeed's own test_zero.py::TestZeroToFP32::test_2_param_groups. The repro runs stock
ZeRO-3 (overlap_comm, accumulation 2, synchronized: false); the patched variant makes every all-gather wait for the
stream that issues it.""",
    references=("docs/upstream/zero3-param-gather.md (measurements on 2xH200, write-up for upstream)",),
    affected="deepspeed 0.19.8 (older releases not checked)",
    fixed="not fixed upstream as of 0.19.8",
    framework=Framework("deepspeed", "==0.19.8", extra="deepspeed"),
    variants=(
        Variant("unpatched", "reproduced", "stock: the all-gather stream never waits for the step's copy"),
        Variant("patched", "clean", "every all-gather first waits for the stream that issues it"),
    ),
    run=run,
    relevant=gather_reads_partition_under_copy,
)
