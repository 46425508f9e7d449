"""The ops CUDA makes the host wait for: one table for both backends.

A value read back to the host — ``.item()``, a copy to host memory, an op whose output size depends on the data —
blocks the host until the stream that ran it gets there, so work the host issues next, on any stream, is ordered
after that stream's work so far. Code relies on it (DeepSpeed ZeRO-3's trace check reads a flag with ``.item()``),
and the virtual backend must model the same waits or it reports races a GPU cannot have.

A blocking copy from host memory to the device waits too (torch synchronizes the copy's stream after it).

Not host-synchronous, so not here: ``non_blocking=True`` copies into pinned memory (``.to("cpu", non_blocking=True)``
allocates its output pinned), ``nonzero_static``, ``repeat_interleave`` given ``output_size``.

Each entry names the sync as a person would (``name``), for reports that say which read-back ordered two accesses,
and may carry a rule on the op's arguments for ops that sync only sometimes. Rules read tensors by duck typing (no
torch import here); ``device`` is the modelled device's type ("cuda", or "cpu" under virtual streams, where every
tensor is on the device and a host copy is seen at the Tensor method instead: ``METHODS``).

Where no arguments are at hand (the cuda backend's C++ capture), only unconditional entries apply; the conditional
ones sync through ``cudaStreamSynchronize`` there, which torch's GPU trace reports by itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Callable

Rule = Callable[[tuple, dict, str], bool]  # (args, kwargs, modelled device type) -> whether the host waits


@dataclass(frozen=True)
class HostSync:
    name: str  # what the program wrote: ".item()", ".cpu()", "nonzero"
    rule: Rule | None = None  # None: always

    def applies(self, args: tuple, kwargs: dict, device: str) -> bool:
        return self.rule is None or bool(self.rule(args, kwargs, device))


def _arg(args: tuple, kwargs: dict, i: int, name: str, default=None):
    return args[i] if i < len(args) else kwargs.get(name, default)


def _device_type(value) -> str | None:
    device = getattr(value, "device", value)
    return getattr(device, "type", None) if not isinstance(device, str) else device.split(":")[0]


def _to_host(args, kwargs, device) -> bool:
    """``_to_copy`` from the device to the host, blocking (a non-blocking one gets a pinned output: no wait)."""
    src, dst = _arg(args, kwargs, 0, "self"), kwargs.get("device")
    return (dst is not None and _device_type(src) == device and _device_type(dst) != device
            and not kwargs.get("non_blocking", False))


def _pinned(tensor) -> bool:
    try:
        return bool(tensor.is_pinned())
    except Exception:  # a tensor that cannot say (meta, some subclasses): not host memory we know of
        return False


def _copy_with_host(args, kwargs, device) -> bool:
    """``host.copy_(device_tensor)``: blocking, or non-blocking into pageable memory (cudaMemcpyAsync returns only
    once such a copy is done). ``device_tensor.copy_(host)``: blocking (torch copies and then synchronizes the copy's
    stream, ``memcpy_and_sync``, for a copy between host and device either way). Under virtual streams (`device` "cpu")
    host memory is what is pinned, and a copy to the host is seen elsewhere (``METHODS``, host storages)."""
    dst, src = _arg(args, kwargs, 0, "self"), _arg(args, kwargs, 1, "src")
    non_blocking = _arg(args, kwargs, 2, "non_blocking", False)
    if device == "cpu":
        return not non_blocking and _pinned(src) and not _pinned(dst)
    if _device_type(dst) == device and _device_type(src) == "cpu":
        return not non_blocking
    if _device_type(src) != device or _device_type(dst) == device:
        return False
    return not non_blocking or not dst.is_pinned()


def _device_masks(indices, device: str) -> bool:
    """Whether a boolean mask on the device is among the indices (a host mask's nonzero() waits for nothing)."""
    return any(str(getattr(i, "dtype", "")) in ("torch.bool", "torch.uint8") and _device_type(i) == device
               for i in (indices or ()))


def _mask_index(args, kwargs, device) -> bool:
    """``t[mask]``: a boolean index becomes ``nonzero()`` inside the kernel."""
    return _device_masks(_arg(args, kwargs, 1, "indices"), device)


def _mask_assign(args, kwargs, device) -> bool:
    """``t[mask] = v``: as ``t[mask]``, except a one-element host value with accumulate=False (a masked_fill)."""
    if not _device_masks(_arg(args, kwargs, 1, "indices"), device):
        return False
    value, accumulate = _arg(args, kwargs, 2, "values"), _arg(args, kwargs, 3, "accumulate", False)
    masked_fill = not accumulate and getattr(value, "numel", lambda: 0)() == 1 and _device_type(value) != device
    return not masked_fill


def _no_output_size(args, kwargs, device) -> bool:
    return kwargs.get("output_size") is None


def _no_range(args, kwargs, device) -> bool:
    """histc without a range reads the data's min and max back."""
    return _arg(args, kwargs, 2, "min", 0) == _arg(args, kwargs, 3, "max", 0)


def _forced(args, kwargs, device) -> bool:
    """``.numpy()`` of a device tensor needs force=True (it copies to the host first); without it the program could
    only have called it on a host tensor."""
    return bool(_arg(args, kwargs, 0, "force", False))


_ITEM = HostSync(".item()")  # also bool(t), `if t:`, int(t), float(t), printing
_UNIQUE = HostSync("unique")
_TO_HOST = ".cpu() / .to('cpu') / .tolist() / .numpy()"

# ATen ops (as the dispatch mode and the capture name them) -> the sync they make.
OPS: dict[str, HostSync] = {
    "aten::_local_scalar_dense": _ITEM,
    "aten::equal": HostSync("torch.equal"),
    "aten::nonzero": HostSync("nonzero"),  # also torch.where(cond), argwhere
    "aten::masked_select": HostSync("masked_select"),
    "aten::_unique": _UNIQUE,
    "aten::_unique2": _UNIQUE,
    "aten::unique_dim": _UNIQUE,
    "aten::unique_consecutive": HostSync("unique_consecutive"),
    "aten::unique_dim_consecutive": HostSync("unique_consecutive"),
    "aten::bincount": HostSync("bincount"),
    "aten::_linalg_check_errors": HostSync("linalg error check"),  # linalg.inv / cholesky / solve, not their _ex
    "aten::repeat_interleave": HostSync("repeat_interleave without output_size", _no_output_size),
    "aten::histc": HostSync("histc without min/max", _no_range),
    "aten::index": HostSync("boolean-mask indexing t[mask]", _mask_index),
    "aten::index_put_": HostSync("boolean-mask assignment t[mask] = v", _mask_assign),
    "aten::index_put": HostSync("boolean-mask assignment t[mask] = v", _mask_assign),
    "aten::_index_put_impl_": HostSync("boolean-mask assignment t[mask] = v", _mask_assign),
    "aten::_to_copy": HostSync(_TO_HOST, _to_host),
    "aten::copy_": HostSync("copy_ to or from host memory", _copy_with_host),
}

# Tensor methods that copy a device tensor to the host, for the virtual backend, where "device" tensors are host
# memory and these copies run no op at all. Not ``.to("cpu")``: under virtual streams the device *is* the CPU, so it
# cannot be told from ``.to(device)``.
METHODS: dict[str, HostSync] = {
    "cpu": HostSync(".cpu()"),
    "tolist": HostSync(".tolist()"),
    "numpy": HostSync(".numpy(force=True)", _forced),
}


# Explicit syncs a program makes for another purpose — a framework's timers synchronize the device to time a step —
# order its streams today as incidentally as a read-back does. A user names the files they come from (the
# ``incidental-sync:`` rule, docs/how-to/adopting.md); syncs made from there count as implicit in the latent view.

IMPLICIT = "an implicit host sync"  # the name of a sync the cuda model could not tie to an op


def path_matches(path: str, glob: str) -> bool:
    """A glob against a whole path or a trailing part of one (``deepspeed/utils/timer.py``); the suppression rules'
    ``file:`` terms match the same way."""
    path = path.replace(os.sep, "/")
    return fnmatchcase(path, glob) or fnmatchcase(path, "*/" + glob.lstrip("/"))


def incidental(frames, globs) -> bool:
    """Whether a sync whose user frames (innermost first) are `frames` was made from one of the files `globs` name."""
    return any(path_matches(filename, glob) for filename, _, _ in frames for glob in globs)
