"""What a rank process is told by its parent: one JSON object in one environment variable.

An environment variable (not argv) because the rank is an ordinary pytest session whose command line belongs to
pytest; the variable is also how ``launcher.install`` recognizes a rank, and how a test can find its own ranks
(every process of a rank tree carries it).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from .. import env



@dataclass(frozen=True)
class RankSpec:
    rank: int
    world_size: int
    backend: str  # "gloo" | "nccl"
    store: str  # FileStore path, shared by the ranks of one item
    result: str  # JSON-lines file this rank writes its phase reports into
    stacks: str  # file faulthandler writes this rank's Python stacks into on SIGUSR1
    release: str  # file whose existence lets a finished rank tear down and exit
    timeout: float  # seconds; the process group's own timeout is set beyond it
    device: int | None = None  # CUDA device index (nccl), None on gloo

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        return cls(**json.loads(text))


def from_env(environ=os.environ) -> RankSpec | None:
    text = environ.get(env.RANK_SPEC)
    return RankSpec.from_json(text) if text else None
