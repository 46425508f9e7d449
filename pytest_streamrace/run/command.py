"""``streamrace run``: parse, set up the policy and the following of the program's processes, run it, report.

Exit status: the program's own (128 + N where a signal N ended it) when no new race was found; 3 when one was (not
under ``--report-only`` or ``--baseline-update``; with ``--latent=fail``, new latent races too); 2 on bad usage or
bad input (suppressions, baseline); 127 where the program cannot be found, 126 where it cannot be executed; 1 where
this interpreter's site-packages cannot take the start-up hook (no process could be followed).
"""

from __future__ import annotations

import os
import signal
import sys
import time

from .. import env
from . import job, options

USAGE_ERROR = 2


def main(argv: list[str]) -> int:
    mask = job.block_signals()  # before anything starts a thread (torch does)
    try:
        settings = options.parse(argv)
    except options.UsageError as exc:
        sys.stderr.write(f"usage: {options.USAGE}\nstreamrace run: error: {exc}\n")
        return USAGE_ERROR
    backend = settings.backend
    gpus = env.visible_gpus()
    if backend == "auto":
        backend = "cuda" if gpus else "virtual"
    elif backend == "cuda" and not gpus:
        sys.stderr.write("streamrace run: --backend=cuda needs a GPU, and none is visible; use --backend=virtual (or "
                         "auto) on CPU-only machines\n")
        return USAGE_ERROR
    from ..races import policy as policies

    try:
        policy = policies.build(settings.suppress, settings.baseline, settings.baseline_update,
                                settings.report_only, settings.latent, settings.rootdir, flag="--")
    except policies.BadInput as exc:
        sys.stderr.write(f"streamrace run: {exc}\n")
        return USAGE_ERROR
    return _run(settings, backend, policy, mask)


def _run(settings: options.Settings, backend: str, policy, mask: set) -> int:
    from ..children import child
    from ..children.following import Following
    from . import report

    child.stand_down()  # this process may be followed itself (run from a test under --streamrace): it checks nothing
    _build_extensions(backend)
    following = Following(backend, bool(settings.trace), policy.latent != "off", policy.incidental)
    try:
        if following.problem:
            sys.stderr.write(f"streamrace run: cannot follow the program's processes: {following.problem}\n")
            return 1
        name = report.label(settings.program)
        findings = report.Findings(policy, name)
        environ = {**os.environ, env.SUBPROCESS: following.variable(name)}
        early = job.pending_interrupt()
        if early is not None:
            return 128 + early
        started = time.monotonic()
        try:
            pid = job.spawn(settings.program, environ, mask)
        except job.NotFound as exc:
            sys.stderr.write(f"{exc}\n")
            return exc.status
        status, signo = job.watch(pid, lambda: findings.feed(following.read()))
        findings.feed(following.read())
        if settings.confirm and signo is None and findings.races:
            from .confirm import confirm

            confirm(settings.program, backend, environ[env.SUBPROCESS], list(findings.races.values()), status,
                    time.monotonic() - started, mask)
        signal_name = signal.Signals(signo).name if signo is not None else None
        return findings.finish(status, signal_name, settings.json, settings.trace)
    finally:
        following.close()


BUILD = ("from pytest_streamrace.detector import capture; capture.load(); "
         "capture.load_trace() if {cuda} else None")


def _build_extensions(backend: str) -> None:
    """Build (or load) the C++ capture once before the program's processes all want it at once, as the plugin does at
    session start; in a process of its own, so that this one never imports torch (its memory and threads). Its
    warning, where the build fails, is said here once."""
    import subprocess

    environ = {**os.environ, env.SUBPROCESS: "0"}  # not followed, where this command runs under a test of ours
    subprocess.run([sys.executable, "-c", BUILD.format(cuda=backend == "cuda")], env=environ, stdout=sys.stderr,
                   check=False)
