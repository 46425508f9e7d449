"""What the environment tells a process: every ``STREAMRACE_*`` variable, the GPUs, a torchrun launch — read
without importing torch.

pytest loads the plugin in every session of every user; importing torch (1-2 s, hundreds of MB) just to print a
header line or to decide a stream model would tax sessions that never run a distributed test. A followed child's
start-up hook reads this module too, so it imports nothing beyond the standard library's cheapest parts.
(``launcher/forkserver.py`` must import nothing of the package: it spells ``RANK_SPEC`` out.)
"""

from __future__ import annotations

import collections
import os
import sys

RANK_SPEC = "STREAMRACE_RANK_SPEC"  # JSON RankSpec: this process is one rank of a ``distributed`` item
SUBPROCESS = "STREAMRACE_SUBPROCESS"  # JSON: a child of a test under --streamrace, to follow ("0": opted out)
REPRO = "STREAMRACE_REPRO"  # JSON: the repro CLI's settings for repros/test_repros.py
PROGRESS = "STREAMRACE_PROGRESS"  # file a repro's ranks append their progress lines to
FORKSERVER_STATE = "STREAMRACE_FORKSERVER_STATE"  # JSON: a re-executed rank fork server's own state (no rank inherits)
CONFIRM = "STREAMRACE_CONFIRM"  # JSON: this session re-runs one test for --streamrace-confirm (locate, or force a race)
NATIVE = "STREAMRACE_NATIVE"  # "0": no C++ (op capture, core): the pure-Python path, as where no compiler is
APPLIER = "STREAMRACE_APPLIER"  # "thread" / "inline": captured records applied beside the program or on its thread
CRASH_OUTPUT = "STREAMRACE_CRASH_OUTPUT"  # file a fatal signal's native stack goes to (a rank's output), not fd 2

_NVIDIA_PROC = "/proc/driver/nvidia/gpus"


def visible_gpus() -> list[str]:
    """Identifiers of the CUDA devices this process may use, in CUDA order.

    Uses torch when something already imported it (then it is free and exact); otherwise the NVIDIA driver's
    /proc entries filtered by CUDA_VISIBLE_DEVICES.
    """
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        try:
            return [str(i) for i in range(torch.cuda.device_count())]
        except Exception:
            return []
    try:
        installed = sorted(os.listdir(_NVIDIA_PROC))
    except OSError:
        return []
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        return [str(i) for i in range(len(installed))]
    chosen = []
    for entry in mask.split(","):
        entry = entry.strip()
        if not entry:
            break
        if entry.isdigit() and int(entry) < len(installed):
            chosen.append(entry)
        elif entry.startswith(("GPU-", "MIG-")):
            chosen.append(entry)
        else:
            break  # CUDA stops enumerating at the first invalid entry
    return chosen


TorchrunEnv = collections.namedtuple("TorchrunEnv", "rank world_size local_rank")  # not a dataclass: 10 ms to import


def torchrun_env(environ=os.environ) -> TorchrunEnv | None:
    """The rank this process has in a torchrun (torch.distributed.run) launch, or None outside one."""
    if "TORCHELASTIC_RUN_ID" not in environ:
        return None
    try:
        return TorchrunEnv(
            rank=int(environ["RANK"]),
            world_size=int(environ["WORLD_SIZE"]),
            local_rank=int(environ.get("LOCAL_RANK", environ["RANK"])),
        )
    except (KeyError, ValueError):
        return None
