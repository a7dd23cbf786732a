"""Files that ship inside the package: the embedded default model."""

from pathlib import Path

from sharpi_jax.errors import SharpiError

ASSETS_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL = ASSETS_DIR / "default.gguf"


def default_model_path() -> Path:
    """The embedded default model (a small qwen35moe GGUF with an MTP block, produced by this project)."""
    if not DEFAULT_MODEL.exists():
        raise SharpiError(f"the embedded default model {DEFAULT_MODEL} is missing; reinstall sharpi-jax "
                          "or pass a GGUF path explicitly")
    return DEFAULT_MODEL
