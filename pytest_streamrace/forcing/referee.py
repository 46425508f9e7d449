"""Numeric referee: the forced run must give bit-identical numbers to a reference run, or say where it does not.

Stream races show as wrong numbers, not exceptions. Running the same step in a forced configuration (several
streams, delays) and a reference one (one stream, no overlap) and comparing exactly turns them into a test failure
that names the first parameter that differs. A deterministic step is assumed: run the reference twice to check that.

NaN poisoning: a stale read of a reused buffer returns the previous step's bytes, which are plausible numbers and
easy to miss. `poisoned_collective_inputs` fills each collective's *input* buffer with NaN right after the
collective returns — on the caller's current stream, which a synchronous collective has ordered after its read — so
a later read that comes before the buffer's next proper write sees NaN, the symptom users report. Inputs of
all_reduce/broadcast are also its outputs and are never poisoned; neither are async collectives (async_op=True).
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from ..patching import patched

POISONED = {  # collective -> which argument holds the input it only reads
    "reduce_scatter_tensor": ("input", 1),
    "all_gather_into_tensor": ("input_tensor", 1),
    "reduce_scatter": ("input_list", 1),
    "all_gather": ("tensor", 1),
}


@dataclass
class NumericVerdict:
    """The comparison of a forced run with its reference."""

    identical: bool
    compared: int  # tensors compared
    max_rel_error: float  # max |forced - ref| / max |ref| over all tensors (0.0 when identical)
    first_difference: str | None  # name of the first tensor that differs, in the step's order
    nonfinite: list[str] = field(default_factory=list)  # forced tensors holding NaN/Inf where the reference did not
    missing: list[str] = field(default_factory=list)  # names one run produced and the other did not

    def __bool__(self) -> bool:
        return self.identical

    def __str__(self) -> str:
        if self.identical:
            return f"referee: bit-identical ({self.compared} tensors)"
        parts = [f"referee: forced run differs from reference: max relative error {self.max_rel_error:.3g}"]
        if self.first_difference:
            parts.append(f"first difference in {self.first_difference}")
        if self.nonfinite:
            parts.append(f"NaN/Inf in {', '.join(self.nonfinite[:5])}" + (" ..." if len(self.nonfinite) > 5 else ""))
        if self.missing:
            parts.append(f"only in one run: {', '.join(self.missing)}")
        return "; ".join(parts)


def _named_tensors(result, what: str) -> dict[str, torch.Tensor]:
    if isinstance(result, torch.nn.Module):
        if what == "grads":
            return {n: p.grad for n, p in result.named_parameters() if p.grad is not None}
        return dict(result.named_parameters())
    if isinstance(result, Mapping):
        return dict(result)
    raise TypeError(f"streamrace: referee: the step function must return a torch.nn.Module or a mapping "
                    f"name -> tensor, got {type(result).__name__}")


def _snapshot(result, what: str) -> dict[str, torch.Tensor]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return {n: t.detach().to("cpu", copy=True) for n, t in _named_tensors(result, what).items()}


def compare(forced: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> NumericVerdict:
    """Exact comparison, tensor by tensor in the reference's order."""
    missing = sorted(set(forced) ^ set(reference))
    first, worst, nonfinite, compared = None, 0.0, [], 0
    for name, ref in reference.items():
        got = forced.get(name)
        if got is None:
            continue
        compared += 1
        if got.shape != ref.shape or got.dtype != ref.dtype:
            first = first or name
            worst = math.inf
            continue
        bad = ~torch.isfinite(got) & torch.isfinite(ref) if got.is_floating_point() else None
        if bad is not None and bool(bad.any()):
            nonfinite.append(name)
        if torch.equal(got, ref) or (got.is_floating_point() and bool(torch.equal(got.isnan(), ref.isnan()))
                                     and torch.equal(got.nan_to_num(0.0), ref.nan_to_num(0.0))):
            continue
        first = first or name
        diff = (got.double() - ref.double()).abs()
        scale = ref.double().abs().max().item()
        err = diff.max().item() / scale if scale > 0 else math.inf
        worst = max(worst, err if not math.isnan(err) else math.inf)
    identical = first is None and not missing
    return NumericVerdict(identical, compared, 0.0 if identical else worst, first, nonfinite, missing)


def referee(step_fn: Callable[[Any], Any], forced_config: Any, reference_config: Any,
            compare_what: str = "grads") -> NumericVerdict:
    """Run `step_fn(reference_config)`, then `step_fn(forced_config)`; compare gradients ("grads") or parameters
    ("params") of the module each returns (or the mapping name -> tensor it returns) exactly."""
    if compare_what not in ("grads", "params"):
        raise ValueError(f"streamrace: referee compares 'grads' or 'params', got {compare_what!r}")
    reference = _snapshot(step_fn(reference_config), compare_what)
    forced = _snapshot(step_fn(forced_config), compare_what)
    return compare(forced, reference)


@contextlib.contextmanager
def poisoned_collective_inputs(names=tuple(POISONED)):
    """Within: after each synchronous collective in `names` returns, its input buffers are filled with NaN."""
    import torch.distributed as dist

    with contextlib.ExitStack() as patches:
        for name in names:
            if name not in POISONED:
                raise ValueError(f"streamrace: cannot poison the inputs of {name!r}; "
                                 f"poisonable: {', '.join(POISONED)}")
            patches.enter_context(patched(dist, name, _poisoning(getattr(dist, name), *POISONED[name])))
        yield


def _poisoning(collective, arg_name: str, position: int):
    @functools.wraps(collective)
    def poisoning(*args, **kwargs):
        out = collective(*args, **kwargs)
        if kwargs.get("async_op"):
            return out
        target = kwargs.get(arg_name, args[position] if len(args) > position else None)
        for t in (target if isinstance(target, (list, tuple)) else [target]):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                with torch.no_grad():
                    t.fill_(math.nan)
        return out
    return poisoning
