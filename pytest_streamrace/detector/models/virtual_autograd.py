"""Autograd's stream rules, modelled for virtual streams (on a GPU the engine applies them itself).

The rules (PyTorch's CUDA semantics, confirmed on H200 — see shared/notes/upstream-bugs.md §5):
- a backward node runs on the stream that was current when its forward op ran; an AccumulateGrad node — with its
  hooks and post-accumulate-grad hooks — on the stream current when the node was created;
- a node waits on the streams that produced its incoming gradients;
- when backward() / autograd.grad() returns, the caller's stream waits on every stream the backward used.

Mechanism (``autograd_binding``): each new graph node is bound to the stream current when the call that made it
returned, and gets a pre-hook that switches the thread's current stream to it — in C++ at the op's end where the
capture runs, else by a TorchFunctionMode. The pre-hook is registered before any hook a user can register on the node,
so those see the node's stream. The stream is not switched back after a node: the next node's pre-hook sets its own,
and the wrapper around the engine restores the caller's stream at the end.

When two producers on different streams feed one input, the engine adds their gradients on the consumer's stream
after waiting on both: a post-hook on each node sees the second gradient arrive and has the tracker run the next op
reading it (that add) on the consumer's stream.

Known gap: tensor hooks (Tensor.register_hook) run before node pre-hooks, so on the previous node's stream.

Like the engine of torch >= 2.10 on a GPU, the model warns (same text, so the same filters apply) when an
AccumulateGrad node runs on another stream than the one that produced its gradient: the sign that gradient hooks
run off the backward's stream (``hints`` turns the warning into a finding under --streamrace).
"""

from __future__ import annotations

import threading
import warnings

import torch

from ...patching import AttrPatch, skip_in_dynamo
from .autograd_binding import ModeBinding, NativeBinding

MISMATCH = ("The AccumulateGrad node's stream does not match the stream of the node that produced the incoming "
            "gradient.")  # torch's own wording (input_buffer.cpp), so filters written for torch's warning apply


_engine_classes: dict = {}  # torch's engine class -> our subclass of it: made once (a class costs a session's start)


def _engine_class(base: type) -> type:
    engine = _engine_classes.get(base)
    if engine is None:
        class Engine(base):
            """torch's engine, its `run_backward` set on the object (``VirtualAutograd.patches``)."""

        engine = _engine_classes[base] = Engine
    return engine


