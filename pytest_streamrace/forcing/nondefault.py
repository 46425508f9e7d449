"""``--streamrace-nondefault-stream``: each test body runs on a fresh non-default stream.

Code that silently assumes the default stream (allocates there, syncs only it, passes ``torch.cuda.default_stream()``
where it means the current one) is correct until someone calls it from a side stream — as Megatron's training
script does. PyTorch's own CUDA tests catch this by running every test on a new stream (CudaNonDefaultStream); the
same here, with the same care: the previous stream is synchronized before the switch, the new one after the test.
"""

from __future__ import annotations

import pytest

from . import streams as _streams


class NondefaultStream:
    """A plugin: wraps each test's call phase in a fresh stream made current."""

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        import torch

        _streams.require_streams("--streamrace-nondefault-stream")
        previous = torch.cuda.current_stream()
        previous.synchronize()
        stream = _streams.new_stream("test stream")
        torch.cuda.set_stream(stream)
        try:
            return (yield)
        finally:
            stream.synchronize()
            torch.cuda.set_stream(previous)
