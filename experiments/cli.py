"""What the entry points share on the command line: how they report a bad input."""

from __future__ import annotations

import sys


def fail(message: object) -> int:
    """Print `error: <message>` on stderr and return 2, the exit status of every entry point's bad input:
    `except SharpiError as e: return fail(e)`."""
    print(f"error: {message}", file=sys.stderr)
    return 2
