"""pytest-streamrace: find and reproduce CUDA stream-synchronization races in distributed PyTorch training.

Importing this package must stay cheap: pytest loads the plugin in every session, so nothing here imports torch.
"""

__version__ = "0.1.0.dev0"
