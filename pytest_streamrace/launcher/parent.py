"""The parent side of ``distributed`` items: run each as N rank processes and report it as one item.

The parent takes such an item over in ``pytest_runtest_protocol`` and sets up none of its fixtures — they are
set up in every rank, which runs the item as an ordinary pytest item (``child``). Ranks are forked from a
per-process fork server that has torch imported (``forkserver``), supervised (``supervise``), and their
results merged into the item's setup/call/teardown reports (``report``).
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile

import pytest

from .. import env, options
from . import marker, nccl_conf, placement, report
from .ranks import LaunchError, shared
from .spec import RankSpec
from .supervise import RankRun, reap, supervise


def install(config: pytest.Config, marker_problem) -> None:
    config.pluginmanager.register(ParentPlugin(config, marker_problem), "streamrace-parent")


class ParentPlugin:
    def __init__(self, config: pytest.Config, marker_problem):
        self.config = config
        self.server = shared()
        self.marker_problem = marker_problem  # item -> one line, or None

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        # Start importing torch in the fork server now, while the other tests run.
        if session.config.option.collectonly:
            return
        if any(item.get_closest_marker("distributed") for item in session.items):
            self.server.start(str(self.config.invocation_params.dir))

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem) -> bool | None:
        mark = item.get_closest_marker("distributed")
        if mark is None:
            return None
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        reports = self._run(item, mark)
        _tear_down_to(item, nextitem, reports)
        for rep in reports:
            item.ihook.pytest_runtest_logreport(report=rep)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def _run(self, item: pytest.Item, mark) -> list[pytest.TestReport]:
        problem = self.marker_problem(item)
        if problem is not None:
            return report.setup_outcome(item, "failed", problem)
        try:
            request = marker.parse(mark)
            where = placement.place(request.world_size, request.pg_backend)
        except marker.MarkerError as exc:
            return report.setup_outcome(item, "failed", str(exc))
        except placement.Unservable as exc:
            return report.setup_outcome(item, "skipped", (str(item.path), item.location[1] + 1, f"Skipped: {exc}"))
        timeout = request.timeout or options.get(self.config, "streamrace_timeout")
        launch = functools.partial(self._launch, item, request, where, timeout)
        reports = launch()
        if options.get(self.config, "streamrace") and options.get(self.config, "streamrace_confirm") and \
                not os.environ.get(env.CONFIRM):
            from ..races.confirm import confirm_distributed
            from ..races.plugin import resolve_backend

            confirm_distributed(item, reports, resolve_backend(self.config), launch)
        return reports

    def _launch(self, item: pytest.Item, request, where, timeout: float,
                extra: dict[str, str] | None = None) -> list[pytest.TestReport]:
        """The item's ranks, forked from this session's fork server, to their end: its reports. `extra`: variables
        every rank's environment also gets, None for one it goes without (a confirmation's re-run of the item)."""
        workdir = tempfile.mkdtemp(prefix="streamrace-")
        try:
            cwd = str(self.config.invocation_params.dir)
            self.server.start(cwd)
            runs = []
            try:
                for rank, device in enumerate(where.devices):
                    spec = RankSpec(rank=rank, world_size=request.world_size, backend=where.backend,
                                    store=os.path.join(workdir, "store"),
                                    result=os.path.join(workdir, f"rank{rank}.jsonl"),
                                    stacks=os.path.join(workdir, f"rank{rank}.stacks"),
                                    release=os.path.join(workdir, "release"), timeout=timeout, device=device)
                    output = os.path.join(workdir, f"rank{rank}.out")
                    environ = _env(spec, output, item.nodeid)
                    for name, value in (extra or {}).items():
                        if value is None:
                            environ.pop(name, None)
                        else:
                            environ[name] = value
                    pid = self.server.spawn(self._argv(item, workdir, rank), environ, cwd, output)
                    runs.append(RankRun(spec, pid, output))
            except LaunchError as exc:
                reap(self.server, runs)  # what did start
                return report.setup_outcome(item, "failed", f"could not start the ranks: {exc}")
            duration = supervise(self.server, runs, timeout)
            return report.build(item, runs, timeout, duration)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _argv(self, item: pytest.Item, workdir: str, rank: int) -> list[str]:
        """A rank's pytest command line: the one item, the parent's ini/rootdir and reporting options, no xdist."""
        config = self.config
        file_part = item.nodeid.split("::", 1)[0]
        argv = [str(item.path) + item.nodeid[len(file_part):],
                "--rootdir", str(config.rootpath), "-p", "no:cacheprovider",
                "--basetemp", os.path.join(workdir, f"rank{rank}.tmp"),
                f"--import-mode={config.option.importmode}",
                f"--capture={'tee-sys' if config.option.capture == 'no' else config.option.capture}"]
        # reporting options exist only with the terminal plugin (absent under `-p no:terminal`)
        if getattr(config.option, "tbstyle", None):
            argv.append(f"--tb={config.option.tbstyle}")
        if getattr(config.option, "verbose", None) is not None:
            argv.append(f"--verbosity={config.option.verbose}")
        if config.inipath:
            argv += ["-c", str(config.inipath)]
        if getattr(config.option, "showlocals", False):
            argv.append("-l")
        for name in config.option.plugins or ():
            argv += ["-p", name]
        for w in config.known_args_namespace.pythonwarnings or ():
            argv += ["-W", w]
        if config.pluginmanager.hasplugin("xdist"):
            argv += ["-n", "0"]  # addopts may ask for workers; a rank runs its one item in-process
        for s in options.SETTINGS:  # the plugin's own settings as this session resolved them
            value = options.get(config, s.name)
            if isinstance(value, list):  # "paths": absolute already, one a line as a linelist ini value
                value = "\n".join(value) or None
            if value is not None:
                argv += ["-o", f"{s.name}={str(value).lower() if isinstance(value, bool) else value}"]
        return argv


def _tear_down_to(item: pytest.Item, nextitem: pytest.Item | None, reports: list[pytest.TestReport]) -> None:
    """Tear down, in this process, what earlier items set up here and `nextitem` does not share, as pytest's own
    teardown phase does (``SetupState.teardown_exact``): the module, class and session fixtures an item's plain
    neighbours hold. The ranks ran the item's own fixtures; these are the parent's, and left in place they break
    the next module's first test ("previous item was not torn down properly"). An error there is the item's
    teardown error, as pytest reports it."""
    call = pytest.CallInfo.from_call(lambda: item.session._setupstate.teardown_exact(nextitem), when="teardown",
                                     reraise=(pytest.exit.Exception, KeyboardInterrupt))
    if call.excinfo is None:
        return
    teardown = next(r for r in reports if r.when == "teardown")
    error = pytest.TestReport.from_item_and_call(item, call)
    if teardown.passed:
        teardown.outcome, teardown.longrepr = "failed", error.longrepr
    else:  # the ranks' own teardown failed too: both are said
        teardown.sections.append(("Captured teardown error in the session's process", error.longreprtext))


def _env(spec: RankSpec, output: str, nodeid: str) -> dict[str, str]:
    """A rank's environment. Every variable the rank's pytest or NCCL would add once its process group is up is
    there from the start: a rank joins its group as its test's setup starts, and adding a variable can move the
    environment's array while torch's NCCL heartbeat thread, started with the group, reads it in getenv (SIGSEGV).
    pytest's own per-test variable is one (its writes then replace a value in place), torch's inductor cache folder
    another, NCCL's configuration files' variables the others (``nccl_conf``)."""
    environ = dict(os.environ)
    environ[env.RANK_SPEC] = spec.to_json()
    environ[env.CRASH_OUTPUT] = output  # pytest's capture has fd 2 while a test runs: a crash's stack goes here
    environ.update(RANK=str(spec.rank), WORLD_SIZE=str(spec.world_size), LOCAL_RANK=str(spec.rank),
                   LOCAL_WORLD_SIZE=str(spec.world_size))
    environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # nothing listens beyond loopback
    environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    environ.pop("TORCHELASTIC_RUN_ID", None)
    environ["PYTEST_CURRENT_TEST"] = f"{nodeid} (setup)"  # not the session's test: the rank's, as pytest will say
    inductor = _inductor_cache_dir()  # set by torch as dynamo is first imported
    if inductor is not None:
        environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor)
    return nccl_conf.preset(environ)


@functools.lru_cache(maxsize=None)
def _inductor_cache_dir() -> str | None:
    """The folder torch's inductor puts in TORCHINDUCTOR_CACHE_DIR when it is first imported (torch's own default)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        return os.path.abspath(default_cache_dir())
    except Exception:
        return None
