"""Repro modules shipped with pytest-streamrace (installed as ``pytest_streamrace.repros``).

Each module defines ``REPRO``; ``python -m pytest_streamrace.repro list`` shows them.
"""
