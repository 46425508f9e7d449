"""The package's layout: no import cycle between its modules or between its parts, few modules loose at its top, and
every package directory and data file shipped by pyproject.toml.

Imports are read from the source with ``ast``, wherever they sit: an import inside a function runs all the same, so
a cycle through one is a cycle.
"""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

import pytest_streamrace

PACKAGE = pathlib.Path(pytest_streamrace.__file__).parent
ROOT = PACKAGE.name
PYPROJECT = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"
MAX_LOOSE = 7


def _sources() -> dict[str, tuple[str, bool]]:
    """Dotted module name -> (source, whether it is a package's __init__), for every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = (ROOT, *path.relative_to(PACKAGE).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path.read_text(encoding="utf-8"), is_package)
    return out


def _graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Module -> the modules among `sources` it imports, anywhere in its source."""
    graph = {}
    for name, (source, is_package) in sources.items():
        here = name.split(".") if is_package else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(source, name)):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = here[:len(here) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:  # `from package import module` imports the module
                    found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in sources else target)
        graph[name] = {m for m in found if m in sources and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Groups of nodes that reach each other (strongly connected components of more than one node)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                out.append(group)

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for node in sorted(graph):
            if node not in index:
                visit(node)
    finally:
        sys.setrecursionlimit(limit)
    return out


def _part(module: str) -> str:
    """The top-level subpackage a module belongs to (a module loose at the top is a part of its own)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_the_cycle_finder_sees_a_cycle_closed_by_a_function_level_import():
    """The finder itself, on made-up modules: a one-way chain is no cycle; closing it inside a function is one."""
    chain = {"a": "from . import b\n", "b": "def f():\n    from .c import x\n", "c": "import os\n"}

    def cycles(texts):
        return _cycles(_graph({f"{ROOT}.{name}": (text, False) for name, text in texts.items()}))

    assert cycles(chain) == []
    assert cycles({**chain, "c": "def g():\n    from . import a\n"}) == [{f"{ROOT}.{name}" for name in "abc"}]


def test_no_module_imports_itself_back():
    assert _cycles(_graph(_sources())) == []


def test_no_part_imports_itself_back():
    parts: dict[str, set[str]] = {}
    for module, imported in _graph(_sources()).items():
        parts.setdefault(_part(module), set()).update(_part(m) for m in imported if _part(m) != _part(module))
    assert _cycles(parts) == []


def test_few_modules_sit_loose_at_the_top():
    loose = sorted(p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= MAX_LOOSE, loose


def test_pyproject_ships_every_package_and_the_capture_source():
    """A package directory missing from the list, or the C++ source missing from package data, works in a checkout
    and breaks only once installed."""
    tomllib = pytest.importorskip("tomllib")
    if not PYPROJECT.is_file():
        pytest.skip("run outside a checkout: no pyproject.toml")
    config = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["tool"]["setuptools"]
    directories = {".".join((ROOT, *p.parent.relative_to(PACKAGE).parts)) for p in PACKAGE.rglob("__init__.py")}
    assert directories <= set(config["packages"])
    data = config.get("package-data", {})
    for path in PACKAGE.rglob("*.cpp"):
        package = ".".join((ROOT, *path.parent.relative_to(PACKAGE).parts))
        assert path.name in data.get(package, ()), path
