"""Where the detector's own time goes on a training step: its work per step and per op, by part.

    python benchmarks/profile_step.py [--backend virtual|cuda] [--model launch-bound|larger|compiled|ddp]
                                      [--steps N] [--rounds 7] [--top N]

One process per model (`--model` again: each in a process of its own; the DDP model's rank 1 in a second one, running
the same rounds on its own GPU over NCCL where there are two, else over gloo, its numbers not printed): the plain step
first, timed before any session starts (a session leaves the capture's kernel entry registered in the process, which
later plain steps would pay), then the same step under the Detector with its timers off (the detector step: its real
cost), then with them on for the breakdown. On the virtual backend the step runs on one intra-op thread unless
OMP_NUM_THREADS says otherwise (two spinning on a shared 2-core machine made a launch-bound step 300 ms). Each step time
is the fastest round's (wall time, synchronized on cuda), and each part its least over the breakdown rounds (steady
clock): the rounds least disturbed by whatever else the machine runs. "Share" is of the detector's extra: the detector
step less the plain step.

The parts, timed exclusively (a part inside another stops the outer one's clock), in rounds of their own with the
extension's timers on, each part less its timers' own clock reads (two a part entered, at the cost of a clock read
here, measured):

- capture: the kernel entry's start and end callbacks of each op (its plan, storages, stream, autograd node; the
  virtual model's leaf binding), a compiled kernel's record (``record_kernel``), a free queued. Not the stack's walk.
- frames: walking the Python stack for a record's site (``stack_here``).
- intake: handing the records over (``Feed.apply``; ``drain`` where the feed is off), less the core's calls.
  Where the capture's applier thread applies them (``applied: thread``, the cuda backend's default where four cores
  are free), only what is left to the stepping thread's drains: the parts time the stepping thread's work, not the
  applier's.
- hb core: the happens-before core's calls (each under its lock), from the feed and from the Python models.
- models: the detector's Python, every function under ``pytest_streamrace/`` (the tracker, the stream models,
  compiled code's launch hooks, a drain's Python side), by its own time under cProfile in rounds of their own (timers
  off), on the stepping thread only (Python the autograd engine's threads run for a GPU's backward is not counted);
  where cProfile does not list the feed's ``apply`` apart (Python 3.12 puts a pybind method's time in its caller's),
  intake and hb core are taken out of it. Plus the virtual model's node binding in C++ (``node_streams.cpp``).
  Python the C++ parts call back (a drain, a plan, a race's judge) is here, not in the part that called it.

Not in any part, and below them: "kernel entry", the boxing and redispatch of every op by the capture's kernel entry
(``kernel_entry.cpp``), as the plain step timed again after the session (which leaves the entry registered; on cuda,
the GPU trace's callbacks too) less the plain step before it; "unattributed", the extra less the parts and the kernel
entry: pybind's glue around the extension's calls, the helpers outside the package the detector's Python calls
(torch's, the standard library's), the clock's noise. Both are differences of step times, and noise on a shared
machine can make either negative. The last line prints the time of all the code outside the package that the
detector's Python called: mostly the originals its patches wrap (a compiled kernel, a factory), which is the program's
own work, in the plain step too.

The line after it counts the tracker's drains a step on every thread (in the cProfile rounds), by the function that
asked for each: a model's Python, or the capture itself (``_drain_forced``: its queue full, or the applier thread
stalled on a record that needs Python). Where the applier thread applies the records, a drain is where a program's
thread applies what is left, so this names what keeps a step's records off the applier.

``--top N``: the cProfile rounds' listing, the top N functions by own time.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import os
import pstats
import subprocess
import sys
import tempfile
import threading
import time

NAMES = {"launch-bound": "launch-bound MLP (8x64, batch 8)", "larger": "larger MLP (4x2048, batch 256)",
         "compiled": "compiled MLP (8x64, batch 8, Inductor)", "ddp": "DDP MLP (8x512, batch 32, 2 ranks)"}
STEPS = 200  # a round's by default; on CPU the larger MLP's 3 (a step is 0.3 s a core), the DDP MLP's 10
RANKS = 2  # the DDP model's: this process is rank 0, rank 1 a process of its own running the same rounds
PARTS = ("capture", "frames", "intake", "hb core", "models")
_EXTENSIONS = ("streamrace_capture", "streamrace_trace")  # the extension's modules: its functions' time is C++ parts'


def python_time(stats: pstats.Stats, package: str) -> tuple[float, float]:
    """(own time of the package's Python functions, time of the code outside the package they call), in seconds."""
    own = outside = 0.0
    for (path, _, name), (_, _, tt, _, callers) in stats.stats.items():
        if path.startswith(package):
            own += tt
        elif not any(e in name for e in _EXTENSIONS):
            outside += sum(ct for caller, (_, _, _, ct) in callers.items() if caller[0].startswith(package))
    return own, outside


def feed_listed(stats: pstats.Stats) -> bool:
    """Whether cProfile listed the feed's `apply` (a pybind method) apart: Python 3.12's cProfile does not, and puts
    its C++ time in the own time of the Python that called it (the tracker's drain)."""
    return any(_EXTENSIONS[0] in name and "apply" in name for (_, _, name) in stats.stats)


@contextlib.contextmanager
def counting_drains(package: str):
    """Yields a switch (a list: [on]) and the drains it counted, by what asked: the tracker's `drain` wrapped for
    every session started inside, on every thread (the capture calls the method it was given as a session started)."""
    from pytest_streamrace.detector.tracker import AccessTracker

    original, switch, asked = AccessTracker.drain, [False], collections.Counter()

    def drain(self):
        if switch[0]:
            caller = sys._getframe(1)
            path = caller.f_code.co_filename
            asked[f"{os.path.relpath(path, package)}:{caller.f_lineno}({caller.f_code.co_name})"
                  if path.startswith(package) else f"{os.path.basename(path)}({caller.f_code.co_name})"] += 1
        return original(self)

    AccessTracker.drain = drain
    try:
        yield switch, asked
    finally:
        AccessTracker.drain = original


def timed(counters: dict, steps: int, clock_ns: float) -> dict:
    """One timed round's µs a step by C++ part, less the timers' own clock reads (two a part entered), and ops a
    step."""
    us = {part: max(0.0, (counters[part][0] - 2 * clock_ns * counters[part][1]) / 1e3 / steps) for part in PARTS}
    us["ops"] = counters["ops"][1] / steps
    return us


def profiled_python(stats: pstats.Stats, package: str, steps: int, fed_us: float) -> dict:
    """One cProfile round's µs a step of the package's own Python (less `fed_us`, the feed's C++ a step, where
    cProfile counted it as its caller's own time) and of the code outside the package its Python called."""
    own, outside = python_time(stats, package)
    python = own * 1e6 / steps - (0.0 if feed_listed(stats) else fed_us)
    return {"models: Python": max(0.0, python), "outside the package": outside * 1e6 / steps}


def rounds(step, count: int, steps: int, cuda: bool, around=None) -> list:
    """Each round's ms a step (wall time, synchronized on cuda), with what `around` (a context manager's factory) gave
    for it."""
    import torch

    out = []
    for _ in range(count):
        with (around or contextlib.nullcontext)() as got:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            if cuda:
                torch.cuda.synchronize()
            ms = (time.perf_counter() - start) / steps * 1e3
        out.append((ms, got))
    return out


def profile(args, model: str) -> None:
    import torch

    from paired_overhead import launch_bound_step  # this folder is on the path of a script run from it

    import pytest_streamrace
    from pytest_streamrace.detector import capture
    from pytest_streamrace.detector.session import Detector

    cuda = args.backend == "cuda"
    if not cuda and "OMP_NUM_THREADS" not in os.environ:  # intra-op threads spinning on a shared CPU drown the step
        torch.set_num_threads(1)
    title = f"{NAMES[model]}, {args.backend} backend"
    device = "cuda" if cuda else "cpu"
    if model == "ddp":  # one GPU a rank (NCCL) where there are two, else gloo (on one GPU: over CUDA tensors)
        import datetime

        import torch.distributed as dist

        nccl = cuda and torch.cuda.device_count() >= RANKS
        if cuda:
            device = f"cuda:{args.rank if nccl else 0}"
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if nccl else "gloo", init_method=f"file://{args.store}", rank=args.rank,
                                world_size=RANKS, timeout=datetime.timedelta(seconds=300))
        title += f", {'NCCL' if nccl else 'gloo'}, rank {args.rank} of {RANKS}"
    step = launch_bound_step(device, model)
    compiled = model == "compiled"

    def warm() -> None:
        if compiled:  # compiled afresh under each configuration, as a session compiles
            torch._dynamo.reset()
        for _ in range(3):
            step()

    try:
        warm()
    except Exception as exc:  # Inductor needs a C++ compiler on CPU
        print(f"{title}: not run: the step did not compile ({type(exc).__name__}: {str(exc).splitlines()[0]})")
        return
    plain_rounds = [ms for ms, _ in rounds(step, args.rounds, args.steps, cuda)]
    plain = min(plain_rounds)
    extension = capture.load()
    if extension is None:
        raise SystemExit(f"no C++ capture, no timers: {capture.failure()}")

    @contextlib.contextmanager
    def timers_on():  # a round's C++ counters
        got = {}
        extension.profile(True)
        try:
            yield got
        finally:
            detector.tracker.drain()
            extension.profile(False)
            got["counters"] = extension.profile_counters()

    @contextlib.contextmanager
    def profiled():  # a round's cProfile listing (the timers off: neither's cost lands in the other's numbers)
        profiler, got = cProfile.Profile(), {}
        counting[0] = True
        profiler.enable()
        try:
            yield got
        finally:
            counting[0] = False
            detector.tracker.drain()
            profiler.disable()
            got["stats"] = pstats.Stats(profiler)

    package = os.path.dirname(pytest_streamrace.__file__) + os.sep
    with counting_drains(package) as (counting, asked), Detector(backend=args.backend) as detector:
        warm()
        detector.tracker.drain()
        off = min(ms for ms, _ in rounds(step, args.rounds, args.steps, cuda))
        measured = rounds(step, args.rounds, args.steps, cuda, timers_on)
        listed = rounds(step, args.rounds, args.steps, cuda, profiled)
        source, feed = detector.op_source, detector.tracker._feed is not None
        applier = "thread" if detector.tracker.applier else "inline"
    if detector.races:
        raise SystemExit(f"{len(detector.races)} races reported on a correct step")
    warm()  # plain again, the kernel entry left registered: its boxing and redispatch of every op
    entry = (min(ms for ms, _ in rounds(step, args.rounds, args.steps, cuda)) - plain) * 1e3

    clock_ns = extension.clock_cost_ns()
    per_round = [timed(got["counters"], args.steps, clock_ns) for _, got in measured]
    us = {part: min(r[part] for r in per_round) for part in per_round[0]}
    per_round = [profiled_python(got["stats"], package, args.steps, us["intake"] + us["hb core"])
                 for _, got in listed]
    us.update({part: min(r[part] for r in per_round) for part in per_round[0]})
    us["models: C++"] = us["models"]
    us["models"] = us["models: C++"] + us["models: Python"]
    extra = (off - plain) * 1e3
    us["kernel entry"] = entry
    us["unattributed"] = extra - sum(us[part] for part in PARTS) - entry
    on = min(ms for ms, _ in measured)
    _, got = min(listed, key=lambda m: m[0])

    print(f"{title}: best of {args.rounds} rounds of {args.steps} steps; ops from: {source}, feed: "
          f"{'on' if feed else 'off'}, applied: {applier}; intra-op threads: {torch.get_num_threads()}")
    print(f"plain step {plain:.3f} ms (rounds up to {max(plain_rounds):.3f}); detector step {off:.3f} ms "
          f"({off / plain:.2f}x, extra {extra / 1e3:.3f} ms); with the timers on {on:.3f} ms (a clock read "
          f"{clock_ns:.0f} ns, taken out of the parts)")
    ops = us["ops"]
    print(f"ops a step: {ops:.1f}")
    print(f"{'part':<18}{'µs a step':>11}{'µs an op':>10}{'share':>8}")
    for part in (*PARTS, "kernel entry", "unattributed"):
        value = us[part]
        per_op = value / ops if ops else 0.0
        share = f"{value / extra * 100:.1f}%" if extra > 0 else "n/a"  # no extra beyond the step's noise
        print(f"{part:<18}{value:>11.1f} {per_op:>9.3f} {share:>7}")
    print(f"models: Python {us['models: Python']:.1f} µs, C++ {us['models: C++']:.1f} µs a step; code outside the "
          f"package its Python called (the originals its patches wrap too): {us['outside the package']:.1f} µs a step")
    profiled_steps = args.rounds * args.steps
    print(f"drains a step: {sum(asked.values()) / profiled_steps:.2f}"
          + "".join(f"; {n / profiled_steps:.2f} from {where}" for where, n in asked.most_common(5)))
    if args.top:
        got["stats"].sort_stats("tottime").print_stats(args.top)
    if model == "ddp":
        torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("virtual", "cuda"), default="virtual")
    parser.add_argument("--model", choices=tuple(NAMES), action="append")
    parser.add_argument("--steps", type=int,
                        help="steps a round (default: 200; on CPU the larger MLP's 3, the DDP MLP's 10)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--top", type=int, default=0, help="print cProfile's top N functions by own time")
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)  # the DDP model's rank 1 (its process)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    models = args.model or ["launch-bound"]
    if len(models) > 1:  # each plain step before any session in its process
        argv = [a for i, a in enumerate(sys.argv[1:]) if a != "--model" and sys.argv[i] != "--model"
                and not a.startswith("--model=")]
        for i, model in enumerate(models):
            if i:
                print(flush=True)
            code = subprocess.run([sys.executable, sys.argv[0], *argv, "--model", model]).returncode
            if code:
                raise SystemExit(code)
        return
    cpu_steps = {"larger": 3, "ddp": 10} if args.backend == "virtual" else {}
    args.steps = args.steps or cpu_steps.get(models[0], STEPS)
    if models[0] == "ddp" and args.store is None:
        with tempfile.TemporaryDirectory() as tmp:
            args.store = os.path.join(tmp, "store")
            with second_rank(args):
                profile(args, models[0])
        return
    profile(args, models[0])


@contextlib.contextmanager
def second_rank(args):
    """The DDP model's rank 1: this script again in a process of its own, running the same rounds (so the two ranks'
    collectives pair up), its table not printed. Should it fail, rank 0 would wait in a collective for good: its
    output goes to stderr here, with its rank, and this process ends with its exit status."""
    argv = [sys.executable, sys.argv[0], "--backend", args.backend, "--model", "ddp", "--steps", str(args.steps),
            "--rounds", str(args.rounds), "--rank", "1", "--store", args.store]
    with tempfile.TemporaryFile("w+") as log:
        rank1 = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log)

        def watch() -> None:
            code = rank1.wait()
            if code:
                log.seek(0)
                print(f"profile_step.py: rank 1 failed (exit status {code}):\n{log.read()[-3000:]}", file=sys.stderr,
                      flush=True)
                os._exit(code if code > 0 else 1)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            yield
        finally:
            try:
                rank1.wait(timeout=120)
            except subprocess.TimeoutExpired:
                rank1.kill()
                rank1.wait()
            watcher.join(timeout=5)


if __name__ == "__main__":
    main()
