"""Following a test into the Python processes it starts: ``parent`` (the pytest side), ``child`` (the start-up hook
in each child), ``process_patches`` (what a child patches so it reports before it ends)."""
