"""The ``streamrace`` command, and ``python -m pytest_streamrace``: ``streamrace run [options] -- PROGRAM [ARGS...]``
(``run``). Dispatches only: each subcommand lives in its own package."""

from __future__ import annotations

import sys

USAGE = "usage: streamrace run [options] -- PROGRAM [ARGS...]   (streamrace run --help for the options)\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:
        from .run.command import main as run

        return run(argv[1:])
    if argv[:1] in (["-h"], ["--help"]):
        sys.stdout.write(USAGE)
        return 0
    sys.stderr.write(USAGE + (f"streamrace: error: unknown command {argv[0]!r}\n" if argv else
                              "streamrace: error: expected a command\n"))
    return 2


if __name__ == "__main__":
    sys.exit(main())
