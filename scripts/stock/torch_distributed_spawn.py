"""Held-out false-positive check: PyTorch's own distributed test base, run under ``--streamrace``.

Why it exists: a race report on correct code is the worst bug this plugin can have. The detector's models
(collectives, work futures, the virtual streams) were written against our own tests; this module runs a body of code
none of us wrote, ``torch.testing._internal.distributed.distributed_test`` as shipped in the torch wheel, the way
PyTorch's ``test/distributed/test_distributed_spawn.py`` runs it: each test spawns WORLD_SIZE rank processes
(``MultiProcessTestCase``) that run the test body on the gloo backend. Under ``--streamrace`` each rank is followed by
the subprocess detector, so any race it reports here is a false positive to triage (or a real race in PyTorch).

The torch module reads BACKEND and WORLD_SIZE when it is imported (TEMP_DIR later), so they are set here first (values
already in the environment win). Run from the repository root, e.g.::

    python -m pytest scripts/stock/torch_distributed_spawn.py -p no:cacheprovider -p no:randomly \\
        -k "ddp and not cuda" --streamrace --streamrace-backend=virtual --streamrace-json /tmp/held/races.json

and once without ``--streamrace`` to compare outcomes test by test (``--junitxml``). ``-k`` also matches the
module's and the class's names (``-k spawn`` selects everything); select on test names or give node ids. Each test
spawns its ranks afresh (a few seconds each on CPU); tests needing GPUs or NCCL are skipped inside the ranks.

A clean run proves something only while the ranks really run the detector: check that with a planted race in a test
of the same shape (a ``TestDistBackend`` subclass whose test body, run on each rank, writes a tensor on a side
stream and reads it on the default one, or touches an ``async_op=True`` all_reduce's tensor before ``wait()``):
it must fail with "stream race on ranks 0, 1".
"""

import atexit
import os
import shutil
import sys
import tempfile

os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
if "TEMP_DIR" not in os.environ:
    # One folder for the pytest process (each test's setUp then points TEMP_DIR at a folder of its own, which the
    # spawned ranks inherit); removed when the process that made it exits.
    os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="torch-dist-spawn-")
    atexit.register(shutil.rmtree, os.environ["TEMP_DIR"], ignore_errors=True)

import torch.distributed as dist  # noqa: E402

if not dist.is_available():  # pragma: no cover - a torch built without distributed
    import pytest

    pytest.skip("torch.distributed is not available", allow_module_level=True)

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """Every ``_DistTestBase`` test, run on WORLD_SIZE spawned rank processes."""

    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run this module with pytest (see the docstring)")
