"""What every session pays for the capture before and after its first race: loading a finished build must not run
cpp_extension's checks again, and naming a race's stacks must not import torch's compiler stack (torch's own
symbolizer does: two seconds, once per process). Each case runs in a fresh interpreter, as a session starts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from pytest_streamrace.detector import capture


@pytest.fixture(scope="module", autouse=True)
def built():
    if capture.load() is None:  # builds it for the subprocesses below too (same extensions folder)
        pytest.skip(f"the capture extension does not build here: {capture.failure()}")


def _run(script: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "STREAMRACE_NATIVE"}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


def test_a_finished_build_is_imported_without_cpp_extension():
    lines = _run("""
        import sys
        from pytest_streamrace.detector import capture
        ext = capture.load()
        print(ext is not None, hasattr(ext, "Feed"), "torch.utils.cpp_extension" in sys.modules)
    """)
    assert lines == ["True True False"]


def test_only_a_finished_build_is_imported_as_it_is(tmp_path):
    """A `lock` in the folder means a build is under way (the module may be half written): cpp_extension's own path,
    which waits for it, is taken then."""
    (tmp_path / "m.so").write_bytes(b"")
    assert capture._built_here("m", str(tmp_path))
    (tmp_path / "lock").write_text("")
    assert not capture._built_here("m", str(tmp_path))
    assert not capture._built_here("other", str(tmp_path))


def test_from_torch_2_14_only_a_held_lock_means_a_build_under_way(tmp_path):
    """torch 2.14's cpp_extension holds `lock` as an advisory lock and leaves the file behind every build: a finished
    build is one whose lock nobody holds (were the file's existence taken for a build, every session would wait for
    it to go stale)."""
    import fcntl

    assert [capture._advisory_lock(v) for v in ("2.4.1", "2.13.0+cpu", "2.14.1+cu130", "2.15.0a0", "3.0")] == \
        [False, False, True, True, True]
    (tmp_path / "m.so").write_bytes(b"")
    (tmp_path / "lock").write_text("")
    assert capture._built_here("m", str(tmp_path), advisory=True)
    with open(tmp_path / "lock") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a build under way
        assert not capture._built_here("m", str(tmp_path), advisory=True)
    assert capture._built_here("m", str(tmp_path), advisory=True)
    assert not capture._built_here("other", str(tmp_path), advisory=True)


def test_a_killed_builds_lock_is_cleared_and_a_live_ones_waited_for(tmp_path, monkeypatch):
    """cpp_extension waits without end on the lock of a build that was killed: every later session would hang. A build
    under way is waited for until its lock goes; a lock older than any build is removed, however young it was when the
    wait began."""
    import threading

    monkeypatch.setattr(capture, "_STALE_LOCK_S", 2.0)
    lock = tmp_path / "lock"
    lock.write_text("")
    threading.Timer(0.3, lock.unlink).start()  # the build under way finishes
    start = time.monotonic()
    capture._clear_stale_lock(str(tmp_path))
    assert time.monotonic() - start < 1.5 and not lock.exists()
    lock.write_text("")  # a build killed just now: nobody removes its lock
    start = time.monotonic()
    capture._clear_stale_lock(str(tmp_path))
    assert 1.5 < time.monotonic() - start < 5 and not lock.exists()
    old = time.time() - 60
    lock.write_text("")
    os.utime(lock, (old, old))
    start = time.monotonic()
    capture._clear_stale_lock(str(tmp_path))
    assert time.monotonic() - start < 0.5 and not lock.exists()


def test_each_torch_installation_builds_in_a_folder_of_its_own(tmp_path, monkeypatch):
    """Two venvs with the same torch version share the extensions folder; were their builds one folder, each would
    rebuild it (its build.ninja names the other's headers) whenever the other had."""
    import torch

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    here = capture._where("streamrace_probe", "// probe", torch)
    assert capture._where("streamrace_probe", "// probe", torch) == here
    monkeypatch.setattr(torch, "__file__", "/elsewhere/venv/site-packages/torch/__init__.py")
    elsewhere = capture._where("streamrace_probe", "// probe", torch)
    assert elsewhere[1] != here[1] and all(path.startswith(str(tmp_path)) for path in (here[1], elsewhere[1]))


def test_race_stacks_are_named_without_importing_the_compiler():
    lines = _run("""
        import sys
        import torch
        from pytest_streamrace.detector import capture, frames
        capture.load()

        def taken_here():
            return frames.stack()  # TAKEN

        def caller():
            return taken_here()  # CALLER

        site = caller()
        assert "torch._inductor" not in sys.modules and "torch._dynamo" not in sys.modules
        for filename, line, function in site.stack.frames()[:3]:
            print(filename.endswith("frames.py") or filename == "<string>", line, function)
        print("torch._inductor" in sys.modules, "torch._dynamo" in sys.modules)
    """)
    # the taker's own frame (frames.py), then the two callers at their lines of the script (lines 8 and 11)
    assert lines[0].split()[2] == "stack" and lines[0].startswith("True")
    assert lines[1:3] == ["True 8 taken_here", "True 11 caller"]
    assert lines[3] == "False False"
