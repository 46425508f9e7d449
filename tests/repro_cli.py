"""Test helper: the repro CLI as users run it (`python -m pytest_streamrace.repro ...`), in a subprocess."""

import json
import subprocess
import sys


def repro(*args, env=None, cwd=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "pytest_streamrace.repro", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)


def both_variants(name, tmp_path):
    """Runs both variants of `name` with --json; asserts each got its expected verdict. Returns (stdout, document)."""
    path = tmp_path / "out.json"
    out = repro(name, "--json", str(path), timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{name}/unpatched: reproduced (as expected)" in out.stdout
    assert f"{name}/patched: clean (as expected)" in out.stdout
    return out.stdout, json.loads(path.read_text())
