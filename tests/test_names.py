"""Every name the package's code uses is defined: CI has no GPU, so the cuda backend's paths (forced orders on real
streams, the GPU trace, the GPU checks of tests/gpu) never run here, and a misspelt or misplaced name in them would
only show on a GPU host. pyflakes reads the code without running it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_undefined_name_in_the_package_its_scripts_or_its_tests():
    done = subprocess.run([sys.executable, "-m", "pyflakes", "pytest_streamrace", "scripts", "benchmarks", "tests"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "No module named pyflakes" not in done.stderr, done.stderr
    undefined = [line for line in done.stdout.splitlines() if "undefined name" in line or "referenced before" in line]
    assert undefined == []
