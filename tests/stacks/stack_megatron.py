"""Megatron-core's DistributedDataParallel as users train with it: ``overlap_grad_reduce`` with the distributed
optimizer (one instance) clean, racy twins caught.

On CPU under ``--streamrace`` Megatron runs inside ``megatron_on_virtual_streams()``: its ``torch.cuda`` devices are
CPU and its streams the virtual ones, its collectives run on gloo. On GPUs the same module runs on CUDA and NCCL.
Megatron-core has no CPU path, so without ``--streamrace`` on CPU every case is skipped.
"""

import contextlib

import pytest

from pytest_streamrace.frameworks.megatron_cpu import prepare_import

prepare_import()  # before megatron-core's import-time JIT build
pytest.importorskip("megatron.core")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

pytestmark = pytest.mark.distributed(world_size=2)

WIDTH, DEPTH, BATCH = 16, 4, 8
BUCKET = 2 * (WIDTH * WIDTH + WIDTH)  # two layers a bucket: gradient sync starts while backward goes on


def _virtual():
    from pytest_streamrace.detector.session import active

    detector = active()
    return detector is not None and detector.backend == "virtual"


@pytest.fixture
def megatron():
    """Megatron's parallel state on this test's ranks (data parallel over both), on CPU inside the virtual devices."""
    if not (_virtual() or torch.cuda.is_available()):
        pytest.skip("megatron-core needs CUDA: a GPU, or --streamrace on CPU")
    from pytest_streamrace.frameworks.megatron_cpu import megatron_on_virtual_streams

    with megatron_on_virtual_streams() if _virtual() else contextlib.nullcontext():
        parallel_state.initialize_model_parallel()
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()


def _ddp(device, **options):
    torch.manual_seed(0)
    module = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)]).to(device)
    config = DistributedDataParallelConfig(overlap_grad_reduce=True, use_distributed_optimizer=True,
                                           bucket_size=BUCKET, **options)
    return DistributedDataParallel(TransformerConfig(num_attention_heads=1, num_layers=1), config, module)


def _optimizer(ddp):
    return get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True), [ddp])


def _batches(device, rank, steps=2):
    generator = torch.Generator(device=device).manual_seed(1 + rank)
    return [torch.randn(BATCH, WIDTH, device=device, generator=generator) for _ in range(steps)]


@pytest.mark.streamrace(expect="clean")
@pytest.mark.parametrize("options", [{}, {"overlap_param_gather": True}, {"grad_reduce_in_fp32": True}],
                         ids=["default", "overlap-param-gather", "fp32-reduce"])
def test_ddp_distributed_optimizer(streamrace_device, rank, megatron, options):
    """Megatron's training iteration: zero the grad buffers, forward, backward, finish_grad_sync, optimizer step."""
    ddp = _ddp(streamrace_device, **options)
    optimizer = _optimizer(ddp)
    for x in _batches(streamrace_device, rank, steps=3):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = ddp(x).pow(2).mean()
        loss.backward()
        ddp.finish_grad_sync()
        update_successful, grad_norm, _ = optimizer.step()
        assert update_successful and torch.isfinite(torch.as_tensor(grad_norm)).item()


@pytest.mark.streamrace(expect="clean")
def test_grad_norm_logged_after_finish_grad_sync(streamrace_device, rank, megatron):
    """Gradient statistics read from main_grad once finish_grad_sync() returned: this rank's reduced shard is there."""
    ddp = _ddp(streamrace_device)
    for x in _batches(streamrace_device, rank):
        ddp.zero_grad_buffer()
        ddp(x).pow(2).mean().backward()
        ddp.finish_grad_sync()
        norms = torch.stack([p.main_grad.norm() for p in ddp.parameters()])
        assert torch.isfinite(norms).all().item()


@pytest.mark.streamrace(expect="race")
def test_grad_norm_logged_before_finish_grad_sync(streamrace_device, rank, megatron):
    """The same statistics, read before finish_grad_sync(): the reduce-scatter that backward started on the gradient
    buckets may still be writing this rank's shard of main_grad."""
    ddp = _ddp(streamrace_device)
    for x in _batches(streamrace_device, rank):
        ddp.zero_grad_buffer()
        ddp(x).pow(2).mean().backward()
        norms = torch.stack([p.main_grad.norm() for p in ddp.parameters()])  # race: test_grad_norm_logged_before_finish_grad_sync
        ddp.finish_grad_sync()
