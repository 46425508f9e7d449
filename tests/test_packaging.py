"""The package as a user gets it: built into an sdist and a wheel, the wheel installed into a fresh virtual
environment with no source tree in sight, catching a race under ``pytest --streamrace``.

The editable install this suite runs from hides packaging mistakes: a C++ source missing from the package data still
loads from the checkout. So this builds the distributions the way a release does (``python -m build``), checks their
metadata as PyPI would (``twine check``), and runs a user's test file against the installed wheel alone. The fresh
environment borrows torch, pytest and the rest from this one through a ``.pth`` line (a plain path entry: this
environment's own ``.pth`` files, the editable install's among them, are not processed), so no 700 MB torch is
copied. It builds the C++ capture from the installed sources into an empty extensions folder, as a first-time user's
session does, and that session must say so on stderr.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="building the C++ capture needs a compiler")

RACY_AND_CLEAN = '''
import torch


def test_racy():
    x = torch.ones(1000)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1)
    assert x.mul(2).sum().item() > 0


def test_clean():
    x = torch.ones(1000)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    assert x.mul(2).sum().item() == 4000
'''


def _run(args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=540, **kwargs)


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # --no-isolation: setuptools is this environment's; an isolated build would fetch it from an index
    done = _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def test_sdist_and_wheel_carry_the_cpp_sources_and_pass_twine_check(dists):
    from pytest_streamrace import __version__

    wheel, = dists.glob("pytest_streamrace-*.whl")
    sdist, = dists.glob("pytest_streamrace-*.tar.gz")
    assert wheel.name == f"pytest_streamrace-{__version__}-py3-none-any.whl"
    cpp = sorted(p.name for p in (ROOT / "pytest_streamrace" / "detector").glob("*.cpp"))
    assert cpp, "no C++ sources found in the checkout"
    names = zipfile.ZipFile(wheel).namelist()
    assert [n for n in cpp if f"pytest_streamrace/detector/{n}" not in names] == []
    assert "pytest_streamrace/repros/zero_overlap.py" in names  # the shipped repros, under their installed name
    import tarfile

    members = tarfile.open(sdist).getnames()
    assert [n for n in cpp if not any(m.endswith(f"pytest_streamrace/detector/{n}") for m in members)] == []
    checked = _run([sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)])
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_installed_wheel_alone_catches_a_race(dists, tmp_path):
    wheel, = dists.glob("pytest_streamrace-*.whl")
    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    installed = _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                      "-q", str(wheel)])
    assert installed.returncode == 0, installed.stdout + installed.stderr
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    ours = [p for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]] if os.path.isdir(p)]
    Path(purelib, "borrowed_from_the_test_environment.pth").write_text("\n".join(dict.fromkeys(ours)) + "\n")

    work = tmp_path / "user"
    work.mkdir()
    (work / "test_streams.py").write_text(RACY_AND_CLEAN)
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("PYTEST_", "STREAMRACE_", "PYTHON")) and k != "TORCH_EXTENSIONS_DIR"}
    environ["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "extensions")  # empty: a first-time user's build
    where = _run([str(python), "-c", "import pytest_streamrace; print(pytest_streamrace.__file__)"], cwd=work,
                 env=environ)
    assert where.stdout.strip().startswith(purelib), where.stdout + where.stderr  # the wheel's copy, not the tree's

    done = _run([str(python), "-m", "pytest", "--streamrace", "-p", "no:cacheprovider", "-p", "no:xdist",
                 "test_streams.py"], cwd=work, env=environ)
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert "1 failed, 1 passed" in out, out
    assert "stream race: read-after-write on tensor float32[1000] (allocated at test_streams.py:6)" in out, out
    assert "did not build" not in out + done.stderr  # the C++ capture built from the installed sources
    building = [line for line in done.stderr.splitlines() if line.startswith("streamrace: compiling")]
    assert len(building) == 1, done.stderr
    assert "about a minute" in building[0] and str(tmp_path / "extensions") in building[0]
