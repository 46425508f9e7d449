"""The Megatron-core ``megatron_instances`` repro: the training run, the stream-wait switch and the race it looks for.

Megatron's DDP with ``overlap_grad_reduce`` and ``num_distributed_optimizer_instances > 1`` reduces each bucket from
its last gradient hook: ``start_grad_sync`` scales the bucket on the hook's stream, then makes its communication
stream wait and runs the reduce-scatter and the inter-instance all-reduce there; ``finish_grad_sync`` makes the
compute stream wait for the communication stream. Up to 0.16.1 both waits name ``torch.cuda.default_stream()``;
from 0.17 (Megatron-LM #3693) ``torch.cuda.current_stream()``. They differ only when the hooks run on a side stream —
which they do under Megatron's training script, which builds DDP inside ``torch.cuda.stream(torch.cuda.Stream())``.

The switch: ``stream_waits(which)`` finds those two wait lines in the installed megatron-core's source and, for the
run, redirects the ``torch.cuda.<native>_stream()`` call made *on exactly those lines* to the other function (a
caller check on file and line; every other call, megatron's or torch's, is untouched). So the unpatched variant
re-introduces the bug on >= 0.17 and the patched variant applies the fix on <= 0.16.1, with the rest of the installed
code as it is.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import sys

from pytest_streamrace.patching import patched
from pytest_streamrace.repro.evidence import in_frames

PGB_FILE = "param_and_grad_buffer.py"
DDP_FILE = "distributed_data_parallel.py"
WAITS = ("default", "current")
REL_TOL = 1e-6  # a race's error is O(1) (an unscaled or half-accumulated gradient); this only absorbs rounding
_WAIT_LINE = re.compile(r"torch\.cuda\.(default|current)_stream\(\)")


class LayoutError(RuntimeError):
    """The installed megatron-core's gradient-sync code does not have the waits this repro switches."""


def _bucket_group():
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    return _ParamAndGradBucketGroup


def wait_sites() -> tuple[str, dict[int, str]]:
    """(file, {line: 'default'|'current'}) of the communication-stream waits in start_grad_sync/finish_grad_sync."""
    group = _bucket_group()
    sites: dict[int, str] = {}
    for method in (group.start_grad_sync, group.finish_grad_sync):
        lines, first = inspect.getsourcelines(method)
        found = [(first + i, m.group(1)) for i, line in enumerate(lines)
                 if "communication_stream" in line and "wait_stream" in line and (m := _WAIT_LINE.search(line))]
        if len(found) != 1:
            raise LayoutError(f"megatron-core: expected one communication-stream wait in {method.__qualname__}, "
                              f"found {len(found)}; this repro knows megatron-core 0.10 .. 0.19")
        sites.update(found)
    return inspect.getsourcefile(group), sites


def native_wait() -> str:
    """Which stream the installed megatron-core's communication stream waits on: 'default' (<= 0.16.1, the bug)
    or 'current' (>= 0.17, the fix) — read from its code, not its version."""
    kinds = set(wait_sites()[1].values())
    if len(kinds) != 1:
        raise LayoutError(f"megatron-core: start_grad_sync and finish_grad_sync wait on different streams "
                          f"({', '.join(sorted(kinds))}); this repro knows megatron-core 0.10 .. 0.19")
    return kinds.pop()


@contextlib.contextmanager
def stream_waits(which: str):
    """Run megatron-core's gradient sync with its communication-stream waits on the `which` ('default'|'current')
    stream, whichever the installed version does natively."""
    import torch

    if which not in WAITS:
        raise ValueError(f"stream_waits: expected one of {WAITS}, got {which!r}")
    filename, sites = wait_sites()
    native = next(iter(sites.values()))
    if native == which:
        yield
        return
    name = f"{native}_stream"
    called, instead = getattr(torch.cuda, name), getattr(torch.cuda, f"{which}_stream")

    def redirected(*args, **kwargs):
        caller = sys._getframe(1)
        if caller.f_lineno in sites and caller.f_code.co_filename == filename:
            return instead(*args, **kwargs)
        return called(*args, **kwargs)

    with patched(torch.cuda, name, redirected):
        yield


# which races are this bug's


def collective_reads_hook_write(race: dict) -> bool:
    """Megatron-LM #3670: the later access is start_grad_sync's collective (on the communication stream), the earlier
    one a write made from DDP's gradient hook (main_grad accumulation or the bucket's scaling) on the hook's stream."""
    later, earlier = race["later"], race["earlier"]
    collective = later["op"].startswith(("reduce_scatter", "all_reduce"))
    return collective and in_frames(later, "start_grad_sync", PGB_FILE) and in_frames(earlier, "hook", DDP_FILE)


