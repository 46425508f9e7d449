"""pytest sessions launched by torchrun: every rank runs the same session in lockstep, outcomes are collective.

``torchrun --nproc_per_node N -m pytest ...`` starts N pytest processes (how Megatron runs its unit tests). Left
alone they disagree: a test failing on rank 1 passes on rank 0, which prints; a skip on some ranks leaves the
others blocked in a collective; a hang blocks every rank for the collective timeout. This module makes the N
sessions behave as one:

Process group
    Initialized once at session start from the torchrun environment (``env://``): nccl with
    ``cuda.set_device(LOCAL_RANK)`` when CUDA has a GPU for every local rank, else gloo. A group the user's code
    initialized earlier (``conftest.py`` ``pytest_configure``/``pytest_sessionstart``) is joined, not replaced.
    Only a group created here is destroyed at session end, and only when no rank went missing.

``distributed`` tests
    Run in-process on every rank (no nested spawning). ``world_size=`` other than the torchrun world size, or a
    ``backend=`` other than the session's, skips the test on every rank with a reason naming both.

Collective outcomes
    After each item (all its phases ran locally) every rank posts a summary of its reports to the torchrun store
    (a ``PrefixStore`` on the default group's store; store ops time out, collectives could hang) under the item's
    running number, and reads every other rank's. Per phase: all ranks agree → the local report stands; any rank
    failed → the phase fails on every rank and the report shows each failing rank's own traceback under
    "rank N"; outcomes differ otherwise (e.g. a skip on some ranks) → the phase fails naming each rank's outcome
    and skip reason. Exit codes therefore agree across ranks. After collection the ranks compare their ordered
    test ids (and collection errors); a difference stops every rank before the first test (a shuffling plugin
    with per-rank seeds, or a file that fails to import on one rank, would otherwise desynchronize them).

Output
    Only rank 0 prints: the terminal reporter of the other ranks writes to a closed gate. Their failures reach
    rank 0 through the exchange. Only rank 0 writes ``--junitxml`` and ``.pytest_cache`` (the others still read
    the cache, so ``--lf`` selects alike everywhere). If rank 0 itself went missing, the lowest rank that noticed
    opens its gate and prints the rest of its session (the failure and the summary). An INTERNALERROR opens the
    gate of its rank.

Hangs and crashes
    An item's timeout T is the ``distributed`` marker's ``timeout=``, else ``--streamrace-timeout`` (ini
    ``streamrace_timeout``), else 300 s; G = 5 s is the grace. Times count from the item's start on each rank.
    - At T, a rank still running the item dumps its Python stacks (faulthandler, all threads) into the store.
    - A rank waiting in the exchange stops waiting when every missing rank posted its stack, or at T + G. The
      item fails with "rank K did not report within T s" and that rank's stack if it posted one, and the session
      stops (``session.shouldstop``): the rank exits non-zero and torchrun stops every other rank.
    - Every rank stuck in the item (e.g. all blocked in one collective): at T + G rank 0 writes the stacks of
      every rank to its terminal and exits with status 1 (the session summary is lost); the other ranks exit at
      T + 2G unless torchrun stopped them first.
    - A rank that crashes makes torchrun stop the others at once (SIGTERM; no handler is installed so that a rank
      blocked in C code dies at once); torchrun's own error summary names the rank and its exit code or signal.

Not combinable with pytest-xdist (``-n``): a clear usage error says so.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

import pytest

from .. import hardware, options
from ..races import record
from . import marker

GRACE = 5.0
_MARKER_ERROR = pytest.StashKey[str]()
_TIMEOUT = pytest.StashKey["float | None"]()


def install(config: pytest.Config) -> None:
    """Make this pytest process one rank of a collective torchrun session."""
    if config.getoption("numprocesses", None) or hasattr(config, "workerinput"):
        raise pytest.UsageError("pytest-xdist (-n) cannot run inside a torchrun session: torchrun already "
                                "starts one pytest per rank; drop -n (or use -p no:xdist)")
    env = hardware.torchrun_env()
    config.pluginmanager.register(TorchrunRank(config, env), "streamrace-torchrun")


def leave_files_to_rank_0(config: pytest.Config) -> None:
    """Every rank runs the same session and outcomes are collective, so rank 0's files say it all — and N ranks
    writing one ``--junitxml`` file (or ``.pytest_cache``) at once would interleave. Called before configuration."""
    if hardware.torchrun_env().rank != 0:
        config.option.xmlpath = None


def _dropped(key: str, value) -> None:
    """Cache.set on ranks other than 0: rank 0 writes the session's cache."""


class Gate:
    """A text stream that drops everything until opened; non-zero ranks' terminal reporters write into one."""

    def __init__(self, stream, is_open: bool):
        self._stream = stream
        self.is_open = is_open

    def open(self) -> None:
        self.is_open = True

    def write(self, text: str) -> int:
        if self.is_open:
            self._stream.write(text)
        return len(text)

    def flush(self) -> None:
        if self.is_open:
            self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    @property
    def encoding(self) -> str:
        return getattr(self._stream, "encoding", "utf-8")