class VirtualAutograd:
    """A patch (install/uninstall): binds new graph nodes to streams and joins streams at the end of backward."""

    def __init__(self, streams, hb, tracker, extension=None):
        """extension: the C++ capture's, which then binds nodes (else a function mode does)."""
        self.streams = streams
        self.hb = hb
        self.tracker = tracker
        self._tls = threading.local()
        self._mismatches: set = set()  # (node stream, producer stream) pairs already warned about
        self.binding = NativeBinding(self, extension) if extension is not None else ModeBinding(self)
        self.active = False
        self._around = extension.around if extension is not None else _Around
        self._engine = None  # the engine object `patches` puts in torch's place

    def adopt_outputs(self, out) -> None:
        """A compiled graph ran: bind the autograd nodes its outputs carry (and the new ones behind them) to the
        stream current at the call, as is done for each eager call."""
        if self.active and torch.is_grad_enabled():
            self.binding.adopt_outputs(out)

    def enter_node(self, stream, grads, accumulate: bool = False) -> None:
        """A bound node is about to run: its stream becomes current, after the streams that wrote its inputs.
        `accumulate`: the node is an AccumulateGrad (a stream mismatch with its gradient's producer warns)."""
        self.tracker.drain()  # the ops before it (captured ones included) land first: their writers are read here
        self.streams.set_current(stream)
        frames = getattr(self._tls, "frames", None)
        if frames:
            frames[-1].used.add(stream)
        tracker = self.tracker
        for grad in grads:
            if isinstance(grad, torch.Tensor) and tracker.on_device(grad):
                key = tracker.storage_key(grad)
                writer = tracker.last_writer.get(key)
                if writer is not None and writer is not stream:
                    self.hb.wait_stream(stream, writer)
                    self.hb.record_stream(key, stream)  # the engine's input buffer does the same
                    if accumulate:
                        self._warn_mismatch(stream, writer)

    def _warn_mismatch(self, stream, producer) -> None:
        """torch's AccumulateGrad stream-mismatch warning, once per (node stream, producer stream) pair."""
        if (stream, producer) not in self._mismatches:
            self._mismatches.add((stream, producer))
            warnings.warn(f"{MISMATCH} [streamrace virtual model: AccumulateGrad on {self.hb.stream_name(stream)}, "
                          f"gradient from {self.hb.stream_name(producer)}]", UserWarning, stacklevel=2)

    def leave_node(self, stream, edges, grad_inputs) -> None:
        """A bound node produced gradients. Where a second one lands in an input that already holds one, the engine
        adds them on the consumer's stream after it waited on both producers: the tracker runs that add there."""
        frames = getattr(self._tls, "frames", None)
        if not frames:
            return
        self.tracker.drain()  # the node's ops land before the redirect and the waits below
        buffers = frames[-1].buffers
        for edge, grad in zip(edges, grad_inputs):
            if edge is None or not isinstance(grad, torch.Tensor):
                continue
            consumer_key, input_nr, consumer_stream = edge
            if not self.tracker.on_device(grad):
                continue
            key = self.tracker.storage_key(grad)
            first = buffers.get((consumer_key, input_nr))
            if first is None:
                buffers[(consumer_key, input_nr)] = (stream, key)
                continue
            first_stream, first_key = first
            if first_stream is stream or key is None:
                continue
            for producer in (first_stream, stream):
                if producer is not consumer_stream:
                    self.hb.wait_stream(consumer_stream, producer)
            self.tracker.redirect[key] = consumer_stream
            for storage in (first_key, key):  # the engine's input buffer does the same
                if storage is not None:
                    self.hb.record_stream(storage, consumer_stream)

    # the engine

    def _before_backward(self, *args, **kwargs):
        """The engine is about to run a backward (its roots, `tensors`, first, positional or by name): its graph
        bound. Returns what `_after_backward` takes; None while inactive."""
        if not self.active:
            return None
        self.binding.before_backward(args[0] if args else kwargs.get("tensors", ()))
        frame = _Backward()
        self._tls.__dict__.setdefault("frames", []).append(frame)
        return self.streams.current(), frame

    def _after_backward(self, state) -> None:
        """The backward returned or raised: its nodes' streams joined into the caller's."""
        caller, frame = state
        frames = self._tls.frames
        frames.pop()
        self.tracker.drain()  # the backward's ops land before its redirects go and the caller waits
        self.tracker.redirect.clear()
        if frames:  # a backward inside a node (checkpointing) belongs to the outer one
            frames[-1].used.update(frame.used)
        self.streams.set_current(caller)
        for stream in frame.used:
            if stream is not caller:
                self.hb.wait_stream(caller, stream)

    def patches(self) -> list:
        """The engine itself, not torch's Python entry to it: Megatron's pipeline schedules call
        ``Variable._execution_engine.run_backward`` directly (``custom_backward``). Where the capture is built, the
        engine's `run_backward` is one builtin (``capture.around``): no frame of ours sits under the backward's hooks,
        so a warning they raise with a `stacklevel` (a module's full backward hook) points where it would without
        the detector, and a filter on the user's module still matches it. The fallback wraps it in Python."""
        from torch.autograd.variable import Variable

        cls = _engine_class(type(Variable._execution_engine))
        engine = self._engine = cls()
        engine.run_backward = self._around(self._before_backward, super(cls, engine).run_backward,
                                           self._after_backward)
        return [AttrPatch(Variable, "_execution_engine", engine), self]

    @property
    def mode(self):
        """The function mode binding new nodes to streams, which other threads enter too; None with the C++ binding
        or while uninstalled."""
        return self.binding.mode

    def install(self) -> None:
        self.binding.install()
        self.active = True

    def uninstall(self) -> None:
        self.active = False
        self.binding.uninstall()
        # its run_backward holds the engine's bound method: with the builtin, a cycle the collector cannot see
        if self._engine is not None:
            self._engine.__dict__.pop("run_backward", None)


class _Around:
    """``capture.around`` where the extension is not built: the same, with a frame of ours under `call`."""

    __slots__ = ("before", "call", "after")

    def __init__(self, before, call, after):
        self.before, self.call, self.after = before, call, after

    def __call__(self, *args, **kwargs):
        state = self.before(*args, **kwargs)
        if state is None:
            return self.call(*args, **kwargs)
        try:
            return self.call(*args, **kwargs)
        finally:
            self.after(state)


# called from inside torch's backward, compiled regions' too (capture.around calls the first two from C++)
skip_in_dynamo(VirtualAutograd._before_backward, VirtualAutograd._after_backward, _Around.__call__)


class _Backward:
    """One engine run: the streams its nodes ran on, and which node inputs already received a gradient."""

    def __init__(self):
        self.used: set = set()
        self.buffers: dict = {}
