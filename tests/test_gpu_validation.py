"""The GPU validation's plumbing, on CPU: tests/gpu/conftest.py's skips, row selection and results file, run on items
that need no GPU, and scripts/render_validation.py's table from that real file; tests/gpu skipping cleanly here
without importing a framework; and the claims in tests/gpu the same as docs/validation.md's."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "tests" / "gpu"
RENDER = ROOT / "scripts" / "render_validation.py"

CASES = """
import pytest

CLAIMS = {901: "A measured claim", 902: "A claim half on GPUs", 903: "A claim that does not hold"}


@pytest.mark.validates(901)
def test_measures(gpu_result, gpu_repeat):
    gpu_result.record("right", "26/26")
    gpu_result.record("runs", gpu_repeat)
    gpu_result.record("max |d|", 0.5)


@pytest.mark.validates(902)
def test_runs_here():
    pass


@pytest.mark.validates(902)
@pytest.mark.gpu(count=64)
def test_needs_many_gpus():
    pass


@pytest.mark.validates(902)
@pytest.mark.skipif(True, reason="its own reason")
def test_skipped_by_its_own_mark():
    pass


@pytest.mark.validates(903)
def test_wrong():
    assert 1 == 2, "the count was off"


def test_not_a_row():
    pass
"""


def _gpu_conftest(pytester) -> None:
    """tests/gpu's conftest and markers in a pytester folder."""
    pytester.makeconftest((GPU / "conftest.py").read_text(encoding="utf-8"))
    pytester.makeini("[pytest]\nmarkers =\n    gpu(count=1): a GPU item\n    validates(N): a validation row\n")


def _session(pytester, *args):
    _gpu_conftest(pytester)
    pytester.makepyfile(test_rows=CASES)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)


def _render(*args):
    return subprocess.run([sys.executable, str(RENDER), *map(str, args)], capture_output=True, text=True, timeout=60)


def test_the_results_file_records_each_row_item_and_renders_as_the_page_table(pytester):
    path = pytester.path / "out" / "results.json"
    result = _session(pytester, "--gpu-results", str(path), "--gpu-repeat", "5")
    result.assert_outcomes(passed=3, failed=1, skipped=2)
    result.stdout.fnmatch_lines([f"gpu validation: 5 items of rows [901, 902, 903] written to {path}"])
    data = json.loads(path.read_text())
    items = {item["nodeid"].rsplit("::", 1)[1]: item for item in data["items"]}
    assert sorted(items) == ["test_measures", "test_needs_many_gpus", "test_runs_here", "test_skipped_by_its_own_mark",
                             "test_wrong"]
    assert items["test_skipped_by_its_own_mark"]["reason"] == "its own reason"
    assert items["test_measures"]["numbers"] == {"right": "26/26", "runs": 5, "max |d|": 0.5}
    assert items["test_measures"]["claims"] == {"901": "A measured claim"}
    assert items["test_needs_many_gpus"]["outcome"] == "skipped"
    assert items["test_needs_many_gpus"]["reason"] == "needs 64 CUDA GPUs, this host has 0"
    assert items["test_wrong"]["outcome"] == "failed" and items["test_wrong"]["reason"] == "the count was off"
    assert all(item["duration_s"] >= 0 for item in data["items"])
    machine = data["machine"]
    assert machine["torch"] and machine["gpu_count"] == 0 and re.fullmatch(r"\d{4}-\d\d-\d\d", machine["date"])

    rendered = _render(path)
    assert rendered.returncode == 0, rendered.stderr
    date, torch = machine["date"], machine["torch"]
    assert rendered.stdout.splitlines() == [
        "| # | claim | result | hardware, torch | date | re-run |",
        "|---|---|---|---|---|---|",
        f"| 901 | A measured claim | **passed**: right 26/26, runs 5, max \\|d\\| 0.5 | CPU, {torch} | {date} | "
        "`pytest -m gpu tests/gpu --validates 901` |",
        f"| 902 | A claim half on GPUs | **passed** (1 of 3 items; the rest skipped: its own reason; needs 64 CUDA GPUs, "
        f"this host has 0) | CPU, {torch} | {date} | `pytest -m gpu tests/gpu --validates 902` |",
        f"| 903 | A claim that does not hold | **failed**: `test_wrong`: the count was off | "
        f"CPU, {torch} | {date} | `pytest -m gpu tests/gpu --validates 903` |",
    ]
    assert _render(path, "--row", "902").stdout.count("| 90") == 1


