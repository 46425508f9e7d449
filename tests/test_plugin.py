import subprocess
import sys

import pytest


def test_plugin_loads_without_importing_torch():
    code = ("import sys, pytest_streamrace.plugin, pytest_streamrace.options, pytest_streamrace.launcher;"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_header_reports_machine_and_session(pytester):
    pytester.makepyfile("def test_ok(): pass")
    result = pytester.runpytest_subprocess()
    result.stdout.fnmatch_lines(["streamrace: * not under torchrun; race checks off*"])
    result.assert_outcomes(passed=1)


@pytest.mark.cold_start
def test_a_plain_session_never_imports_torch(pytester):
    """Every part the plugin registers at configure time stays torch-free until a test needs torch."""
    pytester.makeconftest("""
        import sys
        def pytest_sessionfinish(session):
            print("torch imported:", "torch" in sys.modules)
    """)
    pytester.makepyfile("def test_ok(): pass")
    result = pytester.runpytest_subprocess("-s")
    result.stdout.fnmatch_lines(["*torch imported: False*"])
