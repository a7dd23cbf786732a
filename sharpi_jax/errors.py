"""Exceptions of sharpi-jax.

Every problem with user input (a GGUF file, a prompt, a budget) raises a subclass of `SharpiError`
with a message naming the file, tensor or key at fault, never a traceback from deep inside JAX.
"""


class SharpiError(Exception):
    """Base class of every error sharpi-jax raises on bad input."""


class GGUFError(SharpiError, ValueError):
    """A GGUF file is malformed, truncated, foreign, or contradicts its own metadata."""


class UnsupportedQuantError(GGUFError):
    """A tensor uses a ggml block type that sharpi-jax cannot dequantize."""


class UnsupportedArchitectureError(GGUFError):
    """The GGUF's `general.architecture` is not one sharpi-jax runs."""


class InputError(SharpiError, ValueError):
    """A prompt, token id or runtime option is invalid (too long, empty, out of range)."""


def shown(value: object, limit: int = 80) -> str:
    """A value as an error message shows it: its repr on one line, cut to `limit` characters."""
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
