"""Running a test as N rank processes, and pytest sessions launched by torchrun."""

from __future__ import annotations


def install(config) -> None:
    """Register the launcher behaviour this process needs (parent, spawned rank, or torchrun rank)."""
