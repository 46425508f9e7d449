"""torch DCP's async staging on 2 GPUs: the dcp_async_staging repro (NCCL ranks, a gloo group for DCP) with its
numeric referee, the checkpoint loaded back against the model."""

import json

import pytest
from repro_cli import repro


CLAIMS = {
    42: '`dcp_async_staging` on 2 GPUs with its referee (the checkpoint loaded back against the model): '
        'unpatched reproduced every run, the checkpoint about one AdamW step (lr 0.01) from the model; '
        'patched clean and equal every run',
}

pytestmark = [pytest.mark.gpu(count=2), pytest.mark.validates(42)]


def test_the_referee_sees_the_pre_step_checkpoint(tmp_path, gpu_repeat, gpu_result):
    """The step delayed on its stream: the checkpoint holds pre-step values unpatched (about one AdamW step) and the
    model's exactly with the fix, each run."""
    path = tmp_path / "out.json"
    out = repro("dcp_async_staging", "--backend", "cuda", "--repeat", str(gpu_repeat), "--json", str(path),
                timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    runs = json.loads(path.read_text())["runs"]
    assert len(runs) == 2 * gpu_repeat
    errors = {variant: [n["max_abs_err"] for r in runs if r["variant"] == variant for n in r["numeric"]]
              for variant in ("unpatched", "patched")}
    for variant, verdict in (("unpatched", "reproduced"), ("patched", "clean")):
        got = sum(r["variant"] == variant and r["verdict"] == verdict for r in runs)
        gpu_result.record(f"{variant} {verdict}", f"{got}/{gpu_repeat}")
        gpu_result.record(f"{variant} max_abs_err", [min(errors[variant]), max(errors[variant])])
    for run in runs:
        assert len(run["numeric"]) == 2, run["numeric"]  # one referee a rank
        assert (run["verdict"], bool(run["races"])) == (("clean", False) if run["variant"] == "patched"
                                                        else ("reproduced", True)), run
    assert min(errors["unpatched"]) > 1e-3 and errors["patched"] == [0.0] * len(errors["patched"]), errors
