"""The child side of following a test into the processes it starts (the parent side is ``children.parent``).

While ``pytest --streamrace`` runs a test, its environment carries ``STREAMRACE_SUBPROCESS`` (JSON: the session's data
folder and backend). Every Python process started then runs ``start()`` from a one-line ``.pth`` start-up hook
(``children.parent``), which costs one environment lookup when the variable is absent. ``start()`` imports nothing
heavy: it arms a ``sys.meta_path`` watcher that activates a Detector when ``torch`` finishes importing (a child that
never imports torch pays for nothing else), and an ``os.register_at_fork`` handler for children forked from it
(multiprocessing's fork and forkserver start methods do not re-run the ``.pth``). The parent pytest process arms the
same fork handler for children forked from itself, adopting the test's own detector (``adopt``).

Each race is written when it is judged — one JSON line appended with ``os.write`` to this process's own file
``<dir>/child-<pid>.jsonl`` — so a child that ``os._exit``s or is killed still delivers what was judged before; when
it ends, each race seen again is written once more with its count (``recount``), and a process whose detector
starts says so first (``process``). Every
record names the test it belongs to: the test that was running when this process started (from the variable, which
the parent sets at each test's start) or was forked (from the live file ``<dir>/current``, which the parent rewrites
at each test's start: a forkserver's environment is that of the test that started the server); a multiprocessing pool worker works for
whichever test is running when it hands a task's result back, so its races name the test current when judged. The
cuda backend judges captured ops in batches: a child drains them before ``os._exit``, at interpreter exit, before a
multiprocessing queue hands a result back and before ``destroy_process_group`` (``process_patches``).

Under ``streamrace run --confirm``, and in ``--streamrace-confirm``'s re-runs of a test whose races were in the
processes it started, the program (the test) runs again with ``STREAMRACE_CONFIRM`` set (the race to force, per rank):
each followed process arms the plans on its detector when that starts (or when it is forked, by a process that had no
rank yet: a forkserver, a pool), uses its rank's once the capture reaches one of their ops, and writes what the forced
order changed to the instruction's folder when it ends (``races.confirm_run.ConfirmRun``).

Opting out: ``STREAMRACE_SUBPROCESS=0`` (or removing the variable) in a child's environment. Nothing here may raise into
the child: what fails is dropped (a broken child file only loses that child's races).
"""

from __future__ import annotations

import os
import sys

from .. import env
from . import process_patches

CURRENT = "current"  # the live test file in the data folder: the nodeid of the running test, or empty


class _State:
    raw: str = ""  # the variable as this process started with it (parsed when first needed: json costs ms)
    parsed: dict | None = None
    origin: str = ""  # the test running when this process started (or was forked)
    pid: int = 0
    fd: int | None = None
    detector = None
    owns_detector = False  # started here (not adopted from a forked parent pytest process)
    stood_down = False
    trace_written = False
    rank: int | None = None  # the last rank the process group gave (it is gone after destroy_process_group)
    reported: set = set()  # (test, race key) written: a pool worker forgets races between tasks, not per test
    confirm = None  # races.confirm_run.ConfirmRun: this process forces a race for streamrace run --confirm


_state = _State()


def config_from_env(environ=os.environ) -> dict | None:
    raw = environ.get(env.SUBPROCESS, "")
    if raw in ("", "0"):
        return None
    import json

    try:
        config = json.loads(raw)
    except ValueError:
        return None
    return config if isinstance(config, dict) and config.get("dir") else None


def _config() -> dict | None:
    if _state.parsed is None and _state.raw:
        _state.parsed = config_from_env({env.SUBPROCESS: _state.raw}) or {}
        if not _state.origin and _state.parsed:  # exec'd: the owner the variable names (the live file may have
            _state.origin = str(_state.parsed.get("test", ""))  # moved on already)
            if not _state.origin:
                _state.parsed = {}  # started while no test ran (a session's fixture, say): not followed
    return _state.parsed or None


def start() -> None:
    """The ``.pth`` hook: arm the torch watcher and the fork handler (never raises)."""
    try:
        raw = os.environ.get(env.SUBPROCESS, "")
        if not raw.startswith("{") or _state.raw:
            return
        if os.environ.get(env.RANK_SPEC):
            return  # a rank of our own distributed marker: its pytest session runs the checks itself
        _state.raw = raw
        _state.pid = os.getpid()
        _watch()
        os.register_at_fork(after_in_child=_after_fork)
    except Exception:
        pass


def stand_down() -> None:
    """This process is a pytest session that runs ``--streamrace`` itself: undo what ``start`` armed."""
    _state.stood_down = True
    _unwatch()
    detector, _state.detector = _state.detector, None
    if detector is not None and _state.owns_detector:
        try:
            detector.__exit__(None, None, None)
        except Exception:
            pass


