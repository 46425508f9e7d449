"""The torch and Python releases the README names: the native parts build and load against this torch without the
fallback's warning, one source holds every difference between torch releases, and the tox environments that test the
range on demand cover exactly the releases the README and pyproject.toml name."""

from __future__ import annotations

import configparser
import os
import pathlib
import re
import subprocess
import sys

import pytest_streamrace

ROOT = pathlib.Path(__file__).resolve().parents[1]
DETECTOR = pathlib.Path(pytest_streamrace.__file__).parent / "detector"

BUILD = """
import warnings
warnings.simplefilter("error")
import torch
from pytest_streamrace.detector import capture
assert capture.load() is not None, capture.failure()
assert capture.load_trace() is not None, capture.trace_failure()
print("built", torch.__version__)
"""


def test_the_native_parts_build_and_load_against_this_torch():
    """The capture with its core, and the GPU trace's interpreter: no 'did not build' warning, in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "STREAMRACE_NATIVE"}
    done = subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("built ")


def test_only_torch_compat_tests_the_torch_version():
    tested = {path.name for path in DETECTOR.glob("*.cpp")
              if re.search(r"TORCH_VERSION|STREAMRACE_TORCH_AT_LEAST", path.read_text(encoding="utf-8"))}
    assert tested == {"torch_compat.cpp"}


def _range(text: str, what: str) -> tuple[str, str]:
    found = re.search(rf"{what} (\d+\.\d+) to (\d+\.\d+)", text)
    assert found, f"no '{what} X to Y' in the README's install section"
    return found[1], found[2]


def test_the_tox_environments_test_the_range_the_readme_names():
    """Each end of the README's torch and Python ranges has a `torch-range` environment (pyXY-torchAB), every such
    environment pins a torch inside the range on a Python inside it, and pyproject.toml asks for the same lower ends."""
    install = (ROOT / "README.md").read_text(encoding="utf-8").split("## Install", 1)[1].split("\n## ", 1)[0]
    torch_low, torch_high = _range(install, "torch")
    python_low, python_high = _range(install, "Python")
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini", encoding="utf-8")
    tested = []
    for section in tox.sections():
        if section.startswith("testenv:") and "torch-range" in tox[section].get("labels", ""):
            named = re.fullmatch(r"testenv:py3(\d+)-torch2(\d+)", section)
            assert named, f"{section}: a torch-range environment is named pyXY-torchAB"
            python, torch = f"3.{named[1]}", f"2.{named[2]}"
            pin = re.search(r"torch==(\d+\.\d+)\.\d+", tox[section]["deps"])
            assert pin and pin[1] == torch, (section, tox[section]["deps"])
            tested.append((python, torch))
    assert tested, "no tox environment labelled torch-range"
    key = lambda version: tuple(int(part) for part in version.split("."))  # noqa: E731
    pythons, torches = sorted({p for p, _ in tested}, key=key), sorted({t for _, t in tested}, key=key)
    assert (pythons[0], pythons[-1]) == (python_low, python_high), tested
    assert (torches[0], torches[-1]) == (torch_low, torch_high), tested
    project = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert f'requires-python = ">={python_low}"' in project
    assert f'"torch>={torch_low}"' in project
