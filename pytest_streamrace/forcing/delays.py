"""Injected delays: sleep kernels on chosen streams, so an unsynchronized reader overtakes its writer.

A race only corrupts data when the reader really runs first; a sleep kernel queued on the writer's stream makes that
the common case instead of a rare one (measured: 0/50 -> 49/50 wrong). On a GPU a delay is ``torch.cuda._sleep``
with cycles per millisecond measured once per process (clock rates differ between GPUs and boost states); on the
virtual backend the same call is recorded as an op on the current stream, so the detector sees the schedule.

A schedule says how long each stream (by label, see ``streams``) sleeps at each injection point.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field

import torch

from ..patching import AttrPatch
from . import streams as _streams

DEFAULT_MS = 2.0
VIRTUAL_CYCLES_PER_MS = 1_000_000  # nominal: a virtual sleep takes no time, only its place in the order matters
COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather", "reduce_scatter",
               "broadcast", "reduce", "all_to_all_single")

_calibrated: dict[int, float] = {}


def cycles_per_ms() -> float:
    """Sleep-kernel cycles per millisecond on the current device, measured once per process with CUDA events."""
    from ..detector import session

    detector = session.active()
    if detector is not None and detector.backend == "virtual":
        return VIRTUAL_CYCLES_PER_MS
    device = torch.cuda.current_device()
    if device not in _calibrated:
        cycles = 20_000_000
        torch.cuda._sleep(cycles // 10)  # warm-up: the first launch pays for module loading
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _calibrated[device] = cycles / start.elapsed_time(end)
    return _calibrated[device]


def sleep(ms: float) -> None:
    """Queue a sleep of about `ms` milliseconds on the current stream (returns at once on the host)."""
    if ms > 0:
        torch.cuda._sleep(max(1, int(ms * cycles_per_ms())))


# schedules


@dataclass(frozen=True)
class Schedule:
    """How long the stream labelled L sleeps at an injection point: `slow[L]` ms, or a seeded random draw."""

    name: str
    slow: tuple = ()  # ((label, ms), ...)
    seed: int | None = None
    max_ms: float = DEFAULT_MS

    def rng(self) -> random.Random | None:
        return None if self.seed is None else random.Random(self.seed)

    def delay_ms(self, label: str | None, rng: random.Random | None) -> float:
        if rng is not None:
            return round(rng.uniform(0, self.max_ms), 3)
        return dict(self.slow).get(label, 0.0)


def no_delay() -> Schedule:
    return Schedule("no delay")


def one_slow(label: str, ms: float = DEFAULT_MS) -> Schedule:
    return Schedule(f"{label} slow ({ms:g} ms)", ((label, ms),))


def each_slow_in_turn(labels: list[str], ms: float = DEFAULT_MS) -> list[Schedule]:
    return [one_slow(label, ms) for label in labels]


def seeded_random(seed: int, max_ms: float = DEFAULT_MS) -> Schedule:
    """Every injection point sleeps a uniform 0..max_ms draw; the same seed gives the same sequence."""
    return Schedule(f"random delays (seed {seed}, up to {max_ms:g} ms)", seed=seed, max_ms=max_ms)


def numbered(k: int, labels: list[str], ms: float = DEFAULT_MS) -> Schedule:
    """Schedule k of a series: each labelled stream slow in turn, then seeded random ones (seed k)."""
    return one_slow(labels[k], ms) if k < len(labels) else seeded_random(k, ms)


# injection


@dataclass(frozen=True)
class Delay:
    where: str  # "AccumulateGrad of model.0.weight", "before all_reduce", "after Foo.bar"
    stream: str | None  # label of the stream it was queued on
    ms: float


@dataclass(repr=False)
class Delays:
    """Injects delays under one schedule and logs each one; `restore()` undoes every patch (the fixture calls it).
    Node hooks live as long as their nodes: they stop delaying after `restore()`.

    `schedule` may be a number k: it becomes `numbered(k, labels, ms)` over the side streams alive when the first
    injection point is set up, created after this object (so bind first, then inject)."""

    schedule: Schedule | int
    ms: float = DEFAULT_MS
    log: list[Delay] = field(default_factory=list)
    _undo: list = field(default_factory=list, repr=False)
    _active: bool = True
    _rng: random.Random | None = field(default=None, repr=False)
    _since: int = field(default_factory=_streams.mark, repr=False)

    def _resolve(self) -> Schedule:
        if isinstance(self.schedule, int):
            labels = [label for label in _streams.labels_alive(self._since) if label != _streams.DEFAULT]
            self.schedule = numbered(self.schedule, labels, self.ms)
            self._rng = self.schedule.rng()
        elif self._rng is None:
            self._rng = self.schedule.rng()
        return self.schedule

    def _inject(self, where: str) -> None:
        if not self._active:
            return
        self._resolve()
        label = _streams.label(torch.cuda.current_stream())
        ms = self.schedule.delay_ms(label, self._rng)
        if ms > 0:
            sleep(ms)
            self.log.append(Delay(where, label, ms))

    def before_accumulate(self, binding_or_nodes) -> None:
        """Before each AccumulateGrad node (and so before its gradient hooks) runs, on the node's stream. Takes a
        Binding, or AccumulateGrad nodes (e.g. Megatron's ``ddp.grad_accs``)."""
        self._resolve()
        named = (list(zip(binding_or_nodes.record, binding_or_nodes.nodes))
                 if hasattr(binding_or_nodes, "record") else
                 [(f"node {i}", n) for i, n in enumerate(binding_or_nodes)])
        for name, node in named:
            node.register_prehook(self._node_prehook(f"AccumulateGrad of {name}"))

    def _node_prehook(self, where: str):
        def prehook(grad_outputs):
            self._inject(where)
        return prehook

    def around(self, owner, name: str, before: bool = True, after: bool = False, label: str | None = None) -> None:
        """Patch `owner.name` (a function or method) for this scope: delay before and/or after each call."""
        self._resolve()
        original = getattr(owner, name)
        label = label or f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"

        @functools.wraps(original)
        def delayed(*args, **kwargs):
            if before:
                self._inject(f"before {label}")
            out = original(*args, **kwargs)
            if after:
                self._inject(f"after {label}")
            return out

        patch = AttrPatch(owner, name, delayed)
        patch.install()
        self._undo.append(patch.uninstall)

    def before_collectives(self, names: tuple[str, ...] = COLLECTIVES) -> None:
        """Delay before each torch.distributed collective in `names`, on the caller's current stream."""
        import torch.distributed as dist

        for name in names:
            if not hasattr(dist, name):
                raise ValueError(f"streamrace: torch.distributed has no collective {name!r}")
            self.around(dist, name, label=name)

    def __repr__(self) -> str:
        name = self.schedule.name if isinstance(self.schedule, Schedule) else f"schedule {self.schedule}"
        return f"<Delays: {name}; {len(self.log)} injected>"

    def restore(self) -> None:
        self._active = False
        while self._undo:
            self._undo.pop()()

    def summary(self) -> str:
        self._resolve()
        if not self.log:
            return f"schedule: {self.schedule.name}; no delay injected"
        lines = [f"schedule: {self.schedule.name}; {len(self.log)} delays injected"]
        lines += [f"  {d.ms:g} ms on {d.stream or 'unlabelled stream'} {d.where}" for d in self.log[:20]]
        if len(self.log) > 20:
            lines.append(f"  ... {len(self.log) - 20} more")
        return "\n".join(lines)