class RankFailures:
    """The longrepr of a phase that failed collectively: each part is a titled traceback (object or text)."""

    def __init__(self, parts: list[tuple[str, object]], crash: str):
        self.parts = parts
        self.reprcrash = SimpleNamespace(message=crash, path="", lineno=0)

    def toterminal(self, tw) -> None:
        for title, body in self.parts:
            tw.sep("-", title)
            if hasattr(body, "toterminal"):
                body.toterminal(tw)
            else:
                tw.line(str(body).rstrip("\n"))

    def __str__(self) -> str:
        from _pytest._io import TerminalWriter  # the public API offers no string rendering of a longrepr
        import io

        out = io.StringIO()
        self.toterminal(TerminalWriter(out))
        return out.getvalue()


def summarize(report: pytest.TestReport) -> dict:
    """What a rank tells the others about one phase: its outcome label, skip/xfail reason, failure text."""
    xfail = hasattr(report, "wasxfail")
    label = report.outcome
    if xfail and not report.failed:
        label = "xpassed" if report.passed else "xfailed"
    reason = report.wasxfail if xfail else ""
    if report.skipped and not xfail and isinstance(report.longrepr, tuple):
        reason = report.longrepr[2]
    crash = ""
    if report.failed:
        crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", "") or report.longreprtext[-200:]
    return {"label": label, "reason": reason, "text": report.longreprtext if report.failed else "", "crash": crash}


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def disagreement(local: pytest.TestReport, rank: int, phases: dict[int, dict | None]) -> RankFailures | None:
    """The collective failure of one phase, given every live rank's summary of it; None when the ranks agree."""
    labels = {r: (p["label"] if p else "not run") for r, p in phases.items()}
    if len(set(labels.values())) == 1 and "failed" not in labels.values():
        return None
    parts: list[tuple[str, object]] = []
    crash = ""
    by_text: dict[str, list[int]] = {}
    for r in sorted(r for r, lab in labels.items() if lab == "failed"):
        text = local.longreprtext if r == rank else phases[r]["text"]
        by_text.setdefault(text, []).append(r)
    for text, ranks in by_text.items():
        parts.append((_ranks(ranks), local.longrepr if rank in ranks else text))
        crash = crash or f"{_ranks(ranks)}: {phases[ranks[0]]['crash']}"
    # Besides failures, ranks that merely passed say nothing; any other outcome (a skip, an xfail) is listed.
    others = {r: lab for r, lab in labels.items() if lab != "failed" and (lab != "passed" or not by_text)}
    if len(set(labels.values())) > 1 and others:
        lines = []
        for lab in sorted(set(others.values())):
            ranks = [r for r in sorted(others) if others[r] == lab]
            reasons = {phases[r]["reason"] for r in ranks if phases[r] and phases[r]["reason"]}
            lines.append(f"{lab} on {_ranks(ranks)}" + (": " + "; ".join(sorted(reasons)) if reasons else ""))
        parts.append(("outcomes differ across ranks", "\n".join(lines)))
        crash = crash or "outcomes differ across ranks: " + "; ".join(lines)
    return RankFailures(parts, crash)


def fail(report: pytest.TestReport, failure: RankFailures) -> None:
    """Turn a local report into the collective failure."""
    if isinstance(report.longrepr, RankFailures) and report.failed:
        report.longrepr.parts.extend(failure.parts)
        return
    report.outcome = "failed"
    report.longrepr = failure
    if hasattr(report, "wasxfail"):
        del report.wasxfail


