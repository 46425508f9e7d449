"""The virtual backend's slowdown on the launch-bound step, measured so that a loaded machine does not drown it.

    python benchmarks/paired_overhead.py [--steps 20] [--rounds 15]

``overhead.py`` times each configuration in its own process, minutes apart: on a shared 2-core machine the plain
step alone moves 3x between runs, so its ratios do too. Here one process alternates rounds of plain, empty dispatch
mode and the virtual Detector on the same model, and times each round in CPU time of this process
(``time.process_time``: time spent waiting for a core does not count) as well as wall time; the slowdown is the median
over rounds of each round's ratio to the plain round next to it.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from pytest_streamrace.detector.session import Detector

    class Empty(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(64, 64), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 64)

    def step():
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()

    def timed(context):
        with context() as detector:
            for _ in range(3):
                step()
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(args.steps):
                step()
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        if isinstance(detector, Detector) and detector.races:
            raise SystemExit(f"{len(detector.races)} races reported on a correct step")
        return cpu / args.steps * 1e3, wall / args.steps * 1e3

    import contextlib

    configs = {"plain": contextlib.nullcontext, "empty-mode": Empty, "virtual": lambda: Detector(backend="virtual")}
    times = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, context in configs.items():
            times[name].append(timed(context))
    print(f"torch {torch.__version__}; launch-bound MLP (8x64, batch 8); {args.rounds} rounds of {args.steps} steps")
    for name in configs:
        cpu = statistics.median(t[0] for t in times[name])
        wall = statistics.median(t[1] for t in times[name])
        cpu_x = statistics.median(t[0] / p[0] for t, p in zip(times[name], times["plain"]))
        wall_x = statistics.median(t[1] / p[1] for t, p in zip(times[name], times["plain"]))
        print(f"{name:12} cpu {cpu:7.3f} ms/step ({cpu_x:5.2f}x)   wall {wall:7.3f} ms/step ({wall_x:5.2f}x)")


if __name__ == "__main__":
    main()
