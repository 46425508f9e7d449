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

When two producers on different streams feed one input, the engine adds their gradients on the consumer's stream
after waiting on both: a post-hook on each node sees the second gradient arrive and has the tracker run the next op
reading it (that add) on the consumer's stream.

Known gap: tensor hooks (Tensor.register_hook) run before node pre-hooks, so on the previous node's stream.

Like the engine of torch >= 2.10 on a GPU, the model warns (same text, so the same filters apply) when an
AccumulateGrad node runs on another stream than the one that produced its gradient: the sign that gradient hooks
run off the backward's stream (``hints`` turns the warning into a finding under --streamrace).
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref

import torch
from torch.overrides import TorchFunctionMode

from ...patching import AttrPatch, skip_in_dynamo

_TAG = "streamrace.stream"
MISMATCH = ("The AccumulateGrad node's stream does not match the stream of the node that produced the incoming "
            "gradient.")  # torch's own wording (input_buffer.cpp), so filters written for torch's warning apply


_grad_enabled = torch.is_grad_enabled  # per call of every torch function: one attribute load less


def _grad_fns(out) -> list:
    if isinstance(out, torch.Tensor):
        node = out.grad_fn
        return [node] if node is not None else []
    if isinstance(out, (tuple, list)):
        return [t.grad_fn for t in out if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    return []


class _NewNodes(TorchFunctionMode):
    def __init__(self, model: "VirtualAutograd"):
        super().__init__()
        self.model = model

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **kwargs) if kwargs else func(*args)
        # traced, not run, while compiling: compiled code's nodes are bound when it runs (asked before reading
        # grad_fn, which dynamo cannot trace)
        if _grad_enabled() and not torch.compiler.is_compiling():
            nodes = _grad_fns(out)
            if nodes:
                self.model.adopt(nodes)
        return out


skip_in_dynamo(_NewNodes.__torch_function__)  # the mode is entered around compiled regions too


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
        self._mismatches: set = set()  # (node stream, producer stream) pairs already warned about
        self._deferred = False  # whether `adopt` left nodes without their hooks (one stream seen then)
        self.active = False

    # graph nodes

    def node_stream(self, node):
        """The stream a graph node was bound to, or None."""
        tag = node.metadata.get(_TAG)
        return tag[1] if tag is not None and tag[0] is self._token else None

    def adopt(self, nodes: list) -> None:
        """Bind new graph nodes to the current stream. While the session has seen one stream, the hooks wait: with
        every node on that stream they would only set the stream already current, and two hooks a node cost more
        than the op that made it. The first backward after a second stream appears registers them (`_hook_deferred`).
        """
        stream = self.streams.current()
        stack = list(nodes)
        hooked = self.hb.stream_count > 1
        if not hooked:
            self._deferred = True
        ref = weakref.ref(self)
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

    def _hook_deferred(self, outputs) -> None:
        """Register the hooks `adopt` deferred on the nodes this backward may run (a second stream exists now)."""
        ref = weakref.ref(self)
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

    def adopt_outputs(self, out) -> None:
        """A compiled graph ran: bind the autograd nodes its outputs carry (and the new ones behind them) to the
        stream current at the call, as the function mode does for each eager call."""
        if self.active and torch.is_grad_enabled():
            nodes = _grad_fns(out)
            if nodes:
                self.adopt(nodes)

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

    def _wrap(self, run_backward):
        @functools.wraps(run_backward)
        def wrapper(*args, **kwargs):
            if not self.active:
                return run_backward(*args, **kwargs)
            if self._deferred and self.hb.stream_count > 1:
                self._hook_deferred(args[0] if args else kwargs.get("t_outputs", ()))
            caller = self.streams.current()
            frame = _Backward()
            frames = self._tls.__dict__.setdefault("frames", [])
            frames.append(frame)
            try:
                return run_backward(*args, **kwargs)
            finally:
                frames.pop()
                self.tracker.drain()  # the backward's ops land before its redirects go and the caller waits
                self.tracker.redirect.clear()
                if frames:  # a backward inside a node (checkpointing) belongs to the outer one
                    frames[-1].used.update(frame.used)
                self.streams.set_current(caller)
                for stream in frame.used:
                    if stream is not caller:
                        self.hb.wait_stream(caller, stream)
        return wrapper

    def patches(self) -> list:
        import torch.autograd.graph

        wrapped = self._wrap(torch.autograd.graph._engine_run_backward)
        return [AttrPatch(torch.autograd.graph, "_engine_run_backward", wrapped),
                AttrPatch(torch.autograd, "_engine_run_backward", wrapped), self]

    @property
    def mode(self):
        """The function mode binding new nodes to streams (None while uninstalled); other threads enter it too."""
        return self._mode

    def install(self) -> None:
        self._mode = _NewNodes(self)
        self._mode.__enter__()
        self.active = True

    def uninstall(self) -> None:
        self.active = False
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None


class _Backward:
    """One engine run: the streams its nodes ran on, and which node inputs already received a gradient."""

    def __init__(self):
        self.used: set = set()
        self.buffers: dict = {}


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


def _live(ref):
    """The model a hook reports to, or None: the session ended, or the hook is traced into compiled autograd's graph
    (it then runs on the caller's stream)."""
    if torch.compiler.is_compiling():
        return None
    model = ref()
    return model if model is not None and model.active else None
