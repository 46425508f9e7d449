"""The virtual backend's slowdown on the launch-bound step, measured so that a loaded machine does not drown it.

    python benchmarks/paired_overhead.py [--steps 20] [--rounds 15]

``overhead.py`` times each configuration in its own process, minutes apart: on a shared 2-core machine the plain
step alone moves 3x between runs, so its ratios do too. Here one process alternates rounds of plain, empty dispatch
mode and the virtual Detector on the same model, and times each round in CPU time of this process
(``time.process_time``: time spent waiting for a core does not count) as well as wall time; the slowdown is the median
over rounds of each round's ratio to the plain round next to it.

    python benchmarks/paired_overhead.py --backend cuda   # on a GPU

The cuda backend, paired the same way (wall time, synchronized per round). Activating torch's GPU trace, which the
cuda model's stream and event callbacks need, cannot be undone in a process and costs every allocation and free a
call into Python: the rounds before it (plain, the capture floor) and after it (plain again, the detector with its
records applied by the C++ feed, and by the tracker's Python `_apply_captured`) are two tables, and the two plain
rows say what the trace alone costs. "python-apply" rows force the Python path (the feed unset) on the same core;
"python-trace" leaves every GPU trace callback in Python (no `TraceShortcut`); "in-place trace" takes the trace's
frees and ignored events in C functions put in the registries' place, which torch's Python interpreter still calls
(where the trace's own C++ interpreter does not build).
"""

from __future__ import annotations

import argparse
import statistics
import time


def launch_bound_step(device: str):
    """One training step of the launch-bound MLP (8x64, batch 8) on `device`: many small ops, little math."""
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(64, 64), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 64, device=device)

    def step():
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--backend", choices=("virtual", "cuda"), default="virtual")
    args = parser.parse_args()
    cuda = args.backend == "cuda"

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from pytest_streamrace.detector.session import Detector

    class Empty(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    device = "cuda" if cuda else "cpu"
    step = launch_bound_step(device)

    def timed(context):
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
    def in_place_trace():  # the cuda detector with C functions in the registries, not the trace's C++ interpreter
        from unittest import mock

        from pytest_streamrace.detector import capture

        with mock.patch.object(capture, "load_trace", lambda: None), Detector(backend="cuda") as d:
            yield d

    @contextlib.contextmanager
    def capture_floor():  # the C++ capture alone: records drained raw after each round, nothing judged
        from pytest_streamrace.detector import capture
        from pytest_streamrace.detector.hb import HappensBefore
        from pytest_streamrace.detector.tracker import AccessTracker

        extension = capture.load()
        tracker = AccessTracker(HappensBefore(), lambda: 0, device)
        extension.enable(cuda, tracker._capture_plan, tracker._handoff)
        try:
            yield None
        finally:
            extension.drain()
            extension.disable()

    detector = lambda: Detector(backend=args.backend)  # noqa: E731
    if cuda:  # the GPU trace, once on, stays on: the rounds without it first
        tables = [{"plain": contextlib.nullcontext, "capture-floor": capture_floor},
                  {"plain (trace on)": contextlib.nullcontext, "cuda": detector, "cuda python-apply": python_apply,
                   "cuda in-place trace": in_place_trace, "cuda python-trace": python_trace}]
    else:
        tables = [{"plain": contextlib.nullcontext, "empty-mode": Empty, "virtual": detector,
                   "virtual python-apply": python_apply}]
    where = torch.cuda.get_device_name(0) if cuda else "CPU"
    print(f"torch {torch.__version__} on {where}; launch-bound MLP (8x64, batch 8); {args.rounds} rounds of "
          f"{args.steps} steps; ratios: median over rounds of each round against the plain round beside it")
    for configs in tables:
        times = {name: [] for name in configs}
        for _ in range(args.rounds):
            for name, context in configs.items():
                times[name].append(timed(context))
        plain = times[next(iter(configs))]
        for name in configs:
            cpu = statistics.median(t[0] for t in times[name])
            wall = statistics.median(t[1] for t in times[name])
            cpu_x = statistics.median(t[0] / p[0] for t, p in zip(times[name], plain))
            wall_x = statistics.median(t[1] / p[1] for t, p in zip(times[name], plain))
            print(f"{name:20} cpu {cpu:7.3f} ms/step ({cpu_x:5.2f}x)   wall {wall:7.3f} ms/step ({wall_x:5.2f}x)")


if __name__ == "__main__":
    main()
