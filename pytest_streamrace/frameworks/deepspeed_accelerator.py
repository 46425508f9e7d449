"""A DeepSpeed accelerator whose streams and events are ``torch.cuda``'s — the virtual ones on CPU.

DeepSpeed's own CPU accelerator reports a synchronized device without streams, so ZeRO's ``overlap_comm`` code paths
(reduction stream, copy streams, record_stream, reuse events) never run on CPU. This one is the CPU accelerator with
streams: under the virtual backend ZeRO's real stream logic runs on gloo and the detector sees every ordering it makes.
It also refuses the shared-memory communication op, which DeepSpeed would otherwise try to build with a C++ toolchain.
"""

from __future__ import annotations

import contextlib


def virtual_stream_accelerator():
    """A fresh accelerator object; ``torch.cuda`` must be the virtual one while DeepSpeed uses it."""
    import torch
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    class VirtualStreamAccelerator(CPU_Accelerator):
        def __init__(self):
            super().__init__()
            self._communication_backend_name = "gloo"

        # CPU_Accelerator answers True to these three, which switches ZeRO's stream logic off.
        def is_synchronized_device(self):
            return False

        def resolves_data_dependency(self):
            return False

        def handles_memory_backpressure(self):
            return False

        @property
        def Stream(self):
            return torch.cuda.Stream

        @property
        def Event(self):
            return torch.cuda.Event

        def stream(self, stream):
            return torch.cuda.stream(stream)

        def current_stream(self, device_index=None):
            return torch.cuda.current_stream()

        def default_stream(self, device_index=None):
            return torch.cuda.default_stream()

        def synchronize(self, device_index=None):
            return torch.cuda.synchronize()

        # CPU_Accelerator's pinning is a no-op; the virtual backend pins (emulated), so ZeRO-Offload's pinned
        # buffers are host memory as on a GPU host, and the host's accesses to them are checked. Written here, not
        # borrowed from DeepSpeedAccelerator: its pinning helpers differ between DeepSpeed releases.
        def pin_memory(self, tensor, *args, make_copy=True, match_shape=True, **kwargs):
            if make_copy:
                return tensor.pin_memory()
            return tensor.new_empty(tensor.shape if match_shape else (tensor.numel(),), pin_memory=True)

        def is_pinned(self, tensor):
            return tensor.is_pinned()

        def get_op_builder(self, class_name):
            if class_name == "ShareMemCommBuilder":
                return None  # would JIT-build a C++ extension; gloo does the work
            return super().get_op_builder(class_name)

    return VirtualStreamAccelerator()


@contextlib.contextmanager
def deepspeed_on_virtual_streams():
    """Make DeepSpeed use the virtual-stream accelerator for the duration; the previous one is restored after.
    Needs an active Detector with the virtual backend: its torch.cuda streams are the ones DeepSpeed gets."""
    from deepspeed.accelerator import real_accelerator

    from ..detector.session import active
    from ..patching import patched

    detector = active()
    if detector is None or detector.backend != "virtual":
        raise RuntimeError("streamrace: deepspeed_on_virtual_streams() needs an active Detector(backend='virtual') "
                           "(enter it first, or run under --streamrace on CPU)")
    with patched(real_accelerator, "ds_accelerator", real_accelerator.ds_accelerator):  # the previous one comes back
        real_accelerator.set_accelerator(virtual_stream_accelerator())  # DeepSpeed's own checks of an accelerator
        yield real_accelerator.ds_accelerator
