"""Bind each parameter's AccumulateGrad node to a side stream, so its gradient hooks run there.

Autograd runs an AccumulateGrad node — with its hooks and post-accumulate-grad hooks, where DeepSpeed and Megatron
copy and reduce gradients — on the stream that was current when the node was *created*. The node is created lazily
and cached only while something holds it, so binding = creating it (``p.expand_as(p).grad_fn.next_functions[0][0]``)
inside ``torch.cuda.stream(s)`` and keeping it alive. It must happen before the framework under test touches the
node (registers its hooks): a node that already exists keeps the stream it was created on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from . import streams as _streams

POLICIES = ("round_robin", "per_module", "one_stream")


@dataclass
class Binding:
    """What was bound where. Holds the nodes and streams alive until `release()` (or until it is dropped)."""

    record: dict[str, str]  # parameter name -> stream label
    streams: list
    nodes: list = field(repr=False)
    params: dict = field(repr=False)  # parameter name -> parameter

    @property
    def labels(self) -> list[str]:
        return [_streams.label(s) for s in self.streams]

    def stream_of(self, name: str):
        return self.streams[self.labels.index(self.record[name])]

    def release(self) -> None:
        self.nodes.clear()

    def __str__(self) -> str:
        width = max((len(n) for n in self.record), default=0)
        return "\n".join(f"{name:<{width}}  -> {where}" for name, where in self.record.items())


def _named(target) -> list[tuple[str, torch.Tensor]]:
    if isinstance(target, torch.nn.Module):
        named = list(target.named_parameters())
    else:
        items = list(target)
        if all(isinstance(i, tuple) and len(i) == 2 for i in items):
            named = [(str(n), p) for n, p in items]
        else:
            named = [(f"param {i}", p) for i, p in enumerate(items)]
    for name, p in named:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"streamrace: bind_accumulators: {name} is a {type(p).__name__}, not a tensor")
        if p.requires_grad and not p.is_leaf:
            raise ValueError(f"streamrace: bind_accumulators: {name} is not a leaf tensor (it has no AccumulateGrad)")
    return [(n, p) for n, p in named if p.requires_grad]


def _choose(named, count: int, policy) -> dict[str, int]:
    """parameter name -> stream index, by policy."""
    if policy == "round_robin":
        return {name: i % count for i, (name, _) in enumerate(named)}
    if policy == "one_stream":
        return {name: 0 for name, _ in named}
    if policy == "per_module":
        modules: dict[str, int] = {}
        out = {}
        for name, _ in named:
            owner = name.rpartition(".")[0]
            out[name] = modules.setdefault(owner, len(modules) % count)
        return out
    if isinstance(policy, Mapping):
        names = {n for n, _ in named}
        unknown = sorted(set(policy) - names)
        if unknown:
            raise ValueError(f"streamrace: bind_accumulators mapping names unknown parameters: {', '.join(unknown)}")
        bad = {n: i for n, i in policy.items() if not (isinstance(i, int) and 0 <= i < count)}
        if bad:
            raise ValueError(f"streamrace: bind_accumulators mapping: stream indices must be in 0..{count - 1}, "
                             f"got {bad}")
        return dict(policy)
    if callable(policy):
        return _choose(named, count, {name: policy(name) for name, _ in named})
    raise ValueError(f"streamrace: unknown binding policy {policy!r}; expected one of {', '.join(POLICIES)}, "
                     "a mapping name -> stream index, or a callable name -> stream index")


def bind_accumulators(target, streams: int | list = 2,
                      policy: str | Mapping[str, int] | Callable[[str], int] = "round_robin") -> Binding:
    """Create the AccumulateGrad node of each parameter of `target` (a module, parameters, or (name, parameter)
    pairs) on one of `streams` (a count of new labelled side streams, or streams), chosen by `policy`:
    "round_robin" (parameter i on stream i mod K), "per_module" (a module's parameters together), "one_stream"
    (all on the first), or a mapping / callable name -> stream index (others stay unbound). Call it before the
    framework registers its hooks."""
    named = _named(target)
    if isinstance(streams, int):
        chosen = _streams.side_streams(1 if policy == "one_stream" else streams)
    else:
        chosen = list(streams)
        if not chosen:
            raise ValueError("streamrace: bind_accumulators needs at least one stream")
        for i, s in enumerate(chosen):
            if _streams.label(s) is None:
                _streams.set_label(s, f"given {i}")
    where = _choose(named, len(chosen), policy)
    nodes, record, params = [], {}, {}
    for name, p in named:
        if name not in where:
            continue
        stream = chosen[where[name]]
        with torch.cuda.stream(stream):
            nodes.append(p.expand_as(p).grad_fn.next_functions[0][0])
        record[name] = _streams.label(stream)
        params[name] = p
    if isinstance(target, torch.nn.Module):
        from ..detector import session

        detector = session.active()
        if detector is not None:
            detector.name(target)
    return Binding(record, chosen, nodes, params)


def built_on_side_stream(factory: Callable, stream=None, label: str = "build side"):
    """Megatron's pattern: run `factory()` with a side stream current, so every AccumulateGrad node it creates (and
    the hooks it registers on them) runs on that stream. Returns (result, stream); keep the stream alive with it."""
    if stream is None:
        _streams.require_streams("built_on_side_stream")
        stream = _streams.new_stream(label)
    with torch.cuda.stream(stream):
        result = factory()
    return result, stream
