"""The cuda backend's own behaviour that the virtual backend cannot show. Skipped without a CUDA GPU.

Run on a GPU machine: `python -m pytest tests/test_cuda_backend.py -v` (tests/gpu/test_suites_gpu.py runs it).
"""

from __future__ import annotations

import json

import pytest

from pytest_streamrace import env

pytestmark = pytest.mark.skipif(not env.visible_gpus(), reason="needs a CUDA GPU")

# CUDA's stream pool creates all its streams at the first request on a device (here: a stream made earlier, and
# NCCL's communicator); the racing stream must still be named after the line that constructed it.
POOLED = """
import os, socket
import pytest, torch, torch.distributed as dist

def race_on(side):
    x = torch.ones(1 << 20, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(1_000_000)
        x.add_(1)
    return x * 2

@pytest.mark.streamrace(expect="race")
def test_second_stream():
    torch.cuda.Stream()  # FIRST
    race_on(torch.cuda.Stream())  # SECOND
    torch.cuda.synchronize()

@pytest.mark.streamrace(expect="race")
def test_after_nccl():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        dist.all_reduce(torch.ones(1, device="cuda"))
        race_on(torch.cuda.Stream())  # AFTER-NCCL
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()
"""


def test_streams_are_named_where_python_constructs_them(pytester):
    pytester.makepyfile(test_pooled=POOLED)
    result = pytester.runpytest_subprocess("--streamrace", "--streamrace-backend=cuda", "-p", "no:cacheprovider",
                                           "--streamrace-json", "races.json")
    result.assert_outcomes(passed=2)
    source = pytester.path.joinpath("test_pooled.py").read_text().splitlines()
    lines = {tag: next(i for i, text in enumerate(source, 1) if text.endswith(f"# {tag}"))
             for tag in ("SECOND", "AFTER-NCCL")}
    streams = {}
    for race in json.loads(pytester.path.joinpath("races.json").read_text())["races"]:
        test = race["test"].rsplit("::", 1)[1]
        streams.setdefault(test, set()).update({race["earlier"]["stream"], race["later"]["stream"]})
    assert f"stream created at test_pooled.py:{lines['SECOND']}" in streams["test_second_stream"], streams
    assert f"stream created at test_pooled.py:{lines['AFTER-NCCL']}" in streams["test_after_nccl"], streams
