"""The launch-bound step's cost in instructions (valgrind's callgrind), where time on a shared machine is too noisy.

    python benchmarks/instructions.py [--steps 20] [--model launch-bound|larger] [--top 0]

Each configuration runs in its own process under callgrind with instrumentation off until the warm-up is done; then
`steps` steps are counted. Instructions are not time (a cache miss or a contended lock costs none here), but they do
not move with the machine's load, so a change of a few percent in the detector's own work shows where paired timing
cannot see it. Rows: plain; torch's floor under any RecordFunction-based
capture (an empty global callback with boxed arguments, as in paired_overhead.py); the capture floor (the C++ capture
as the virtual detector runs it, through its kernel entry, kernel_entry.cpp, its records dropped unread each step:
what the capture costs apart from applying its records); the virtual detector. ``--top N`` also lists the N functions
whose own instructions grew most from torch's floor to the detector, and where the extra allocations come from.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

MODES = ("plain", "RecordFunction boxed", "capture floor", "virtual")


def worker(mode: str, steps: int, model: str) -> None:
    """Runs inside callgrind: warm up, switch instrumentation on for `steps` steps, off again."""
    from paired_overhead import EMPTY_CALLBACK, launch_bound_step

    step = launch_bound_step("cpu", model)
    after_step = lambda: None  # noqa: E731
    if mode == "RecordFunction boxed":
        from torch.utils.cpp_extension import load_inline

        load_inline("streamrace_bench_empty_callback", EMPTY_CALLBACK).add(True)
    elif mode == "capture floor":  # the C++ capture as the virtual detector runs it (its kernel entry)
        from paired_overhead import capture_alone

        after_step = capture_alone(False, every_thread=False, host_frees=True).discard
    elif mode == "virtual":
        from pytest_streamrace.detector.session import Detector

        Detector(backend="virtual").__enter__()  # left open: the process ends after counting
    for _ in range(20):
        step()
        after_step()
    control = ["callgrind_control", "-i"]
    subprocess.run(control + ["on", str(os.getpid())], check=True, capture_output=True)
    for _ in range(steps):
        step()
        after_step()
    subprocess.run(control + ["off", str(os.getpid())], check=True, capture_output=True)


def measure(mode: str, steps: int, model: str, out: str) -> int:
    """Instructions counted over the steps, from callgrind's summary."""
    command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}", sys.executable,
               __file__, "--worker", mode, "--steps", str(steps), "--model", model]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"instructions.py: {mode} failed under callgrind:\n{done.stderr[-2000:]}")
    return int(found.group(1))


def costs(path: str) -> tuple[collections.Counter, collections.Counter]:
    """(own instructions per function, allocations per calling function) from a callgrind output file."""
    names: dict[str, str] = {}

    def name(token: str) -> str:
        m = re.match(r"\((\d+)\)(?: (.*))?", token)
        if not m:
            return token
        if m.group(2):
            names[m.group(1)] = m.group(2)
        return names.get(m.group(1), token)

    own, allocs = collections.Counter(), collections.Counter()
    fn = callee = None
    after_calls = False
    with open(path) as f:
        for line in f:
            if line.startswith("fn="):
                fn, callee = name(line[3:].strip()), None
            elif line.startswith("cfn="):
                callee = name(line[4:].strip())
            elif line.startswith("calls="):
                if callee and ("operator new" in callee or callee.endswith(":malloc")):
                    allocs[fn] += int(line[6:].split()[0])
                after_calls = True
            elif line[:1].isdigit() or line[:1] in "+-*":
                if after_calls:  # the cost line after calls= is the call's inclusive cost, not this function's own
                    after_calls = False
                    continue
                fields = line.split()
                if len(fields) >= 2 and fn is not None:
                    own[fn] += int(fields[1])
    return own, allocs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", choices=("launch-bound", "larger"), default="launch-bound")
    parser.add_argument("--top", type=int, default=0, metavar="N")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.model)
        return 0
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("instructions.py: valgrind (with callgrind_control) is not installed; apt-get install valgrind",
              file=sys.stderr)
        return 2
    import torch

    print(f"torch {torch.__version__}, CPU; {args.model} MLP; {args.steps} steps counted per configuration")
    counted = {}
    with tempfile.TemporaryDirectory() as tmp:
        outs = {mode: os.path.join(tmp, f"{i}.out") for i, mode in enumerate(MODES)}
        for mode in MODES:
            counted[mode] = measure(mode, args.steps, args.model, outs[mode]) / args.steps
            print(f"{mode:22} {counted[mode] / 1e6:8.3f} M instructions/step ({counted[mode] / counted['plain']:.3f}x)",
                  flush=True)
        if args.top:
            (floor_own, floor_allocs), (own, allocs) = costs(outs["RecordFunction boxed"]), costs(outs["virtual"])
            print(f"\nown instructions a step, detector over the floor (top {args.top}):")
            grown = sorted(((own[k] - floor_own[k]) / args.steps, k) for k in set(own) | set(floor_own))
            for value, fn in reversed(grown[-args.top:]):
                print(f"{value:10.0f}  {fn[:110]}")
            extra = (sum(allocs.values()) - sum(floor_allocs.values())) / args.steps
            print(f"\nallocations a step: floor {sum(floor_allocs.values()) / args.steps:.0f}, detector "
                  f"{sum(allocs.values()) / args.steps:.0f} (+{extra:.0f}); the detector's by caller (top {args.top}):")
            grown = sorted(((allocs[k] - floor_allocs[k]) / args.steps, k) for k in set(allocs) | set(floor_allocs))
            for value, fn in reversed(grown[-args.top:]):
                print(f"{value:10.1f}  {fn[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
