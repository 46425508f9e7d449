"""The virtual backend's slowdown on the launch-bound step, measured so that a loaded machine does not drown it.

    python benchmarks/paired_overhead.py [--steps 20] [--rounds 15]

``overhead.py`` times each configuration in its own process, minutes apart: on a shared 2-core machine the plain
step alone moves 3x between runs, so its ratios do too. Here one process alternates rounds of plain, empty dispatch
mode and the virtual Detector on the same model, and times each round in CPU time of this process
(``time.process_time``: time spent waiting for a core does not count) as well as wall time; the slowdown is the median
over rounds of each round's ratio to the plain round next to it.

    python benchmarks/paired_overhead.py --backend cuda   # on a GPU

The cuda backend, paired the same way (wall time, synchronized per round). torch's GPU trace, which the cuda model's
stream and event callbacks need, cannot be switched off once on; between sessions the model leaves its own C++
interpreter there with the events nobody listens to kept out of Python (``models.cuda``), so the plain rounds after
the first detector session run as plain (where that interpreter does not build, they pay torch's: about 1.2x on an H200,
and "cuda" is then against a plain step slowed by it). "python-apply" rows force the Python path (the feed unset) on the
same core;
"python-trace" leaves every GPU trace callback in Python (no `TraceShortcut`), "events-in-python" only the event
records and waits (a drain each: a dozen a DDP step); "in-place trace" takes the trace's
frees and ignored events in C functions put in the registries' place, which torch's Python interpreter still calls
(where the trace's own C++ interpreter does not build).

    python benchmarks/paired_overhead.py --model larger   # the larger MLP (4x2048, batch 256)
    python benchmarks/paired_overhead.py --model ddp --backend cuda   # overhead.py's 2-rank DDP row (NCCL; gloo on CPU)

The DDP row runs a process a rank, in lockstep (DDP's all-reduce holds each round's ranks together); rank 0 prints,
and only the rows that tell the detector from its floors run there.

Then the detector against its capture floor, round by round: a slower host slows the plain step and the floor together,
so this moves less between hosts than either ratio to plain (on two H200 hosts the DDP floor alone was 1.12-1.24x).

"RecordFunction" rows are torch's own floor under any capture built on it: an empty global callback (built here, with
torch's C++ extension loader), without arguments and with them boxed (as such a capture needs them). The capture
takes its ops from its kernel entry instead (``detector/kernel_entry.cpp``), which stays registered in the process
once a session added it: the plain rounds after the first detector round carry it (a boxing per op), and the
last line compares them with the first plain round.
"""

from __future__ import annotations

import argparse
import statistics
import time


MODELS = {"launch-bound": (64, 8, 8), "larger": (2048, 4, 256), "ddp": (512, 8, 32),  # width, depth, batch:
          "compiled": (64, 8, 8)}
# overhead.py's rows
RANKS = {"ddp": 2}
COMPILED = {"compiled"}  # torch.compile'd (inductor)

EMPTY_CALLBACK = r"""
#include <torch/extension.h>
#include <ATen/record_function.h>
namespace {
std::unique_ptr<at::ObserverContext> start(const at::RecordFunction&) { return nullptr; }
void end(const at::RecordFunction&, at::ObserverContext*) {}
}
uint64_t add_callback(bool boxed) {
  return at::addGlobalCallback(at::RecordFunctionCallback(start, end).needsInputs(boxed).needsOutputs(boxed)
      .scopes({at::RecordScope::FUNCTION}));
}
void remove_callback(uint64_t handle) { at::removeCallback(handle); }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add", &add_callback); m.def("remove", &remove_callback); }
"""


