"""The stock-stack suite: PyTorch's, DeepSpeed's and Megatron's own training wrappers under ``pytest --streamrace``.

Each ``stacks/stack_*.py`` is a plain pytest module whose tests carry ``streamrace(expect="clean"|"race")``: correct
use of a stack must run clean, and its racy twin — a mistake users make with it — must be caught. Run here as users run
them (a pytest subprocess, ``--streamrace`` on the virtual backend, ranks on gloo); on GPUs the same modules run with
``pytest --streamrace tests/stacks/stack_*.py`` (tests/gpu/test_stacks_gpu.py). A racy twin tags the line(s) where its
race is with ``# race: <test name>``, and its reported races must name one of them.
"""

import ast
import json
import re
from pathlib import Path

import pytest

# stack_offload.py runs in tests/test_offload.py, which builds DeepSpeedCPUAdam before its ranks start and compares
# the plain run too
STACKS = sorted(p for p in (Path(__file__).parent / "stacks").glob("stack_*.py") if p.stem != "stack_offload")


def tagged(source: str) -> dict[str, set[int]]:
    """test name -> the lines tagged `# race: <test name>`."""
    tags: dict[str, set[int]] = {}
    for number, text in enumerate(source.splitlines(), 1):
        found = re.search(r"#\s*race:\s*(\w+)\s*$", text)
        if found:
            tags.setdefault(found.group(1), set()).add(number)
    return tags


@pytest.mark.parametrize("stack", STACKS, ids=[p.stem.removeprefix("stack_") for p in STACKS])
def test_stack(pytester, stack):
    source = stack.read_text()
    module = pytester.makepyfile(**{stack.stem: source})
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=virtual", "--streamrace-json",
                                           "races.json", "-p", "no:cacheprovider", "-rA", module)
    outcomes = result.parseoutcomes()
    if set(outcomes) <= {"skipped", "warnings"}:
        pytest.skip(f"{stack.name}: its framework is not installed here")
    assert outcomes.get("failed", 0) == outcomes.get("error", 0) == 0, result.stdout.str()
    races = json.loads((pytester.path / "races.json").read_text())["races"]
    tags = tagged(source)
    racy = {name for name in tags}
    for test in racy:
        lines = {f["line"] for race in races if race["test"].split("[")[0].endswith("::" + test)
                 for access in (race["earlier"], race["later"]) for f in access["frames"]
                 if Path(f["file"]).name == module.name}
        assert lines & tags[test], f"{test}: no reported race names a line tagged for it; races:\n" + "\n".join(
            json.dumps(r) for r in races if r["test"].split("[")[0].endswith("::" + test))
    assert racy_twins(source) == racy, "every racy twin, and only those, tag their race lines"


def racy_twins(source: str) -> set[str]:
    """The tests marked streamrace(expect="race")."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef):
            for decorator in node.decorator_list:
                if isinstance(decorator, ast.Call) and ast.unparse(decorator.func).endswith("mark.streamrace") \
                        and any(k.arg == "expect" and ast.literal_eval(k.value) == "race" for k in decorator.keywords):
                    names.add(node.name)
    return names
