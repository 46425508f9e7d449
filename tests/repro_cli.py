"""Test helper: the repro CLI as users run it (`python -m pytest_streamrace.repro ...`), in a subprocess."""

import json
import subprocess
import sys


def repro(*args, env=None, cwd=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "pytest_streamrace.repro", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)


def both_variants(name, tmp_path, confirm=False):
    """Runs both variants of `name` with --json; asserts each got its expected verdict. Returns (stdout, document).
    With `confirm` (--confirm), also that the general mechanism agrees with the referee: each race of the bug's kind
    in the unpatched variant forced (none left untried), at least one confirmed, and nothing to confirm in the patched
    one. Which races are confirmed is the caller's to check."""
    path = tmp_path / "out.json"
    out = repro(name, "--json", str(path), *(["--confirm"] if confirm else []), timeout=900 if confirm else 600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{name}/unpatched: reproduced (as expected)" in out.stdout
    assert f"{name}/patched: clean (as expected)" in out.stdout
    doc = json.loads(path.read_text())
    if confirm:
        runs = {r["variant"]: r for r in doc["runs"]}
        unpatched, patched = runs["unpatched"], runs["patched"]
        found = unpatched["confirmations"]
        assert found and "not-tried" not in {c["status"] for c in found}, found
        assert unpatched["confirmed"]["agrees"] is True and unpatched["confirmed"]["confirmed"] >= 1
        assert patched["confirmations"] == [] and patched["confirmed"]["agrees"] is True
        assert f"{name}: confirmation agrees with the referee" in out.stdout
        assert f"confirmed {unpatched['confirmed']['confirmed']} of {len(found)}; agrees with the referee " \
               "(reproduced)" in out.stdout
    return out.stdout, doc
