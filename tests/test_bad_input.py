"""Bad input never costs a run: every option, ini key, ``STREAMRACE_*`` variable and marker argument of the plugin,
and every option of the repro CLI, given wrong values — one line naming it, the value and what is expected, the
usage-error exit status, no traceback, nothing run.

The cases are enumerated from the code (the parser's registered options and ini keys, env.py's variables and every
``STREAMRACE_`` name in the package's source, the markers the plugin registers with their documented arguments, the
repro CLI's argparse actions), so an option added without a check, or without bad values here, fails this file.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest
from repro_cli import repro

import pytest_streamrace
from pytest_streamrace import checks, env, options, plugin
from pytest_streamrace.repro.__main__ import _parser

USAGE = pytest.ExitCode.USAGE_ERROR

# Bad values for what a setting takes. A kind (or written file) missing here fails
# test_every_setting_has_bad_values: add its bad values, and the check they need.
BAD_VALUES = {
    "bool": ["maybe"],  # ini only: on the command line a flag takes no value
    "choice": ["bogus", "Virtual"],
    "float": ["-1", "0", "soon", "inf"],
    "int": ["0", "-3", "two", "1.5"],
    "write": ["afile/out.json", "afolder"],  # under a regular file; a folder
}
# Files read before the first test: (files to create, value) -> the line's pattern.
BAD_READ = {
    "streamrace_baseline": [({}, "missing.json"), ({"b.json": "{not json"}, "b.json"), ({}, "afolder")],
    "streamrace_suppressions": [({}, "missing.supp"), ({"s.supp": "colour:red\n"}, "s.supp"), ({}, "afolder")],
}


def _setting_cases():
    for s in options.SETTINGS:
        kind = "write" if s.file == "write" else s.kind
        if kind in ("path", "paths"):
            for files, value in BAD_READ.get(s.name, ()):
                yield pytest.param(s, files, [s.flag, value], value, id=f"{s.flag}={value}")
                yield pytest.param(s, files, ["-o", f"{s.name}={value}"], value, id=f"ini-{s.name}={value}")
            continue
        for value in BAD_VALUES.get(kind, ()):
            if kind != "bool":
                yield pytest.param(s, {}, [f"{s.flag}={value}"], value, id=f"{s.flag}={value}")
            yield pytest.param(s, {}, ["-o", f"{s.name}={value}"], value, id=f"ini-{s.name}={value}")


def _prepare(pytester, files):
    pytester.makepyfile(test_ok="def test_ok():\n    print('RAN test_ok')\n")
    pytester.path.joinpath("afile").write_text("a file, not a folder\n")
    pytester.path.joinpath("afolder").mkdir()
    for name, text in files.items():
        pytester.path.joinpath(name).write_text(text)


def _assert_one_line(result, *parts):
    """The session stopped before the first test with one line on stderr naming each of `parts`."""
    out, err = result.stdout.str(), result.stderr.str()
    lines = [line for line in err.splitlines() if line.strip()]
    assert result.ret == USAGE, out + err
    assert len(lines) == 1, err
    assert lines[0].startswith("ERROR: streamrace: "), lines[0]
    for part in parts:
        assert part in lines[0], (part, lines[0])
    assert "Traceback" not in out + err and "INTERNALERROR" not in out + err
    assert "RAN test_ok" not in out and "passed" not in out


@pytest.mark.parametrize("setting, files, args, value", list(_setting_cases()))
def test_a_bad_setting_is_one_line_before_the_first_test(pytester, setting, files, args, value):
    _prepare(pytester, files)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s", "--streamrace", *args)
    shown = value.strip() if setting.kind != "paths" else value
    named = [] if setting.kind in ("path", "paths") else [setting.flag if args[0] != "-o" else f"ini {setting.name}"]
    _assert_one_line(result, shown, *named)
    if setting.kind == "bool":
        assert "expected true or false" in result.stderr.str()
    elif setting.kind not in ("path", "paths"):
        assert ": expected " in result.stderr.str()


BAD_ENV = {
    env.NATIVE: ["yes", "2"],
    env.APPLIER: ["yes", "Thread"],
    env.SUBPROCESS: ["1", "{not json", '{"backend": "virtual"}'],
    env.RANK_SPEC: ["x", "{}"],
    env.REPRO: ["x", '{"world_size": 0}', '{"steps": -1}'],
    env.PROGRESS: ["afile/progress", "afolder"],
    env.FORKSERVER_STATE: ["x", "[1]"],
    env.CONFIRM: ["x", '{"mode": "locate"}'],
    env.CRASH_OUTPUT: ["afile/output", "afolder"],
}


@pytest.mark.parametrize("name, value", [(n, v) for n, values in BAD_ENV.items() for v in values])
def test_a_bad_variable_is_one_line_before_the_first_test(pytester, monkeypatch, name, value):
    _prepare(pytester, {})
    monkeypatch.setenv(name, value)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s")
    _assert_one_line(result, name, repr(value), "expected")


# markers: each bad use is one error for its test (the file's other test runs), never a second, internal one

BAD_MARKERS = {
    ("distributed", "world_size"): ["distributed(world_size=0)", "distributed(world_size='2')",
                                    "distributed(world_size=True)", "distributed()", "distributed(2, 3)"],
    ("distributed", "backend"): ["distributed(world_size=2, backend='mpi')"],
    ("distributed", "timeout"): ["distributed(world_size=2, timeout=-1)", "distributed(world_size=2, timeout='1')"],
    ("distributed", None): ["distributed(world_size=2, ranks=2)"],
    ("streamrace", "expect"): ["streamrace(expect='maybe')", "streamrace('racy')", "streamrace",
                               "streamrace(expect=None)"],
    ("streamrace", None): ["streamrace(expect='race', strict=True)", "streamrace('race', 'clean')"],
    ("streamrace_compile", "modes"): ["streamrace_compile(modes=('jit',))", "streamrace_compile(modes=())",
                                      "streamrace_compile(modes='eager')"],
    ("streamrace_compile", "backend"): ["streamrace_compile(backend='tvm')"],
    ("streamrace_compile", None): ["streamrace_compile(mode='eager')", "streamrace_compile(('eager',))"],
}
_MESSAGE = {"distributed": "@pytest.mark.distributed", "streamrace": "@pytest.mark.streamrace",
            "streamrace_compile": "@pytest.mark.streamrace_compile"}


def _bad_marker_module() -> tuple[str, dict[str, str]]:
    """One test per bad use (streamrace_compile's ask for compile_mode, the fixture it configures); test name ->
    marker."""
    lines, names = ["import pytest", ""], {}
    for (name, _), uses in BAD_MARKERS.items():
        for use in uses:
            test = f"test_{len(names)}"
            names[test] = name
            fixture = "compile_mode" if name == "streamrace_compile" else ""
            lines += [f"@pytest.mark.{use}", f"def {test}({fixture}):", "    print('RAN')", ""]
    lines += ["def test_plain():", "    pass", ""]
    return "\n".join(lines), names


@pytest.mark.parametrize("args", [[], ["--streamrace"], ["--streamrace", "-n", "2"]],
                         ids=["plain", "streamrace", "streamrace-xdist"])
def test_a_bad_marker_argument_is_one_error_for_its_test(pytester, args):
    source, names = _bad_marker_module()
    pytester.makepyfile(test_markers=source)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rE", "-s", *args)
    out = result.stdout.str()
    result.assert_outcomes(passed=1, errors=len(names))
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert "Traceback" not in out and "KeyError" not in out and "INTERNALERROR" not in out
    assert "RAN" not in out
    assert sum(line.startswith("@pytest.mark.") for line in out.splitlines()) == len(names)  # one line each
    for test, name in names.items():  # one error per test, naming its marker
        summary = [line for line in out.splitlines() if line.startswith(f"ERROR test_markers.py::{test} ")]
        assert len(summary) == 1, (test, summary)
        assert _MESSAGE[name] in summary[0], summary[0]


# completeness: everything the user can give is enumerated above


def test_every_registered_option_and_ini_key_is_a_checked_setting(pytester):
    config = pytester.parseconfig()
    flags = {name for group in config._parser._groups for opt in group.options for name in opt.names()
             if name.startswith("--streamrace")}
    inis = {name for name in config._parser._inidict if name.startswith("streamrace")}
    assert flags == {s.flag for s in options.SETTINGS}
    assert inis == {s.name for s in options.SETTINGS}


def test_every_setting_has_bad_values():
    for s in options.SETTINGS:
        kind = "write" if s.file == "write" else s.kind
        if kind in ("path", "paths"):
            assert BAD_READ.get(s.name), f"{s.name}: a file read before the first test needs bad cases in BAD_READ"
        else:
            assert BAD_VALUES.get(kind), f"{s.name}: no bad values for its kind {kind!r}: add them (and its check)"
    assert {s.kind for s in options.SETTINGS if not s.file} <= set(BAD_VALUES) | {"path", "paths"}


def test_every_streamrace_variable_is_checked():
    declared = {v for k, v in vars(env).items() if k.isupper() and isinstance(v, str) and v.startswith("STREAMRACE_")}
    used = set()
    for path in pathlib.Path(pytest_streamrace.__file__).parent.rglob("*.py"):
        used.update(re.findall(r"STREAMRACE_[A-Z_]+", path.read_text(encoding="utf-8")))
    assert used <= declared, f"read but not named in env.py: {sorted(used - declared)}"
    assert declared == set(checks.ENVIRONMENT)
    assert declared == set(BAD_ENV)


def _marker_arguments(line: str) -> tuple[str, list[str]]:
    """A registered marker line's name and documented keyword arguments: "m(a=1, b=(2, 3)): ..." -> m, [a, b]."""
    call = ast.parse(line.split(":", 1)[0].replace("|", " or "), mode="eval").body
    if isinstance(call, ast.Name):
        return call.id, []
    return call.func.id, [k.arg for k in call.keywords]


def test_every_marker_argument_is_checked(pytester):
    ours = set(pytester.parseconfigure().getini("markers")) - set(
        pytester.parseconfigure("-p", "no:streamrace").getini("markers"))
    documented = dict(_marker_arguments(line) for line in ours)
    assert set(documented) == set(plugin.MARKER_CHECKS)
    for name, arguments in documented.items():
        for argument in arguments + [None]:  # None: an argument the marker does not take
            assert BAD_MARKERS.get((name, argument)), f"no bad uses of {name}({argument or 'unknown'}=...)"
    assert {name for name, _ in BAD_MARKERS} == set(documented)


# the repro CLI: every option checked before its first rank, exit 2

BAD_REPRO = {
    "command": [["nosuch"]],
    "name": [["show", "nosuch"], ["zero_overlap", "extra"]],
    "--variant": [["zero_overlap", "--variant", "sideways"]],
    "--backend": [["zero_overlap", "--backend", "tpu"]],
    "--world-size": [["zero_overlap", "--world-size", "0"], ["zero_overlap", "--world-size", "two"]],
    "--steps": [["zero_overlap", "--steps", "-1"]],
    "--repeat": [["zero_overlap", "--repeat", "0"]],
    "--json": [["zero_overlap", "--json", "afile/out.json"], ["zero_overlap", "--json", "afolder"]],
    "--trace": [["zero_overlap", "--trace", "afile/trace.json"], ["zero_overlap", "--trace", "afolder"]],
    "--confirm": [["zero_overlap", "--confirm=yes"]],  # a flag: it takes no value
}


def test_every_repro_cli_option_has_bad_values():
    actions = {a.option_strings[0] if a.option_strings else a.dest for a in _parser()._actions if a.dest != "help"}
    assert actions == set(BAD_REPRO)


@pytest.mark.parametrize("args", [args for cases in BAD_REPRO.values() for args in cases],
                         ids=lambda args: " ".join(args))
def test_bad_repro_cli_input_is_one_line_and_exit_2(tmp_path, args):
    (tmp_path / "afile").write_text("a file\n")
    (tmp_path / "afolder").mkdir()
    out = repro(*args, cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout == ""  # before the first rank: not even the repro's banner
    assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1, out.stderr
    assert args[-1] in out.stderr or args[-1] == "extra" and "'extra'" in out.stderr or (
        "=" in args[-1] and f"'{args[-1].split('=', 1)[1]}'" in out.stderr)


def test_a_bad_variable_stops_the_repro_cli_before_its_first_rank(tmp_path, monkeypatch):
    monkeypatch.setenv(env.NATIVE, "yes")
    out = repro("zero_overlap", cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == "error: STREAMRACE_NATIVE = 'yes': expected 0 (the pure-Python path) or 1\n"


# output files: folders created up front; a write that fails at the end costs a warning line, not the report


RACY_AND_FAILING = """
    import shutil
    import torch

    def test_racy(streamrace_device):
        side = torch.cuda.Stream()
        x = torch.ones(1000, device=streamrace_device)
        with torch.cuda.stream(side):
            x.add_(1)
        x.mul(2)

    def test_fails():
        assert 1 == 2
"""


def test_output_folders_are_created_and_the_files_written(pytester):
    pytester.makepyfile(test_x=RACY_AND_FAILING)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--streamrace", "--streamrace-backend=virtual",
                                           "--streamrace-json", "out/run1/races.json",
                                           "--streamrace-trace", "out/traces/trace.json")
    result.assert_outcomes(failed=2)
    races = (pytester.path / "out/run1/races.json").read_text()
    assert '"test": "test_x.py::test_racy"' in races
    assert (pytester.path / "out/traces/trace.json").read_text().startswith('{"traceEvents"')
    assert "WARNING" not in result.stdout.str() + result.stderr.str()


@pytest.mark.parametrize("args", [[], ["-n", "2"]], ids=["session", "xdist"])
def test_a_session_file_lost_at_the_end_is_one_warning_and_the_report_stands(pytester, args):
    """The folder is removed during the run (as a cleanup step might): each file that cannot be written is one
    warning line, and pytest's report, summary and exit status are those of the run."""
    pytester.makepyfile(test_x=RACY_AND_FAILING + """
    def test_zz_removes_the_folder():
        shutil.rmtree("out")
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--streamrace", "--streamrace-backend=virtual",
                                           "--streamrace-json", "out/races.json",
                                           "--streamrace-trace", "out/trace.json", *args)
    out = result.stdout.str()
    result.assert_outcomes(failed=2, passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert "Traceback" not in out + result.stderr.str() and "INTERNALERROR" not in out
    for line in ("FAILED test_x.py::test_racy - 2 stream races*", "FAILED test_x.py::test_fails - assert 1 == 2"):
        result.stdout.fnmatch_lines(["*short test summary info*", line])
    for option, path in (("--streamrace-json", "out/races.json"), ("--streamrace-trace", "out/trace.json")):
        lines = [line for line in out.splitlines() if option in line and "WARNING" in line]
        assert lines == [f"streamrace: WARNING: could not write {option} {path}: No such file or directory"]


@pytest.mark.parametrize("rank", ["0", "1"])
def test_every_torchrun_rank_stops_and_rank_0_says_why(pytester, monkeypatch, rank):
    """Each rank of ``torchrun -m pytest`` checks alike (the files rank 0 writes too), so none waits for a rank that
    stopped; only rank 0 prints the line."""
    _prepare(pytester, {})
    for name, value in {"TORCHELASTIC_RUN_ID": "x", "RANK": rank, "WORLD_SIZE": "2", "LOCAL_RANK": rank}.items():
        monkeypatch.setenv(name, value)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--streamrace", "--streamrace-json",
                                           "afile/races.json")
    assert result.ret == USAGE
    err = result.stderr.str()
    if rank == "0":
        _assert_one_line(result, "--streamrace-json", "afile/races.json", "afile is not a folder")
    else:
        assert err.strip() == "" and result.stdout.str().strip() == ""
