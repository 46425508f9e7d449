"""Where the larger row's cost goes on a GPU: per configuration (a fresh process each), the wall and CPU time a step,
the GPU's kernel time a step and the CUDA runtime calls a step (torch.profiler), and the caching allocator's device
mallocs and frees over the measurement. Tells a CPU cost (CPU time moves with wall) from a GPU-side one (kernel time
moves) and from one the allocator or a sync adds (runtime calls that plain does not make).

    python scripts/device/larger_probe.py [--model larger] [--repeat 2]   # on one GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks"))

MODES = ("plain", "capture-floor", "cuda")


def worker(model_name: str, mode: str, rounds: int, steps: int) -> dict:
    import torch
    from overhead import MODELS
    from paired_overhead import capture_alone

    width, depth, batch, _, _ = MODELS[model_name]
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width, device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()

    after = lambda: None  # noqa: E731
    detector = extension = None
    if mode == "capture-floor":
        extension = capture_alone(True)
        after = extension.discard
    elif mode == "cuda":
        from pytest_streamrace.detector.session import Detector

        detector = Detector(backend="cuda").__enter__()
    for _ in range(50):
        step()
        after()
    torch.cuda.synchronize()
    stats0 = torch.cuda.memory_stats()
    walls, cpus = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        w, c = time.perf_counter(), time.process_time()
        for _ in range(steps):
            step()
            after()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - w) / steps * 1e3)
        cpus.append((time.process_time() - c) / steps * 1e3)
    stats1 = torch.cuda.memory_stats()
    from torch.profiler import ProfilerActivity, profile

    prof_steps = 20
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(prof_steps):
            step()
            after()
        torch.cuda.synchronize()
    kernel_us = 0.0
    runtime = Counter()
    for e in prof.key_averages():
        kernel_us += getattr(e, "self_device_time_total", 0.0)
        if e.key.startswith("cu"):  # the CUDA runtime and driver calls: launches, mallocs, syncs, event calls
            runtime[e.key] += e.count
    if detector is not None:
        detector.__exit__(None, None, None)
        races = len(detector.races)
    else:
        races = 0
        if extension is not None:
            extension.disable()
    keys = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
    return {"wall": statistics.median(walls), "wall_min": min(walls), "cpu": statistics.median(cpus),
            "kernel_ms": kernel_us / prof_steps / 1e3,
            "runtime": {k: round(v / prof_steps, 2) for k, v in sorted(runtime.items())},
            "allocator": {k: stats1.get(k, 0) - stats0.get(k, 0) for k in keys},
            "reserved_MB": stats1.get("reserved_bytes.all.current", 0) / 2**20,
            "peak_MB": stats1.get("allocated_bytes.all.peak", 0) / 2**20, "races": races}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="larger")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES))
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    from overhead import MODELS

    model = next(m for m in MODELS if args.model in m)
    if args.worker:
        print(json.dumps(worker(model, args.worker[1], args.rounds, args.steps)))
        return 0
    print(f"{model}: {args.rounds} rounds of {args.steps} steps a process; fresh process per line")
    modes = args.modes.split(",")
    results = {m: [] for m in modes}
    for rep in range(args.repeat):
        for mode in modes:
            out = subprocess.run([sys.executable, __file__, "--model", args.model, "--rounds", str(args.rounds),
                                  "--steps", str(args.steps), "--worker", model, mode],
                                 capture_output=True, text=True)
            if out.returncode:
                print(f"{mode}: exit {out.returncode}\n{out.stderr[-2000:]}")
                return 1
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results[mode].append(r)
            print(f"{rep} {mode:14} wall {r['wall']:.3f} (min {r['wall_min']:.3f}) cpu {r['cpu']:.3f} "
                  f"kernel {r['kernel_ms']:.3f} ms/step; allocator {r['allocator']}; reserved {r['reserved_MB']:.0f} "
                  f"peak {r['peak_MB']:.0f} MB; races {r['races']}\n   runtime calls/step {r['runtime']}",
                  flush=True)
    base = statistics.median(r["wall"] for r in results[modes[0]])
    cbase = statistics.median(r["cpu"] for r in results[modes[0]])
    for mode in modes:
        w = statistics.median(r["wall"] for r in results[mode])
        c = statistics.median(r["cpu"] for r in results[mode])
        walls = " ".join(f"{r['wall']:.3f}" for r in results[mode])
        print(f"{mode:14} wall {w / base:.2f}x  cpu {c / cbase:.2f}x  (processes: {walls})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
