"""One GPU, two ranks: the `distributed` marker falls back to gloo with CUDA tensors, whose collectives run through
gloo's own pooled streams, pinned host memory and worker threads. The stock stacks (tests/stacks) must give the same
outcomes plain and under `--streamrace`: every clean case clean, every racy twin caught at its tagged lines."""

import json
import os

import pytest
from gpu_support import PYTEST, ROOT, junit_outcomes, out_log, run

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
    import test_stacks  # the CPU suite's reading of a stack: its racy twins and their tagged lines

    path = ROOT / "tests" / "stacks" / f"stack_{stack}.py"
    env = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}  # one GPU: gloo
    outcomes = {}
    for mode, extra in (("plain", []), ("streamrace", ["--streamrace", "--streamrace-backend=cuda",
                                                       "--streamrace-json", str(tmp_path / "races.json")])):
        junit = tmp_path / f"{mode}.xml"
        done = run([*PYTEST, str(path), "-n", "0", "-rA", "-q", f"--junitxml={junit}", *extra], timeout=600,
                   env=env, log=out_log(f"gloo-cuda-{stack}-{mode}"))
        outcomes[mode] = {name: outcome for name, (outcome, _) in junit_outcomes(junit).items()}
        assert outcomes[mode], done.stdout[-3000:]
    source = path.read_text()
    racy = test_stacks.racy_twins(source)
    tags = test_stacks.tagged(source)
    races = json.loads((tmp_path / "races.json").read_text())["races"] if (tmp_path / "races.json").exists() else []
    raced = {r["test"].split("::")[-1].split("[")[0] for r in races}
    clean_with_races = sorted(raced - racy)
    missed = sorted(t for t in racy if not any(
        f["line"] in tags.get(t, ()) for r in races if r["test"].split("::")[-1].split("[")[0] == t
        for access in (r["earlier"], r["later"]) for f in access["frames"] if f["file"].endswith(path.name)))
    differ = sorted(n for n in outcomes["plain"] if outcomes["plain"][n] != outcomes["streamrace"].get(n))
    gpu_result.record("tests", len(outcomes["plain"]))
    gpu_result.record("racy twins caught", f"{len(racy) - len(missed)}/{len(racy)}")
    gpu_result.record("clean tests with races", len(clean_with_races))
    gpu_result.record("outcomes that differ", len(differ))
    assert not clean_with_races, f"races on clean tests: {clean_with_races}: " + "\n".join(
        json.dumps(r)[:600] for r in races if r["test"].split("::")[-1].split("[")[0] in clean_with_races)
    assert not missed, f"racy twins not caught at their tagged lines: {missed}"
    assert not differ, f"outcomes differ plain vs --streamrace: {differ}"