def test_results_of_several_slices_render_together_each_item_from_the_last_file_that_ran_it(pytester):
    first, second = pytester.path / "a.json", pytester.path / "b.json"
    _session(pytester, "--gpu-results", str(first))
    _session(pytester, "--gpu-results", str(second), "--validates", "901", "--gpu-repeat", "7")
    data = json.loads(second.read_text())
    data["machine"]["date"] = "2099-01-02"
    ran_before = next(i for i in json.loads(first.read_text())["items"] if i["nodeid"].endswith("test_runs_here"))
    data["items"].append(dict(ran_before, outcome="skipped", reason="a host without it"))  # skipped later: kept
    second.write_text(json.dumps(data))
    rendered = _render(first, second)
    assert rendered.returncode == 0, rendered.stderr
    table = {line.split(" | ")[0]: line for line in rendered.stdout.splitlines()[2:]}
    assert sorted(table) == ["| 901", "| 902", "| 903"]
    assert "runs 7" in table["| 901"] and "2099-01-02" in table["| 901"]
    assert "2099-01-02" not in table["| 902"] and "**passed** (1 of 3 items" in table["| 902"]
    assert "a host without it" not in table["| 902"] and "**failed**" in table["| 903"]


SHARED = """
import pytest

CLAIMS = {906: "A claim two variants re-create"}


@pytest.mark.validates(906)
@pytest.mark.parametrize("variant, error", [("first", 0.5), ("second", 0.25), ("third", None)])
def test_variant(gpu_result, variant, error):
    gpu_result.record("runs", 3)
    gpu_result.record("source", "abc123")
    gpu_result.record("max error", error)
"""


def test_a_number_every_item_of_a_row_recorded_alike_is_said_once(pytester):
    _gpu_conftest(pytester)
    pytester.makepyfile(test_shared=SHARED)
    path = pytester.path / "shared.json"
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "--gpu-results", str(path)).assert_outcomes(passed=3)
    row = _render(path).stdout.splitlines()[2]
    assert "| **passed**: runs 3, source abc123; `first-0.5`: max error 0.5; `second-0.25`: max error 0.25; `third-None` |" in row


STOPPED = """
import pytest

CLAIMS = {905: "A claim whose check was stopped"}


@pytest.mark.validates(905)
def test_done(gpu_result):
    gpu_result.record("count", 3)


@pytest.mark.validates(905)
def test_failed_after_measuring(gpu_result):
    gpu_result.record("count", 1)
    assert 1 == 3


@pytest.mark.validates(905)
def test_stopped(gpu_result):
    gpu_result.record("count", 2)
    raise KeyboardInterrupt  # as a session stopped from outside mid-test
"""


def test_a_test_the_session_stopped_in_is_not_recorded_as_passed_and_a_failure_keeps_its_numbers(pytester):
    _gpu_conftest(pytester)
    pytester.makepyfile(test_stopped=STOPPED)
    path = pytester.path / "r.json"
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "--gpu-results", str(path))
    items = {i["nodeid"].rsplit("::", 1)[1]: i for i in json.loads(path.read_text())["items"]}
    assert items["test_stopped"]["outcome"] == "unfinished" and items["test_done"]["outcome"] == "passed"
    row = _render(path).stdout.splitlines()[2]
    assert "| **failed**: `test_failed_after_measuring`: assert 1 == 3 (count 1); `test_stopped`: the session ended " \
           "before its test did; passed: `test_done`: count 3 |" in row, row
    items.pop("test_failed_after_measuring")
    path.write_text(json.dumps(dict(json.loads(path.read_text()), items=list(items.values()))))
    assert "| **did not finish**: `test_stopped`: " in _render(path).stdout


MESSAGES = """
import pytest

CLAIMS = {906: "A claim whose checks fail with messages"}


@pytest.mark.validates(906)
def test_short():
    assert 1 == 3, "confirmed 0 of 1: not tried"


@pytest.mark.validates(906)
def test_long():
    assert 1 == 3, "a session's output\\nline 2\\nline 3"
"""


def test_a_failure_s_reason_is_its_one_line_message_else_its_comparison(pytester):
    _gpu_conftest(pytester)
    pytester.makepyfile(test_messages=MESSAGES)
    path = pytester.path / "r.json"
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "--gpu-results", str(path))
    reasons = {i["nodeid"].rsplit("::", 1)[1]: i["reason"] for i in json.loads(path.read_text())["items"]}
    assert reasons == {"test_short": "confirmed 0 of 1: not tried", "test_long": "assert 1 == 3"}


def test_validates_selects_rows_and_a_gpu_session_writes_under_OUT(pytester, monkeypatch):
    monkeypatch.setenv("OUT", str(pytester.path / "device-out"))
    result = _session(pytester, "--validates", "902", "-m", "gpu or not gpu")
    result.assert_outcomes(passed=1, skipped=2, deselected=3)
    items = json.loads((pytester.path / "device-out" / "gpu-results.json").read_text())["items"]
    assert [item["rows"] for item in items] == [[902], [902], [902]]


def test_a_session_that_asks_for_no_results_writes_none(pytester):
    result = _session(pytester)
    result.assert_outcomes(passed=3, failed=1, skipped=2)
    assert not list(pytester.path.rglob("gpu-results.json"))


