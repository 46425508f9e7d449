"""Top-level conftest: enables pytester for the plugin's own tests.

pytester gives each run its own HOME, where torch would build the C++ op capture again (half a minute each): the
extensions folder is pinned for the processes these tests start (unless set already)."""

import os
import tempfile

os.environ.setdefault("TORCH_EXTENSIONS_DIR",
                      os.path.join(tempfile.gettempdir(), f"streamrace-torch-extensions-{os.getuid()}"))

pytest_plugins = ["pytester"]
