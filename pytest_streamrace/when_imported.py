"""Run a callback once a module has been imported: at once if it already is, else from a ``sys.meta_path`` finder
that lets the normal finders load it. Imports nothing itself, so a child's start-up hook can use it before torch.

Used to patch dynamo and Inductor only when a program imports them (importing them costs seconds), and to start a
child process's detector only once it imports torch.
"""

from __future__ import annotations

import sys


class WhenImported:
    """Runs `then(module)` once the module `name` is imported (a patch: install/uninstall)."""

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
