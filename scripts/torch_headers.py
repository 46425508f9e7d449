"""Compile the native parts' sources against the headers of torch releases that are not installed: the releases
between the ends `tox -m torch-range` tests, without their several GB of CUDA libraries.

    python scripts/torch_headers.py 2.5.1 2.7.1 2.8.0      # each wheel downloaded (pip, no dependencies), headers kept

For each release: `pip download --no-deps torch==V` (for this Python), its `torch/include` unpacked into a cache
folder, then the capture's joined sources and the GPU trace's (stubs generated from that release's header, as
`capture.load_trace` does) compiled with `-fsyntax-only` and the flags torch's extension loader uses. Prints one line
a release; exit status 1 if any did not compile. Checks the C++ against each release's API, not linking or running.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pytest_streamrace.detector import capture  # noqa: E402  (torch-free at import)


def headers(version: str, cache: str) -> str:
    """The release's `torch/include` folder, downloaded once into `cache`."""
    include = os.path.join(cache, version, "torch", "include")
    if os.path.isdir(include):
        return include
    with tempfile.TemporaryDirectory() as wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"torch=={version}", "-d", wheels],
                       check=True)
        (wheel,) = glob.glob(os.path.join(wheels, "torch-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(os.path.join(cache, version),
                               [name for name in archive.namelist() if name.startswith("torch/include/")])
    return include


def standard(include: str) -> str:
    """The C++ standard torch's extension loader builds with for this release: C++20 where its ATen requires it
    (2.14 on), else C++17."""
    with open(os.path.join(include, "ATen", "ATen.h"), encoding="utf-8") as f:
        return "c++20" if "C++20 or later" in f.read() else "c++17"


def compiles(include: str, source: str) -> str | None:
    """None where `source` compiles against `include`, else the first error line."""
    flags = [f"-std={standard(include)}", "-fsyntax-only", "-O2", "-DNDEBUG", "-DTORCH_EXTENSION_NAME=check",
             "-DTORCH_API_INCLUDE_EXTENSION_H", "-isystem", include,
             "-isystem", os.path.join(include, "torch", "csrc", "api", "include"),
             "-isystem", sysconfig.get_paths()["include"], "-x", "c++", "-"]
    done = subprocess.run([shutil.which("c++") or "g++", *flags], input=source, capture_output=True, text=True)
    if done.returncode == 0:
        return None
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    return (errors or done.stderr.splitlines() or ["failed"])[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="+", metavar="VERSION")
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "streamrace-torch-headers"))
    args = parser.parse_args(argv)
    code = "\n".join(capture.sources())
    trace = os.path.join(ROOT, "pytest_streamrace", "detector", "gpu_trace.cpp")
    failed = 0
    for version in args.versions:
        include = headers(version, args.cache)
        with open(os.path.join(include, "c10", "core", "impl", "PyInterpreter.h"), encoding="utf-8") as f:
            stubs = capture.interpreter_stubs(f.read())
        with open(trace, encoding="utf-8") as f:
            trace_code = f.read().replace("// STUBS", stubs)
        results = {"capture": compiles(include, code), "trace": compiles(include, trace_code)}
        failed += any(results.values())
        print(f"torch {version}: " + ", ".join(f"{part} {'compiles' if error is None else 'FAILS: ' + error}"
                                               for part, error in results.items()), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