# the run


def _model(ctx):
    import torch

    width, depth, batch = (2048, 8, 64) if ctx.backend == "cuda" else (16, 4, 8)  # < 40 M params: one bucket
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)]).to(ctx.device), width, batch


def _local_shards(ddp):
    """This rank's reduce-scatter shard of every bucket (the rest of the buffer is not this rank's result)."""
    import torch

    shards = []
    for group in ddp.bucket_groups:
        n, r = group.intra_distributed_optimizer_instance_size, group.intra_distributed_optimizer_instance_rank
        shards += [bucket.grad_data.view(n, -1)[r].clone() for bucket in group.buckets]
    return torch.cat(shards)


def _train(ctx, overlap: bool, delayed: bool) -> list:
    """ctx.steps iterations of Megatron DDP built on a side stream; each iteration's local shard (on CPU)."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    from pytest_streamrace.forcing.accumulators import built_on_side_stream
    from pytest_streamrace.forcing.delays import Delays, one_slow

    model, width, batch = _model(ctx)
    config = DistributedDataParallelConfig(overlap_grad_reduce=overlap, use_distributed_optimizer=True,
                                           num_distributed_optimizer_instances=2, grad_reduce_in_fp32=True)

    def build():
        # Only the gradient sync is judged: the build itself is ordered after the model's init and before training.
        torch.cuda.current_stream().wait_stream(torch.cuda.default_stream())
        return DistributedDataParallel(TransformerConfig(num_attention_heads=1, num_layers=1), config, model)

    ddp, side = built_on_side_stream(build, label="hook stream")
    torch.cuda.current_stream().wait_stream(side)
    ctx.detector.name(model)
    for i, buffer in enumerate(ddp.buffers):
        ctx.detector.name(buffer.grad_data, f"grad buffer {i} (main_grad)")
    delays = None
    if delayed:
        delays = Delays(one_slow("hook stream", ms=1.0))
        delays.before_accumulate(ddp.grad_accs)
    generator = torch.Generator(device=ctx.device).manual_seed(1234 + ctx.rank)
    shards = []
    for step in range(ctx.steps):
        ddp.zero_grad_buffer()
        loss = ddp(torch.randn(batch, width, device=ctx.device, generator=generator)).pow(2).mean()
        loss.backward()
        ddp.finish_grad_sync()
        if ctx.backend == "cuda":
            torch.cuda.synchronize()
        shards.append(_local_shards(ddp).float().cpu())
        ctx.progress(f"{'overlapped' if overlap else 'reference'} run: iteration {step + 1}/{ctx.steps}, "
                     f"loss {loss.item():.6f}")
    if delays is not None:
        delays.restore()
    return shards


def _wrong_iterations(got: list, reference: list) -> tuple[int, float]:
    from pytest_streamrace.forcing.referee import compare

    wrong, worst = 0, 0.0
    for i, (a, b) in enumerate(zip(got, reference)):
        verdict = compare({f"iteration {i + 1}": a}, {f"iteration {i + 1}": b})
        worst = max(worst, verdict.max_rel_error)
        wrong += verdict.max_rel_error > REL_TOL or bool(verdict.nonfinite)
    return wrong, worst


def run(ctx, wait: str) -> dict | None:
    """One rank of the repro with the communication stream waiting on the `wait` stream. On a GPU each iteration's
    local shard is compared with an overlap_grad_reduce=False run (1 ms delay on the hook stream); on the virtual
    backend the detector is the evidence."""
    from pytest_streamrace.frameworks.megatron_cpu import megatron_on_virtual_streams, prepare_import

    prepare_import()
    from megatron.core import parallel_state

    devices = megatron_on_virtual_streams() if ctx.backend == "virtual" else contextlib.nullcontext()
    with devices:
        parallel_state.initialize_model_parallel(num_distributed_optimizer_instances=2)
        try:
            reference = None
            if ctx.backend == "cuda":
                with ctx.detector.paused():
                    reference = _train(ctx, overlap=False, delayed=False)
            with stream_waits(wait):
                got = _train(ctx, overlap=True, delayed=True)
        finally:
            parallel_state.destroy_model_parallel()
    if reference is None:
        return None
    wrong, worst = _wrong_iterations(got, reference)
    return {"wrong_iterations": wrong, "iterations": len(got), "worst_rel_err": worst,
            "against": "overlap_grad_reduce=False"}
