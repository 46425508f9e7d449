"""Test helper: find a source line by the comment that tags it, so assertions on reported locations survive edits."""

import sys


def line(tag: str) -> int:
    """The line of the calling test file that ends with the comment `# tag`."""
    path = sys._getframe(1).f_globals["__file__"]
    with open(path) as f:
        for number, text in enumerate(f, 1):
            if text.rstrip().endswith(f"# {tag}"):
                return number
    raise LookupError(tag)
