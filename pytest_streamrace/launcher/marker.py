"""Reading ``@pytest.mark.distributed(world_size=N, backend=None, timeout=None)`` into checked values.

Checked in the parent, before anything is started, so a typo costs one clear error line, not N rank crashes.
``backend=`` is the process group's backend (``pg_backend`` here), not the detector's stream model.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import checks

PG_BACKENDS = (None, "auto", "gloo", "nccl")  # the process group's backend (the marker's backend=)


class MarkerError(checks.BadInput):
    """Bad marker arguments; the message is one line meant for the user."""


@dataclass(frozen=True)
class Request:
    world_size: int
    pg_backend: str | None  # the process group's backend; None: auto
    timeout: float | None  # None: the option/ini/default timeout


def parse(mark) -> Request:
    if len(mark.args) > 1:
        raise MarkerError(f"@pytest.mark.distributed takes one positional argument (world_size), got {len(mark.args)}")
    kwargs = dict(mark.kwargs)
    if mark.args:
        if "world_size" in kwargs:
            raise MarkerError("@pytest.mark.distributed: world_size given twice")
        kwargs["world_size"] = mark.args[0]
    unknown = sorted(set(kwargs) - {"world_size", "backend", "timeout"})
    if unknown:
        raise MarkerError(f"@pytest.mark.distributed: unknown argument {unknown[0]!r} "
                          "(expected world_size, backend, timeout)")
    if "world_size" not in kwargs:
        raise MarkerError("@pytest.mark.distributed: world_size is required, e.g. distributed(world_size=2)")
    world_size = kwargs["world_size"]
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise MarkerError(f"@pytest.mark.distributed: world_size must be a positive integer, got {world_size!r}")
    pg_backend = kwargs.get("backend")
    if pg_backend not in PG_BACKENDS:
        raise MarkerError(f"@pytest.mark.distributed: unknown backend {pg_backend!r} (expected gloo, nccl or auto)")
    timeout = kwargs.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise MarkerError(f"@pytest.mark.distributed: timeout must be a positive number of seconds, got {timeout!r}")
    return Request(world_size, None if pg_backend == "auto" else pg_backend,
                   None if timeout is None else float(timeout))
