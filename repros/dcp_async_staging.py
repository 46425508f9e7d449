"""New: torch DCP's DefaultStager copies the state dict on its staging stream without waiting for the stream that
produced it (torch 2.11, 2.13)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from pytest_streamrace.patching import patched
from pytest_streamrace.repro.spec import Repro, Variant

STAGING_STREAM = "DCP staging stream"  # the stager's torch.Stream, named in reports
DELAY_MS = 50.0  # on GPUs, before the optimizer step: the staging copies then run ahead of it
LR = 0.01  # AdamW's first steps move each weight by about lr: the size of the referee's difference
_groups: dict = {}  # a gloo group per rank process (async_save needs a CPU backend; NCCL ranks get one too)


def staging_reads_before_the_step_wrote(race: dict) -> bool:
    """The bug: the optimizer step writes a parameter on the stream current at stage() and the staging copy reads it
    on the staging stream, with nothing ordering the two."""
    return (race["kind"] == "read-after-write" and race["later"]["stream"] == STAGING_STREAM
            and race["earlier"]["stream"] != STAGING_STREAM)


@contextlib.contextmanager
def staging_fix(fixed: bool):
    """The fix proposed upstream, applied for the patched variant: DefaultStager.stage makes its staging stream wait
    for the stream current when stage() is called (the one that produced the state dict) before handing the copy to
    its worker thread."""
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager

    if not fixed:
        yield
        return
    stage = DefaultStager.stage

    def stage_after_producer(self, state_dict, **kwargs):
        if self._staging_stream is not None:
            self._staging_stream.wait_stream(torch.accelerator.current_stream())
        return stage(self, state_dict, **kwargs)

    with patched(DefaultStager, "stage", stage_after_producer):
        yield


def _stager(ctx):
    """DefaultStager as torchtitan's async_with_pinned_mem makes it: pinned, shared, async, non-blocking."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from pytest_streamrace.frameworks.accelerator import accelerator_available

    with contextlib.ExitStack() as scope:
        if ctx.backend == "virtual":  # its staging stream and pinned memory, made only where an accelerator is
            scope.enter_context(accelerator_available())
        stager = DefaultStager(StagingOptions(True, True, True, True))
    ctx.detector.name_stream(stager._staging_stream, STAGING_STREAM)
    return stager


def _staged_once(stager) -> bool:
    """torch 2.11's DefaultStager._stage ends with self._state_dict_stager.close(), which empties the StateDictStager's
    deep-copy table: a second stage() then fails in its ranks with `KeyError: <class 'type'>` (the copy falls through
    to __reduce_ex__ and looks up the table's entry for class objects). torch 2.13 no longer closes it there. Such a
    stager stages once, so the repro makes a new one for the next checkpoint."""
    inner = getattr(stager, "_state_dict_stager", None)
    return inner is not None and not getattr(inner, "_deepcopy_dispatch", True)


def _shared_dir(ctx) -> str:
    import torch.distributed as dist

    path = [tempfile.mkdtemp(prefix="streamrace-dcp-") if ctx.rank == 0 else None]
    dist.broadcast_object_list(path, src=0, group=_groups[ctx.rank])
    return path[0]


def run(ctx) -> dict | None:
    """ctx.steps AdamW steps of a small MLP, each followed by dcp.async_save through the stager, then waiting for the
    staging and the upload before the next step. On GPUs the last checkpoint is loaded back and compared with the
    model (the referee); on the virtual backend the detector is the evidence."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from pytest_streamrace.forcing.delays import sleep

    if ctx.rank not in _groups:
        _groups[ctx.rank] = dist.new_group(backend="gloo")
    group = _groups[ctx.rank]
    cuda = ctx.backend == "cuda"
    width = 1024 if cuda else 16
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))
    model.to(ctx.device)
    ctx.detector.name(model, "model")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    generator = torch.Generator(device=ctx.device).manual_seed(1)  # the same data on every rank: one replica
    root = _shared_dir(ctx)
    stager = _stager(ctx)
    try:
        with staging_fix(ctx.variant == "patched"):
            for step in range(ctx.steps):
                loss = model(torch.randn(8, width, device=ctx.device, generator=generator)).pow(2).mean()
                loss.backward()
                if cuda:
                    sleep(DELAY_MS)  # the step's kernels queue behind it on the default stream
                optimizer.step()
                optimizer.zero_grad()
                checkpoint = os.path.join(root, f"step-{step}")
                saved = dcp.async_save({"model": model.state_dict()}, checkpoint_id=checkpoint,
                                       async_stager=stager, process_group=group)
                saved.staging_completion.result()  # training may go on once staging completed
                saved.upload_completion.result()
                if _staged_once(stager):
                    stager.close()
                    stager = _stager(ctx)
                ctx.progress(f"step {step + 1}/{ctx.steps} checkpointed")
        return _referee(ctx, model, checkpoint, group) if cuda else None
    finally:
        stager.close()
        dist.barrier(group=group)
        if ctx.rank == 0:
            shutil.rmtree(root, ignore_errors=True)


def _referee(ctx, model, checkpoint: str, group) -> dict:
    """The checkpoint on disk against the model once every stream is done: max |checkpoint - model|."""
    import torch
    import torch.distributed.checkpoint as dcp

    with ctx.detector.paused():
        torch.cuda.synchronize()
        expected = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
        loaded = {"model": {name: torch.empty_like(tensor) for name, tensor in expected.items()}}
        dcp.load(loaded, checkpoint_id=checkpoint, process_group=group)
    diffs = {name: (loaded["model"][name] - tensor).abs().max().item() for name, tensor in expected.items()}
    worst = max(diffs, key=diffs.get)
    return {"max_abs_err": diffs[worst], "max_rel_err": diffs[worst] / LR, "first_param": worst,
            "compared": len(diffs), "against": "the model after torch.cuda.synchronize()"}


REPRO = Repro(
    name="dcp_async_staging",
    title="torch DCP DefaultStager: the staging copy reads parameters the optimizer step is still writing",
    description="""
dcp.async_save(..., async_stager=DefaultStager(StagingOptions(True, True, True, True))) — what torchtitan's
async_with_pinned_mem mode uses — stages the state dict on a ThreadPoolExecutor worker: DefaultStager._stage enters
its staging stream (made by torch.Stream() in __init__) and StateDictStager copies every storage to CPU with
non_blocking=True there (_state_dict_stager.py _stage_untyped_storage), then synchronizes the staging stream. Nothing
orders the staging stream after the stream that produced the state dict: an optimizer step still queued on the
default stream when stage() is called is read by the copies before it ran, and the checkpoint holds pre-step values
(docs/upstream/dcp-async-staging.md). The repro runs AdamW steps, each followed by async_save and waiting for staging and
upload; the patched variant makes the staging stream wait for the stream current at stage().""",
    references=("docs/upstream/dcp-async-staging.md (write-up for upstream, torchtitan's exposure)",),
    affected="torch 2.11, 2.13 (DefaultStager with use_async_staging and use_non_blocking_copy)",
    fixed="not fixed upstream as of torch 2.13",
    framework=None,
    variants=(
        Variant("unpatched", "reproduced", "stock: the staging stream never waits for the step's stream"),
        Variant("patched", "clean", "stage() makes the staging stream wait for the stream current at the call"),
    ),
    run=run,
    relevant=staging_reads_before_the_step_wrote,
)
