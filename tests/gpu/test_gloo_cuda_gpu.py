"""One GPU, two ranks: the `distributed` marker falls back to gloo with CUDA tensors, whose collectives run through
gloo's own pooled streams, pinned host memory and worker threads. The stock stacks (tests/stacks) must give the same
outcomes plain and under `--streamrace`: every clean case clean, every racy twin caught at its tagged lines."""

import os

import pytest
from gpu_support import stack_twins

CLAIMS = {
    54: "One GPU, `world_size=2` (gloo over CUDA tensors): stock DDP (comm hooks, fp16 compression, `no_sync`), FSDP2 "
        "(both reshard settings), DTensor and c10d collectives called directly give the same outcomes plain and under "
        "`--streamrace`, clean cases with 0 races, racy twins caught",
}

STACKS = ["c10d", "ddp", "fsdp2", "dtensor"]


@pytest.mark.gpu(count=1)
@pytest.mark.validates(54)
@pytest.mark.parametrize("stack", STACKS)
def test_stack_on_gloo_over_cuda_same_outcomes_plain_and_under_streamrace(stack, gpu_result, tmp_path):
    env = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}  # one GPU: gloo
    stack_twins(stack, gpu_result, tmp_path, env, log=f"gloo-cuda-{stack}")
