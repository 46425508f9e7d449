"""The pytest plugin of one torchrun rank: the process group, collection in lockstep, each item's collective outcome.

The whole design is in the package's docstring (``launcher.torchrun``).
"""

from __future__ import annotations

import os
import sys
import time

import pytest

from ... import env, options
from .. import marker
from .exchange import Exchange
from .verdict import RankFailures, disagreement, fail, ranks_text, summarize
from .watch import GRACE, Gate, Watchdog

SHARED = "streamrace_"  # user_properties keys every rank's teardown report shares with the other ranks
_MARKER_ERROR = pytest.StashKey[str]()
_TIMEOUT = pytest.StashKey["float | None"]()


def install(config: pytest.Config) -> None:
    """Make this pytest process one rank of a collective torchrun session."""
    if config.getoption("numprocesses", None) or hasattr(config, "workerinput"):
        raise pytest.UsageError("pytest-xdist (-n) cannot run inside a torchrun session: torchrun already "
                                "starts one pytest per rank; drop -n (or use -p no:xdist)")
    run = env.torchrun_env()
    config.pluginmanager.register(TorchrunRank(config, run), "streamrace-torchrun")


def leave_files_to_rank_0(config: pytest.Config) -> None:
    """Every rank runs the same session and outcomes are collective, so rank 0's files say it all — and N ranks
    writing one ``--junitxml`` file (or ``.pytest_cache``) at once would interleave. Called before configuration."""
    if env.torchrun_env().rank != 0:
        config.option.xmlpath = None


def _dropped(key: str, value) -> None:
    """Cache.set on ranks other than 0: rank 0 writes the session's cache."""


