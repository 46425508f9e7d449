"""--streamrace-confirm for races found in the rank processes a plain test starts through another harness
(torch.multiprocessing.spawn, PyTorch's MultiProcessTestCase, a forkserver pool as DeepSpeed's DistributedTest uses,
a fork, a subprocess), through pytester as users run it, on CPU (virtual streams, gloo): each racy twin's race is forced in those
processes in a re-run and confirmed with the values that changed; a clean twin is never re-run
(`tests/gpu/test_harnesses_gpu.py` does the same with DeepSpeed's own tests on NCCL)."""

import json

from test_confirm import run_cases

BODY = """
import torch
import torch.distributed as dist


def racy_body(tag, racy=True):
    with open("runs.txt", "a") as f:             # each run of a rank (the original and the re-runs) leaves a line
        f.write(tag + "\\n")
    side = torch.cuda.Stream()
    x = torch.ones(64)
    if dist.is_initialized():
        dist.all_reduce(x)                        # 2 on each rank of 2
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.mul_(3)                                 # SIDE-WRITE
    if not racy:
        torch.cuda.current_stream().wait_stream(side)
    y = (x + 1).sum().item()                      # MAIN-READ
    torch.cuda.current_stream().wait_stream(side)
    return y
"""

RANKS = """
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from torch.testing._internal.common_distributed import MultiProcessTestCase

from body import racy_body


class TestRanks(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def _rank_body(self, racy):
        dist.init_process_group("gloo", store=dist.FileStore(self.file_name, self.world_size), rank=self.rank,
                                world_size=self.world_size)
        racy_body(self.id().rsplit(".", 1)[1], racy)
        dist.barrier()
        dist.destroy_process_group()

    def test_case_racy(self):
        self._rank_body(True)

    def test_case_clean(self):
        self._rank_body(False)


def spawned(rank, store, tag, racy):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    racy_body(tag, racy)
    dist.barrier()
    dist.destroy_process_group()


def test_spawn_racy(tmp_path):
    torch_mp.spawn(spawned, args=(str(tmp_path / "store"), "test_spawn_racy", True), nprocs=2)


def test_spawn_clean(tmp_path):
    torch_mp.spawn(spawned, args=(str(tmp_path / "store"), "test_spawn_clean", False), nprocs=2)
"""

POOLS = """
import multiprocessing as mp
import os
import subprocess
import sys

import torch.distributed as dist

from body import racy_body


def ranked(rank, store, tag, racy):
    os.environ["RANK"] = str(rank)                # as DeepSpeed's DistributedTest sets it in its pool's workers
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    racy_body(tag, racy)
    dist.barrier()
    dist.destroy_process_group()


def in_a_pool(tmp_path, tag, racy):
    pool = mp.get_context("forkserver").Pool(2)
    try:
        pool.starmap(ranked, [(rank, str(tmp_path / "store"), tag, racy) for rank in (0, 1)])
    finally:
        pool.terminate()                          # the workers never exit on their own


def test_pool_racy(tmp_path):
    in_a_pool(tmp_path, "test_pool_racy", True)


def test_pool_clean(tmp_path):
    in_a_pool(tmp_path, "test_pool_clean", False)


def test_subprocess_racy():
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); from body import racy_body; racy_body('test_subprocess_racy')"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fork_racy():
    child = mp.get_context("fork").Process(target=racy_body, args=("test_fork_racy",))
    child.start()
    child.join()
    assert child.exitcode == 0
"""


def _line(marker: str) -> int:
    return next(i for i, text in enumerate(BODY.lstrip("\n").splitlines(), 1) if marker in text)


def run(pytester, **files):
    """The files' tests under --streamrace-confirm: (the run, {test name: [records]}, rank runs per test)."""
    return run_cases(pytester, "virtual", "-rA", files=dict(body=BODY, **files))


def check_confirmed(result, by_test: dict, racy: dict, ranks: tuple) -> None:
    """Every racy test's race, on each of its `ranks`, confirmed: 3 read instead of 3 * 2 (or 1 * 3 without a process
    group) in each of the 64 elements."""
    assert set(by_test) == set(racy), sorted(by_test)
    for name, diff in racy.items():
        records = by_test[name]
        assert sorted(r["rank"] for r in records) == list(ranks), records
        for race in records:
            confirmation = race["confirmation"]
            assert confirmation["status"] == "confirmed", json.dumps(confirmation)
            assert (confirmation["differing"], confirmation["elements"], confirmation["max_abs_diff"]) == (64, 64, diff)
            assert confirmation["held"] == f"body.py:{_line('SIDE-WRITE')}"
            assert confirmation["observed"] == f"body.py:{_line('MAIN-READ')}"
    result.stdout.fnmatch_lines([
        "confirmations (each race forced into its bad order in a re-run; * s):",
        f"  confirmed: read-after-write body.py:{_line('SIDE-WRITE')} -> body.py:{_line('MAIN-READ')}: with the write "
        f"at body.py:{_line('SIDE-WRITE')} held back, the values read at body.py:{_line('MAIN-READ')} differed by "
        "max |Δ| = * in 64 of 64 elements"])


def check_summary(result, confirmed: int) -> None:
    result.stdout.fnmatch_lines([f"streamrace confirmations: {confirmed} confirmed, 0 not confirmed, 0 not tried "
                                 "(re-runs took * s)"])


def test_races_in_spawned_ranks_and_multiprocess_test_case_ranks_are_confirmed(pytester):
    result, by_test, runs = run(pytester, test_ranks=RANKS)
    result.assert_outcomes(passed=2, failed=2)
    check_confirmed(result, by_test, {"test_case_racy": 4.0, "test_spawn_racy": 4.0}, (0, 1))
    check_summary(result, 2)
    # a racy test is re-run twice (to find its race, then with it forced), each time with both ranks; a clean one never
    assert runs == {"test_case_racy": 6, "test_spawn_racy": 6, "test_case_clean": 2, "test_spawn_clean": 2}


def test_races_in_a_forkserver_pool_s_workers_a_forked_child_and_a_subprocess_are_confirmed(pytester):
    result, by_test, runs = run(pytester, test_pools=POOLS)
    result.assert_outcomes(passed=1, failed=3)
    check_confirmed(result, {"test_pool_racy": by_test.pop("test_pool_racy")}, {"test_pool_racy": 4.0}, (0, 1))
    check_confirmed(result, by_test, {"test_fork_racy": 2.0, "test_subprocess_racy": 2.0}, (None,))
    check_summary(result, 3)
    assert runs == {"test_pool_racy": 6, "test_fork_racy": 3, "test_subprocess_racy": 3, "test_pool_clean": 2}
