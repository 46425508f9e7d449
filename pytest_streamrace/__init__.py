"""pytest-streamrace: find and reproduce CUDA stream-synchronization races in distributed PyTorch training.

Importing this package must stay cheap: pytest loads the plugin in every session, so nothing here imports torch.
"""

__version__ = "0.1.0"


class StreamRaceError(Exception):
    """A test's stream races, raised in the phase that had them so pytest's outcome handling applies: under
    ``xfail`` a race is the expected failure, and ``xfail(raises=StreamRaceError)`` expects exactly that."""
