"""How the virtual autograd model learns each new graph node's stream, and gets called when the node runs.

Two bindings with one face (``install``/``uninstall``, ``adopt_outputs``, ``before_backward``, ``mode``), picked with
the op source:
- ``NativeBinding`` (with the C++ capture): before each backward, ``node_streams.cpp`` binds the graph behind its roots,
  each node to the stream current on its thread when it was made (found from its autograd number), and its hooks call
  the model's ``enter_node``/``leave_node`` once two streams exist. Nothing per torch call.
- ``ModeBinding`` (the fallback, no compiler): a TorchFunctionMode, above autograd, binds the new nodes behind each
  call's outputs with Python hooks. It costs a Python frame per torch call, property reads included.

Both bind a node to the stream current when the call that made it ran and stop at nodes already bound in this session;
the function mode leaves compiled code's nodes to ``adopt_outputs`` (called when a compiled graph ran).
"""

from __future__ import annotations

import weakref

import torch
from torch.overrides import TorchFunctionMode

from ...patching import skip_in_dynamo

_TAG = "streamrace.stream"
_grad_enabled = torch.is_grad_enabled  # per call of every torch function: one attribute load less


def _with_nodes(out) -> list:
    """The tensors among a call's outputs that carry a graph node."""
    if isinstance(out, torch.Tensor):
        return [out] if out.grad_fn is not None else []
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    return []


def _live(ref):
    """The model a hook reports to, or None: the session ended, or the hook is traced into compiled autograd's graph
    (it then runs on the caller's stream)."""
    if torch.compiler.is_compiling():
        return None
    model = ref()
    return model if model is not None and model.active else None


class NativeBinding:
    """Nodes bound in C++ before the backward that runs them (``node_streams.cpp``, through the capture)."""

    mode = None  # no function mode for threads to enter

    def __init__(self, model, extension):
        # the model holds this binding: it is held weakly back, so that a finished session is freed as its last
        # reference goes, not by the collector
        self._model, self.extension = weakref.ref(model), extension
        self._streams = model.streams

    def install(self) -> None:
        ref = self._model
        core = getattr(ref().hb, "core", None)  # hb_native's C++ core says when two streams exist, without Python
        self.extension.bind_nodes(lambda stream, grads, accumulate: _enter(ref, stream, grads, accumulate),
                                  lambda stream, edges, grads: _leave(ref, stream, edges, grads), core)

    def uninstall(self) -> None:
        self.extension.unbind_nodes()

    def adopt_outputs(self, out) -> None:
        """Nothing to do: a compiled graph's node is found by its number like any other."""

    def before_backward(self, outputs) -> None:
        roots = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        # tensors, or GradientEdges (node, output number)
        self.extension.bind_graph([r if isinstance(r, torch.Tensor) else getattr(r, "node", None) for r in roots],
                                  self._streams.index(self._streams.current()))


# Called by the C++ hooks once the core has seen two streams (node_streams.cpp's `runs`), with streams as the capture's
# small ints.
def _enter(ref, stream: int, grads, accumulate: bool) -> None:
    model = _live(ref)
    if model is not None:
        model.enter_node(model.streams.keys[stream], grads, accumulate)


def _leave(ref, stream: int, edges, grads) -> None:
    model = _live(ref)
    if model is not None:
        keys = model.streams.keys
        model.leave_node(keys[stream], [None if e is None else (e[0], e[1], keys[e[2]]) for e in edges], grads)


class _NewNodes(TorchFunctionMode):
    def __init__(self, binding: "ModeBinding"):
        super().__init__()
        self.binding = binding

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **kwargs) if kwargs else func(*args)
        # traced, not run, while compiling: compiled code's nodes are bound when it runs (asked before reading
        # grad_fn, which dynamo cannot trace)
        if _grad_enabled() and not torch.compiler.is_compiling():
            tensors = _with_nodes(out)
            if tensors:
                self.binding.adopt([t.grad_fn for t in tensors])
        return out


