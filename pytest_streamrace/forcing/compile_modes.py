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

MODES = ("eager", "compile", "compiled_autograd")
BACKENDS = ("aot_eager", "inductor", "eager")


@dataclass
class CompileMode:
    """One mode. `compile(model)` returns what to call forward with; `backward()` is the context to run
    backward in. `graphs` counts what was compiled: {"forward": n, "backward": n}. Use it as a context manager (or
    call `close()`): compiled code is forgotten at the end."""

    name: str
    backend: str = "aot_eager"
    graphs: dict = field(default_factory=lambda: {"forward": 0, "backward": 0})
    _shown: list = field(default_factory=list, repr=False)

    def __post_init__(self):
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
        self._show_detector()
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

        self._show_detector()
        with compiled_autograd._enable(compiler):
            yield

    def _show_detector(self) -> None:
        """Dynamo silently skips compiling (runs eager) while a dispatch mode that does not ignore compile internals
        is active, and the detector's access tracker is one. Marking it so, until `close()`, lets compilation run
        untracked and the compiled graphs' ops run tracked — what the tracker wants."""
        from ..detector import session

        tracker = getattr(session.active(), "tracker", None)
        if tracker is not None and "ignore_compile_internals" not in vars(tracker):
            tracker.ignore_compile_internals = _IGNORE
            self._shown.append(tracker)

    def close(self) -> None:
        """Undo `_show_detector` and forget compiled code, so the next run compiles (and counts) afresh."""
        while self._shown:
            _unhide(self._shown.pop())
        if self.name != "eager":
            import torch._dynamo

            torch._dynamo.reset()

    def __enter__(self) -> "CompileMode":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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


def _unhide(tracker) -> None:
    if vars(tracker).get("ignore_compile_internals") is _IGNORE:
        del tracker.ignore_compile_internals


def _ignore() -> bool:
    return True


_IGNORE = _ignore