def live_record(owner: str) -> bytes:
    """The live file's content for `owner`: a header (checksum, length) and the nodeid. The parent rewrites the file in
    place, so a reader may see a write half done; the header tells it so."""
    import zlib

    data = owner.encode("utf-8")
    return b"%08x %d\n" % (zlib.crc32(data), len(data)) + data


def live_test(folder: str, default: str = "") -> str:
    """The test running in the parent now (``live_record``), or `default` when the file cannot be read."""
    import zlib

    for _ in range(1000):  # a write half done is a few microseconds long
        try:
            with open(os.path.join(folder, CURRENT), "rb") as f:
                raw = f.read()
        except OSError:
            return default
        header, _, rest = raw.partition(b"\n")
        fields = header.split()
        try:
            crc, length = int(fields[0], 16), int(fields[1])
        except (ValueError, IndexError):
            continue
        data = rest[:length]
        if len(data) == length and zlib.crc32(data) == crc:
            return data.decode("utf-8", "replace")
    return default


# waiting for torch


_hooks: list = []  # WhenImported hooks armed by start()


def _quietly(callback):
    def run(module) -> None:
        try:
            callback(module)
        except Exception:
            pass
    return run


def _watch() -> None:
    from ..patching import WhenImported

    for name, callback in (("torch", lambda module: _activate()), ("multiprocessing.queues", _patch_queues)):
        hook = WhenImported(name, _quietly(callback))
        _hooks.append(hook)
        hook.install()


def _unwatch() -> None:
    while _hooks:
        _hooks.pop().uninstall()


# the detector


def _activate() -> None:
    if _state.detector is not None or _state.stood_down or os.environ.get(env.RANK_SPEC):
        return
    config = _config()
    if config is None:
        return
    _patch_distributed()
    if config.get("backend") == "cuda":
        # Not before the child initializes CUDA itself: the backend asks for the current device's default stream,
        # and a context made now would pin the device before the child's set_device / CUDA_VISIBLE_DEVICES and
        # break children that fork later. Ops before CUDA is initialized are CPU ops, which this backend ignores.
        import torch

        if not torch.cuda.is_initialized():
            torch.cuda._lazy_call(_start_quietly)
            return
    _start_detector(config)


def _start_quietly() -> None:
    try:  # runs inside torch.cuda's lazy initialization: an exception here would fail the child's first CUDA call
        _start_detector(_config())
    except Exception:
        pass


def _start_detector(config: dict) -> None:
    if _state.detector is not None or _state.stood_down:
        return
    from ..detector import session

    if session.active() is not None:
        return  # someone in this process runs a detector already
    detector = session.Detector(backend=config.get("backend", "virtual"), trace=bool(config.get("trace")),
                                latent=bool(config.get("latent", True)), incidental=config.get("incidental", ()))
    detector.__enter__()
    _state.owns_detector = True
    _attach(detector)
    _arm_confirmation(detector)


def _arm_confirmation(detector) -> None:
    """A forced re-run (``streamrace run --confirm``, ``--streamrace-confirm``): force this rank's race, with the plan
    its rank picks once the capture reaches the race's ops (a process whose rank has no plan runs as it is). Not
    seeded: under the cuda backend this runs inside torch.cuda's lazy initialization, which a seed call would wait
    on."""
    raw = os.environ.get(env.CONFIRM)
    if not raw:
        return
    try:
        from .. import checks
        from ..races.confirm_run import ConfirmRun

        instruction = checks.confirm_run(raw)
        if not instruction.get("plans"):
            return
        _state.confirm = ConfirmRun(dict(instruction, seed=False), rank_of=_rank)
        _state.confirm.start(detector, (_config() or {}).get("incidental", ()))
    except Exception:
        _state.confirm = None


def adopt(detector, config: dict, origin: str) -> None:
    """In a child forked from the parent pytest process during a test: report the test's (inherited) detector's
    further races from here, as this child's own."""
    _state.parsed = config
    _state.raw = "adopted"
    _state.origin = origin
    _state.pid = os.getpid()
    _state.fd = None
    _state.reported = set()
    _state.owns_detector = False
    _state.stood_down = False  # (the pytest process stood down; this child of it is followed)
    _attach(detector)
    if os.environ.get(env.CONFIRM):  # a forced re-run of the test: not the test's plan (its process's ops), its own
        try:
            detector.force(None)
        except Exception:
            pass
        _arm_confirmation(detector)
    queues = sys.modules.get("multiprocessing.queues")
    if queues is not None:
        _patch_queues(queues)


def _attach(detector) -> None:
    _state.detector = detector
    _state.trace_written = False
    detector.subscribe(on_race=_on_race, on_note=_on_note)
    process_patches.exit_runs_first(_finish)
    import atexit

    atexit.register(_finish)
    _hello()


def _hello() -> None:
    """Say that this process is followed (its parent counts the processes it observed)."""
    try:
        _write({"kind": "process", "test": _owner(), "rank": _rank(), "pid": os.getpid()})
    except Exception:
        pass


