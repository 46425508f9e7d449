"""Autograd's stream rules, modelled for virtual streams (on a GPU the engine applies them itself).

The rules (PyTorch's CUDA semantics, confirmed on H200 — see shared/notes/upstream-bugs.md §5):
- a backward node runs on the stream that was current when its forward op ran; an AccumulateGrad node — with its
  hooks and post-accumulate-grad hooks — on the stream current when the node was created;
- a node waits on the streams that produced its incoming gradients;
- when backward() / autograd.grad() returns, the caller's stream waits on every stream the backward used.

Mechanism: a TorchFunctionMode runs above autograd, so after each call the outputs' grad_fn exist; new graph nodes
(found from there through next_functions, stopping at nodes already seen) get the current stream and a pre-hook
that switches the thread's current stream to it. Hooks users register later run after that pre-hook, so they see
the node's stream. The stream is not switched back after a node: the next node's pre-hook sets its own, and the
wrapper around the engine restores the caller's stream at the end.

Known gaps: tensor hooks (Tensor.register_hook) run before node pre-hooks, so on the previous node's stream; when
two producers on different streams feed one input, the engine's accumulation is attributed to the second
producer's stream (on a GPU it runs on the consumer's, after waiting both) and may be reported as a race.
"""

from __future__ import annotations

import functools
import threading
import weakref

import torch
from torch.overrides import TorchFunctionMode

_TAG = "streamrace.stream"


def _grad_fns(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out.grad_fn] if out.grad_fn is not None else []
    if isinstance(out, (tuple, list)):
        return [t.grad_fn for t in out if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    return []


class _NewNodes(TorchFunctionMode):
    def __init__(self, model: "VirtualAutograd"):
        super().__init__()
        self.model = model

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled():
            nodes = _grad_fns(out)
            if nodes:
                self.model.adopt(nodes)
        return out


class VirtualAutograd:
    """A patch (install/uninstall): binds new graph nodes to streams and joins streams at the end of backward."""

    def __init__(self, streams, hb, tracker):
        self.streams = streams
        self.hb = hb
        self.tracker = tracker
        self._token = object()  # tells this session's tags from an earlier session's on long-lived nodes
        self._tls = threading.local()
        self._mode: _NewNodes | None = None
        self._saved: list = []
        self.active = False

    # graph nodes

    def node_stream(self, node):
        """The stream a graph node was bound to, or None."""
        tag = node.metadata.get(_TAG)
        return tag[1] if tag is not None and tag[0] is self._token else None

    def adopt(self, nodes: list) -> None:
        stream = self.streams.current()
        stack = list(nodes)
        ref = weakref.ref(self)
        while stack:
            node = stack.pop()
            if node is None:
                continue
            meta = node.metadata
            tag = meta.get(_TAG)
            if tag is not None and tag[0] is self._token:
                continue
            meta[_TAG] = (self._token, stream)
            node.register_prehook(_prehook(ref, stream))
            stack.extend(next_node for next_node, _ in node.next_functions)

    def enter_node(self, stream, grads) -> None:
        """A bound node is about to run: its stream becomes current, after the streams that wrote its inputs."""
        self.streams.set_current(stream)
        frames = getattr(self._tls, "frames", None)
        if frames:
            frames[-1].add(stream)
        tracker = self.tracker
        for grad in grads:
            if isinstance(grad, torch.Tensor) and tracker.on_device(grad):
                writer = tracker.last_writer.get(tracker.storage_key(grad))
                if writer is not None and writer is not stream:
                    self.hb.wait_stream(stream, writer)

    # the engine

    def _wrap(self, run_backward):
        @functools.wraps(run_backward)
        def wrapper(*args, **kwargs):
            if not self.active:
                return run_backward(*args, **kwargs)
            caller = self.streams.current()
            used: set = set()
            frames = self._tls.__dict__.setdefault("frames", [])
            frames.append(used)
            try:
                return run_backward(*args, **kwargs)
            finally:
                frames.pop()
                if frames:
                    frames[-1].update(used)  # a backward inside a node (checkpointing) belongs to the outer one
                self.streams.set_current(caller)
                for stream in used:
                    if stream is not caller:
                        self.hb.wait_stream(caller, stream)
        return wrapper

    def patches(self, attr_patch) -> list:
        import torch.autograd.graph

        wrapped = self._wrap(torch.autograd.graph._engine_run_backward)
        return [attr_patch(torch.autograd.graph, "_engine_run_backward", wrapped),
                attr_patch(torch.autograd, "_engine_run_backward", wrapped), self]

    def install(self) -> None:
        self._mode = _NewNodes(self)
        self._mode.__enter__()
        self.active = True

    def uninstall(self) -> None:
        self.active = False
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None


def _prehook(ref, stream):
    # Holds the model weakly: nodes (AccumulateGrad kept by DDP wrappers) may outlive the session.
    def prehook(grad_outputs):
        model = ref()
        if model is not None and model.active:
            model.enter_node(stream, grad_outputs)
    return prehook
