"""Stream models: how each source of stream ordering reaches the happens-before core.

One module per source — the stream API (``virtual_streams`` on CPU, ``cuda`` on GPUs), autograd's streams
(``virtual_autograd``), collectives, futures and compiled code. Each is a patch (``patching.Patch``) or hands the
session its patches; each reads the core (``hb``), feeds the tracker, and imports nothing from the session that
installs it. A new source of accesses or orderings is a new module here, installed by ``session``.
"""
