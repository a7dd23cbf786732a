"""What the entry points share on the command line: how they report a bad input."""

from __future__ import annotations

import functools
import sys


def fail(message: object) -> int:
    """Print `error: <message>` on stderr and return 2, the exit status of every entry point's bad input."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def reports_bad_input(main):
    """Wrap an entry point's `main(argv)`: a SharpiError raised anywhere in it (the library's bad-input error)
    becomes one line, `error: <message>`, and exit status 2, instead of a traceback."""

    @functools.wraps(main)
    def run(argv):
        from sharpi_jax.errors import SharpiError  # here, so `--help` does not import the library

        try:
            return main(argv)
        except SharpiError as e:
            return fail(e)

    return run
