"""The forcing fixtures, marker and options, as a pytest plugin (registered by ``pytest_streamrace.plugin``).

Import-light like the entry point: torch and the forcing modules load when a fixture is first used.
"""

from __future__ import annotations

import pytest

from .. import checks, env, options
from ..races.record import COMPILE, SCHEDULE  # user_properties keys (SCHEDULE is also the parameter's name)
from . import COMPILE_BACKENDS, COMPILE_MODES

COMPILE_MARKER = ("streamrace_compile(modes=('eager', 'compile', 'compiled_autograd'), backend='aot_eager'): the "
                  "compile modes (and torch.compile backend) the compile_mode fixture runs a test under")

_delays_key = pytest.StashKey()
_call_passed_key = pytest.StashKey[bool]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", COMPILE_MARKER)
    if options.get(config, "streamrace_nondefault_stream"):
        if not (options.get(config, "streamrace") or env.visible_gpus()):
            raise pytest.UsageError("--streamrace-nondefault-stream needs CUDA streams: run on a GPU, or add "
                                    "--streamrace to use virtual streams on CPU")
        from .nondefault import NondefaultStream

        config.pluginmanager.register(NondefaultStream(), "streamrace-nondefault-stream")
    config.pluginmanager.register(ScheduleSummary(), "streamrace-schedule-summary")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    schedules = options.get(metafunc.config, "streamrace_schedules")
    if schedules and "injected_delays" in metafunc.fixturenames:
        metafunc.parametrize(SCHEDULE, range(schedules), ids=[f"schedule{k}" for k in range(schedules)],
                             indirect=True)
    if "compile_mode" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("streamrace_compile")
        try:
            modes, backend = compile_marker(marker)
        except checks.BadInput:
            return  # one error for the test, at its setup (``plugin.marker_problem``), not the module's collection
        metafunc.parametrize("compile_mode", [(m, backend) for m in modes], ids=list(modes), indirect=True)


def compile_marker(mark) -> tuple[tuple, str]:
    """The modes and torch.compile backend a ``streamrace_compile`` marker (or None) asks for; ``checks.BadInput``
    for bad arguments."""
    if mark is None:
        return COMPILE_MODES, "aot_eager"
    what = "@pytest.mark.streamrace_compile"
    if mark.args:
        raise checks.BadInput(f"{what} takes keyword arguments only (modes=, backend=), got {mark.args[0]!r}")
    unknown = sorted(set(mark.kwargs) - {"modes", "backend"})
    if unknown:
        raise checks.BadInput(f"{what}: unknown argument {unknown[0]!r} (expected modes, backend)")
    modes = mark.kwargs.get("modes", COMPILE_MODES)
    if isinstance(modes, str) or not isinstance(modes, (tuple, list)) or not modes or \
            any(m not in COMPILE_MODES for m in modes):
        raise checks.BadInput(f"{what}: modes must be a tuple of some of {', '.join(COMPILE_MODES)}, got {modes!r}")
    backend = mark.kwargs.get("backend", "aot_eager")
    if backend not in COMPILE_BACKENDS:
        raise checks.BadInput(f"{what}: backend must be one of {', '.join(COMPILE_BACKENDS)}, got {backend!r}")
    return tuple(modes), backend


def _fail_without_streams(what: str) -> None:
    from . import streams

    try:
        streams.require_streams(what)
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture
def stream_bound_accumulators():
    """A binder: ``stream_bound_accumulators(module_or_params, streams=2, policy="round_robin")`` creates each
    parameter's AccumulateGrad node on a side stream (call it before the framework registers its gradient hooks)
    and returns the Binding (parameter name -> stream label). The nodes stay alive until the test ends."""
    _fail_without_streams("stream_bound_accumulators")
    from .accumulators import bind_accumulators

    bindings = []

    def bind(target, streams=2, policy="round_robin"):
        binding = bind_accumulators(target, streams, policy)
        bindings.append(binding)
        return binding

    yield bind
    for binding in bindings:
        binding.release()


@pytest.fixture
def streamrace_schedule(request: pytest.FixtureRequest) -> int:
    """The number of the delay schedule this test runs under (0 without --streamrace-schedules)."""
    return getattr(request, "param", 0)


@pytest.fixture
def injected_delays(request: pytest.FixtureRequest, streamrace_schedule: int):
    """A Delays object under this test's schedule: ``.before_accumulate(binding)``, ``.before_collectives()``,
    ``.around(obj, "name", before=True, after=False)``; ``.log`` lists what was injected. Patches end with the test."""
    _fail_without_streams("injected_delays")
    from .delays import Delays

    delays = Delays(streamrace_schedule)
    request.node.stash[_delays_key] = delays
    yield delays
    delays.restore()


@pytest.fixture
def compile_mode(request: pytest.FixtureRequest):
    """A CompileMode ("eager", "compile", "compiled_autograd"; parametrized, see the streamrace_compile marker):
    ``model = compile_mode.compile(model)``; ``with compile_mode.backward(): loss.backward()``. The test fails
    if the mode compiled nothing."""
    from .compile_modes import CompileMode

    name, backend = getattr(request, "param", ("eager", "aot_eager"))
    mode = CompileMode(name, backend)
    yield mode
    request.node.user_properties.append((COMPILE, mode.summary()))
    request.node.add_report_section("teardown", "streamrace compile mode", mode.summary())
    mode.close()
    if request.node.stash.get(_call_passed_key, False):
        try:
            mode.check()
        except AssertionError as exc:
            pytest.fail(str(exc), pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    report = yield
    if report.when == "call":
        item.stash[_call_passed_key] = report.passed
    delays = item.stash.get(_delays_key, None)
    if delays is not None and report.when in ("call", "teardown"):
        if report.when == "call":
            report.user_properties.append((SCHEDULE, delays._resolve().name))
        if report.failed:
            report.sections.append(("injected delays", delays.summary()))
    return report


class ScheduleSummary:
    """Collects outcomes per schedule (reports travel from xdist workers and rank processes) and lists, per test,
    the schedules it failed under."""

    def __init__(self):
        self.outcomes: dict[str, list[tuple[str, str, bool]]] = {}  # test -> [(id, schedule name, failed)]

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        name = next((v for k, v in report.user_properties if k == SCHEDULE), None)
        if name is None or report.when != "call":
            return
        test, _, param = report.nodeid.partition("[")
        params = param.rstrip("]").split("-") if param else []
        ident = next((p for p in params if p.startswith("schedule")), "schedule0")
        others = [p for p in params if not p.startswith("schedule")]
        test += f"[{'-'.join(others)}]" if others else ""
        self.outcomes.setdefault(test, []).append((ident, name, report.failed))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        failing = {t: runs for t, runs in self.outcomes.items() if any(f for _, _, f in runs)}
        if not failing or not options.get(terminalreporter.config, "streamrace_schedules"):
            return
        terminalreporter.section("streamrace delay schedules")
        for test, runs in failing.items():
            bad = [f"{ident} ({name})" for ident, name, failed in runs if failed]
            terminalreporter.write_line(f"{test}: failed under {len(bad)} of {len(runs)} schedules: "
                                        + "; ".join(bad))
