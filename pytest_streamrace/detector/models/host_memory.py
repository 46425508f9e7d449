"""Host memory as the program uses it: pinned memory on the virtual backend, and host reads that reach no op.

CPU-only torch has no pinned allocator: ``pin_memory=True`` raises there, so a test of code that stages data through
pinned buffers could not run on CPU CI. Under the virtual backend ``PinnedMemory`` makes ``pin_memory=True`` (the
factories), ``Tensor.pin_memory()``, ``Tensor.is_pinned()``, DataLoader's ``pin_memory=True`` (its pin thread, or
the loading loop) and memory registered in place (``torch.cuda._pin_memory_utils``) work, each pinned tensor a host
storage (``host_party``): what tells host memory apart from the CPU
memory standing for the device's. ``.to(device)`` of a pinned tensor is a copy to the device, as on a GPU (on the CPU
it would hand back the pinned tensor itself, and the device would compute in the host's buffer).

On both backends ``HostBufferReads`` sees the host read a host storage where no op runs: ``.numpy()``, ``.tolist()``
and the buffer protocol (``__array__``). Only plain tensors, and only while host storages exist: other code pays one
set test per call.
"""

from __future__ import annotations

import functools
import warnings

import torch

from ...patching import AttrPatch, WrapPatch

# torch's factories that take pin_memory=True (through TensorOptions), those present in this torch
_FACTORIES = ("empty", "empty_strided", "empty_permuted", "zeros", "ones", "full", "rand", "randn", "randint",
              "randperm", "arange", "tensor", "empty_like", "zeros_like", "ones_like", "full_like", "rand_like",
              "randn_like")
_PLAIN = (torch.Tensor, torch.nn.Parameter)


class PinnedMemory:
    """Patches (virtual backend): pinning works, and marks its tensors host storages."""

    def __init__(self, tracker):
        self.tracker = tracker

    def rebind(self, tracker) -> None:
        """The next session's tracker: the patches are built once per process (``session``), and read it per call."""
        self.tracker = tracker

    def _factory(self, original):
        model = self

        @functools.wraps(original)
        def factory(*args, pin_memory=False, **kwargs):
            out = original(*args, **kwargs)
            if pin_memory and isinstance(out, torch.Tensor):
                model.tracker.mark_host(out)
            return out
        return factory

    def _pin_memory(self, original):
        model = self

        @functools.wraps(original)
        def pin_memory(tensor, device=None):
            tracker = model.tracker
            if tracker.is_host(tensor):
                return tensor  # pinned already: torch hands the tensor back
            with torch.no_grad():
                out = torch.empty_like(tensor, memory_format=torch.preserve_format)
                tracker.mark_host(out)
                out.copy_(tensor)  # the host copies into its new pinned buffer: the host's op
            return out.requires_grad_(tensor.requires_grad) if tensor.is_leaf else out
        return pin_memory

    def _is_pinned(self, original):
        model = self

        @functools.wraps(original)
        def is_pinned(tensor, device=None):
            return model.tracker.is_host(tensor)
        return is_pinned

    def _to(self, original):
        model = self

        @functools.wraps(original)
        def to(tensor, *args, **kwargs):
            out = original(tensor, *args, **kwargs)
            tracker = model.tracker
            if out is tensor and tracker.hosts and tensor.__class__ in _PLAIN and not torch.compiler.is_compiling() \
                    and tracker.is_host(tensor) and _names_device(args, kwargs):
                copy = torch.empty_like(tensor)  # the device's own memory, as a GPU's .to(device) makes
                copy.copy_(tensor, non_blocking=bool(kwargs.get("non_blocking", False)))
                return copy
            return out
        return to

    def patches(self) -> list:
        patches: list = [_FactoryPatch(torch, name, self._factory) for name in _FACTORIES if hasattr(torch, name)]
        patches += [WrapPatch(torch.Tensor, "pin_memory", self._pin_memory),
                    WrapPatch(torch.Tensor, "is_pinned", self._is_pinned),
                    WrapPatch(torch.Tensor, "to", self._to)]
        patches += self._loader_patches()
        try:  # torch's cudaHostRegister helpers (DCP's stager pins so), in the releases that have them
            import torch.cuda._pin_memory_utils as registered
        except ImportError:
            return patches
        patches += [AttrPatch(registered, "pin_memory", self._register),
                    AttrPatch(registered, "unpin_memory", self._unregister)]
        return patches

    def _register(self, data_ptr: int, size: int) -> None:
        """Memory registered as pinned where it is: a host storage, from the address of its start."""
        self.tracker.mark_host_address(int(data_ptr))

    def _unregister(self, data_ptr: int) -> None:
        self.tracker.forget_host_address(int(data_ptr))

    def _loader_patches(self) -> list:
        """DataLoader(pin_memory=True) pins as on a GPU host: its iterator asks for an accelerator, which the virtual
        backend does not claim to have (code that branches on one keeps the CPU), so the iterator is told to pin. With
        workers torch pins on a thread of its own, which selects the device through ``torch.accelerator`` (virtual
        here) in recent releases and through ``torch.cuda`` (no device here) in older ones (2.6): there the batches
        are pinned as the iterator hands them out, on the thread that takes them."""
        from torch.utils.data import dataloader  # imported with torch
        from torch.utils.data._utils import pin_memory

        base = dataloader._BaseDataLoaderIter
        original = base.__init__
        thread_pins = "accelerator" in pin_memory._pin_memory_loop.__code__.co_names

        @functools.wraps(original)
        def __init__(iterator, loader, *args, **kwargs):
            with warnings.catch_warnings():
                if loader.pin_memory:
                    warnings.filterwarnings("ignore", message=".*pin_memory.*")
                original(iterator, loader, *args, **kwargs)
            if loader.pin_memory:
                pins_here = not thread_pins and bool(loader.num_workers)
                iterator._pin_memory, iterator._pin_memory_device = not pins_here, "cuda"
                iterator._streamrace_pins_here = pins_here
        patches = [AttrPatch(base, "__init__", __init__)]
        if thread_pins:
            return patches
        next_batch = base.__next__

        @functools.wraps(next_batch)
        def __next__(iterator):
            batch = next_batch(iterator)
            return pin_memory.pin_memory(batch, "cuda") if getattr(iterator, "_streamrace_pins_here", False) else batch
        return patches + [AttrPatch(base, "__next__", __next__)]


