"""The tests' own fixtures: pytester's subprocess sessions forked warm (see warm_pytest.py)."""

import signal

import pytest
import warm_pytest


@pytest.fixture(autouse=True)
def _warm_sessions(request):
    if warm_pytest.COLD or "pytester" not in request.fixturenames or request.node.get_closest_marker("cold_start"):
        return
    pytester = request.getfixturevalue("pytester")
    pytester.popen = warm_pytest.popen_for(pytester)


def pytest_configure(config):
    # Tests of Ctrl-C send SIGINT to the processes they start, as a terminal does. A shell starts a background job
    # (`cmd &`, nohup) with SIGINT ignored, every process below inherits that, and Python then installs no
    # KeyboardInterrupt handler: those tests would fail only there. The processes the suite starts get the default.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config.addinivalue_line("markers", "cold_start: run pytester's sessions as fresh interpreters (what a fresh "
                                       "interpreter imports is the test's subject)")
    config.addinivalue_line("markers", "gpu(count=1): needs COUNT CUDA GPUs (tests/gpu skips it without them); "
                                       "`pytest -m gpu tests/gpu` runs them on a GPU host")
    config.addinivalue_line("markers", "validates(N, ...): re-creates row(s) N of docs/validation.md; tests/gpu "
                                       "records it in the results file scripts/render_validation.py renders")
