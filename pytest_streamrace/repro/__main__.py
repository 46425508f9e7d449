"""``python -m pytest_streamrace.repro list | show NAME | NAME [options]``: run upstream stream-race repros.

Exit status: 0 when every variant run got its expected verdict, 1 when one did not, 2 for anything the user can fix
(unknown repro, framework missing, too few GPUs, bad option) — always one line, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

from .. import checks, env
from ..races.record import location
from .registry import ReproError, discover, get


def _count(text: str) -> int:
    try:
        return checks.count(text, "")
    except checks.BadInput:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}") from None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, not argparse's usage dump
        raise ReproError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m pytest_streamrace.repro",
                     description="Reproduce upstream CUDA stream-synchronization bugs and print a verdict.")
    parser.add_argument("command", help="'list', 'show NAME', or the name of a repro to run")
    parser.add_argument("name", nargs="?", help="repro name (for 'show')")
    parser.add_argument("--variant", choices=("unpatched", "patched", "both"), default="both")
    parser.add_argument("--backend", choices=("auto", "cuda", "virtual"), default="auto",
                        help="cuda: real GPUs and NCCL; virtual: CPU, gloo and the virtual stream model; "
                             "auto: cuda when there are enough GPUs")
    parser.add_argument("--world-size", type=_count, help="number of ranks (default: the repro's)")
    parser.add_argument("--steps", type=_count, help="training steps per run (default: the repro's)")
    parser.add_argument("--repeat", type=_count, default=1,
                        help="runs per variant (in the same rank processes, one launch per variant)")
    parser.add_argument("--confirm", action="store_true",
                        help="force each race of a run into its bad order in a re-run of the variant and show "
                             "whether the values it touched change, beside the referee's verdict")
    parser.add_argument("--json", metavar="PATH", help="write every run's verdict and evidence to PATH")
    parser.add_argument("--trace", metavar="PATH", help="write a Chrome-trace timeline of the last run to PATH")
    return parser


def _backend(repro, requested: str, world_size: int) -> str:
    gpus = len(env.visible_gpus())
    if requested == "auto":
        requested = "cuda" if gpus >= world_size and "cuda" in repro.backends else "virtual"
    if requested not in repro.backends:
        need = "CUDA GPUs" if requested == "virtual" else "the virtual backend"
        raise ReproError(f"{repro.name} runs only on the {' or '.join(repro.backends)} backend "
                         f"(this machine has {gpus} GPU{'s' if gpus != 1 else ''}); it needs {need}")
    if requested == "cuda" and gpus < world_size:
        raise ReproError(f"{repro.name} on the cuda backend needs {world_size} GPUs, this machine has {gpus}")
    return requested


def _print_outcome(outcome, label: str) -> None:
    mark = "as expected" if outcome.expected else f"EXPECTED {outcome.expect}"
    print(f"{outcome.repro}/{outcome.variant}{label}: {outcome.verdict} ({mark}) — {outcome.reason}  [{outcome.seconds:.1f} s]")
    for race in outcome.races[:4]:
        later, earlier = race["later"], race["earlier"]
        print(f"    {race['kind']} on {race['tensor']['name'] or 'tensor'} {race['tensor']['dtype']}"
              f"{race['tensor']['shape']} (rank {race['rank']}):")
        print(f"      {earlier['rw']:5} {earlier['op']:22} on {earlier['stream']:38} at {location(earlier['frames'])}")
        print(f"      {later['rw']:5} {later['op']:22} on {later['stream']:38} at {location(later['frames'])}")
    if len(outcome.races) > 4:
        print(f"    ... {len(outcome.races) - 4} more (--json PATH for all)")
    for n in outcome.numeric:
        print(f"    numbers: {json.dumps(n, sort_keys=True)}")
    for c in outcome.confirmations:
        print(f"    {c['line']}")
    if outcome.confirmed is not None:
        print(f"    confirmation: {outcome.confirmed['summary']}  [{outcome.confirmed['seconds']:.1f} s]")
    if outcome.failure:
        print("    the run failed:\n" + "\n".join("      " + line for line in outcome.failure[-3000:].splitlines()))


def run(args) -> int:
    from .runner import run_variant

    repro = get(args.command)
    for option, path in (("--json", args.json), ("--trace", args.trace)):
        if path is not None:
            checks.output_file(path, option)  # before the first rank: its folder created, writable
    if repro.framework is not None and (problem := repro.framework.problem()):
        raise ReproError(problem)
    world_size = args.world_size or repro.world_size
    backend = _backend(repro, args.backend, world_size)
    variants = [v.name for v in repro.variants] if args.variant == "both" else [args.variant]
    framework = f"{repro.framework.package} {repro.framework.installed()}" if repro.framework else "torch"
    print(f"{repro.name}: {repro.title}")
    print(f"  {framework}; backend {backend} ({'NCCL' if backend == 'cuda' else 'gloo'}); {world_size} ranks; "
          f"variants: {', '.join(variants)}; repeat {args.repeat}", flush=True)
    outcomes = []
    for variant in variants:
        runs = f" for {args.repeat} runs" if args.repeat > 1 else ""
        print(f"  [{variant}] starting {world_size} ranks{runs}...", flush=True)
        results = run_variant(repro, variant, backend, world_size, args.steps or 0, args.repeat, args.trace,
                              confirm=args.confirm)
        for i, outcome in enumerate(results, 1):
            outcomes.append(outcome)
            _print_outcome(outcome, f" run {i}/{len(results)}" if len(results) > 1 else "")
    if args.repeat > 1:
        for variant in variants:
            counts = Counter(o.verdict for o in outcomes if o.variant == variant)
            total = sum(counts.values())
            print(f"{repro.name}/{variant}: " + ", ".join(f"{k} {n}/{total}" for k, n in counts.most_common()))
    if args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"repro": repro.name, "framework": framework, "backend": backend, "world_size": world_size,
                           "runs": [vars(o) | {"expected": o.expected} for o in outcomes]}, f, indent=1)
        except OSError as exc:  # checked before the first rank; lost since (a full disk): the verdict stands
            print(f"warning: could not write --json {args.json}: {exc.strerror or exc}", file=sys.stderr)
    if args.confirm:
        disagree = [f"{o.variant}" for o in outcomes if o.confirmed and o.confirmed["agrees"] is False]
        print(f"{repro.name}: confirmation " + (f"DISAGREES with the referee on {', '.join(disagree)}" if disagree
                                                 else "agrees with the referee wherever it gave a verdict"))
    ok = all(o.expected for o in outcomes)
    print(f"{repro.name}: {'every variant got its expected verdict' if ok else 'NOT every variant got its expected verdict'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        checks.environment()
        if args.command == "list":
            repros = discover()
            if not repros:
                print("no repros installed")
            for name, repro in sorted(repros.items()):
                print(f"{name:20} {repro.title}")
            return 0
        if args.command == "show":
            if not args.name:
                raise ReproError("show needs a repro name (see 'list')")
            print(get(args.name).describe())
            return 0
        if args.name:
            raise ReproError(f"unexpected argument {args.name!r}")
        return run(args)
    except (ReproError, checks.BadInput) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
