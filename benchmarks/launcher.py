"""Per-test overhead of a trivial 2-rank gloo test: this plugin's launcher vs PyTorch's MultiProcessTestCase.

Both suites hold K copies of the same test (all_reduce of one element on 2 gloo ranks) and are run by pytest in
a subprocess; the table shows wall time for the whole run, per test, and the marginal cost of one more test
((T_K - T_1) / (K - 1), which leaves out what a session pays once, such as importing torch).

    python benchmarks/launcher.py [--tests K] [--repeat R]

MultiProcessTestCase needs `expecttest` (pip install -e '.[bench]').
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

OURS = '''
import pytest, torch, torch.distributed as dist

@pytest.mark.distributed(world_size=2, backend="gloo")
@pytest.mark.parametrize("i", range({k}))
def test_all_reduce(i):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
'''

MPTC_HEAD = '''
import torch, torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase


class AllReduce(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def _all_reduce(self):
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2
        dist.destroy_process_group()
'''
MPTC_TEST = '''
    def test_all_reduce_{i}(self):
        self._all_reduce()
'''


def write_suites(folder: str, k: int) -> dict[str, str]:
    ours = os.path.join(folder, f"test_ours_{k}.py")
    with open(ours, "w") as f:
        f.write(OURS.replace("{k}", str(k)))
    mptc = os.path.join(folder, f"test_mptc_{k}.py")
    with open(mptc, "w") as f:
        f.write(MPTC_HEAD + "".join(MPTC_TEST.replace("{i}", str(i)) for i in range(k)))
    return {"pytest-streamrace": ours, "MultiProcessTestCase": mptc}


def timed_run(path: str, k: int) -> float:
    plugin = [] if "ours" in path else ["-p", "no:streamrace"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *plugin, path]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=os.path.dirname(path), capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0 or f"{k} passed" not in proc.stdout:
        sys.exit(f"benchmark suite failed: {' '.join(cmd)}\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=8, help="tests per suite (K, >= 2)")
    parser.add_argument("--repeat", type=int, default=2, help="runs per suite; the fastest counts")
    args = parser.parse_args()
    if args.tests < 2 or args.repeat < 1:
        parser.error("--tests must be >= 2 and --repeat >= 1")
    with tempfile.TemporaryDirectory(prefix="streamrace-bench-") as folder:
        one = write_suites(folder, 1)
        many = write_suites(folder, args.tests)
        rows = []
        for name in many:
            t1 = min(timed_run(one[name], 1) for _ in range(args.repeat))
            tk = min(timed_run(many[name], args.tests) for _ in range(args.repeat))
            rows.append((name, tk, tk / args.tests, (tk - t1) / (args.tests - 1)))
    print(f"trivial 2-rank gloo test (all_reduce of one element), K={args.tests}, {os.cpu_count()} CPUs, "
          f"python {sys.version.split()[0]}")
    print(f"{'launcher':<22} {'K tests (s)':>12} {'per test (s)':>13} {'marginal (s)':>13}")
    for name, tk, per, marginal in rows:
        print(f"{name:<22} {tk:>12.2f} {per:>13.3f} {marginal:>13.3f}")


if __name__ == "__main__":
    main()
