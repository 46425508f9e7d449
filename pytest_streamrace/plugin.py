"""The pytest entry point (``pytest11``): options, markers, the header line, and which parts to switch on.

Kept import-light on purpose — pytest loads it in every session, and nothing here imports torch. The work lives
in ``launcher`` (running a test in N rank processes, torchrun sessions), ``detector`` with ``races`` (stream race
detection and its pytest side), ``forcing`` (fixtures that make races happen) and ``lifetime`` (buffers that outlive
their phase); ``roles`` says which process this is. This module only wires them to pytest.
"""

from __future__ import annotations

import os
import sys

import pytest

from . import checks, env, options, roles
from .forcing import fixtures as forcing
from .launcher import marker, nccl_conf
from .races import plugin as races

MARKERS = (
    "distributed(world_size=N, backend=None, timeout=None): run the test as one item in N rank processes with "
    "torch.distributed initialized (backend auto: nccl with >= N GPUs, else gloo)",
    races.MARKER,
)
# Each marker of ours (registered here or by a part) and the check of its arguments: raises checks.BadInput.
MARKER_CHECKS = {"distributed": marker.parse, "streamrace": races.check_marker,
                 "streamrace_compile": forcing.compile_marker}
_backend_key = pytest.StashKey[str]()


def pytest_addoption(parser: pytest.Parser) -> None:
    options.register(parser)


def pytest_cmdline_main(config: pytest.Config) -> int | None:
    role = roles.of(config)
    if role.kind == roles.TORCHRUN_RANK:
        from .launcher import torchrun

        torchrun.leave_files_to_rank_0(config)  # before junitxml configures itself
    return check_input(config, role)


def check_input(config: pytest.Config, role: roles.Role) -> int | None:
    """Everything the user gave, before anything runs: every setting, every ``STREAMRACE_*`` variable, and under
    --streamrace the files it reads (suppressions, baseline) and writes (JSON, trace: folders created). Bad input is
    one line on stderr (in a torchrun session, rank 0's) and exit status 4, pytest's usage error."""
    if getattr(config.option, "help", False) or getattr(config.option, "version", False):
        return None
    from .races import policy

    try:
        checks.environment()
        streamrace = options.value(config, options.setting("streamrace"))
        # every torchrun rank checks the files rank 0 writes: all stop alike, none waits for a rank that stopped
        writes = role.writes_session_files or role.kind == roles.TORCHRUN_RANK
        options.check(config, files=bool(streamrace) and writes)
        if streamrace:
            policy.load(config)
    except checks.BadInput as exc:
        if role.speaks_for_torchrun:
            sys.stderr.write(f"ERROR: streamrace: {exc}\n")
            sys.stderr.flush()
        return pytest.ExitCode.USAGE_ERROR
    return None


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    from . import launcher
    from .lifetime import fixtures as lifetime

    config.pluginmanager.register(forcing, "streamrace-forcing")
    config.pluginmanager.register(lifetime, "streamrace-lifetime")
    launcher.install(config, marker_problem)
    if options.get(config, "streamrace"):
        from .children import child
        from .children.parent import Children

        child.stand_down()  # started by a test under --streamrace: this session checks for itself
        os.environ.update(nccl_conf.variables(os.environ))  # before the session starts a thread (nccl_conf.py)
        backend = config.stash[_backend_key] = races.resolve_backend(config)
        children = Children(backend, bool(options.get(config, "streamrace_trace")))  # the processes tests start
        config.pluginmanager.register(races.RaceChecks(config, backend, children), "streamrace-checks")
        from .races import hints

        config.pluginmanager.register(hints.StreamHints(config), "streamrace-hints")


def marker_problem(item: pytest.Item) -> str | None:
    """The one line saying what is wrong with the item's markers of ours, or None."""
    for name, check in MARKER_CHECKS.items():
        mark = item.get_closest_marker(name)
        if mark is not None:
            try:
                check(mark)
            except checks.BadInput as exc:
                return str(exc)
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A marker misuse is one error for its test, before any fixture or check runs (a ``distributed`` item's
    parent reports it before starting a rank)."""
    problem = marker_problem(item)
    if problem is not None:
        pytest.fail(problem, pytrace=False)


def pytest_report_header(config: pytest.Config) -> list[str]:
    gpus = env.visible_gpus()
    machine = f"cuda with {len(gpus)} GPU{'s' if len(gpus) != 1 else ''}" if gpus else "CPU-only"
    role = roles.of(config)
    session = (f"torchrun session, rank {role.rank} of {role.world_size}" if role.kind == roles.TORCHRUN_RANK
               else "not under torchrun")
    backend = config.stash.get(_backend_key, None)
    state = f"on ({backend} backend)" if backend else "off (--streamrace to enable)"
    return [f"streamrace: {machine}; {session}; race checks {state}"]


@pytest.fixture
def streamrace_device():
    """The torch.device a test should allocate on: cpu under the virtual backend, cuda under the cuda backend (or
    without --streamrace: cuda when a GPU is visible, else cpu)."""
    from .detector.session import streamrace_device

    return streamrace_device()


@pytest.fixture
def rank() -> int:
    """This process's rank in a ``distributed`` test (or a torchrun session)."""
    return _process_group().get_rank()


@pytest.fixture
def world_size() -> int:
    """The number of ranks of a ``distributed`` test (or a torchrun session)."""
    return _process_group().get_world_size()


def _process_group():
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        pytest.fail("the rank/world_size fixtures need a test marked @pytest.mark.distributed(world_size=N) "
                    "or a torchrun session", pytrace=False)
    return dist
