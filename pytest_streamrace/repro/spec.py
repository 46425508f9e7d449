"""What a repro declares: the upstream bug it reproduces, what it needs, its variants and how to run one rank.

A repro module defines ``REPRO = Repro(...)``. The harness reads the declaration to check requirements before any
rank starts (so a missing framework or GPU is one line, not a rank traceback) and to know which verdict each variant
must get.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import metadata
from typing import Callable

VERDICTS = ("reproduced", "clean", "inconclusive")


@dataclass(frozen=True)
class Framework:
    """The package a repro exercises, e.g. Framework("deepspeed", ">=0.19.2", extra="deepspeed")."""

    package: str
    versions: str = ""  # a PEP 440 specifier set; empty: any version
    extra: str = ""  # the pytest-streamrace extra that installs it

    def installed(self) -> str | None:
        try:
            return metadata.version(self.package)
        except metadata.PackageNotFoundError:
            return None

    def problem(self) -> str | None:
        """Why the installed framework cannot run this repro, as one line; None when it can."""
        from packaging.specifiers import SpecifierSet

        version = self.installed()
        hint = f"pip install 'pytest-streamrace[{self.extra}]'" if self.extra else f"pip install {self.package}"
        if version is None:
            return f"{self.package} is not installed ({hint})"
        if self.versions and version not in SpecifierSet(self.versions):
            return f"{self.package} {version} is installed; this repro needs {self.package}{self.versions}"
        return None


@dataclass(frozen=True)
class Variant:
    name: str  # "unpatched" | "patched"
    expect: str  # the verdict this variant must get: "reproduced" | "clean"
    summary: str


@dataclass(frozen=True)
class Repro:
    name: str
    title: str
    description: str  # the mechanism, as a maintainer would want it explained
    references: tuple[str, ...]  # upstream issues / PRs
    affected: str  # "deepspeed <= 0.19.2"
    fixed: str  # "deepspeed >= 0.19.3"
    framework: Framework | None
    variants: tuple[Variant, ...]
    run: Callable  # run(ctx: RankContext) -> dict | None: one rank's numeric evidence (see repro.evidence)
    world_size: int = 2
    backends: tuple[str, ...] = ("cuda", "virtual")
    # which detected races are this bug's; None: its evidence is not a race (a buffer's lifetime): nothing to confirm
    relevant: Callable[[dict], bool] | None = field(default=lambda race: True)

    def variant(self, name: str) -> Variant:
        for v in self.variants:
            if v.name == name:
                return v
        raise KeyError(name)

    def describe(self) -> str:
        lines = [f"{self.name}: {self.title}", "", self.description.strip(), ""]
        lines += [f"affected: {self.affected}", f"fixed:    {self.fixed}"]
        lines += [f"see:      {ref}" for ref in self.references]
        lines += [f"needs:    {self.framework.package}{self.framework.versions}" if self.framework else "needs:    torch",
                  f"ranks:    {self.world_size}; backends: {', '.join(self.backends)}", "variants:"]
        lines += [f"  {v.name:10} expect {v.expect:11} {v.summary}" for v in self.variants]
        return "\n".join(lines)
