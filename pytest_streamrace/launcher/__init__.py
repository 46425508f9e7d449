"""Running a test as N rank processes, and pytest sessions launched by torchrun.

Three roles, one per process:
- parent (a normal pytest process): runs each ``distributed`` item by spawning its rank processes (``parent``);
- spawned rank (a child pytest the parent started for one item): runs that item in-process (``child``);
- torchrun rank (``torchrun -m pytest``): every rank runs the session, outcomes are made collective (``torchrun``).
"""

from __future__ import annotations

from .. import env


def install(config, marker_problem) -> None:
    """Register the launcher behaviour this process needs. `marker_problem(item)`: what is wrong with an item's
    markers (one line), or None; a parent reports it before starting any rank."""
    from . import child, parent, torchrun

    if env.torchrun_env() is not None:
        torchrun.install(config)
    elif child.spec_from_env() is not None:
        child.install(config)
    else:
        parent.install(config, marker_problem)