class TorchrunRank:
    """The pytest plugin of one torchrun rank."""

    def __init__(self, config: pytest.Config, run: env.TorchrunEnv):
        self.config = config
        self.rank, self.world_size, self.local_rank = run.rank, run.world_size, run.local_rank
        self.exchange: Exchange | None = None
        self.pg_backend = ""  # the process group's
        self.created_group = False
        self.healthy = True
        self.counter = 0
        self.collect_errors: list[str] = []
        self.default_timeout = options.DEFAULT_TIMEOUT
        # The real stdout, kept while capture is suspended: the watchdog writes here while fd 1 is captured.
        self.terminal_fd = os.dup(sys.stdout.fileno()) if self.rank == 0 else None
        self.gate = Gate(sys.stdout, self.rank == 0)
        if self.rank != 0:
            if getattr(config, "cache", None) is not None:
                config.cache.set = _dropped  # reading stays (--lf must select alike on every rank)
            pm = config.pluginmanager
            old = pm.get_plugin("terminalreporter")
            if old is not None:
                pm.unregister(old, "terminalreporter")
                pm.register(pytest.TerminalReporter(config, self.gate), "terminalreporter")

    # -- process group ----------------------------------------------------------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.default_timeout = options.get(self.config, "streamrace_timeout")
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            gpus = torch.cuda.is_available() and torch.cuda.device_count() > self.local_rank
            if gpus:
                torch.cuda.set_device(self.local_rank)
            try:
                dist.init_process_group("nccl" if gpus else "gloo", init_method="env://")
            except Exception as exc:
                raise pytest.UsageError(f"torchrun session: cannot initialize the process group: {exc}") from None
            self.created_group = True
        self.pg_backend = str(dist.get_backend())
        if dist.get_world_size() != self.world_size:
            raise pytest.UsageError(f"torchrun session: the process group has {dist.get_world_size()} ranks, "
                                    f"torchrun started {self.world_size}")
        run = os.environ.get("TORCHELASTIC_RUN_ID", "")
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"streamrace/{run}/{attempt}/", dist.distributed_c10d._get_default_store())
        self.exchange = Exchange(store, self.rank, self.world_size)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.exchange is None or not self.healthy:
            return
        # No rank leaves before every rank got here: torchrun stops the others as soon as one exits non-zero.
        self.exchange.post("finish", {})
        _, missing, _ = self.exchange.gather("finish", time.monotonic() + self.default_timeout + GRACE)
        if self.created_group and not missing:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

    @pytest.hookimpl(tryfirst=True)
    def pytest_internalerror(self) -> None:
        self.gate.open()

    # -- collection -------------------------------------------------------------------------------------------

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self.collect_errors.append(f"{report.nodeid or '.'}: {report.longreprtext}")

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        mine = {"ids": [item.nodeid for item in session.items], "errors": self.collect_errors}
        self.exchange.post("collect", mine)
        posts, missing, _ = self.exchange.gather("collect", time.monotonic() + self.default_timeout + GRACE)
        if missing:
            self.healthy = False
            raise session.Interrupted(f"{ranks_text(missing)} did not finish collecting within "
                                      f"{self.default_timeout:g} s")
        differ = [r for r in sorted(posts) if posts[r] != posts[0]]
        if not differ:
            return
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        for r in differ:
            tr.write_sep("=", f"rank {r} collected differently from rank 0")
            ids0, ids = posts[0]["ids"], posts[r]["ids"]
            extra, lacking = sorted(set(ids) - set(ids0)), sorted(set(ids0) - set(ids))
            for nodeid in extra:
                tr.write_line(f"only on rank {r}: {nodeid}")
            for nodeid in lacking:
                tr.write_line(f"not on rank {r}: {nodeid}")
            if not extra and not lacking and ids != ids0:
                tr.write_line("same tests in another order (a shuffling plugin needs one seed on every rank)")
            for error in posts[r]["errors"]:
                tr.write_line(error)
        verb = "differs" if len(differ) == 1 else "differ"
        raise session.Interrupted(f"ranks collected different tests ({ranks_text(differ)} {verb} from rank 0)")

    # -- running a test ---------------------------------------------------------------------------------------

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        """Skip, at the test's own location, distributed tests this session cannot serve."""
        for item in items:
            mark = item.get_closest_marker("distributed")
            if mark is None:
                continue
            try:
                request = marker.parse(mark)
            except marker.MarkerError as exc:
                item.stash[_MARKER_ERROR] = str(exc)
                continue
            item.stash[_TIMEOUT] = request.timeout
            if request.world_size != self.world_size:
                item.add_marker(pytest.mark.skip(reason=f"distributed(world_size={request.world_size}) needs "
                                                        f"{request.world_size} ranks; this torchrun session has "
                                                        f"{self.world_size}"))
            elif request.pg_backend not in (None, self.pg_backend):
                item.add_marker(pytest.mark.skip(reason=f"distributed(backend={request.pg_backend!r}) needs "
                                                        f"{request.pg_backend}; this torchrun session uses "
                                                        f"{self.pg_backend}"))

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        """Bad marker arguments fail the test with one line (on every rank alike)."""
        if _MARKER_ERROR in item.stash:
            pytest.fail(item.stash[_MARKER_ERROR], pytrace=False)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool:
        from _pytest.runner import runtestprotocol  # the phases without logging, as pytest-rerunfailures does

        ihook = item.ihook
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        key = f"item/{self.counter}"
        self.counter += 1
        timeout = item.stash.get(_TIMEOUT, None) or self.default_timeout
        start = time.monotonic()
        watchdog = Watchdog(self.exchange, self.terminal_fd, key, item.nodeid, start, timeout)
        watchdog.start()
        try:
            reports = runtestprotocol(item, log=False, nextitem=nextitem)
        finally:
            watchdog.finished.set()
        self.exchange.post(key, {"nodeid": item.nodeid, "phases": {r.when: summarize(r) for r in reports},
                                 "shared": shared_properties(reports)})
        posts, missing, stacks = self.exchange.gather(key, start + timeout + GRACE, stack_prefix=f"{key}/stack")
        # every rank's shared records (its races, judged by that rank) on this rank's teardown report, after its own:
        # the plugins that wrote them read them there as their own (rank 0 counts the races and writes the files)
        add_properties(reports, [prop for r in sorted(posts) if r != self.rank and posts[r]["nodeid"] == item.nodeid
                                 for prop in posts[r].get("shared", ())])
        for report in self._collective(item, reports, posts, missing, stacks, timeout):
            ihook.pytest_runtest_logreport(report=report)
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def _collective(self, item, reports, posts, missing, stacks, timeout) -> list[pytest.TestReport]:
        strays = [r for r in sorted(posts) if posts[r]["nodeid"] != item.nodeid]
        out: list[pytest.TestReport] = []
        for report in reports:
            if report.when == "call" and not out[0].passed:
                continue  # the setup failed or was skipped collectively: no call phase
            phases = {r: posts[r]["phases"].get(report.when) for r in posts if r not in strays}
            failure = disagreement(report, self.rank, phases)
            if failure is not None:
                fail(report, failure)
            out.append(report)
        lost = [(k, f"did not report within {timeout:g} s",
                 f"its stacks at the timeout:\n{stacks[k]}" if k in stacks else
                 "it posted no stack (it crashed, or blocked while holding the GIL)") for k in missing]
        lost += [(k, "is out of step", f"it ran {posts[k]['nodeid']} as test #{self.counter - 1}") for k in strays]
        if lost:
            target = next((r for r in out if r.when == "call"), out[0])
            headline = f"rank {lost[0][0]} {lost[0][1]}"
            parts = [(f"rank {k}", f"rank {k} {head}; {detail}") for k, head, detail in lost]
            fail(target, RankFailures(parts, headline))
            self.healthy = False
            item.session.shouldstop = headline
            if 0 in missing and self.rank == min(posts):
                self.gate.open()
        return out


def shared_properties(reports) -> list[list]:
    """The user_properties of a test's teardown report (which holds every phase's) this rank shares: [key, value]."""
    return [[k, v] for r in reports if r.when == "teardown" for k, v in r.user_properties
            if str(k).startswith(SHARED)]


def add_properties(reports, props: list[list]) -> None:
    """Append other ranks' shared user_properties to the test's teardown report."""
    for r in reports:
        if r.when == "teardown":
            r.user_properties.extend((k, v) for k, v in props)
