"""Every shipped and registered repro as a pytest item per variant, so CI can run them:

    pytest --streamrace --pyargs pytest_streamrace.repros

Each item runs on the repro's number of ranks, under the race detector, and passes when the variant gets its
expected verdict (unpatched: reproduced, patched: clean). ``python -m pytest_streamrace.repro`` runs these same items.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from pytest_streamrace import env
from pytest_streamrace.repro import registry
from pytest_streamrace.races.record import EVIDENCE, from_race
from pytest_streamrace.repro.evidence import RankContext, judge, per_run

_SETTINGS = json.loads(os.environ.get(env.REPRO) or "{}")  # from the repro CLI


def _cases():
    for name, repro in sorted(registry.discover().items()):
        problem = repro.framework.problem() if repro.framework else None
        world_size = _SETTINGS.get("world_size") or repro.world_size
        for variant in repro.variants:
            marks = [pytest.mark.distributed(world_size=world_size),
                     pytest.mark.streamrace(expect="race" if variant.expect == "reproduced" else "clean")]
            if problem:
                marks.append(pytest.mark.skip(reason=problem))
            yield pytest.param(repro, variant.name, id=f"{name}-{variant.name}", marks=marks)


@pytest.mark.parametrize("repro, variant", list(_cases()))
def test_repro(repro, variant, rank, world_size, request):
    import torch
    import torch.distributed as dist

    from pytest_streamrace.detector import session

    detector = session.active()
    own = None
    if detector is None:  # run without --streamrace: the repro still needs its detector
        own = detector = session.Detector(backend="cuda" if env.visible_gpus() else "virtual")
        own.__enter__()
    if detector.backend not in repro.backends:
        if own:
            own.__exit__(None, None, None)
        pytest.skip(f"{repro.name} runs on the {' or '.join(repro.backends)} backend, not {detector.backend}")
    ctx = RankContext(variant, detector.backend, session.streamrace_device(), rank, world_size, _SETTINGS.get("steps") or 2, detector)
    runs = []
    start = time.perf_counter()
    try:
        for i in range(_SETTINGS.get("repeat") or 1):
            ctx.repeat = i
            seen = {race.key(): race.count for race in detector.races}
            numeric = repro.run(ctx)
            # races of this run: new ones, and known ones seen again (dedup counts them)
            races = [from_race(r, detector.stream_name, rank) for r in detector.races
                     if r.count > seen.get(r.key(), 0)]
            runs.append({"races": races, "numeric": numeric})
    finally:
        if own:
            own.__exit__(None, None, None)
    framework = repro.framework
    evidence = {"rank": rank, "backend": detector.backend, "runs": runs, "seconds": time.perf_counter() - start,
                "framework": f"{framework.package} {framework.installed()}" if framework else f"torch {torch.__version__}"}
    request.node.user_properties.append((EVIDENCE, evidence))

    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, evidence)
    expect = repro.variant(variant).expect
    verdicts = [judge(per_run(everyone, i), repro.relevant) for i in range(len(runs))]
    wrong = [f"run {i + 1}: {v.verdict} ({v.reason})" for i, v in enumerate(verdicts) if v.verdict != expect]
    assert not wrong, f"{repro.name}/{variant}: expected {expect} in every run; " + "; ".join(wrong)