def _after_fork() -> None:
    """In a forked child: a process of its own, working for the test running now."""
    if not _state.raw or _state.stood_down:
        return
    config = _config()
    if config is None:
        return
    ranked = _rank() is not None  # the forking process's rank (this one's is not known yet)
    _state.pid = os.getpid()
    _state.fd = None
    _state.trace_written = False
    _state.rank = None
    _state.reported = set()
    _state.origin = live_test(config["dir"], _state.origin)
    if _state.confirm is not None:  # the forking process's plan: its ops were counted there
        _state.confirm = None
        try:
            _state.detector.force(None)
        except Exception:
            pass
        if not ranked:  # forked before its parent had a rank (a forkserver, a pool): a rank process of its own
            _arm_confirmation(_state.detector)
    queues = sys.modules.get("multiprocessing.queues")
    if queues is not None:
        _patch_queues(queues)
    if _state.detector is not None:
        _hello()


def _on_race(races) -> None:
    try:
        from ..races.record import from_race

        detector = _state.detector
        rank = _rank()
        test = _owner()
        for race in races:
            key = (test, race.latent, race.key())
            if key in _state.reported:
                continue  # a pool worker's earlier task for the same test reported it already
            _state.reported.add(key)
            _write({"kind": "race", "test": test, "rank": rank, "pid": os.getpid(),
                    "race": from_race(race, detector.stream_name, rank)})
    except Exception:
        pass


def _on_note(text: str) -> None:
    """Something this process's detector could not model: said to the test, as the test's own notes are."""
    try:
        _write({"kind": "note", "test": _owner(), "rank": _rank(), "pid": os.getpid(), "text": text})
    except Exception:
        pass


def _rank() -> int | None:
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            _state.rank = dist.get_rank()
            return _state.rank
    except Exception:
        pass
    if _state.rank is not None:
        return _state.rank
    for name in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def _owner() -> str:
    """The test this process's work belongs to now."""
    if _is_pool_worker():
        return live_test(_config()["dir"], "")
    return _state.origin


def _write(record: dict) -> None:
    if _state.fd is None or _state.pid != os.getpid():
        _state.pid = os.getpid()
        path = os.path.join(_config()["dir"], f"child-{_state.pid}.jsonl")
        _state.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    import json

    os.write(_state.fd, (json.dumps(record) + "\n").encode())


def _drain() -> None:
    detector = _state.detector
    if detector is not None:
        try:
            detector.races  # reading them judges what is pending
            _on_race(detector.latent_races)  # kept by hb, not announced as found: shipped here
        except Exception:
            pass


def _recount() -> None:
    """The races seen more than once, with their counts as this process ends (each was written when first found)."""
    detector = _state.detector
    try:
        from ..races.record import from_race

        again = [race for race in [*detector.races, *detector.latent_races] if race.count > 1]
        rank = _rank()
        for race in again:
            _write({"kind": "recount", "test": _owner(), "rank": rank, "pid": os.getpid(),
                    "race": from_race(race, detector.stream_name, rank)})
    except Exception:
        pass


def _task_done() -> None:
    """A multiprocessing queue hands something back: judge what is pending; a pool worker's next task may be another
    test's, whose races must be reported even where they repeat this one's."""
    _drain()
    detector = _state.detector
    if detector is not None and _is_pool_worker():
        confirm = _state.confirm
        if confirm is not None and confirm.picked():  # a pool's workers may never exit (terminated at its end)
            _state.confirm = None
            try:
                confirm.finish(detector, [], "passed")
            except Exception:
                pass
        try:
            detector.forget_races()
        except Exception:
            pass


def _is_pool_worker() -> bool:
    mp = sys.modules.get("multiprocessing")
    return mp is not None and "PoolWorker" in getattr(mp.current_process(), "name", "")


def _finish() -> None:
    """This process ends: judge what is pending, and write its trace."""
    detector = _state.detector
    if detector is None or _state.stood_down:
        return
    _drain()
    _recount()
    confirm, _state.confirm = _state.confirm, None
    if confirm is not None:
        try:
            confirm.finish(detector, [], "passed")
        except Exception:
            pass
    if not _config().get("trace") or _state.trace_written:
        return
    _state.trace_written = True
    try:
        from ..races.trace import trace_events

        rank = _rank()
        events = trace_events(detector.timeline, detector.races, detector.stream_name, rank)
        _write({"kind": "trace", "test": _owner(), "rank": rank, "pid": os.getpid(), "events": events})
    except Exception:
        pass


def _patch_queues(module) -> None:
    """Judge pending ops before a multiprocessing queue hands something back (a pool worker's task result)."""
    process_patches.queue_put_runs_first(module, _task_done)


def _patch_distributed() -> None:
    """Judge pending ops while the process group still names this process's rank."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None:
        process_patches.destroy_process_group_runs_first(dist, _before_destroy)


def _before_destroy() -> None:
    _rank()
    _drain()
