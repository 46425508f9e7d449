"""docs/reference.md names everything the plugin adds, as pytest itself lists it to a user (``--help``, ``--markers``,
``--fixtures``), every option of the repro CLI and every ``STREAMRACE_*`` variable the package reads or sets, and
docs/how-to/running.md every option of ``streamrace run`` (as each command's ``--help`` lists them): adding one
without documenting it fails here, and so does documenting a pytest option that does not exist."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")


def _named(name: str) -> bool:
    """Named in the reference as code: `name`, `name PATH`, `name=...`, `name(...)`."""
    return re.search(r"`(@pytest\.mark\.)?" + re.escape(name) + r"[`\s=(]", REFERENCE) is not None


def _help(pytester: pytest.Pytester) -> str:
    result = pytester.runpytest("--help")
    assert result.ret == 0
    return result.stdout.str()


def test_every_option_and_ini_key_is_documented(pytester: pytest.Pytester):
    text = _help(pytester)
    flags = set(re.findall(r"^  (--streamrace[\w-]*)", text, re.M))
    keys = set(re.findall(r"^  (streamrace\w*) \(", text, re.M))
    assert "--streamrace-backend" in flags and "streamrace_backend" in keys  # the parsing still reads --help
    assert sorted(n for n in flags | keys if not _named(n)) == []


def test_the_reference_names_no_option_that_does_not_exist(pytester: pytest.Pytester):
    flags = set(re.findall(r"^  (--streamrace[\w-]*)", _help(pytester), re.M))
    assert sorted(set(re.findall(r"(--streamrace[\w-]*)", REFERENCE)) - flags) == []


def _cli_flags(*module_and_args: str) -> set[str]:
    """The flags a command of the package lists in its --help (but --help)."""
    out = subprocess.run([sys.executable, "-m", *module_and_args, "--help"], capture_output=True, text=True,
                         check=True).stdout
    return set(re.findall(r"^  (--[\w-]+)", out, re.M)) - {"--help"}


def test_every_repro_cli_option_is_documented():
    flags = _cli_flags("pytest_streamrace.repro")
    assert {"--variant", "--confirm"} <= flags
    section = REFERENCE[REFERENCE.index("## The repro CLI"):]
    assert sorted(f for f in flags if not re.search(re.escape(f) + r"\b", section)) == []


def test_every_streamrace_run_option_is_documented():
    """`streamrace run`'s options are documented in its how-to's table, each as `--option ...`."""
    flags = _cli_flags("pytest_streamrace", "run")
    assert {"--backend", "--confirm"} <= flags
    page = (ROOT / "docs" / "how-to" / "running.md").read_text(encoding="utf-8")
    assert sorted(f for f in flags if f"| `{f}" not in page and f", `{f}" not in page) == []


def test_every_marker_is_documented(pytester: pytest.Pytester):
    def markers(*args) -> set[str]:
        result = pytester.runpytest("--markers", *args)
        assert result.ret == 0
        return set(re.findall(r"^@pytest\.mark\.(\w+)", result.stdout.str(), re.M))

    ours = markers() - markers("-p", "no:streamrace")
    assert {"distributed", "streamrace"} <= ours
    assert sorted(m for m in ours if not _named(m)) == []


def test_every_fixture_is_documented(pytester: pytest.Pytester):
    result = pytester.runpytest("--fixtures")
    assert result.ret == 0
    ours, in_ours = set(), False
    for line in result.stdout.lines:
        header = re.match(r"^-+ fixtures defined from (\S+) -+$", line)
        if header:
            in_ours = header.group(1).startswith("pytest_streamrace")
        elif in_ours and (m := re.match(r"^(\w+)(?: \[[^]]*\])?(?: -- |$)", line)):
            ours.add(m.group(1))
    assert {"streamrace_device", "injected_delays"} <= ours
    assert sorted(f for f in ours if not _named(f)) == []


def test_every_environment_variable_is_documented():
    """Every STREAMRACE_* name the package's Python spells out: the variables it reads, and the ones it sets for
    its own processes (documented as such)."""
    names = set()
    for path in [*(ROOT / "pytest_streamrace").rglob("*.py"), *(ROOT / "repros").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.update(re.findall(r"\bSTREAMRACE_[A-Z_]+[A-Z]\b", node.value))
    assert {"STREAMRACE_NATIVE", "STREAMRACE_SUBPROCESS"} <= names
    assert sorted(n for n in names if n not in REFERENCE) == []
