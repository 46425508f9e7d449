"""Host offload as users train with it: DeepSpeed ZeRO-Offload and FSDP2's ``CPUOffloadPolicy``, pinned.

Both keep state in pinned host memory and move it with ``non_blocking`` copies: DeepSpeed copies gradients into pinned
fp32 partitions during backward, steps the optimizer on the host and copies the weights back; FSDP2 copies each
sharded parameter to the device for its all-gather and each reduced gradient back to the host. The host is a party to
every one of those copies (docs/explanation/model.md), so a model of it that is too strict shows here first: the stock
configurations must run clean. The racy twin is a user's mistake on top: an EMA of the offloaded master weights copied
to the device on a side stream that the next step's host optimizer never waits for.

The world size is ``STACK_WORLD_SIZE`` (default 2): tests/gpu runs the module with 1 (NCCL) and 2 (gloo over CUDA
tensors on one GPU). On CPU under ``--streamrace`` DeepSpeed runs on virtual streams
(``deepspeed_on_virtual_streams()``), pinning emulated; without it, on DeepSpeed's CPU accelerator (no streams, no
pinning). DeepSpeedCPUAdam is built on first use (a C++ toolchain and ninja; about a minute, cached by torch).
"""

import contextlib
import os

import pytest

deepspeed = pytest.importorskip("deepspeed")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard  # noqa: E402

pytestmark = pytest.mark.distributed(world_size=int(os.environ.get("STACK_WORLD_SIZE", "2")))

WIDTH, DEPTH, BATCH = 16, 4, 4


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


@pytest.fixture(autouse=True)
def local_rank_is_the_device(streamrace_device, monkeypatch):
    """DeepSpeed takes its device from LOCAL_RANK (its engine, and ZeRO-3's partitioning): ranks that share one GPU
    (gloo over CUDA tensors) are given the one they run on."""
    if streamrace_device.type == "cuda":
        monkeypatch.setenv("LOCAL_RANK", str(streamrace_device.index))


@pytest.fixture
def needs_streams():
    """Skips where torch.cuda has no streams: CPU without --streamrace."""
    if not (_virtual() or torch.cuda.is_available()):
        pytest.skip("needs CUDA streams: a GPU, or --streamrace on CPU")


def _model(device):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)]).to(device)


def _config(stage, offload_param=False, cpu_adam=True, overlap_comm=True):
    zero = {"stage": stage, "overlap_comm": overlap_comm, "contiguous_gradients": True,
            "reduce_bucket_size": 2 * WIDTH * WIDTH, "allgather_bucket_size": 2 * WIDTH * WIDTH,
            "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=2 * WIDTH * WIDTH)
        if offload_param:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {"train_micro_batch_size_per_gpu": BATCH, "zero_optimization": zero, "steps_per_print": 1 << 30}
    if cpu_adam:  # what ZeRO-Offload builds by default: DeepSpeedCPUAdam, stepping on the host in its own C++
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    else:  # a torch optimizer on the host partitions: its ops are ATen ops the detector sees
        config.update(zero_force_ds_cpu_optimizer=False, zero_allow_untested_optimizer=True)
    return config


def _engine(model, stage, offload_param=False, cpu_adam=True, overlap_comm=True):
    optimizer = None if cpu_adam else torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                           config=_config(stage, offload_param, cpu_adam, overlap_comm))
    return engine


def _batches(device, rank, steps=3):
    generator = torch.Generator(device=device).manual_seed(1 + rank)
    return [torch.randn(BATCH, WIDTH, device=device, generator=generator) for _ in range(steps)]


@pytest.mark.streamrace(expect="clean")
@pytest.mark.parametrize("stage, offload_param, optimizer", [
    (2, False, "DeepSpeedCPUAdam"), (2, False, "torch.optim.AdamW"), (3, False, "DeepSpeedCPUAdam"),
    (3, True, "torch.optim.AdamW")], ids=["zero2-cpu-adam", "zero2-torch-adamw", "zero3-cpu-adam",
                                          "zero3-offload-param-torch-adamw"])
def test_zero_offload(streamrace_device, rank, stage, offload_param, optimizer):
    with _accelerator():
        engine = _engine(_model(streamrace_device), stage, offload_param, cpu_adam=optimizer == "DeepSpeedCPUAdam")
        losses = []
        x = _batches(streamrace_device, rank, steps=1)[0]
        for _ in range(3):
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0], losses  # the same batch: the host's steps reached the device's weights


def _master_weights(engine):
    """ZeRO-2's fp32 master partitions, in pinned host memory under offload_optimizer."""
    return engine.optimizer.single_partition_of_fp32_groups


def _ema_of_master_weights(device, rank, wait: bool):
    """An EMA of the offloaded master weights on the device, updated on a side stream after each step from a
    non_blocking copy of the pinned partitions; with `wait`, the training stream waits for it before the next step.
    Without overlap_comm: with it, ZeRO synchronizes the whole device after each backward, which orders the host
    after the EMA's copy whether the user waited or not."""
    with _accelerator():
        engine = _engine(_model(device), 2, cpu_adam=False, overlap_comm=False)
        assert all(w.is_pinned() for w in _master_weights(engine))
        ema = [torch.zeros_like(w, device=device) for w in _master_weights(engine)]
        side = torch.cuda.Stream()
        for x in _batches(device, rank):
            engine.backward(engine(x).pow(2).mean())
            engine.step()  # race: test_ema_of_offloaded_master_weights_without_wait
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for average, weights in zip(ema, _master_weights(engine)):
                    average.lerp_(weights.to(device, non_blocking=True), 0.1)  # race: test_ema_of_offloaded_master_weights_without_wait
            if wait:
                torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()


@pytest.mark.streamrace(expect="clean")
def test_ema_of_offloaded_master_weights(streamrace_device, rank, needs_streams):
    _ema_of_master_weights(streamrace_device, rank, wait=True)


@pytest.mark.streamrace(expect="race")
def test_ema_of_offloaded_master_weights_without_wait(streamrace_device, rank, needs_streams):
    """The next step's host optimizer rewrites the pinned master weights while the EMA's copy may still read them."""
    _ema_of_master_weights(streamrace_device, rank, wait=False)


@pytest.fixture
def fsdp2_offload(streamrace_device):
    """FSDP2's CPU offload runs its stream logic on a GPU. On CPU its device is `cpu`: its streams and events are
    torch.cpu's, which order nothing in the detector's model, while the virtual backend takes each pinned parameter's
    `.to(device)` as a copy to the device; and without --streamrace torch cannot pin."""
    if streamrace_device.type != "cuda":
        pytest.skip("FSDP2 CPU offload needs a GPU (on CPU its host ordering runs through torch.cpu streams)")


@pytest.mark.streamrace(expect="clean")
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard-after-forward", "keep-unsharded"])
def test_fsdp2_cpu_offload(streamrace_device, fsdp2_offload, reshard):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))  # on the host: offload materializes there
    policy = CPUOffloadPolicy(pin_memory=True)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, offload_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, offload_policy=policy, reshard_after_forward=reshard)
    assert all(p.to_local().is_pinned() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)  # steps on the host
    for _ in range(3):
        model(torch.randn(4, 16, device=streamrace_device)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert all(p.device.type == "cpu" and torch.isfinite(p.to_local()).all() for p in model.parameters())
