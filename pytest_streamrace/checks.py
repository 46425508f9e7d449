"""Checking what a user gives before anything runs: one function per setting, per file it names and per
``STREAMRACE_*`` variable.

An hour of GPU tests must not be lost to a typo found at the end, so every value is checked up front, and bad input
is one line naming where the value came from, the value and what is expected — never a traceback. Each function takes
the raw value (a string from a command line, an ini file or the environment) and `where` (the name to show:
``--streamrace-timeout``, ``ini streamrace_timeout``, ``STREAMRACE_NATIVE``), and returns the value to use or raises
``BadInput``. Standard library only, no pytest, no torch: ``pytest``, the repro CLI and any other front end share
them (``races/policy.py`` checks what suppression files and baselines hold).
"""

from __future__ import annotations

import json
import os

from . import env


class BadInput(ValueError):
    """Input the user can fix; the message is the one line shown to them."""


def _bad(where: str, value, expected: str) -> BadInput:
    return BadInput(f"{where} = {value!r}: expected {expected}")


# values

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def flag(value, where: str) -> bool:
    """An on/off setting (ini files spell it true/false, yes/no, on/off or 1/0)."""
    if isinstance(value, bool) or value is None:
        return bool(value)
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise _bad(where, value, "true or false")


def choice(value, where: str, choices: tuple) -> str:
    if value not in choices:
        raise _bad(where, value, "one of " + ", ".join(choices))
    return value


def seconds(value, where: str) -> float:
    """A positive number of seconds (``--streamrace-timeout``)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise _bad(where, value, "a positive number of seconds") from None
    if not number > 0 or number == float("inf"):
        raise _bad(where, value, "a positive number of seconds")
    return number


def count(value, where: str) -> int:
    """A positive whole number (``--streamrace-schedules``, the repro CLI's ``--world-size``)."""
    if isinstance(value, bool):
        raise _bad(where, value, "a positive whole number")
    try:
        number = int(str(value).strip())
    except ValueError:
        raise _bad(where, value, "a positive whole number") from None
    if number < 1:
        raise _bad(where, value, "a positive whole number")
    return number


# files

def output_file(path: str, where: str) -> str:
    """A file to write at the end of a run: its folder is created now (``--streamrace-json out/races.json`` works
    in a fresh checkout); a path that can be neither created nor written is bad input now, not at the end."""
    if not path:
        raise _bad(where, path, "a file path")
    if os.path.isdir(path):
        raise _bad(where, path, "a file to write, not a folder")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        above = folder
        while not os.path.exists(above):
            above = os.path.dirname(above)
        shown = os.path.relpath(above) if not os.path.relpath(above).startswith(os.pardir) else above
        why = f"{shown} is not a folder" if not os.path.isdir(above) else exc.strerror or str(exc)
        raise _bad(where, path, f"a writable file path (cannot create its folder: {why})") from None
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise _bad(where, path, "a writable file path (permission denied)")
    return path


def input_file(path: str, where: str) -> str:
    """A file read before the first test: it must exist and be readable (its content is its reader's to check)."""
    if os.path.isdir(path):
        raise _bad(where, path, "a readable file, not a folder")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise _bad(where, path, f"a readable file ({exc.strerror or exc})") from None
    return path


# the environment

def native(value: str, where: str = env.NATIVE) -> bool:
    """``STREAMRACE_NATIVE``: 0 turns the C++ capture and core off; 1 (or unset) keeps them."""
    if value not in ("0", "1"):
        raise _bad(where, value, "0 (the pure-Python path) or 1")
    return value == "1"


def applier(value: str, where: str = env.APPLIER) -> str:
    """``STREAMRACE_APPLIER``: where the captured records are applied, on a thread of their own or inline."""
    if value not in ("thread", "inline"):
        raise _bad(where, value, "thread or inline")
    return value


def _json_object(value: str, where: str, what: str, keys: tuple = ()) -> dict:
    try:
        doc = json.loads(value)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or any(k not in doc for k in keys):
        raise _bad(where, value, what)
    return doc


def subprocess_config(value: str, where: str = env.SUBPROCESS) -> dict | None:
    """``STREAMRACE_SUBPROCESS``: 0 (or empty) opts a process out of being followed; anything else is the JSON
    the plugin itself sets for the processes a test starts."""
    if value in ("", "0"):
        return None
    return _json_object(value, where, "0 (do not follow this process) or the JSON pytest --streamrace sets",
                        ("dir",))


def rank_spec(value: str, where: str = env.RANK_SPEC) -> dict:
    """``STREAMRACE_RANK_SPEC``: set by the launcher for a rank of a ``distributed`` item, never by a user."""
    return _json_object(value, where, "the JSON the launcher sets for a rank process (unset it)",
                        ("rank", "world_size", "store"))


def repro_settings(value: str, where: str = env.REPRO) -> dict:
    """``STREAMRACE_REPRO``: the repro CLI's settings for its shipped pytest items."""
    doc = _json_object(value, where, 'JSON such as {"world_size": 2, "steps": 0, "repeat": 1}')
    for key in ("world_size", "repeat"):
        if key in doc and (isinstance(doc[key], bool) or not isinstance(doc[key], int) or doc[key] < 1):
            raise _bad(where, value, f"JSON whose {key} is a positive whole number")
    if "steps" in doc and (isinstance(doc["steps"], bool) or not isinstance(doc["steps"], int) or doc["steps"] < 0):
        raise _bad(where, value, "JSON whose steps is a whole number (0: the repro's own)")
    return doc


def progress_file(value: str, where: str = env.PROGRESS) -> str:
    """``STREAMRACE_PROGRESS``: the file a repro's ranks append their progress lines to."""
    return output_file(value, where)


def crash_output(value: str, where: str = env.CRASH_OUTPUT) -> str:
    """``STREAMRACE_CRASH_OUTPUT``: the file a rank's output goes to, where a fatal signal's native stack is written."""
    return output_file(value, where)


def forkserver_state(value: str, where: str = env.FORKSERVER_STATE) -> dict:
    """``STREAMRACE_FORKSERVER_STATE``: set by the rank fork server for its own re-execution, never by a user."""
    return _json_object(value, where, "the JSON the rank fork server sets for itself (unset it)")


def confirm_run(value: str, where: str = env.CONFIRM) -> dict:
    """``STREAMRACE_CONFIRM``: set by ``--streamrace-confirm`` and ``streamrace run --confirm`` for the re-runs they
    start, never by a user."""
    return _json_object(value, where, "the JSON --streamrace-confirm sets for its re-runs (unset it)", ("mode", "out"))


ENVIRONMENT = {env.NATIVE: native, env.APPLIER: applier, env.SUBPROCESS: subprocess_config, env.RANK_SPEC: rank_spec,
               env.REPRO: repro_settings, env.PROGRESS: progress_file,
               env.FORKSERVER_STATE: forkserver_state, env.CONFIRM: confirm_run,
               env.CRASH_OUTPUT: crash_output}  # every variable env.py names


def environment(environ=os.environ) -> None:
    """Check every ``STREAMRACE_*`` variable that is set (an empty one counts as unset)."""
    for name, check in ENVIRONMENT.items():
        value = environ.get(name)
        if value:
            check(value, name)
