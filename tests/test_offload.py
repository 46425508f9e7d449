"""Host offload on the virtual backend: DeepSpeed ZeRO-2/3 with ``offload_optimizer`` in pinned host memory (and
ZeRO-3's ``offload_param``), stacks/stack_offload.py, through pytest as users run it, plain and under ``--streamrace``:
the same outcomes, no race on stock code (ZeRO-3's known parameter-gather race latent only), the racy twin's race on
the host. The first run builds DeepSpeedCPUAdam (about a minute, cached by torch). tests/gpu/test_offload_gpu.py runs
the same module on real streams, FSDP2's CPU offload with it."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_stacks import racy_twins

STACK = Path(__file__).parent / "stacks" / "stack_offload.py"
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")


@pytest.fixture(scope="module")
def cpu_adam_built():
    """DeepSpeedCPUAdam's extension, built once before the ranks start (about a minute alone, several on a loaded
    2-core machine): each rank of the stack's cases would otherwise build or wait for it inside its distributed
    test's timeout."""
    code = ("import torch; from deepspeed.ops.adam import DeepSpeedCPUAdam; "
            "DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))])")
    done = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=1200)
    assert done.returncode == 0, f"DeepSpeedCPUAdam did not build:\n{done.stdout[-3000:]}"


def _outcomes(path: Path) -> dict[str, str]:
    import xml.etree.ElementTree as ET

    found = {}
    for case in ET.parse(path).iter("testcase"):
        kind = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        found[case.get("name")] = kind
    return found


@needs_deepspeed
def test_zero_offload_same_outcomes_plain_and_under_streamrace_without_a_race_on_stock_code(pytester, cpu_adam_built):
    source = STACK.read_text()
    module = pytester.makepyfile(**{STACK.stem: source})
    common = ["-p", "no:cacheprovider", "-p", "no:randomly", "-rA", str(module)]
    plain = pytester.runpytest_subprocess(*common, "--junitxml=plain.xml")
    checked = pytester.runpytest_subprocess(*common, "--junitxml=streamrace.xml", "--streamrace",
                                            "--streamrace-backend=virtual", "--streamrace-json", "races.json")
    outcomes = {name: _outcomes(pytester.path / f"{name}.xml") for name in ("plain", "streamrace")}
    stock = {t for t in outcomes["streamrace"] if t.startswith("test_zero_offload[")}
    assert len(stock) == 4 and {outcomes[run][t] for run in outcomes for t in stock} == {"passed"}, (
        plain.stdout.str()[-3000:] + checked.stdout.str()[-3000:])
    # plain on CPU DeepSpeed has no streams: the twins that need them skip; the rest match test by test
    assert {t: o for t, o in outcomes["plain"].items() if o != "skipped"} == {
        t: o for t, o in outcomes["streamrace"].items() if t in outcomes["plain"] and outcomes["plain"][t] != "skipped"}
    assert outcomes["streamrace"]["test_ema_of_offloaded_master_weights"] == "passed"
    assert outcomes["streamrace"]["test_ema_of_offloaded_master_weights_without_wait"] == "passed"  # its race found

    races = json.loads((pytester.path / "races.json").read_text())["races"]
    real = [r for r in races if not r.get("latent")]
    assert {r["test"].split("::")[-1] for r in real} == racy_twins(source), real
    for race in real:  # the host optimizer's write of the pinned master weights, after the side stream's read
        assert (race["kind"], race["earlier"]["rw"], race["later"]["stream"]) == ("write-after-read", "read", "the host")
        assert any(f["file"].endswith("stage_1_and_2.py") for f in race["alloc"]["frames"]), race["alloc"]  # pinned there
    latent = [r for r in races if r.get("latent")]  # ZeRO-3's gather of the partition the step copied (known)
    assert {r["test"].split("::")[-1].split("[")[0] for r in latent} <= {"test_zero_offload"}
    assert all(r["earlier"]["frames"][0]["file"].endswith("stage3.py") for r in latent), latent
