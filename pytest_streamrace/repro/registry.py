"""Finds repros: modules of ``pytest_streamrace.repros`` and third-party ones registered under the
``pytest_streamrace.repros`` entry-point group. Each provides an object ``REPRO`` with a ``name``."""

from __future__ import annotations

import importlib
import pkgutil
from importlib import metadata

ENTRY_POINT_GROUP = "pytest_streamrace.repros"


class ReproError(Exception):
    """A problem the user can fix (unknown name, missing framework, bad option): printed as one line, exit 2."""


def _shipped():
    import pytest_streamrace.repros as package

    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        repro = getattr(module, "REPRO", None)
        if repro is not None:
            yield repro


def _registered():
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        obj = ep.load()
        yield getattr(obj, "REPRO", obj)


def discover() -> dict:
    """All repros by name; shipped ones first, a third-party repro may not shadow one."""
    found: dict = {}
    for repro in (*_shipped(), *_registered()):
        found.setdefault(repro.name, repro)
    return found


def get(name: str):
    repros = discover()
    if name not in repros:
        available = ", ".join(sorted(repros)) or "none installed"
        raise ReproError(f"unknown repro {name!r}; available: {available}")
    return repros[name]
