"""A stand-in for the few names of Hugging Face ``datasets`` that torchtitan's text data loading imports, for GPU hosts
where the real package cannot be installed (it needs pyarrow: more than the wheels carried to them may weigh).

The tests put this folder on ``PYTHONPATH`` only where ``datasets`` is not importable. It reads a local folder of JSON
lines (``{"text": ...}`` per line), which is all torchtitan's ``c4_test``-style loader asks of it; anything else
raises. What the tests check is torchtitan's training and checkpointing, not its data loading.
"""

from __future__ import annotations

import glob
import json
import os

__version__ = "0.0.0+streamrace-stand-in"


class Dataset:
    """A map-style dataset of rows (dicts), as ``datasets.Dataset`` answers torchtitan: len, iteration, skip."""

    def __init__(self, rows: list[dict]):
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self):
        return iter(self._rows)

    def __getitem__(self, index):
        return self._rows[index]

    def skip(self, n: int) -> "Dataset":
        return Dataset(self._rows[n:])

    def shard(self, num_shards: int, index: int, contiguous: bool = True) -> "Dataset":
        """As ``datasets.Dataset.shard(contiguous=True)``: the index-th of num_shards contiguous slices."""
        size, extra = divmod(len(self._rows), num_shards)
        start = index * size + min(index, extra)
        return Dataset(self._rows[start:start + size + (index < extra)])


def load_dataset(path: str, name=None, split: str = "train", streaming: bool = False, **kwargs) -> Dataset:
    """The rows of every ``*.json`` / ``*.jsonl`` file of the local folder `path`, in file-name order."""
    if streaming or split != "train" or not os.path.isdir(path):
        raise ValueError(f"datasets stand-in: only a local folder of JSON lines, split 'train', is supported: {path!r}")
    rows = []
    for file in sorted(glob.glob(os.path.join(path, "*.json")) + glob.glob(os.path.join(path, "*.jsonl"))):
        with open(file) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return Dataset(rows)
