"""The ``buffer_lifetimes`` fixture, as a pytest plugin (registered by ``pytest_streamrace.plugin``).

The test's call fails — not its teardown — when a tracked buffer outlived its phase, so the report reads as the
test's own failure; the peak-memory table rides along as a report section (shown with ``-rA``). Import-light: the
checker, and torch with it, load when a test first asks for the fixture.
"""

from __future__ import annotations

import pytest

_checker_key = pytest.StashKey()


@pytest.fixture
def buffer_lifetimes(request: pytest.FixtureRequest):
    """A LifetimeChecker for this test: ``track(tensor, name, by=PHASE)``, ``phase(PHASE)``,
    ``at_call(obj, "method", phase=PHASE)``. Peaks are measured on the test's device (``streamrace_device``)."""
    from .checker import LifetimeChecker

    device = request.getfixturevalue("streamrace_device")
    checker = LifetimeChecker(device)
    request.node.stash[_checker_key] = checker
    try:
        yield checker
    finally:
        checker.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    report = yield
    checker = item.stash.get(_checker_key, None)
    if checker is None or report.when != "call" or report.skipped:
        return report
    checker.close()  # wrapped calls are restored before anything else runs; the fixture's teardown is then a no-op
    problems = checker.problems()
    report.sections.append(("buffer lifetimes", checker.peak_report()))
    if problems and report.passed:
        report.outcome = "failed"
        report.longrepr = problems
    elif problems:
        report.sections.append(("buffer lifetimes: outlived buffers", problems))
    return report