class _FactoryPatch(WrapPatch):
    """A torch factory wrapped while installed, and known to TorchScript as the op it wraps: TorchScript compiles a
    call to ``torch.zeros`` by the function's identity, and would try to compile a wrapper it does not know from its
    source."""

    def install(self) -> None:
        from torch.jit import _builtins

        _builtins._get_builtin_table()  # built from torch's attributes: before any of them is a wrapper
        super().install()
        op = _builtins._find_builtin(self._original)
        if op is not None:
            _builtins._register_builtin(self.value, op)

    def uninstall(self) -> None:
        from torch.jit import _builtins

        _builtins._get_builtin_table().pop(id(self.value), None)
        super().uninstall()


def _names_device(args, kwargs) -> bool:
    """Whether a Tensor.to call names a device (a copy between memories), not only a dtype."""
    for value in (*args, kwargs.get("device")):
        if isinstance(value, (str, torch.device)) or (isinstance(value, int) and not isinstance(value, bool)):
            return True
    return False


class HostBufferReads:
    """Patches (both backends): the host reading a host storage without an op."""

    def __init__(self, tracker):
        self.tracker = tracker

    rebind = PinnedMemory.rebind

    def _wrap(self, name: str, original):
        model = self

        @functools.wraps(original)
        def method(tensor, *args, **kwargs):
            tracker = model.tracker
            if tracker.hosts and tensor.__class__ in _PLAIN and tracker.enabled and not torch.compiler.is_compiling():
                done = tracker.host_access(f".{name}()", reads=[tensor])
                if done is not None:  # a forced run's place: told when the read is over
                    try:
                        return original(tensor, *args, **kwargs)
                    finally:
                        done()
            return original(tensor, *args, **kwargs)
        return method

    def patches(self) -> list:
        return [WrapPatch(torch.Tensor, name, functools.partial(self._wrap, name))
                for name in ("numpy", "tolist", "__array__")]


class AsyncCopies:
    """Patches (cuda backend): a ``non_blocking`` copy between the device and pinned memory makes its host side a host
    storage (``host_party``), before the op where the host side is its source or destination (so that the capture
    records it), after it where the copy makes it (``.to("cpu", non_blocking=True)``: torch pins its output)."""

    def __init__(self, tracker):
        self.tracker = tracker

    rebind = PinnedMemory.rebind

    def _host(self, t) -> bool:
        return t.__class__ in _PLAIN and t.is_cpu and t.is_pinned()

    def _copy_(self, original):
        model = self

        @functools.wraps(original)
        def copy_(dst, src, non_blocking=False):
            if non_blocking and isinstance(src, torch.Tensor) and not torch.compiler.is_compiling() and \
                    model.tracker.enabled:
                if dst.is_cuda and model._host(src):
                    model.tracker.mark_host(src)
                elif src.is_cuda and model._host(dst):
                    model.tracker.mark_host(dst)
            return original(dst, src, non_blocking)
        return copy_

    def _to(self, original, name: str):
        model = self

        @functools.wraps(original)
        def to(tensor, *args, **kwargs):
            tracker = model.tracker
            asked = (kwargs.get("non_blocking") or any(a is True for a in args[:3])) and \
                not torch.compiler.is_compiling() and tracker.enabled
            if asked and tensor.is_cpu and model._host(tensor):
                tracker.mark_host(tensor)  # a copy to the device reads it
            out = original(tensor, *args, **kwargs)
            if asked and out is not tensor and tensor.is_cuda and isinstance(out, torch.Tensor) and model._host(out):
                tracker.mark_host(out)
                tracker.copied_to_host(out, name)
            return out
        return to

    def patches(self) -> list:
        return [WrapPatch(torch.Tensor, "copy_", self._copy_),
                WrapPatch(torch.Tensor, "to", lambda original: self._to(original, ".to()")),
                WrapPatch(torch.Tensor, "cuda", lambda original: self._to(original, ".cuda()"))]
