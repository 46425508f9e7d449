"""Slowdown of a training step under ``--streamrace``'s detector, against plain eager (and, on a GPU, against
PyTorch's CUDA stream sanitizer on the same step).

    python benchmarks/overhead.py            # CPU: virtual backend; GPU: cuda backend and TORCH_CUDA_SANITIZER

Each configuration runs in its own process (the sanitizer cannot be switched off once on). Prints a table of ms per
step and the slowdown against plain. "empty-mode" is a TorchDispatchMode that only calls through: the cost of
entering Python for every op, the floor for any tool built on one (PyTorch's sanitizer is; the virtual backend is).
"capture-floor" is the cuda backend's C++ op capture alone (``detector/capture.py``): records dropped each step unread.
The compiled model's forward runs under torch.compile (Inductor) and compiles under the detector; tools built on a
plain dispatch mode make dynamo skip compiling, so they get no number there (nan).

    python benchmarks/overhead.py --latent   # the latent view's cost: --streamrace-latent=report against off
    python benchmarks/overhead.py --repeat 3 # every configuration 3 times, interleaved: steadier slowdowns

With ``--latent`` every step reads its loss back (``loss.item()``, as logging does: the implicit sync that splits the
latent view's clocks from the normal ones), and the detector runs twice: latent races kept (report, the default) and
not (``-latent-off``: every sync counts, one view).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODELS = {  # name: (width, depth, batch, ranks, torch.compile'd); ranks > 1: DistributedDataParallel, a process a rank
    "launch-bound MLP (8x64, batch 8)": (64, 8, 8, 1, False),
    "larger MLP (4x2048, batch 256)": (2048, 4, 256, 1, False),
    "DDP MLP (8x512, batch 32, 2 ranks)": (512, 8, 32, 2, False),
    "compiled MLP (8x64, batch 8, inductor)": (64, 8, 8, 1, True),
}
# A dispatch mode without ignore_compile_internals makes dynamo skip compiling (the step would run eager): no number.
NOT_COMPILED_UNDER = ("empty-mode", "sanitizer")


LATENT_OFF = "-latent-off"  # a detector mode's suffix: Detector(latent=False), i.e. --streamrace-latent=off


def step_time(model_name: str, mode: str, steps: int, rank: int = 0, store: str = "",
              read_back: bool = False) -> float:
    import torch

    width, depth, batch, ranks, compiled = MODELS[model_name]
    cuda = torch.cuda.is_available()
    if compiled and mode in NOT_COMPILED_UNDER:
        return float("nan")
    if ranks > 1:  # one GPU a rank (nccl) where there are enough, else gloo on CPU
        import torch.distributed as dist

        cuda = cuda and torch.cuda.device_count() >= ranks
        if cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank,
                                world_size=ranks)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(device)
    if ranks > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width, device=device)
    forward = torch.compile(model) if compiled else model

    def step():
        opt.zero_grad(set_to_none=True)
        loss = forward(x).pow(2).mean()
        loss.backward()
        opt.step()
        if read_back:
            loss.item()

    def timed(after_step=lambda: None):  # the median of 5 rounds of `steps` steps, after warm-up
        for _ in range(3):
            step()
            after_step()
        rounds = []
        for _ in range(5):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                step()
                after_step()
            if cuda:
                torch.cuda.synchronize()
            rounds.append((time.perf_counter() - start) / steps * 1e3)
        return statistics.median(rounds)

    if mode == "plain":
        return timed()
    if mode == "empty-mode":  # the floor of any TorchDispatchMode-based tool: entering Python for every op
        from torch.utils._python_dispatch import TorchDispatchMode

        class Empty(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        with Empty():
            return timed()
    if mode == "capture-floor":  # the cuda backend's C++ op capture alone: records dropped unread each step
        from paired_overhead import capture_alone

        extension = capture_alone(cuda)
        try:
            return timed(after_step=extension.discard)
        finally:
            extension.disable()
    if mode == "sanitizer":
        from torch.cuda._sanitizer import enable_cuda_sanitizer

        enable_cuda_sanitizer()
        return timed()
    from pytest_streamrace.detector.session import Detector

    with Detector(backend=mode.removesuffix(LATENT_OFF), latent=not mode.endswith(LATENT_OFF)) as detector:
        ms = timed()
    if detector.races:  # a stock step is correct: a report here is a false positive, never a number to print
        raise SystemExit(f"{mode}: {len(detector.races)} races reported on a correct step")
    return ms


def run_worker(model: str, mode: str, steps: int, latent: bool = False) -> subprocess.CompletedProcess:
    """One measurement in fresh processes: one, or one a rank (rank 0's time is the result; all must succeed)."""
    import tempfile

    ranks = MODELS[model][3]
    command = [sys.executable, __file__, "--steps", str(steps), "--worker", model, mode] + (["--latent"] if latent
                                                                                            else [])
    if ranks == 1:
        return subprocess.run(command, capture_output=True, text=True)
    # One intra-op thread a rank, as torchrun starts ranks: two ranks of two threads each on a 2-core machine spin
    # against each other and the step time measures the scheduler (plain 105 ms a step there; the ratios swung
    # 0.95-1.71x between runs).
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with tempfile.TemporaryDirectory() as tmp:
        procs = [subprocess.Popen(command + ["--rank", str(r), "--store", f"{tmp}/store"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env) for r in range(ranks)]
        outs = [(p, *p.communicate(timeout=600)) for p in procs]
    failed = [(p, err) for p, _, err in outs if p.returncode != 0]
    first, stdout, _ = outs[0]
    return subprocess.CompletedProcess(command, failed[0][0].returncode if failed else 0, stdout,
                                       failed[0][1] if failed else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--model", action="append", default=[], metavar="TEXT",
                        help="only the rows whose name contains TEXT (repeatable)")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--store", default="", help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="measure every configuration N times, interleaved (ms: medians; slowdowns: the median "
                             "of each repeat's ratio)")
    parser.add_argument("--latent", action="store_true",
                        help="read the loss back every step and compare --streamrace-latent=report against off")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.worker:
        print(json.dumps(step_time(args.worker[0], args.worker[1], args.steps, args.rank, args.store, args.latent)))
        return 0

    import torch

    backend = "cuda" if torch.cuda.is_available() else "virtual"
    if args.latent:
        modes = ["plain", backend + LATENT_OFF, backend]
    else:
        modes = ["plain", "empty-mode", "capture-floor"] + ([backend, "sanitizer"] if backend == "cuda"
                                                            else [backend])
    where = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    print(f"torch {torch.__version__} on {where}; {args.steps} steps per measurement, {args.repeat} repeat(s)"
          + ("; loss.item() every step, latent view off vs report" if args.latent else ""))
    print(f"{'model':36} " + " ".join(f"{m + ' ms':>14}" for m in modes) + "  slowdown vs plain")
    gpus = torch.cuda.device_count()
    for model in MODELS:
        if args.model and not any(text in model for text in args.model):
            continue
        if gpus and MODELS[model][3] > gpus:  # gloo on the CPU would measure another program than the GPU rows
            print(f"{model:36} skipped: {MODELS[model][3]} ranks need as many GPUs, this machine has {gpus}")
            continue
        runs: dict[str, list[float]] = {mode: [] for mode in modes}
        for rep in range(args.repeat):
            for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:  # each repeat starts elsewhere
                out = run_worker(model, mode, args.steps, args.latent)
                if out.returncode != 0:
                    print(f"{model}: {mode} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                    if mode in ("capture-floor", "sanitizer"):  # a compiler is missing / the sanitizer raised
                        runs[mode].append(float("nan"))
                        continue
                    return 1
                runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
        ms = {mode: statistics.median(values) for mode, values in runs.items()}

        def ratio(mode, base="plain"):  # the median of each repeat's own ratio: drift between repeats cancels
            return statistics.median(m / b for m, b in zip(runs[mode], runs[base]))
        slow = ", ".join(f"{m} {ratio(m):.2f}x" for m in modes[1:])
        if args.latent:
            slow += f"; latent view {ratio(backend, backend + LATENT_OFF):.2f}x"
        print(f"{model:36} " + " ".join(f"{ms[m]:14.3f}" for m in modes) + f"  {slow}", flush=True)  # as it comes
    return 0


if __name__ == "__main__":
    sys.exit(main())
