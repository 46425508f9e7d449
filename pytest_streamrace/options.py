"""The plugin's settings: each is a command-line option mirrored by an ini key; the command line wins."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from . import checks

BACKENDS = ("auto", "cuda", "virtual")
DEFAULT_TIMEOUT = 300.0
LATENT = ("report", "fail", "off")


@dataclass(frozen=True)
class Setting:
    name: str  # ini key; the option is --streamrace-<name> (or --streamrace for "streamrace")
    help: str
    default: Any = None
    kind: str = "string"  # "bool" | "string" | "float" | "int" | "choice" | "path" | "paths"
    choices: tuple = ()
    option: str = ""  # the flag, where it is not the ini key's name
    file: str = ""  # "write": a file written at the end of the session (its folder is created up front)

    @property
    def flag(self) -> str:
        return self.option or "--" + self.name.replace("_", "-")


SETTINGS = (
    Setting("streamrace", "check tests for unsynchronized cross-stream accesses", False, "bool"),
    Setting("streamrace_backend", "stream model: cuda (real streams), virtual (CPU model of torch.cuda streams), "
            "auto (cuda when a GPU is present)", "auto", "choice", BACKENDS),
    Setting("streamrace_timeout", "seconds a distributed test may run before its ranks' stacks are dumped and the "
            f"ranks are stopped (default {DEFAULT_TIMEOUT:g}; the distributed marker's timeout= wins)",
            DEFAULT_TIMEOUT, "float"),
    Setting("streamrace_json", "write every race found (all tests, all ranks) to this JSON file (its folder is "
            "created)", file="write"),
    Setting("streamrace_trace", "write a Chrome-trace timeline of the tested ops and their races to this file "
            "(opens in Perfetto; its folder is created)", file="write"),
    Setting("streamrace_schedules", "run each test that uses injected_delays under N delay schedules (each side "
            "stream slow in turn, then seeded random ones) and report which schedules failed", None, "int"),
    Setting("streamrace_nondefault_stream", "run each test body on a fresh non-default stream (needs a GPU or "
            "--streamrace)", False, "bool"),
    # adopting --streamrace in an existing suite (docs/how-to/adopting.md)
    Setting("streamrace_suppressions", "suppression file: races matching one of its rules (KEY:GLOB terms; keys "
            "kind, file, function, tensor) do not fail tests; repeatable, adds to the ini's files (ini paths are "
            "relative to the rootdir, one a line)", None, "paths", option="--streamrace-suppress"),
    Setting("streamrace_baseline", "baseline file: races whose signature (test, kind, both accesses' function and "
            "op) it lists are reported but do not fail; new ones fail", None, "path"),
    Setting("streamrace_baseline_update", "rewrite the --streamrace-baseline file with this session's races "
            "(no test fails because of a race)", False, "bool"),
    Setting("streamrace_latent", "latent races — accesses ordered today only by a host sync the program did not ask "
            "for (a value read back: .item(), .cpu(); an incidental-sync rule's files): report (default: listed, "
            "not failing), fail (fail the test as a race does), off (not collected)", "report", "choice",
            LATENT),
    Setting("streamrace_report_only", "report every race (summary, JSON, trace) but fail no test because of one",
            False, "bool"),
    Setting("streamrace_confirm", "re-run each test that reports races, once per race in a fresh process, with the "
            "race forced into its bad order, and report whether the values it touched change: confirmed, not "
            "confirmed or not tried", False, "bool"),
)
_BY_NAME = {s.name: s for s in SETTINGS}


def setting(name: str) -> Setting:
    return _BY_NAME[name]


def register(parser: pytest.Parser) -> None:
    """Every option takes its value as text: `check`, not argparse, judges it, so a bad value is one line naming the
    option, the value and what is expected, alike on the command line and in an ini file."""
    group = parser.getgroup("streamrace", "CUDA stream race detection (pytest-streamrace)")
    for s in SETTINGS:
        if s.kind == "bool":
            group.addoption(s.flag, action="store_true", default=None, dest=s.name, help=s.help)
            parser.addini(s.name, s.help, type="bool", default=s.default)
            continue
        kwargs = {"dest": s.name, "default": None, "help": s.help}
        if s.kind == "paths":
            group.addoption(s.flag, action="append", metavar="FILE", **kwargs)
            parser.addini(s.name, s.help, type="linelist", default=[])
            continue
        if s.kind == "path" or s.file:
            kwargs["metavar"] = "FILE"
        elif s.kind == "choice":
            kwargs["metavar"] = "{" + ",".join(s.choices) + "}"
        group.addoption(s.flag, **kwargs)
        parser.addini(s.name, s.help, default=None)


def get(config: pytest.Config, name: str) -> Any:
    """The effective value of a setting: command line, else ini, else default. A bad value is a usage error."""
    try:
        return value(config, _BY_NAME[name])
    except checks.BadInput as exc:
        raise pytest.UsageError(f"streamrace: {exc}") from None


def value(config: pytest.Config, s: Setting) -> Any:
    """`s`'s effective value, checked (``checks.BadInput`` when it is bad)."""
    given = config.getoption(s.name)
    if s.kind in ("path", "paths"):
        return _paths(config, s, given)
    if given is not None:
        return _checked(s, given, s.flag)
    return _from_ini(config, s)


def _from_ini(config: pytest.Config, s: Setting) -> Any:
    where = f"ini {s.name}"
    try:
        raw = config.getini(s.name)
    except (ValueError, pytest.UsageError) as exc:  # a bool ini value pytest cannot read: "invalid truth value 'x'"
        raise checks.BadInput(f"{where}: {exc}; expected true or false") from None
    if s.kind != "bool" and raw in (None, ""):
        return s.default
    return _checked(s, raw, where)


def _checked(s: Setting, raw, where: str) -> Any:
    if s.kind == "bool":
        return bool(raw)
    if s.kind == "choice":
        return checks.choice(raw, where, s.choices)
    if s.kind == "float":
        return checks.seconds(raw, where)
    if s.kind == "int":
        return checks.count(raw, where)
    return raw


def check(config: pytest.Config, files: bool) -> None:
    """Every setting's value, the ini file's included where the command line overrides it; with `files` (the process
    that writes the session's files, under --streamrace), the folders of the files written at the end are created
    and must be writable. Raises ``checks.BadInput``."""
    for s in SETTINGS:
        got = value(config, s)
        if s.kind not in ("path", "paths"):
            _from_ini(config, s)
        if files and s.file == "write" and got is not None:
            given = config.getoption(s.name)
            checks.output_file(got, s.flag if given is not None else f"ini {s.name}")
    baseline = value(config, setting("streamrace_baseline"))
    if files and baseline and value(config, setting("streamrace_baseline_update")):
        checks.output_file(baseline, "--streamrace-baseline")  # rewritten at the end


def _paths(config: pytest.Config, s: Setting, value) -> Any:
    """Absolute paths: the command line's relative to the invocation directory, the ini's to the rootdir. For
    "paths", the ini's files then the command line's."""
    import os

    def on_command_line(p: str) -> str:
        return os.path.normpath(os.path.join(str(config.invocation_params.dir), p))

    def in_ini(p: str) -> str:
        return os.path.normpath(os.path.join(str(config.rootpath), p))

    if s.kind == "path":
        if value is not None:
            return on_command_line(value)
        raw = config.getini(s.name)
        return in_ini(raw) if raw else None
    out = [in_ini(p) for p in config.getini(s.name)] + [on_command_line(p) for p in value or ()]
    return list(dict.fromkeys(out))
