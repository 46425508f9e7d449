"""Megatron-core on CPU: its ``torch.cuda`` devices land on CPU, its streams are the virtual ones.

Megatron-core's DDP has no CPU path: it allocates its gradient buffers with ``device=torch.cuda.current_device()``
and creates its communication stream with ``torch.cuda.Stream(device=torch.cuda.current_device())``. Under the
virtual backend ``torch.cuda.Stream`` is already the virtual stream; this context adds what is missing without
touching megatron-core's files: ``torch.cuda.current_device()`` answers 0 (as on a one-GPU rank), and a torch
function mode turns every CUDA device argument (``0``, ``"cuda"``, ``"cuda:1"``, ``torch.device("cuda")``) and
``Tensor.cuda()`` into CPU, and ``Tensor.type()`` names a CPU tensor's type as CUDA's (``torch.cuda.FloatTensor``:
megatron's optimizers accept parameters by that name). Megatron's own stream logic then runs unchanged, on gloo,
under the detector.

megatron-core 0.15.2 also JIT-builds a CUDA allocator extension when it is imported
(``megatron/core/inference/unified_memory.py``). A CPU build of torch has no CUDA_HOME, so ``load_inline`` fails at
once (no compiler runs) and megatron warns "Failed to create unified memory mempool"; only the build directory is
created. ``prepare_import()`` points TORCH_EXTENSIONS_DIR at a private cache before that import, on CPU and GPU alike.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

CUDA_TYPES = ("cuda",)


def private_extensions_dir() -> str:
    """The per-user cache `prepare_import` points TORCH_EXTENSIONS_DIR at."""
    return os.path.join(tempfile.gettempdir(), f"streamrace-torch-extensions-{os.getuid()}")


def prepare_import() -> None:
    """Call before importing megatron-core. TORCH_EXTENSIONS_DIR (unless set) becomes a per-user cache, so its
    import-time JIT build neither writes into ~/.cache nor collides with other checkouts; with a GPU,
    TORCH_CUDA_ARCH_LIST (unless set) becomes this GPU's, since torch's own guess can stop the build with
    "invalid literal for int()" — a ValueError megatron does not catch."""
    import torch

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", private_extensions_dir())
    if torch.cuda.is_available() and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        major, minor = torch.cuda.get_device_capability()
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"


def _is_cuda(device) -> bool:
    import torch

    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a bare index is a CUDA ordinal in torch
    if isinstance(device, str):
        return device.split(":", 1)[0] in CUDA_TYPES
    return isinstance(device, torch.device) and device.type in CUDA_TYPES


def _cpu_mode():
    import torch
    from torch.overrides import TorchFunctionMode

    cpu = torch.device("cpu")

    class CudaDevicesOnCpu(TorchFunctionMode):
        """Rewrites CUDA device arguments to CPU (``device=`` anywhere, ``.to(0)``/``.to("cuda")``, ``.cuda()``);
        ``.type()`` of a CPU tensor answers its CUDA type name."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is torch.Tensor.cuda:  # (modes are off inside their own handler: .to is not seen again)
                return args[0].to(cpu, non_blocking=kwargs.get("non_blocking", False))
            if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].device.type == "cpu":
                return func(*args).replace("torch.", "torch.cuda.", 1)  # torch.FloatTensor -> torch.cuda.FloatTensor
            if "device" in kwargs and _is_cuda(kwargs["device"]):
                kwargs["device"] = cpu
            if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):  # .to(0), .to("cuda")
                args = (args[0], cpu, *args[2:])
            return func(*args, **kwargs)

    return CudaDevicesOnCpu()


@contextlib.contextmanager
def megatron_on_virtual_streams():
    """For the duration, megatron-core's CUDA devices are CPU and its streams the virtual ones. Needs an active
    Detector with the virtual backend (enter it first, or run under --streamrace on CPU)."""
    import torch

    from ..detector.session import active
    from ..patching import patched

    detector = active()
    if detector is None or detector.backend != "virtual":
        raise RuntimeError("streamrace: megatron_on_virtual_streams() needs an active Detector(backend='virtual') "
                           "(enter it first, or run under --streamrace on CPU)")
    with patched(torch.cuda, "current_device", lambda: 0), _cpu_mode():
        yield
