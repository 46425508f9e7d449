"""Compile modes: the same step eager, under torch.compile, and with compiled autograd.

Compilation changes which streams gradient work lands on and when (DeepSpeed #8061 showed only under
torch.compile), so a forcing test should run in each mode. A mode that silently fell back to eager would prove
nothing: every compiled graph goes through a counting backend, and `check()` fails a mode that compiled nothing.

The default backend is "aot_eager" (AOTAutograd graphs run as ATen ops: fast to build, and every op stays visible to
the detector); "inductor" builds real kernels (C++ on CPU, Triton on GPU), slow to compile on small machines.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from . import COMPILE_BACKENDS as BACKENDS, COMPILE_MODES as MODES


@dataclass
class CompileMode:
    """One mode. `compile(model)` returns what to call forward with; `backward()` is the context to run
    backward in. `graphs` counts what was compiled: {"forward": n, "backward": n}. Use it as a context manager (or
    call `close()`): compiled code is forgotten at the end."""

    name: str
    backend: str = "aot_eager"
    graphs: dict = field(default_factory=lambda: {"forward": 0, "backward": 0})

    def __post_init__(self):
        from torch._dynamo.utils import counters

        self._breaks_at_start = sum(counters["graph_break"].values())
        if self.name not in MODES:
            raise ValueError(f"streamrace: unknown compile mode {self.name!r}; expected one of {', '.join(MODES)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"streamrace: unknown compile backend {self.backend!r}; "
                             f"expected one of {', '.join(BACKENDS)}")

    def __str__(self) -> str:
        return self.name if self.name == "eager" else f"{self.name} ({self.backend})"

    def _counting(self, kind: str):
        from torch._dynamo.backends.registry import lookup_backend

        inner = lookup_backend(self.backend)

        def backend(gm, example_inputs, **kwargs):
            self.graphs[kind] += 1
            return inner(gm, example_inputs, **kwargs)
        return backend

    def compile(self, model):
        """The model as this mode runs it (the model itself in eager mode)."""
        if self.name == "eager":
            return model
        return torch.compile(model, backend=self._counting("forward"))

    @contextlib.contextmanager
    def backward(self):
        """Run backward inside: with compiled autograd in that mode, a no-op otherwise."""
        if self.name != "compiled_autograd":
            yield
            return
        from torch._dynamo import compiled_autograd

        backend = self._counting("backward")

        def compiler(graph):
            return torch.compile(graph, backend=backend, fullgraph=False)

        with compiled_autograd._enable(compiler):
            yield

    def close(self) -> None:
        """Forget compiled code, so the next run compiles (and counts) afresh."""
        if self.name != "eager":
            import torch._dynamo

            torch._dynamo.reset()

    def __enter__(self) -> "CompileMode":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def summary(self) -> str:
        """Which mode ran and what it compiled, for the test's report."""
        if self.name == "eager":
            return "eager (nothing compiled)"
        from torch._dynamo.utils import counters

        graphs = ", ".join(f"{n} {kind}" for kind, n in self.graphs.items() if n or kind == "forward")
        breaks = sum(counters["graph_break"].values()) - self._breaks_at_start
        return f"{self}: compiled {graphs} graph(s), {breaks} graph break(s)"

    def check(self) -> None:
        """Raise unless this mode compiled what it promised (forward graphs; backward graphs too with compiled
        autograd)."""
        missing = []
        if self.name != "eager" and not self.graphs["forward"]:
            missing.append("no forward graph")
        if self.name == "compiled_autograd" and not self.graphs["backward"]:
            missing.append("no backward graph (was backward run inside compile_mode.backward()?)")
        if missing:
            raise AssertionError(f"streamrace: compile mode {self} compiled {' and '.join(missing)}")
