"""What the GPU validation items share: running pytest or a repro as a subprocess the way a user does, reading its
outcomes, and the carried framework versions (scripts/device/setup.sh installs each wheel of .whl/ into its own
folder under --framework-sites, so that several DeepSpeed or megatron-core versions can be tried in one session)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
PYTEST = [PYTHON, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "--color=no"]
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colours a suite's conftest turns on (DeepSpeed's sets color=yes)


def run(args: list[str], *, timeout: float, env: dict | None = None, cwd=None, log=None) -> subprocess.CompletedProcess:
    """A subprocess with stdout and stderr merged, as text without colour codes; the environment is this one's plus
    `env`. With `log`, the output goes to that file as it comes (a session stopped from outside leaves what the run
    had said). One that runs past `timeout` fails the test in one line (the results file keeps it as the row's
    reason), with its output's end."""
    if log is not None:
        os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
    try:
        with open(log, "w", encoding="utf-8") if log is not None else contextlib.nullcontext(subprocess.PIPE) as sink:
            done = subprocess.run(args, stdout=sink, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                                  env={**os.environ, **(env or {})}, cwd=cwd or ROOT)
    except subprocess.TimeoutExpired as exc:
        said = Path(log).read_text(encoding="utf-8", errors="replace") if log is not None else exc.output or ""
        said = said.decode(errors="replace") if isinstance(said, bytes) else said
        pytest.fail(f"{' '.join(str(a) for a in args[-3:])} ran past {timeout:g} s\n{said[-3000:]}", pytrace=False)
    if log is not None:
        done.stdout = Path(log).read_text(encoding="utf-8", errors="replace")
    done.stdout = _ANSI.sub("", done.stdout or "")
    return done


def out_log(name: str, suffix: str = ".log") -> str | None:
    """`logs/NAME.log` (or another `suffix`) under $OUT, where OUT is set (the GPU host's results folder): what a run
    writes there as it goes outlives a stopped session."""
    return os.path.join(os.environ["OUT"], "logs", name + suffix) if os.environ.get("OUT") else None


def counts(output: str) -> dict[str, int]:
    """pytest's closing summary as {outcome: count} ('3 passed, 1 failed in 2.0s')."""
    lines = [line for line in output.strip().splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)]
    found = {}
    last = lines[-1] if lines else ""
    for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", last):
        found[word.rstrip("s") if word.startswith("error") else word] = int(n)
    return found


def junit_outcomes(path, qualified: bool = False) -> dict[str, tuple[str, str]]:
    """Test name (`qualified`: class::name) -> (passed | failed | skipped, the failure's message) from a junit XML
    file; {} where the session wrote none (it did not start: its output says why)."""
    result = {}
    if not os.path.exists(path):
        return result
    for case in ET.parse(path).getroot().iter("testcase"):
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        name = f"{case.get('classname')}::{case.get('name')}" if qualified else case.get("name")
        if case.find("skipped") is not None:
            result[name] = ("skipped", "")
        elif problem is None:
            result[name] = ("passed", "")
        else:
            result[name] = ("failed", (problem.get("message") or "") + (problem.text or "")[:2000])
    return result


