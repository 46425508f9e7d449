"""The stock stacks on NCCL (tests/stacks, cuda backend, one GPU a rank) under `--streamrace`: every clean case
clean, every racy twin caught (a twin passes when its race is reported at its tagged lines)."""

import pytest
from gpu_support import PYTEST, ROOT, counts, framework_env, run

CLAIMS = {
    4: "Stock stacks on NCCL run clean and their users' usual mistakes are caught: DDP (bucket views, static graph, "
       "`no_sync`, comm hooks), FSDP2, DTensor TP, DeepSpeed ZeRO-1/2/3 `overlap_comm`, megatron-core DDP with the "
       "distributed optimizer",
}

STACKS = {"ddp": {}, "fsdp2": {}, "dtensor": {}, "deepspeed": {"deepspeed": "0.19.8"},
          "megatron": {"megatron_core": "0.15.2"}}


@pytest.mark.gpu(count=2)
@pytest.mark.validates(4)
@pytest.mark.parametrize("stack", list(STACKS))
def test_stack_on_nccl_clean_cases_clean_and_racy_twins_caught(request, stack, gpu_result):
    env = framework_env(request.config, **STACKS[stack])
    done = run([*PYTEST, str(ROOT / "tests" / "stacks" / f"stack_{stack}.py"), "-n", "0", "--streamrace",
                "--streamrace-backend=cuda", "-rA", "-q"], timeout=600, env=env)
    got = counts(done.stdout)
    gpu_result.record("passed", got.get("passed", 0))
    for framework, version in STACKS[stack].items():
        gpu_result.record(framework.replace("_", "-"), version)
    assert set(got) == {"passed"}, done.stdout[-4000:]
