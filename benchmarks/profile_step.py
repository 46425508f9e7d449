"""Where a launch-bound step's time goes under the Detector: cProfile of 200 steps, the top functions by own time.

    python benchmarks/profile_step.py [--backend virtual|cuda] [--steps 200] [--top 25]

C++ work shows only where Python called it (the capture's callbacks do not show; the feed's `apply` does).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("virtual", "cuda"), default="virtual")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()

    from paired_overhead import launch_bound_step  # this folder is on the path of a script run from it

    from pytest_streamrace.detector.session import Detector

    step = launch_bound_step("cuda" if args.backend == "cuda" else "cpu")

    with Detector(backend=args.backend) as detector:
        for _ in range(20):
            step()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.steps):
            step()
        detector.tracker.drain()
        profile.disable()
        print(f"ops from: {detector.op_source}; feed: {detector.tracker._feed is not None}; {args.steps} steps")
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