def test_render_says_in_one_line_what_is_wrong_with_its_input(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    cases = (([tmp_path / "missing.json"], "cannot read"), ([bad], "is not a results file of tests/gpu"),
             ([bad, "--row", "x"], "argument --row: invalid int value: 'x'"), ([], "the following arguments are required"))
    for args, message in cases:
        done = _render(*args)
        assert done.returncode == 2 and message in done.stderr and len(done.stderr.splitlines()) == 1
        assert "Traceback" not in done.stderr


def test_tests_gpu_skips_cleanly_without_a_gpu_and_imports_no_framework(tmp_path):
    """What CI sees: every item of tests/gpu skipped with its reason, no DeepSpeed or megatron imported to collect."""
    probe = ("import sys, pytest\n"
             f"rc = pytest.main(['-m', 'gpu', '-p', 'no:cacheprovider', '-q', '-rs', 'tests/gpu', '--gpu-results', "
             f"{str(tmp_path / 'r.json')!r}])\n"
             "print('frameworks:', sorted({m.split('.')[0] for m in sys.modules} & {'deepspeed', 'megatron'}))\n"
             "sys.exit(rc)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "frameworks: []" in done.stdout
    items = json.loads((tmp_path / "r.json").read_text())["items"]
    assert items and {item["outcome"] for item in items} == {"skipped"}
    assert all(re.fullmatch(r"needs (1 CUDA GPU|[2-8] CUDA GPUs), this host has 0", item["reason"]) for item in items)


def _claims() -> dict[int, tuple[str, str]]:
    """Row -> (claim, module) from every tests/gpu module's CLAIMS, read without importing it."""
    out = {}
    for path in sorted(GPU.glob("test_*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == ["CLAIMS"]:
                for row, claim in ast.literal_eval(node.value).items():
                    assert row not in out, f"row {row} claimed by {out[row][1]} and {path.name}"
                    out[row] = (claim, path.name)
    return out


def test_the_validation_page_states_each_claim_as_its_tests_do():
    page = (ROOT / "docs" / "validation.md").read_text(encoding="utf-8")
    cells = {int(m.group(1)): m.group(2) for m in re.finditer(r"^\| (\d+) \| (.+?) \| ", page, re.M)}
    claims = _claims()
    assert claims, "no CLAIMS in tests/gpu"
    assert {row: claim for row, (claim, _) in claims.items() if cells.get(row) != claim} == {}
    reruns = {int(row) for row in re.findall(r"--validates (\d+)", page)}
    assert sorted(reruns - set(claims)) == []


LANES = """
import os
import pytest

CLAIMS = {904: "A claim checked in lanes"}


@pytest.mark.validates(904)
@pytest.mark.parametrize("n", range(4))
def test_lane(gpu_result, n):
    gpu_result.record("lane", os.environ.get("CUDA_VISIBLE_DEVICES"))
"""


def test_xdist_workers_each_see_their_own_gpus_and_the_controller_writes_every_lane_s_results(pytester, monkeypatch):
    """`-n 2 --gpus-per-worker 2` on a host whose GPUs are 4-7: one worker sees 4,5, the other 6,7 (set before either
    makes a CUDA context), and the one results file holds every item; too few GPUs for the lanes is one usage line."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    _gpu_conftest(pytester)
    pytester.makepyfile(test_lanes=LANES)
    path = pytester.path / "results.json"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "--gpus-per-worker", "2",
                                           "--gpu-results", str(path))
    result.assert_outcomes(passed=4)
    lanes = [item["numbers"]["lane"] for item in json.loads(path.read_text())["items"]]
    assert len(lanes) == 4 and set(lanes) == {"4,5", "6,7"}, lanes
    wide = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "3", "--gpus-per-worker", "2")
    assert wide.ret == 4  # usage error
    wide.stderr.fnmatch_lines(["*--gpus-per-worker 2 with -n 3 needs 6 GPUs, this host has 4*"])


def test_the_validation_page_s_gpu_rows_are_rendered_from_the_kept_results():
    """The page's GPU rows are what scripts/render_validation.py makes of docs/evidence/gpu-results/ (their file names
    sort by time), and every row a GPU test claims is among them, or pending: on the page as `not yet run` until a
    kept results file has it."""
    page = (ROOT / "docs" / "validation.md").read_text(encoding="utf-8")
    files = sorted((ROOT / "docs" / "evidence" / "gpu-results").glob("*.json"))
    done = _render(*files)
    assert done.returncode == 0, done.stderr
    rendered = {int(line.split(" | ")[0][2:]): line for line in done.stdout.splitlines()[2:]}
    lines = set(page.splitlines())
    assert {row: line for row, line in rendered.items() if line not in lines} == {}
    pending = {int(m.group(1)) for m in re.finditer(r"^\| (\d+) \| .+? \| not yet run \| ", page, re.M)}
    assert sorted(pending & set(rendered)) == []  # a row with results is rendered from them
    assert sorted(set(_claims()) - set(rendered) - pending) == []  # every row a GPU test claims, run or pending
