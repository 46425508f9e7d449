"""The tutorial (docs/tutorial.md) stays true: its code blocks, put into files as its text says, run with its
command, print the output it shows (the races, their line numbers, the summary) and exit as it says, step by step.
Only what differs between machines is left out of the comparison: the platform and plugins lines, the rootdir and the
time a session took. The README's `pytest --streamrace` quick start is held to its shown report the same way."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WHERE = "/tmp/tutorial"  # the directory the page ran in, as its output names it


def _blocks(page: Path) -> dict[str, list[str]]:
    """The page's fenced blocks in order, by language ("" for program output)."""
    out: dict[str, list[str]] = {}
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```$", page.read_text(encoding="utf-8"), re.S | re.M):
        out.setdefault(lang, []).append(body)
    return out


BLOCKS = _blocks(ROOT / "docs" / "tutorial.md")


def _put_def(source: str, block: str) -> str:
    """The tutorial's edits: a block defining a function or method replaces the definition of that name (up to the
    next one at its indent), or is added at the end when there is none."""
    name = re.match(r"\s*def (\w+)", block).group(1)
    indent = re.match(r"\s*", block).group(0)
    found = re.search(rf"^{indent}def {name}\(.*?(?=^{indent}(?:def |class )|\Z)", source, re.S | re.M)
    if found is None:
        return source.rstrip("\n") + "\n\n" + block
    tail = source[found.end():]
    return source[:found.start()] + block + ("\n" + tail if tail else "")


def _normal(text: str, root: Path) -> list[str]:
    """Output lines with the machine's own parts masked: where it ran, which Python and plugins, how long it took."""
    text = text.replace(str(root), WHERE)
    text = re.sub(r"^platform .*$", "platform ...", text, flags=re.M)
    text = re.sub(r"^plugins: .*$", "plugins: ...", text, flags=re.M)
    text = re.sub(r" in [0-9.]+s (=+)$", lambda m: " in Ns " + m.group(1), text, flags=re.M)
    return text.rstrip("\n").splitlines()


def _run(pytester: pytest.Pytester, command: str):
    argv = shlex.split(command)
    assert argv[:3] == [".venv/bin/python", "-m", "pytest"], command
    return pytester.runpytest_subprocess(*argv[3:])


def _equal_widths(shown: list[str], real: list[str]) -> None:
    """pytest centres its rule lines on the terminal's width: a longer time makes the last rule a character shorter."""
    for i, (a, b) in enumerate(zip(shown, real)):
        if a != b and a.strip("=") != a and a.strip("=").strip() == b.strip("=").strip():
            real[i] = a


@pytest.fixture
def terminal(monkeypatch):
    """A user's terminal as the page's output was printed on: 80 columns, and not a CI machine (where pytest does not
    shorten the summary's lines to the width)."""
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("BUILD_NUMBER", raising=False)


def test_the_tutorial_runs_as_it_says(pytester, terminal):
    prefetch, test, prepare, wait, test_fixed = BLOCKS["python"]
    install, run = BLOCKS["bash"]
    build, failing, after_first_fix, passing = BLOCKS[""]
    command = run.strip()
    assert "./pytest-streamrace" in install and command == ".venv/bin/python -m pytest --streamrace test_prefetch.py"

    # 2: the code; 3: the run, its output as shown (the build line aside: the capture is built already)
    (pytester.path / "prefetch.py").write_text(prefetch)
    (pytester.path / "test_prefetch.py").write_text(test)
    result = _run(pytester, command)
    shown, real = _normal(failing, pytester.path), _normal(result.stdout.str(), pytester.path)
    _equal_widths(shown, real)
    assert real == shown
    assert result.ret == 1

    # 5: the first fix; the first report gone, the two reads of `ready` left, the first of them as shown
    (pytester.path / "prefetch.py").write_text(_put_def((pytester.path / "prefetch.py").read_text(), prepare))
    result = _run(pytester, command)
    real = "\n".join(_normal(result.stdout.str(), pytester.path))
    assert after_first_fix.rstrip("\n") in real
    assert "2 stream races (unordered cross-stream accesses" in real and "aten::randn" not in real
    assert result.ret == 1

    # 6: the second fix; the session as shown, passing
    (pytester.path / "prefetch.py").write_text(_put_def((pytester.path / "prefetch.py").read_text(), wait))
    (pytester.path / "test_prefetch.py").write_text(_put_def((pytester.path / "test_prefetch.py").read_text(),
                                                             test_fixed))
    result = _run(pytester, command)
    first, *shown = passing.splitlines()
    assert first == f"$ {command}"
    shown, real = _normal("\n".join(shown), pytester.path), _normal(result.stdout.str(), pytester.path)
    _equal_widths(shown, real)
    assert real == shown
    assert result.ret == 0


def test_the_tutorials_build_line_is_the_one_the_plugin_prints(capsys):
    """The first pytest session's line on stderr, as the page shows it: the folder under TORCH_EXTENSIONS_DIR named by
    the capture's prefix, torch's version and a hash (`<hash>` on the page)."""
    import torch

    from pytest_streamrace.detector import capture

    build = BLOCKS[""][0].strip()
    shown_version = re.search(r" for torch (\S+) ", build).group(1)
    folder = f"{WHERE}/ext/streamrace_capture_{re.sub(r'[^0-9A-Za-z]', '_', shown_version)}_<hash>"
    capture._say_building("streamrace_capture", shown_version, folder)
    assert capsys.readouterr().err.strip() == build
    name, _ = capture._where("streamrace_capture", "", torch)
    assert re.fullmatch(rf"streamrace_capture_{re.sub(r'[^0-9A-Za-z]', '_', torch.__version__)}_[0-9a-f]{{10}}", name)


def test_the_readmes_quick_start_reports_as_shown(pytester, terminal):
    blocks = _blocks(ROOT / "README.md")
    command, elided, *shown = blocks[""][0].rstrip("\n").splitlines()
    assert command == "$ pytest --streamrace test_x.py" and elided == "..."
    (pytester.path / "test_x.py").write_text(blocks["python"][0])
    result = pytester.runpytest_subprocess(*command.split()[2:])
    assert "\n".join(shown) in "\n".join(_normal(result.stdout.str(), pytester.path))
    assert result.ret == 1