def races(path) -> list[dict]:
    """The races of a --streamrace-json file; [] where the session wrote none."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return json.load(f)["races"]


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def framework_env(config, **wanted: str | None) -> dict[str, str]:
    """The environment a subprocess needs to import the named framework versions (deepspeed="0.19.8",
    megatron_core="0.15.2"; None: any version); the item is skipped with the reason where one is missing."""
    sites = Path(config.getoption("framework_sites", default="/tmp/streamrace-sites"))
    paths = []
    for name, version in wanted.items():
        dist = name.replace("_", "-")
        have = _installed(dist)
        if have is not None and version in (None, have):
            continue
        if version is not None and (sites / f"{dist}-{version}").is_dir():
            paths.append(str(sites / f"{dist}-{version}"))
            continue
        if version is None and (found := sorted(sites.glob(f"{dist}-[0-9]*"))):
            paths.append(str(found[-1]))
            continue
        if version is None and any((sites / "common").glob(f"{dist.replace('-', '_')}-*.dist-info")):
            continue
        pytest.skip(f"{dist} {version or ''} is not installed: carry its wheel in .whl/ and source "
                    "scripts/device/setup.sh".replace("  ", " "))
    if (sites / "common").is_dir():
        paths.append(str(sites / "common"))
    old = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join(paths + ([old] if old else []))} if paths else {}


def extensions_dir(dist: str, version: str) -> str:
    """A JIT build cache of its own for a framework version (two versions' builds of one op would collide)."""
    return f"{os.environ.get('TORCH_EXTENSIONS_DIR', '/tmp/tex')}-{dist}-{version}"


def repro(name: str, *args: str, config, timeout: float, env: dict | None = None, json_path=None) -> dict:
    """`python -m pytest_streamrace.repro NAME --backend cuda ARGS --json PATH`: its JSON, exit status and output
    (also in `logs/` under $OUT as it runs, where OUT is set: a repro's progress outlives a stopped session)."""
    log = out_log(f"{name}-{Path(json_path).parent.name}")  # (json_path: in the item's own tmp_path)
    done = run([PYTHON, "-m", "pytest_streamrace.repro", name, "--backend", "cuda", *args, "--json", str(json_path)],
               timeout=timeout, env=env, log=log)
    try:
        with open(json_path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError:
        data = {"runs": []}
    data["returncode"], data["output"] = done.returncode, done.stdout
    return data


def gist(output: str, keep: int = 2500) -> str:
    """A long run's output for a failure message: its start (what failed first) and its end."""
    return output if len(output) <= 2 * keep else f"{output[:keep]}\n[...]\n{output[-keep:]}"


def verdicts(data: dict, variant: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in data["runs"]:
        if r["variant"] == variant:
            out[r["verdict"]] = out.get(r["verdict"], 0) + 1
    return out


def stack_twins(stack: str, gpu_result, tmp_path, env: dict, log: str, extra=(), known_latent=None) -> dict:
    """A tests/stacks module run plain and under `--streamrace` (cuda backend, `extra` options): the same outcomes both
    ways, no race on a clean test, every racy twin caught at its tagged lines; the counts go to `gpu_result`.
    `known_latent`: {test name: why} of clean tests on which a known upstream race is expected as latent (ordered
    today by a sync the program did not ask for); those latent races are counted apart, any other race there still
    fails. Returns the plain run's outcomes by test id."""
    import test_stacks  # the CPU suite's reading of a stack: its racy twins and their tagged lines

    path = ROOT / "tests" / "stacks" / f"stack_{stack}.py"
    outcomes = {}
    for mode, args in (("plain", []), ("streamrace", ["--streamrace", "--streamrace-backend=cuda", *extra,
                                                       "--streamrace-json", str(tmp_path / "races.json")])):
        junit = tmp_path / f"{mode}.xml"
        done = run([*PYTEST, str(path), "-n", "0", "-rA", "-q", f"--junitxml={junit}", *args], timeout=600, env=env,
                   log=out_log(f"{log}-{mode}"))
        outcomes[mode] = {name: outcome for name, (outcome, _) in junit_outcomes(junit).items()}
        assert outcomes[mode], done.stdout[-3000:]
    source = path.read_text()
    racy, tags = test_stacks.racy_twins(source), test_stacks.tagged(source)
    found = races(tmp_path / "races.json")

    def test_of(race: dict) -> str:
        return race["test"].split("::")[-1].split("[")[0]

    known = [r for r in found if r.get("latent") and test_of(r) in (known_latent or {})]
    clean_with_races = sorted({test_of(r) for r in found if r not in known} - racy)
    missed = sorted(t for t in racy if not any(
        f["line"] in tags.get(t, ()) for r in found if test_of(r) == t
        for access in (r["earlier"], r["later"]) for f in access["frames"] if f["file"].endswith(path.name)))
    differ = sorted(n for n in outcomes["plain"] if outcomes["plain"][n] != outcomes["streamrace"].get(n))
    gpu_result.record("tests", len(outcomes["plain"]))
    gpu_result.record("racy twins caught", f"{len(racy) - len(missed)}/{len(racy)}")
    gpu_result.record("clean tests with races", len(clean_with_races))
    gpu_result.record("outcomes that differ", len(differ))
    if known_latent is not None:
        gpu_result.record("known latent races", len(known))
    assert not clean_with_races, f"races on clean tests: {clean_with_races}: " + "\n".join(
        json.dumps(r)[:600] for r in found if test_of(r) in clean_with_races)
    assert not missed, (f"racy twins not caught at their tagged lines: {missed} (their outcomes plain: "
                        f"{ {t: o for n, o in outcomes['plain'].items() for t in missed if n.startswith(t)} })")
    assert not differ, f"outcomes differ plain vs --streamrace: {differ}"
    return outcomes["plain"]
