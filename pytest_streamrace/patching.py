"""One way to patch: every change the package makes to other code is a patch that can be undone.

A patch is an object with install() and uninstall() (`Patch`); a session keeps the ones it installed in a list and
undoes them in reverse order. `AttrPatch` replaces one attribute, `WrapPatch` wraps one as it is at install,
`patched` does an AttrPatch's work for a ``with`` block, `WhenImported` runs a callback once a module is imported, and
`skip_in_dynamo` lists the entry points torch.compile must never trace. Imports nothing from the package, nor torch: a child's start-up hook uses it before torch loads.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Protocol


class Patch(Protocol):
    """Something installed into other code and taken out again, leaving it exactly as before."""

    def install(self) -> None: ...

    def uninstall(self) -> None: ...


class AttrPatch:
    """setattr(obj, name, value) while installed; the original attribute (or its absence) comes back after."""

    _MISSING = object()

    def __init__(self, obj, name: str, value):
        self.obj, self.name, self.value = obj, name, value
        self._original = self._MISSING

    def install(self) -> None:
        self._original = vars(self.obj).get(self.name, self._MISSING)
        setattr(self.obj, self.name, self.value)

    def uninstall(self) -> None:
        if self._original is self._MISSING:
            delattr(self.obj, self.name)
        else:
            setattr(self.obj, self.name, self._original)


class WrapPatch(AttrPatch):
    """``obj.name`` replaced by ``wrap(obj.name)`` as it is at install: it composes with a patch installed before it
    on the same attribute (another model's wrapper of ``Thread._bootstrap_inner``), whoever built theirs first. A
    patch installed again over the same attribute reuses its wrapper (sessions reuse their patches: ``session``)."""

    def __init__(self, obj, name: str, wrap):
        super().__init__(obj, name, None)
        self.wrap = wrap
        self._wrapped = self._MISSING  # what `value` wraps

    def install(self) -> None:
        current = getattr(self.obj, self.name)
        if current is not self._wrapped:
            self.value, self._wrapped = self.wrap(current), current
        super().install()


class CallPatch:
    """A patch that is a pair of calls: `on()` installs, `off()` uninstalls (a mode entered, a C++ hook swapped in)."""

    def __init__(self, on, off):
        self.on, self.off = on, off

    def install(self) -> None:
        self.on()

    def uninstall(self) -> None:
        self.off()


@contextlib.contextmanager
def patched(obj, name: str, value):
    """``obj.name`` is `value` inside the block; the original attribute (or its absence) comes back after."""
    patch = AttrPatch(obj, name, value)
    patch.install()
    try:
        yield value
    finally:
        patch.uninstall()


_dynamo_skips: list = []  # functions whose frames dynamo must never trace


def skip_in_dynamo(*functions) -> None:
    """Entry points called from inside torch (a dispatch handler, autograd hooks, weakref callbacks) that run inside
    compiled regions too: dynamo must skip their frames. Each stream model registers its own; the compiled-code
    model hands them to dynamo once it is imported (`dynamo_skipped`)."""
    for fn in functions:
        if fn not in _dynamo_skips:
            _dynamo_skips.append(fn)


def dynamo_skipped() -> list:
    """The code objects registered with `skip_in_dynamo`."""
    codes = (getattr(getattr(fn, "__func__", fn), "__code__", None) for fn in _dynamo_skips)
    return [code for code in codes if code is not None]


class WhenImported:
    """Runs `then(module)` once the module `name` is imported (a patch: install/uninstall): at once if it already
    is, else from a ``sys.meta_path`` finder that lets the normal finders load it. Patches dynamo and Inductor only
    when a program imports them (importing them costs seconds), and starts a child's detector once it imports torch.
    """

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def install(self) -> None:
        module = sys.modules.get(self.name)
        if module is not None:
            self.then(module)
        else:
            sys.meta_path.insert(0, self)

    def uninstall(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        self.uninstall()
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ThenLoader(spec.loader, self.then)
                return spec  # a loader without exec_module: that module is not followed
        return None


class _ThenLoader:
    """A module's own loader, then a call with the module it executed."""

    def __init__(self, loader, then):
        self._loader, self._then = loader, then

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._then(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)
