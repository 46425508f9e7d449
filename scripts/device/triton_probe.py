"""Why a pointwise Triton kernel's launch is (not) seen by the cuda backend: what Inductor's generated module holds,
whether its launch goes through the patched CachingAutotuner.run, and which roles the hook reads from it.

    python scripts/device/triton_probe.py      # on a GPU, under the same torch as the device image
"""
import sys

import torch

from pytest_streamrace.detector.models import compiled
from pytest_streamrace.detector.session import Detector


def f(x, y):
    return (x * 2 + y).sin()


def main() -> int:
    cf = torch.compile(f)
    launches = []
    with Detector(backend="cuda", trace=True) as d:
        model = compiled._model()
        original = model.launch
        model.launch = lambda name, args, roles, stream=None: (launches.append((name, roles, stream)),
                                                              original(name, args, roles, stream))
        x, y = torch.ones(1 << 20, device="cuda"), torch.ones(1 << 20, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = cf(x, y)
        out.sum()
        from torch._inductor import codecache
        from torch._inductor.runtime import triton_heuristics as th

        print("CachingAutotuner.run patched:", th.CachingAutotuner.run.__name__ == "launch",
              th.CachingAutotuner.run)
        for module in codecache.PyCodeCache.modules:
            for name, value in vars(module).items():
                if name.startswith("triton_"):
                    fn = getattr(value, "fn", None)
                    print(f"  {module.__name__}.{name}: {type(value).__mro__[:3]} fn={type(fn)} "
                          f"arg_names={getattr(fn, 'arg_names', None)} "
                          f"signature={list((getattr(value, 'triton_meta', None) or {}).get('signature', {}) or ())} "
                          f"mutated={getattr(value, 'mutated_arg_names', None)} kernel={compiled._triton_kernel(value)}")
        print("launches seen:", launches)
        print("races:", [(r.kind, r.earlier.op.site.op, r.later.op.site.op) for r in d.races])
        print("timeline:", [(op.site.op, d.stream_name(op.stream)) for op in d.timeline][-8:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
