"""Does a program under ``streamrace run`` hold flat memory after warm-up? A 1,000-step CPU training job, plain and
under the command, with the resident memory of the job's process every 100 steps, as a table.

    python benchmarks/run_memory.py [--steps 1000] [--warmup 300] [--every 100] [--slack-mb 4]

The job is a small training loop (a 32-layer MLP, width 256, batch 64, SGD) with what makes the detector's state
pile up if anything does: a second stream (a gradient "all-reduce" stand-in on a side stream), fresh activations
freed every step, an event recorded per step and a loss read back per step (``.item()``: the latent view's implicit
syncs). Rows: the job plain; under ``streamrace run`` (virtual backend), where the side stream is waited for; and
where it is not (the same race every step: deduplicated, counted). The job's process measures itself
(``/proc/self/statm``); the command's own process is sampled from outside while it runs (its peak).

Warm-up is the detector filling its one growing table to its bound: the forward ops' sites it keeps to name backward
accesses (16,384 autograd nodes, about 1 KB each; ``detector/backward_sites.py``), some 65 nodes a step here, so full
after about 250 steps. Exit status 1 if the clean job raced, the racy one did not, or a job grew by more than
`--slack-mb` after step `--warmup`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

JOB = """
import json, os, sys, torch

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

steps, every, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
racy = "--racy" in sys.argv
torch.manual_seed(0)
model = torch.nn.Sequential(*[m for _ in range(32) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())])
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
if "--plain" in sys.argv:  # no stream API on CPU without the detector: the same work on one stream
    import contextlib

    class Plain:
        def wait_stream(self, other): pass
        def wait_event(self, event): pass
        def record(self): pass

    side = done = Plain()
    stream, current = (lambda s: contextlib.nullcontext()), Plain
else:
    side, done, stream, current = torch.cuda.Stream(), torch.cuda.Event(), torch.cuda.stream, torch.cuda.current_stream
found = {}
for step in range(1, steps + 1):
    x = torch.randn(64, 256)
    loss = model(x).square().mean()
    loss.backward()
    side.wait_stream(current())
    with stream(side):                                # the "all-reduce" stand-in: scale the gradients
        for p in model.parameters():
            p.grad.mul_(0.5)
        done.record()
    if not racy:
        current().wait_event(done)
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss.item()
    if step % every == 0 or step == steps:
        found[step] = rss_mb()
with open(out, "w") as f:
    json.dump(found, f)
"""

ROWS = (("plain", False, False), ("streamrace run, clean", True, False), ("streamrace run, racy", True, True))


def _status_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def measure(folder: str, under: bool, racy: bool, steps: int, every: int) -> dict:
    out = os.path.join(folder, f"rss-{under}-{racy}.json")
    job = [sys.executable, os.path.join(folder, "job.py"), str(steps), str(every), out] + \
        (["--racy"] if racy else []) + ([] if under else ["--plain"])
    command = [sys.executable, "-m", "pytest_streamrace", "run", "--backend", "virtual", "--", *job] if under else job
    environ = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(command, env=environ, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = [0.0]

    def sample():
        while proc.poll() is None:
            peak[0] = max(peak[0], _status_mb(proc.pid) or 0.0)
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    err = proc.communicate()[1]
    sampler.join()
    if not os.path.exists(out):
        raise RuntimeError(f"the job wrote no measurement (exit status {proc.returncode}):\n{err[-3000:]}")
    with open(out) as f:
        rss = {int(step): mb for step, mb in json.load(f).items()}
    return {"rss": rss, "status": proc.returncode, "seconds": time.perf_counter() - start,
            "command_mb": peak[0] if under else None, "err": err}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=300, help="the step after which memory should stay flat")
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--slack-mb", type=float, default=4.0, help="growth allowed after warm-up")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="streamrace-run-memory-") as folder:
        with open(os.path.join(folder, "job.py"), "w") as f:
            f.write(JOB)
        results = [measure(folder, under, racy, args.steps, args.every) for _, under, racy in ROWS]
    names = [name for name, _, _ in ROWS]
    print(f"{args.steps} steps: RSS of the job's process (MiB)")
    print(f"{'step':>6}" + "".join(f"{name:>24}" for name in names))
    for step in sorted(results[0]["rss"]):
        print(f"{step:>6}" + "".join(f"{r['rss'].get(step, float('nan')):>24.1f}" for r in results))
    rows = {f"growth after step {args.warmup}": [f"{_growth(r['rss'], args.warmup):+.1f}" for r in results],
            "command's peak RSS": [f"{r['command_mb']:.1f}" if r["command_mb"] is not None else "-" for r in results],
            "exit status": [str(r["status"]) for r in results],
            "wall s": [f"{r['seconds']:.1f}" for r in results]}
    for label, cells in rows.items():
        print(f"{label}:" + "".join(f"{cell:>24}" for cell in cells))
    failed = False
    for (name, _, racy), r in zip(ROWS, results):
        expected = 3 if racy else 0
        if r["status"] != expected:
            print(f"{name}: exit status {r['status']}, expected {expected}\n{r['err'][-2000:]}", file=sys.stderr)
            failed = True
        growth = _growth(r["rss"], args.warmup)
        if growth > args.slack_mb:
            print(f"{name}: grew {growth:.1f} MiB after step {args.warmup} (slack {args.slack_mb} MiB)",
                  file=sys.stderr)
            failed = True
    return 1 if failed else 0


def _growth(rss: dict, warmup: int) -> float:
    """MiB grown from the first measurement at or after `warmup` to the last."""
    after = [step for step in sorted(rss) if step >= warmup] or sorted(rss)
    return rss[after[-1]] - rss[after[0]]


if __name__ == "__main__":
    sys.exit(main())