skip_in_dynamo(_NewNodes.__torch_function__)  # the mode is entered around compiled regions too


class ModeBinding:
    """Nodes bound in Python by a function mode; each bound node is tagged in its metadata with its stream."""

    def __init__(self, model):
        self.model = model
        self._token = object()  # tells this session's tags from an earlier session's on long-lived nodes
        self._deferred = False  # whether `adopt` left nodes without their hooks (one stream seen then)
        self.mode: _NewNodes | None = None

    def install(self) -> None:
        self.mode = _NewNodes(self)
        self.mode.__enter__()

    def uninstall(self) -> None:
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None

    def adopt_outputs(self, out) -> None:
        tensors = _with_nodes(out)
        if tensors:
            self.adopt([t.grad_fn for t in tensors])

    def node_stream(self, node):
        """The stream a graph node was bound to, or None."""
        tag = node.metadata.get(_TAG)
        return tag[1] if tag is not None and tag[0] is self._token else None

    def adopt(self, nodes: list) -> None:
        """Bind new graph nodes to the current stream. While the session has seen one stream, the hooks wait: with
        every node on that stream they would only set the stream already current, and two hooks a node cost more
        than the op that made it. The first backward after a second stream appears registers them
        (`before_backward`)."""
        stream = self.model.streams.current()
        stack = list(nodes)
        hooked = self.model.hb.stream_count > 1
        if not hooked:
            self._deferred = True
        ref = weakref.ref(self.model)
        while stack:
            node = stack.pop()
            if node is None:
                continue
            meta = node.metadata
            tag = meta.get(_TAG)
            if tag is not None and tag[0] is self._token:
                continue
            meta[_TAG] = (self._token, stream, hooked)
            if hooked:
                self._hook(ref, node, stream)
            for next_node, _ in node.next_functions:
                if next_node is not None:
                    stack.append(next_node)

    def _hook(self, ref, node, stream) -> None:
        """The pre-hook that enters the node's stream, and the post-hook that follows its gradients."""
        node.register_prehook(_prehook(ref, stream, node.name() == "torch::autograd::AccumulateGrad"))
        edges = []
        for next_node, input_nr in node.next_functions:
            if next_node is None:
                edges.append(None)
                continue
            edges.append((id(next_node.metadata), input_nr, self.node_stream(next_node) or stream))
        if edges:
            node.register_hook(_posthook(ref, stream, edges))

    def before_backward(self, outputs) -> None:
        """Register the hooks `adopt` deferred on the nodes this backward may run, once a second stream exists."""
        if not self._deferred or self.model.hb.stream_count <= 1:
            return
        ref = weakref.ref(self.model)
        roots = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        # tensors, or GradientEdges (node, output number)
        stack = [r.grad_fn if isinstance(r, torch.Tensor) else getattr(r, "node", None) for r in roots]
        seen = set()
        while stack:
            node = stack.pop()
            if node is None:
                continue
            meta = node.metadata
            if id(meta) in seen:
                continue
            seen.add(id(meta))
            tag = meta.get(_TAG)
            if tag is not None and tag[0] is self._token and not tag[2]:
                meta[_TAG] = (self._token, tag[1], True)
                self._hook(ref, node, tag[1])
            stack.extend(next_node for next_node, _ in node.next_functions)


def _posthook(ref, stream, edges):
    # Holds no node: a hook referring to its own node would keep the graph alive through C++.
    def posthook(grad_inputs, grad_outputs):
        model = _live(ref)
        if model is not None:
            model.leave_node(stream, edges, grad_inputs)
    return posthook


def _prehook(ref, stream, accumulate: bool):
    # Holds the model weakly: nodes (AccumulateGrad kept by DDP wrappers) may outlive the session.
    def prehook(grad_outputs):
        model = _live(ref)
        if model is not None:
            model.enter_node(stream, grad_outputs, accumulate)
    return prehook
