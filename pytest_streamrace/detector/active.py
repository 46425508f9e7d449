"""The one Detector active in this process, and its stream models by type.

Kept apart from ``session`` (which builds the models) so that code running inside torch — a virtual stream's
methods, a compiled graph's run-time shim that outlives sessions — finds the active session without importing the
module that imports it. Imports nothing.
"""

from __future__ import annotations

import threading

_session = None  # the active Detector
models: dict = {}  # stream model class -> the active session's instance (`model`; read directly where a frame counts)
_lock = threading.Lock()


def session():
    """The Detector active in this process, if any."""
    return _session


def enter(detector) -> None:
    """Make `detector` the active one; only one may be active at a time."""
    global _session
    with _lock:
        if _session is not None:
            raise RuntimeError("streamrace: another Detector is already active in this process; "
                               "exit it before entering a new one")
        _session = detector


def leave(detector) -> None:
    """`detector` is no longer active: its models go with it."""
    global _session
    with _lock:
        if _session is detector:
            _session = None
            models.clear()


def register(model) -> None:
    """A stream model of the active session, found again by its class (`model`)."""
    models[type(model)] = model


def model(kind):
    """The active session's stream model of class `kind`, or None."""
    return models.get(kind)
