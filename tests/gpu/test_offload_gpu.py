"""Host offload on one GPU: DeepSpeed ZeRO-2/3 with `offload_optimizer` (and ZeRO-3's `offload_param`) in pinned host
memory, and FSDP2 with `CPUOffloadPolicy(pin_memory=True)`, from tests/stacks/stack_offload.py, plain and under
`--streamrace` on the cuda backend: 1 rank on NCCL, and 2 ranks on gloo over CUDA tensors. Every stock case passes
both ways with no race; the racy twin (an EMA of the offloaded master weights whose side stream the next step's host
optimizer does not wait for) is caught. ZeRO-3's parameter gather race (docs/upstream/zero3-param-gather.md) shows
there as latent, as in its stock configuration elsewhere: counted apart."""

import os

import pytest
from gpu_support import extensions_dir, framework_env, stack_twins

CLAIMS = {
    59: "Host offload on one GPU, plain and under `--streamrace`: DeepSpeed ZeRO-2/3 `offload_optimizer` (pinned; "
        "DeepSpeedCPUAdam and a torch optimizer) and ZeRO-3 `offload_param`, FSDP2 `CPUOffloadPolicy(pin_memory=True)`, "
        "on 1 rank (NCCL) and 2 (gloo over CUDA tensors): the same outcomes, every stock case passed with 0 races, the "
        "racy twin caught",
}

DEEPSPEED = "0.19.8"
ZERO3_GATHER = "DeepSpeed's ZeRO-3 parameter gather after the step (docs/upstream/zero3-param-gather.md)"


@pytest.mark.gpu(count=1)
@pytest.mark.validates(59)
@pytest.mark.parametrize("world_size", [1, 2], ids=["1-rank-nccl", "2-ranks-gloo"])
def test_offload_same_outcomes_plain_and_under_streamrace(request, world_size, gpu_result, tmp_path):
    env = {**framework_env(request.config, deepspeed=DEEPSPEED), "STACK_WORLD_SIZE": str(world_size),
           "TORCH_EXTENSIONS_DIR": extensions_dir("deepspeed", DEEPSPEED),  # DeepSpeedCPUAdam's JIT build
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}  # one GPU
    plain = stack_twins("offload", gpu_result, tmp_path, env, log=f"offload-{world_size}",
                        known_latent={"test_zero_offload": ZERO3_GATHER})
    gpu_result.record("deepspeed", DEEPSPEED)
    not_passed = {test: outcome for test, outcome in plain.items() if outcome != "passed"}
    gpu_result.record("passed plain", f"{len(plain) - len(not_passed)}/{len(plain)}")
    assert not not_passed, f"stock offload cases that did not pass (plain run): {not_passed}"
