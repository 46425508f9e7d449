"""Does the detector's shadow state stay bounded over a long test? A 10,000-step training loop under the Detector,
with the resident memory and the detector's own tables printed every few thousand steps.

    python benchmarks/memory.py [--steps 10000] [--every 1000] [--backend virtual|cuda]

The step has what makes state pile up if anything does: a second stream (a gradient "all-reduce" stand-in on a side
stream, waited for properly, so histories span streams and frees have hazards to judge), fresh activations freed
every step, events recorded per step, and an ``.item()`` read-back per step (the latent view's implicit syncs).
Memory is flat when the last rows stop growing: the ForwardSites table fills up to its bound first (65,536 forward
sites), then everything is steady. Exit status 1 if the step raced (it is correct) or memory grew in the second
half by more than `--slack-mb`.
"""

from __future__ import annotations

import argparse
import gc
import os
import time


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def forward_sites(tracker) -> int:
    """Forward ops' sites kept to name backward accesses: the C++ feed's table, else the tracker's."""
    feed = tracker._feed
    return feed.forward_sites if feed is not None else len(tracker.forward_sites._sites)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--every", type=int, default=1000)
    parser.add_argument("--backend", choices=("virtual", "cuda"), default="virtual")
    parser.add_argument("--slack-mb", type=float, default=8.0, help="growth allowed over the second half")
    args = parser.parse_args()

    import torch

    from pytest_streamrace.detector.session import Detector

    device = "cuda" if args.backend == "cuda" else "cpu"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 64, device=device)
    flat = torch.zeros(sum(p.numel() for p in model.parameters()), device=device)

    rows = []
    with Detector(backend=args.backend) as detector:
        side = torch.cuda.Stream()

        def step():
            opt.zero_grad(set_to_none=True)
            loss = model(x).pow(2).mean()
            loss.backward()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # the "all-reduce" of the gradients, into a flat buffer
                torch.cat([p.grad.flatten() for p in model.parameters()], out=flat)
                flat.mul_(0.5)
                done = torch.cuda.Event()
                done.record()
            torch.cuda.current_stream().wait_event(done)
            opt.step()
            return loss.item()  # a read-back every step, as a loss logger does

        start = time.perf_counter()
        for i in range(1, args.steps + 1):
            step()
            if i % args.every == 0 or i == args.steps:
                gc.collect()
                detector.tracker.drain()
                hb = detector.hb
                rows.append((i, rss_mb(), hb.history_size(), len(detector.tracker.watched),
                             forward_sites(detector.tracker), time.perf_counter() - start))
        races = detector.races

    print(f"torch {torch.__version__}; backend {args.backend}; {args.steps} steps")
    print(f"{'step':>7} {'rss MB':>8} {'hb history':>11} {'storages':>9} {'fwd sites':>10} {'s':>7}")
    for step_no, rss, history, storages, sites, elapsed in rows:
        print(f"{step_no:7d} {rss:8.1f} {history:11d} {storages:9d} {sites:10d} {elapsed:7.1f}")
    half = [r for r in rows if r[0] >= args.steps // 2]
    growth = half[-1][1] - half[0][1] if len(half) > 1 else 0.0
    print(f"second half: rss {growth:+.1f} MB over {half[-1][0] - half[0][0] if len(half) > 1 else 0} steps; "
          f"races {len(races)}")
    if races or growth > args.slack_mb:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