class TorchrunRank:
    """The pytest plugin of one torchrun rank."""

    def __init__(self, config: pytest.Config, env: hardware.TorchrunEnv):
        self.config = config
        self.rank, self.world_size, self.local_rank = env.rank, env.world_size, env.local_rank
        self.store = None
        self.backend = ""
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
        self.backend = str(dist.get_backend())
        if dist.get_world_size() != self.world_size:
            raise pytest.UsageError(f"torchrun session: the process group has {dist.get_world_size()} ranks, "
                                    f"torchrun started {self.world_size}")
        run = os.environ.get("TORCHELASTIC_RUN_ID", "")
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.store = dist.PrefixStore(f"streamrace/{run}/{attempt}/",
                                      dist.distributed_c10d._get_default_store())

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.store is None or not self.healthy:
            return
        # No rank leaves before every rank got here: torchrun stops the others as soon as one exits non-zero.
        self._post("finish", {})
        _, missing, _ = self._gather("finish", time.monotonic() + self.default_timeout + GRACE)
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
        self._post("collect", mine)
        posts, missing, _ = self._gather("collect", time.monotonic() + self.default_timeout + GRACE)
        if missing:
            self.healthy = False
            raise session.Interrupted(f"{_ranks(missing)} did not finish collecting within "
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
        raise session.Interrupted(f"ranks collected different tests ({_ranks(differ)} {verb} from rank 0)")

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
            elif request.backend not in (None, self.backend):
                item.add_marker(pytest.mark.skip(reason=f"distributed(backend={request.backend!r}) needs "
                                                        f"{request.backend}; this torchrun session uses "
                                                        f"{self.backend}"))

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
        watchdog = Watchdog(self, key, item.nodeid, start, timeout)
        watchdog.start()
        try:
            reports = runtestprotocol(item, log=False, nextitem=nextitem)
        finally:
            watchdog.finished.set()
        self._post(key, {"nodeid": item.nodeid, "phases": {r.when: summarize(r) for r in reports},
                         "races": record.races_in(reports)})
        posts, missing, stacks = self._gather(key, start + timeout + GRACE, stack_prefix=f"{key}/stack")
        # every rank's races (judged by that rank) on this rank's teardown report: rank 0 counts and writes them
        record.add_races(reports, [race for r in sorted(posts) if r != self.rank and posts[r]["nodeid"] == item.nodeid
                                   for race in posts[r].get("races", ())])
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

    # -- the store --------------------------------------------------------------------------------------------

    def _post(self, key: str, payload: dict) -> None:
        self.store.set(f"{key}/{self.rank}", json.dumps(payload))

    def _gather(self, key: str, deadline: float, stack_prefix: str | None = None):
        """Every rank's post under key: (posts by rank, missing ranks, stacks the missing ranks posted).

        Polls with ``check`` rather than blocking in ``wait``: a timed-out wait logs a C++ warning, and a missing
        rank that posted its stack ends the wait early.
        """
        pending = [r for r in range(self.world_size)]
        posts: dict[int, dict] = {}
        stacks: dict[int, str] = {}
        delay, detailed_at = 0.0002, time.monotonic() + 0.5
        while True:
            now = time.monotonic()
            keys = [f"{key}/{r}" for r in pending]
            try:
                if self.store.check(keys):
                    for r, raw in zip(pending, self.store.multi_get(keys)):
                        posts[r] = json.loads(raw)
                    return posts, [], {}
                if now < deadline and now < detailed_at:
                    time.sleep(delay)
                    delay = min(delay * 2, 0.02)
                    continue
                detailed_at = now + 0.5
                for r in list(pending):
                    if self.store.check([f"{key}/{r}"]):
                        posts[r] = json.loads(self.store.get(f"{key}/{r}"))
                        pending.remove(r)
                    elif stack_prefix and r not in stacks and self.store.check([f"{stack_prefix}/{r}"]):
                        stacks[r] = self.store.get(f"{stack_prefix}/{r}").decode()
            except Exception as exc:  # the store itself is gone: every rank still pending is lost
                stacks.update({r: f"(the torchrun store failed: {exc})" for r in pending})
                return posts, pending, stacks
            if not pending:
                return posts, [], {}
            if now >= deadline or (stack_prefix and all(r in stacks for r in pending)):
                return posts, pending, stacks


def stack_dump() -> str:
    """Every other thread's Python stack, as faulthandler prints it (it needs a real file)."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        blocks = f.read().split("\n\n")
    return "\n\n".join(b for b in blocks if not b.startswith("Current thread")).strip("\n") + "\n"


class Watchdog(threading.Thread):
    """Posts this rank's stacks when its item outlives the timeout; ends the process when it stays stuck."""

    def __init__(self, rank: TorchrunRank, key: str, nodeid: str, start: float, timeout: float):
        super().__init__(name=f"streamrace-watchdog-{key}", daemon=True)
        self.plugin, self.key, self.nodeid, self.start_time, self.timeout = rank, key, nodeid, start, timeout
        self.finished = threading.Event()

    def _wait_until(self, moment: float) -> bool:
        return self.finished.wait(max(0.0, moment - time.monotonic()))

    def run(self) -> None:
        p = self.plugin
        if self._wait_until(self.start_time + self.timeout):
            return
        mine = stack_dump()
        try:
            p.store.set(f"{self.key}/stack/{p.rank}", mine)
        except Exception:
            pass
        if self._wait_until(self.start_time + self.timeout + GRACE * (1 if p.rank == 0 else 2)):
            return
        if p.rank == 0:
            lines = [f"\n{'!' * 20} streamrace: {self.nodeid} still running on rank 0 after {self.timeout:g} s "
                     f"(timeout); stopping the torchrun session {'!' * 20}", "---- rank 0 ----", mine]
            for r in range(1, p.world_size):
                try:
                    stack = p.store.get(f"{self.key}/stack/{r}").decode() \
                        if p.store.check([f"{self.key}/stack/{r}"]) else "(finished the test, or posted no stack)"
                except Exception as exc:
                    stack = f"(the torchrun store failed: {exc})"
                lines += [f"---- rank {r} ----", stack]
            os.write(p.terminal_fd, "\n".join(lines).encode() + b"\n")
        os._exit(1)
