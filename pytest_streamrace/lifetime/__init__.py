"""Buffer lifetimes: fail a test when a buffer it registered is still alive at the phase that should have freed it.

Not every synchronization bug corrupts values: some keep memory alive too long (DeepCompile ZeRO-1 held its gradient
targets through the optimizer step, one gradient partition of peak memory per step). A bigger peak says that
something leaked; this checker says *which* buffer, how big it is and where it was allocated.

Import-light (the fixture plugin imports this package when pytest starts): torch loads with the checker.
"""

from __future__ import annotations

__all__ = ["LifetimeChecker", "LifetimeError"]


def __getattr__(name: str):
    if name in __all__:
        from . import checker

        return getattr(checker, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
