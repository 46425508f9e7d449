"""``python -m pytest_streamrace.repro list | show NAME | NAME [options]``."""

from __future__ import annotations

import argparse
import sys

from .registry import ReproError, discover, get


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, not argparse's usage dump
        raise ReproError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m pytest_streamrace.repro",
                     description="Reproduce upstream CUDA stream-synchronization bugs and print a verdict.")
    parser.add_argument("command", help="'list', 'show NAME', or the name of a repro to run")
    parser.add_argument("name", nargs="?", help="repro name (for 'show')")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        if args.command == "list":
            repros = discover()
            if not repros:
                print("no repros installed")
            for name, repro in sorted(repros.items()):
                print(f"{name:24} {getattr(repro, 'title', '')}")
            return 0
        if args.command == "show":
            if not args.name:
                raise ReproError("show needs a repro name")
            print(get(args.name))
            return 0
        get(args.command)
        raise ReproError(f"repro {args.command!r} cannot run: no runner yet")
    except ReproError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