def rank_env() -> dict:
    """A rank process's environment: one intra-op thread, as torchrun starts ranks (unless OMP_NUM_THREADS is set).
    Two ranks of two threads each on a 2-core machine spin against each other, and the step time measures the
    scheduler (plain 105 ms a step there; overhead.py's DDP ratio swung 0.95-1.71x between runs)."""
    import os

    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def capture_alone(cuda: bool, **enable):
    """The C++ capture enabled without a detector (the capture floor), planning ops as a tracker does, its records
    dropped unread (`discard`) as often as the detector applies them: the extension, to discard and disable."""
    from pytest_streamrace.detector import capture
    from pytest_streamrace.detector.hb import HappensBefore
    from pytest_streamrace.detector.tracker import AccessTracker

    extension = capture.load()
    if extension is None:
        raise SystemExit(f"capture floor: {capture.failure()}")
    tracker = AccessTracker(HappensBefore(), lambda: 0, "cuda" if cuda else "cpu")
    extension.enable(cuda, tracker._capture_plan, extension.discard, **enable)
    return extension


def launch_bound_step(device: str, model: str = "launch-bound"):
    """One training step of an MLP on `device` (the launch-bound one: many small ops, little math); wrapped in
    DistributedDataParallel for the ddp row (its process group already started)."""
    import torch

    width, depth, batch = MODELS[model]
    ddp, compiled = model in RANKS, model in COMPILED
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(device)
    if ddp:
        index = torch.device(device).index
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=None if index is None else [index])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width, device=device)
    forward = torch.compile(model) if compiled else model

    def step():
        opt.zero_grad(set_to_none=True)
        forward(x).pow(2).mean().backward()
        opt.step()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--backend", choices=("virtual", "cuda"), default="virtual")
    parser.add_argument("--model", choices=tuple(MODELS), default="launch-bound")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--store", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cuda = args.backend == "cuda"
    ranks = RANKS.get(args.model, 1)
    if ranks > 1 and args.rank is None:  # the launcher: a process a rank, rank 0's output is the result
        import subprocess
        import sys
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            procs = [subprocess.Popen([sys.executable, *sys.argv, "--rank", str(r), "--store", f"{tmp}/store"],
                                      stdout=None if r == 0 else subprocess.DEVNULL, env=rank_env())
                     for r in range(ranks)]
            raise SystemExit(max(p.wait() for p in procs))

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from pytest_streamrace.detector.session import Detector

    class Empty(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    device = "cuda" if cuda else "cpu"  # the tracker's device type
    step_device = device
    if ranks > 1:
        import torch.distributed as dist

        if cuda:
            torch.cuda.set_device(args.rank)
            step_device = f"cuda:{args.rank}"
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{args.store}", rank=args.rank,
                                world_size=ranks)
    step = launch_bound_step(step_device, args.model)

    def timed(context):
        if args.model in COMPILED:  # compiled afresh under each configuration (in the warm-up), as a session compiles
            torch._dynamo.reset()
        with context() as detector:
            for _ in range(3):
                step()
            if cuda:
                torch.cuda.synchronize()
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(args.steps):
                step()
            if cuda:
                torch.cuda.synchronize()
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        if isinstance(detector, Detector) and detector.races:
            raise SystemExit(f"{len(detector.races)} races reported on a correct step")
        return cpu / args.steps * 1e3, wall / args.steps * 1e3

    import contextlib

    @contextlib.contextmanager
    def python_apply():  # the detector with its records applied by the tracker's Python, not the C++ feed
        with Detector(backend=args.backend) as detector:
            detector.tracker._feed = None
            yield detector

    @contextlib.contextmanager
    def python_trace():  # the cuda detector with the GPU trace's callbacks all in Python (no TraceShortcut)
        from unittest import mock

        from pytest_streamrace.detector.models.cuda import TraceShortcut

        with mock.patch.object(TraceShortcut, "install", TraceShortcut._add_fallback), Detector(backend="cuda") as d:
            yield d

    @contextlib.contextmanager
    def events_in_python():  # the cuda detector with the trace's event records and waits in Python, a drain each
        from unittest import mock

        import torch.cuda._gpu_trace as trace

        from pytest_streamrace.detector.models.cuda import TraceShortcut

        install = TraceShortcut.install

        def in_python(shortcut):
            if shortcut.registry in (trace.EventRecordCallbacks, trace.EventWaitCallbacks):
                shortcut._add_fallback()
            else:
                install(shortcut)

        with mock.patch.object(TraceShortcut, "install", in_python), Detector(backend="cuda") as d:
            yield d

    @contextlib.contextmanager
    def in_place_trace():  # the cuda detector with C functions in the registries, not the trace's C++ interpreter
        from unittest import mock

        from pytest_streamrace.detector import capture

        with mock.patch.object(capture, "load_trace", lambda: None), Detector(backend="cuda") as d:
            yield d

    @contextlib.contextmanager
    def capture_floor():
        extension = capture_alone(cuda)
        try:
            yield None
        finally:
            extension.discard()
            extension.disable()

    from torch.utils.cpp_extension import load_inline

    empty = load_inline("streamrace_bench_empty_callback", EMPTY_CALLBACK)

    def record_function(boxed):  # torch's floor: an empty global callback, arguments boxed or not
        @contextlib.contextmanager
        def context():
            handle = empty.add(boxed)
            try:
                yield None
            finally:
                empty.remove(handle)
        return context

    detector = lambda: Detector(backend=args.backend)  # noqa: E731
    configs = {"plain": contextlib.nullcontext, "RecordFunction": record_function(False),
               "RecordFunction boxed": record_function(True), "capture-floor": capture_floor}
    if ranks > 1 or args.model in COMPILED:  # the detector and its floors only (a rank-pair's seconds a round; no
        # dispatch mode or Python variant runs compiled code as the detector does)
        configs = {"plain": contextlib.nullcontext, "RecordFunction boxed": record_function(True),
                   "capture-floor": capture_floor, args.backend: detector}
        if cuda and ranks > 1:
            configs["cuda events-in-python"] = events_in_python
    elif cuda:  # the round's last session leaves the trace as the detector does, for the next round's plain
        configs.update({"cuda python-trace": python_trace, "cuda in-place trace": in_place_trace,
                        "cuda python-apply": python_apply, "cuda": detector})
    else:
        configs.update({"empty-mode": Empty, "virtual": detector, "virtual python-apply": python_apply})
    where = torch.cuda.get_device_name(0) if cuda else "CPU"
    width, depth, batch = MODELS[args.model]
    show = print if not args.rank else (lambda *a, **k: None)
    show(f"torch {torch.__version__} on {where}; {args.model} MLP ({depth}x{width}, batch {batch}"
         f"{f', {ranks} ranks' if ranks > 1 else ''}); {args.rounds} rounds of "
         f"{args.steps} steps; ratios: median over rounds of each round against the plain round beside it")
    times = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, context in configs.items():
            times[name].append(timed(context))
    plain = times["plain"]
    for name in configs:
        cpu = statistics.median(t[0] for t in times[name])
        wall = statistics.median(t[1] for t in times[name])
        cpu_x = statistics.median(t[0] / p[0] for t, p in zip(times[name], plain))
        wall_x = statistics.median(t[1] / p[1] for t, p in zip(times[name], plain))
        show(f"{name:20} cpu {cpu:7.3f} ms/step ({cpu_x:5.2f}x)   wall {wall:7.3f} ms/step ({wall_x:5.2f}x)")
    if "capture-floor" in times and args.backend in times:  # what the detector adds to the capture: the host's own
        # speed moves the plain step and the floor together, so this ratio moves less between hosts than either
        pairs = list(zip(times[args.backend], times["capture-floor"]))
        cpu_x = statistics.median(t[0] / f[0] for t, f in pairs)
        wall_x = statistics.median(t[1] / f[1] for t, f in pairs)
        show(f"{args.backend} over the capture floor, median over rounds: cpu {cpu_x:.2f}x, wall {wall_x:.2f}x")
    if cuda:  # what torch's trace, on from the first detector session, leaves on the plain step after it
        show(f"plain: first round (before any session) wall {plain[0][1]:.3f} ms/step; the later rounds' median "
             f"{statistics.median(t[1] for t in plain[1:]):.3f}")


if __name__ == "__main__":
    main()
