"""Functional collectives (``torch.ops._c10d_functional``): what DTensor, compiled FSDP/TP and Inductor's generated
code issue instead of ``torch.distributed`` calls.

Each op issues its collective on the process group's communication stream (NCCL's, the one c10d collectives use)
after the caller's current stream, and returns at once: the output (a fresh tensor, or the input for the in-place
``*_`` / ``*_out`` forms) is written there, the input read there. Only ``wait_tensor(output)`` orders the waiting
stream after the collective (``AsyncCollectiveTensor`` calls it at first use; compiled code calls it where Inductor put
the wait). torch keeps one registered work per output storage and drops it at the first wait, so a second
``wait_tensor`` orders nothing — here too. Inputs and outputs are kept alive by the work until it is waited (the
backend stashes them), so their frees are safe: modelled as ``record_stream`` on the communication stream.

The ops reach the dispatch mode as ATen ops of their own namespace, and the C++ capture queues them as they return, with
their outputs, the issuing thread's stream and stack, in order with the ops around them; what they run inside (a
clone, the c10d op on the group) is theirs and not seen.
"""

from __future__ import annotations

from typing import Callable, Hashable

from .collectives import _stream_name

NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")

# op -> (user-facing name, how it touches its tensors): "out" reads its input(s) and writes fresh outputs, "inplace"
# writes its input(s) (reads them first), "out_arg" writes its `out` argument, "root" is a broadcast (the source
# reads, the others write), "p2p" names its peer and direction itself.
_OPS = {
    "all_reduce": ("all_reduce", "out"),
    "all_reduce_": ("all_reduce", "inplace"),
    "all_reduce_coalesced": ("all_reduce (coalesced)", "out"),
    "all_reduce_coalesced_": ("all_reduce (coalesced)", "inplace"),
    "all_gather_into_tensor": ("all_gather_into_tensor", "out"),
    "all_gather_into_tensor_out": ("all_gather_into_tensor", "out_arg"),
    "all_gather_into_tensor_coalesced": ("all_gather_into_tensor (coalesced)", "out"),
    "reduce_scatter_tensor": ("reduce_scatter_tensor", "out"),
    "reduce_scatter_tensor_out": ("reduce_scatter_tensor", "out_arg"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter_tensor (coalesced)", "out"),
    "all_to_all_single": ("all_to_all_single", "out"),
    "broadcast": ("broadcast", "root"),
    "broadcast_": ("broadcast", "root"),
    "isend": ("send", "p2p"),
    "irecv": ("recv", "p2p"),
}


class _Issued:
    """The hb event of one functional collective's completion (weakly held by hb, kept by the outputs' entries)."""

    __slots__ = ("__weakref__",)


def _tensors(value) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


class FunctionalCollectives:
    """A patch (install/uninstall) registering the namespace handler of the functional collective ops."""

    def __init__(self, hb, tracker, current_stream: Callable[[], Hashable]):
        self.hb = hb
        self.tracker = tracker
        self.current_stream = current_stream
        self._streams: set = set()
        self._pending: dict = {}  # storage key of an output -> _Issued (torch's work registry, per storage)
        self._keys: dict = {}  # (group name, peer) -> its communication stream's key (a name resolves once)

    def on_op(self, func, args, kwargs, out, phase: str = "once", stream: Hashable | None = None,
              frames=None) -> None:
        """A functional collective or wait, as it returned: on the issuing thread (the dispatch mode) or from the
        capture's records, with that thread's `stream` and `frames`."""
        current = self.current_stream() if stream is None else stream
        op = func._overloadpacket.__name__
        if op == "wait_tensor":
            self._waited(args[0] if args else kwargs.get("tensor"), current)
        elif op == "batch_p2p_ops":
            self._batch_p2p(func, args, kwargs, out, current, frames)
        elif op in _OPS:
            self._issued(op, func, args, kwargs, out, current, frames)
        # anything else in the namespace (``_wrap_tensor_autograd``) moves no bytes

    def _issued(self, op: str, func, args, kwargs, out, current, frames) -> None:
        name, kind = _OPS[op]
        values = _bound(func, args, kwargs)
        group = values.get("group_name")  # resolved only where the op needs the group itself (a root's rank)
        peer = None
        inputs = _tensors(values.get("input", values.get("inputs", values.get("tensor"))))
        reads, writes = inputs, _tensors(out)
        if kind == "inplace":
            writes = inputs
        elif kind == "out_arg":
            writes = _tensors(values.get("out"))
        elif kind == "root":  # the source sends its tensor, the others receive into theirs
            touched = _tensors(out) if op == "broadcast" else inputs  # broadcast: into a clone of the input
            group = _group(group)
            sends = group is not None and values.get("src") == group.rank()
            reads, writes = (touched, []) if sends else ([], touched)
        elif kind == "p2p":
            peer = values.get("dst", values.get("src"))
            reads, writes = (inputs, []) if op == "isend" else ([], inputs)
        self._collective(name, group, peer, reads, writes, _tensors(out) or inputs, current, frames)

    def _batch_p2p(self, func, args, kwargs, out, current, frames) -> None:
        values = _bound(func, args, kwargs)
        group = values.get("group_name")
        for kind, peer, tensor in zip(values.get("op_list", ()), values.get("peer_list", ()),
                                      _tensors(values.get("tensors"))):
            send = "send" in str(kind)
            self._collective("send" if send else "recv", group, peer, [tensor] if send else [],
                             [] if send else [tensor], [tensor], current, frames)

    def _collective(self, name: str, group, peer, reads, writes, waited_on, current, frames) -> None:
        comm = self._comm_stream(group, peer)
        self.hb.wait_stream(comm, current)
        self.tracker.run(name, comm, reads, writes, frames)
        issued = _Issued()
        self.hb.record_event(issued, comm)
        for t in [*reads, *writes]:  # stashed by the work until it is waited: safe to drop
            key = self.tracker.storage_key(t) if self.tracker.on_device(t) else None
            if key is not None:
                self.hb.record_stream(key, comm)
        for t in waited_on:
            key = self.tracker.storage_key(t) if self.tracker.on_device(t) else None
            if key is not None:
                self._pending[key] = issued

    def _waited(self, tensor, current) -> None:
        """wait_tensor: the current stream is ordered after the collective that produced `tensor` (once)."""
        if tensor is None or not self.tracker.on_device(tensor):
            return
        key = self.tracker.storage_key(tensor)
        issued = self._pending.pop(key, None)
        if issued is None:
            return  # waited already, or issued where nothing saw it: torch's wait is a no-op then too
        # a coalesced op's other outputs keep their entries: waiting on one of them later waits (again) in torch too
        self.hb.wait_event(current, issued)

    def _comm_stream(self, group, peer) -> Hashable:
        """The hb key of the communication stream of `group` (a ProcessGroup, its name, or boxed), with `peer`."""
        key = self._keys.get((group, peer)) if isinstance(group, str) else None
        if key is not None:
            return key
        group_name, group = group, _group(group)
        key = ("communication", group.group_name if group is not None else "?", peer)
        if key not in self._streams:
            self._streams.add(key)
            self.hb.add_stream(key, _stream_name(group, peer))
        if group is not None and isinstance(group_name, str):  # a name, once resolved, keys the same stream
            self._keys[(group_name, peer)] = key
        return key

    # patch protocol

    def patches(self) -> list:
        return [self]

    def install(self) -> None:
        for namespace in NAMESPACES:
            self.tracker.namespace_handlers[namespace] = self.on_op

    def uninstall(self) -> None:
        for namespace in NAMESPACES:
            self.tracker.namespace_handlers.pop(namespace, None)
        self._pending.clear()


_ARGUMENT_NAMES: dict[int, tuple] = {}  # id(op) -> (op, its arguments' names): a schema read costs microseconds


def _bound(func, args, kwargs) -> dict:
    """The op's arguments by schema name."""
    known = _ARGUMENT_NAMES.get(id(func))
    if known is None or known[0] is not func:  # (the op is held: its id is not handed to another)
        known = _ARGUMENT_NAMES[id(func)] = (func, [a.name for a in func._schema.arguments])
    values = dict(zip(known[1], args))
    values.update(kwargs)
    return values


def _group(group_name):
    """The ProcessGroup a functional op names (a group name, or the group itself); None when it cannot be told."""
    from torch._C._distributed_c10d import ProcessGroup, _resolve_process_group

    try:
        if isinstance(group_name, ProcessGroup):
            return group_name
        if isinstance(group_name, str):
            return _resolve_process_group(group_name)
        return ProcessGroup.unbox(group_name)  # the group itself, boxed (from the C++ capture's records)
    except (RuntimeError, TypeError, ValueError):
        return None
