"""Repro harness: ``python -m pytest_streamrace.repro`` runs upstream stream-race repros and prints a verdict."""
