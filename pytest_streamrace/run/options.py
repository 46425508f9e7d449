"""``streamrace run``'s settings, parsed in one place: the pytest options without their ``--streamrace-`` prefix, from
the same table (``pytest_streamrace.options.SETTINGS``: help, choices, defaults), with the same ini keys as defaults.

The ini file is found as pytest finds it, from the working directory up: the first ``pytest.ini``,
``.pytest.ini``, ``pyproject.toml`` with ``[tool.pytest.ini_options]``, ``tox.ini`` with ``[pytest]`` or
``setup.cfg`` with ``[tool:pytest]``. Its folder is the rootdir: ini paths are relative to it, command-line paths to
the working directory. Bad input raises ``UsageError`` (one line; the command prints its usage and exits 2).
"""

from __future__ import annotations

import argparse
import configparser
import os
from dataclasses import dataclass, field

from .. import options

PREFIX = "--streamrace-"
USAGE = "streamrace run [options] -- PROGRAM [ARGS...]"
NAMES = ("streamrace_backend", "streamrace_latent", "streamrace_suppressions", "streamrace_baseline",
         "streamrace_baseline_update", "streamrace_report_only", "streamrace_json", "streamrace_trace",
         "streamrace_confirm")
HELP = {"streamrace_confirm": "after the program ends with races, run it again once per distinct race with that race "
                              "forced into its bad order in every followed process, and report whether the values "
                              "it touched change: confirmed, not confirmed or not tried (the exit status stays)"}
_TRUE, _FALSE = ("1", "true", "yes", "y", "on", "t"), ("0", "false", "no", "n", "off", "f")


class UsageError(Exception):
    """Bad usage: the message is the one line shown under the usage."""


@dataclass
class Settings:
    program: list[str]
    backend: str = "auto"
    latent: str = "report"
    suppress: list[str] = field(default_factory=list)
    baseline: str | None = None
    baseline_update: bool = False
    report_only: bool = False
    json: str | None = None
    trace: str | None = None
    confirm: bool = False
    rootdir: str = "."


def flag(setting: options.Setting) -> str:
    """The run command's flag of a pytest setting: ``--streamrace-backend`` → ``--backend``."""
    return "--" + setting.flag[len(PREFIX):]


def _dest(setting: options.Setting) -> str:
    return {"streamrace_suppressions": "suppress"}.get(setting.name, setting.name[len("streamrace_"):])


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would exit; the command prints the usage and exits 2 itself
        raise UsageError(message)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="streamrace run", usage=USAGE, add_help=True, allow_abbrev=False,
                description="Run PROGRAM (python script.py, python -m module, torchrun ..., deepspeed ...) with "
                            "every Python process it starts under the stream race detector; report the races of "
                            "all of them, merged. Exit status: the program's own, or 3 when new races were found "
                            "(not under --report-only); 2 on bad usage; 127 when PROGRAM cannot be found.",
                epilog="Defaults come from the pytest ini file's streamrace_* keys (streamrace_backend, ...).")
    for s in options.SETTINGS:
        if s.name not in NAMES:
            continue
        kwargs = {"dest": _dest(s), "default": None, "help": HELP.get(s.name, s.help.replace(PREFIX, "--"))}
        if s.kind == "bool":
            kwargs["action"] = "store_true"
        elif s.kind == "paths":
            kwargs.update(action="append", metavar="FILE")
        elif s.kind == "choice":
            kwargs["choices"] = s.choices
        elif s.kind == "path":
            kwargs["metavar"] = "FILE"
        else:
            kwargs["metavar"] = "PATH"
        p.add_argument(flag(s), **kwargs)
    return p


def parse(argv: list[str], cwd: str | None = None) -> Settings:
    """The settings of ``streamrace run`` ARGV (what follows ``run``)."""
    cwd = os.path.abspath(cwd or os.getcwd())
    if "--" not in argv:
        if any(a in ("-h", "--help") for a in argv):
            parser().parse_args(["--help"])  # prints the help and exits 0
        raise UsageError("expected -- before the program")
    cut = argv.index("--")
    program = argv[cut + 1:]
    known = parser().parse_args(argv[:cut])
    if not program:
        raise UsageError("no program after --")
    rootdir, ini = find_ini(cwd)
    out = Settings(program=program, rootdir=rootdir)
    by_name = {s.name: s for s in options.SETTINGS}
    for name in NAMES:
        s = by_name[name]
        dest = _dest(s)
        given = getattr(known, dest)
        raw = ini.get(name)
        if s.kind == "paths":
            value = [_under(rootdir, p) for p in _lines(raw)] + [_under(cwd, p) for p in given or ()]
            value = list(dict.fromkeys(value))
        elif given is not None and given is not False:
            value = _under(cwd, given) if s.kind == "path" or dest in ("json", "trace") else given
        elif raw in (None, "", []):
            value = s.default if s.kind != "bool" else False
        elif s.kind == "bool":
            value = _bool(name, raw)
        elif s.kind == "choice":
            if str(raw) not in s.choices:
                raise UsageError(f"ini {name} = {raw!r}: expected one of {', '.join(s.choices)}")
            value = str(raw)
        elif s.kind == "path":
            value = _under(rootdir, str(raw))
        else:  # --json, --trace: where pytest would write them, from the working directory
            value = _under(cwd, str(raw))
        setattr(out, dest, value)
    return out


def _under(base: str, path: str) -> str:
    return os.path.normpath(os.path.join(base, os.path.expanduser(path)))


def _lines(raw) -> list[str]:
    if raw in (None, ""):
        return []
    items = raw if isinstance(raw, list) else str(raw).splitlines()
    return [str(p).strip() for p in items if str(p).strip()]


def _bool(name: str, raw) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise UsageError(f"ini {name} = {raw!r}: expected true or false")


# the ini file


def find_ini(start: str) -> tuple[str, dict]:
    """(rootdir, its streamrace_* ini values) for a command run in `start`: the first pytest configuration file from
    there up, as pytest looks for it; (start, {}) where there is none."""
    folder = start
    while True:
        for name in ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg"):
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                values = _read(path, name)
                if values is not None:
                    return folder, {k: v for k, v in values.items() if k.startswith("streamrace")}
        parent = os.path.dirname(folder)
        if parent == folder:
            return start, {}
        folder = parent


def _read(path: str, name: str) -> dict | None:
    """The file's pytest section, or None where it has none (pytest.ini counts even when empty)."""
    if name == "pyproject.toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10: tomli, as pytest reads it there (its dependency on 3.10)
            try:
                import tomli as tomllib
            except ImportError:
                return None
        try:
            with open(path, "rb") as f:
                tool = tomllib.load(f).get("tool", {})
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot read {path}: {exc}") from None
        section = tool.get("pytest", {})
        section = section.get("ini_options", section) if isinstance(section, dict) else None
        return section if isinstance(section, dict) and "pytest" in tool else None
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(path, encoding="utf-8")
    except (configparser.Error, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from None
    section = {"pytest.ini": "pytest", ".pytest.ini": "pytest", "tox.ini": "pytest", "setup.cfg": "tool:pytest"}[name]
    if parser.has_section(section):
        return dict(parser.items(section))
    return {} if name in ("pytest.ini", ".pytest.ini") else None
