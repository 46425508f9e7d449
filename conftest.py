"""Top-level conftest: enables pytester for the plugin's own tests."""

import os

from pytest_streamrace.frameworks.megatron_cpu import private_extensions_dir

pytest_plugins = ["pytester"]

# The megatron tests point TORCH_EXTENSIONS_DIR at a private cache in their worker (prepare_import, as the repro
# does), and every subprocess started there later would build the capture's extension again in it (about a minute
# on CI). The whole run uses that cache from the start: one build.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", private_extensions_dir())
