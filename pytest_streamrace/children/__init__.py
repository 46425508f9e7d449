"""Following the Python processes a test (or a program under ``streamrace run``) starts: ``following`` (the one
interface: data folder, start-up hook, records), ``parent`` (the pytest side, per test), ``child`` (the start-up hook
in each child), ``process_patches`` (what a child patches so it reports before it ends)."""
