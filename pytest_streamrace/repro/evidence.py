"""Evidence from a repro's ranks and the verdict it supports.

Two kinds of evidence: the detector's races (every backend) and numbers from the numeric referee (a GPU run that
compares against a reference configuration; on the virtual backend nothing executes out of order, so there are no
wrong numbers to see). A variant *reproduced* the bug when a race of the bug's kind was detected or the numbers went
wrong; it is *clean* when nothing was detected and the numbers, where measured, match; anything else — only races
unrelated to the bug, say — is *inconclusive*, with the reason.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .. import env


@dataclass
class RankContext:
    """What a repro's ``run`` gets in each rank."""

    variant: str
    backend: str  # "cuda" | "virtual"
    device: object  # torch.device
    rank: int
    world_size: int
    steps: int
    detector: object  # the active detector.session.Detector
    repeat: int = 0  # which of the --repeat runs this is (0-based)

    def progress(self, message: str) -> None:
        """A progress line the repro CLI shows while ranks run (rank 0's only, to keep it readable)."""
        path = os.environ.get(env.PROGRESS)
        if path and self.rank == 0:
            with open(path, "a", encoding="utf-8") as f:
                f.write(message + "\n")


@dataclass
class ReproVerdict:
    verdict: str  # reproduced | clean | inconclusive
    reason: str
    races: list = field(default_factory=list)  # the relevant ones, merged over ranks
    numeric: list = field(default_factory=list)  # per rank


def wrong(numeric: dict | None) -> bool:
    if not numeric:
        return False
    return bool(numeric.get("nan") or numeric.get("max_rel_err", 0.0) > 0.0 or numeric.get("wrong_iterations", 0)
                or numeric.get("retained"))


def in_frames(access: dict, function: str, file: str) -> bool:
    """Whether a reported access (a race's "earlier" or "later") ran inside `function` of a file ending in `file`:
    what a repro's ``relevant`` tests to tell its bug's races from others."""
    return any(f["function"] == function and f["file"].endswith(file) for f in access["frames"])


def per_run(evidence: list[dict], i: int) -> list[dict]:
    """Run i of every rank's evidence ({rank, runs: [{races, numeric}]}) as judge() takes it."""
    return [{"rank": ev["rank"], **ev["runs"][i]} for ev in evidence if i < len(ev["runs"])]


def judge(evidence: list[dict], relevant) -> ReproVerdict:
    """The verdict of one run over all ranks' evidence for it ({rank, races, numeric})."""
    races = [race for ev in evidence for race in ev.get("races", [])]
    mine = [race for race in races if relevant(race)] if relevant is not None else []
    numeric = [ev["numeric"] for ev in evidence if ev.get("numeric")]
    numbers_wrong = any(wrong(n) for n in numeric)
    if mine or numbers_wrong:
        parts = []
        if mine:
            parts.append(f"{len(mine)} race(s) of this bug's kind detected")
        if numbers_wrong:
            parts.append("results differ from the reference")
        return ReproVerdict("reproduced", " and ".join(parts), mine, numeric)
    if races:
        return ReproVerdict("inconclusive", f"{len(races)} race(s) detected, none of this bug's kind", races, numeric)
    measured = " and results match the reference" if numeric else ""
    return ReproVerdict("clean", f"no race detected{measured}", [], numeric)
