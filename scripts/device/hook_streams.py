"""DeepSpeed #8061 as reported: on which stream do gradient hooks run when torch itself — compile, compiled autograd,
forward work on several streams — decides, with no stream_bound_accumulators? Prints, per mode, the stream each
parameter's post-accumulate-grad hook saw.

    python scripts/device/hook_streams.py          # GPU: real streams; CPU: the virtual backend's model of them

Two Linear layers, the first run on side stream A and the second on side stream B in forward; backward called on the
default stream. Eager autograd runs each AccumulateGrad node (and its hooks) on the stream current when the node was
created (the forward stream of its first use), so hooks land on A and B; the question is what compile does to that.
"""

from __future__ import annotations

import contextlib
import sys

import torch


def run(mode: str) -> dict:
    torch._dynamo.reset()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8, device=device), torch.nn.Linear(8, 8, device=device)
    streams = {"A": torch.cuda.Stream(), "B": torch.cuda.Stream()}

    def label():
        current = torch.cuda.current_stream()
        if current == torch.cuda.default_stream():
            return "default"
        return next((k for k, s in streams.items() if s == current), "other")

    seen = {}

    def hook(name):
        def record(p):
            seen.setdefault(name, label())
        return record
    for name, p in [("a.weight", a.weight), ("b.weight", b.weight)]:
        p.register_post_accumulate_grad_hook(hook(name))

    def forward(x):
        with torch.cuda.stream(streams["A"]):
            h = a(x)
        streams["B"].wait_stream(streams["A"])
        with torch.cuda.stream(streams["B"]):
            out = b(h).sum()
        torch.cuda.current_stream().wait_stream(streams["B"])
        return out

    x = torch.ones(4, 8, device=device)
    for s in streams.values():
        s.wait_stream(torch.cuda.current_stream())
    fn = forward if mode == "eager" else torch.compile(forward)
    loss = fn(x)
    ctx = contextlib.nullcontext()
    if mode == "compiled_autograd":
        from torch._dynamo import compiled_autograd

        ctx = compiled_autograd._enable(torch.compile)
    with ctx:
        loss.backward()
    torch.cuda.synchronize()
    return seen


def main() -> int:
    gpu = torch.cuda.is_available()
    print(f"torch {torch.__version__} on {'cuda' if gpu else 'CPU (virtual streams)'}")
    print(f"{'mode':20} {'a.weight hook':>14} {'b.weight hook':>14}")
    for mode in ("eager", "compile", "compiled_autograd"):
        if gpu:
            detector = contextlib.nullcontext()
        else:
            from pytest_streamrace.detector.session import Detector

            detector = Detector("virtual")
        with detector:
            try:
                seen = run(mode)
                print(f"{mode:20} {seen.get('a.weight', '-'):>14} {seen.get('b.weight', '-'):>14}")
            except Exception as exc:
                print(f"{mode:20} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
