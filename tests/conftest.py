"""Shared pytest fixtures: where the reference data in ../shared/fixtures lives."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = REPO_ROOT.parent / "shared" / "fixtures"


def fixture_path(*parts: str) -> Path:
    """Path under ../shared/fixtures; skips the calling test with a clear reason if it is absent."""
    p = FIXTURES.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"reference fixture {p} is absent (expected ../shared/fixtures beside the repo)")
    return p


@functools.lru_cache(maxsize=None)
def load_references(model_dir: str) -> dict:
    return json.loads(fixture_path(model_dir, "references.json").read_text())


@functools.lru_cache(maxsize=None)
def fixture_engine(name: str, variant: str, max_context: int, prefill_buckets: tuple[int, ...] | None = None):
    """`sj.load` of fixture `<name>/<name>-<variant>.gguf`, cached so a module's tests share compiled
    engines (released after each module, see `_release_compiled_code`)."""
    import sharpi_jax as sj

    options = {} if prefill_buckets is None else {"prefill_buckets": prefill_buckets}
    return sj.load(fixture_path(name, f"{name}-{variant}.gguf"), max_context=max_context, **options)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """After each test module, drop the cached engines and JAX's compiled executables. Each XLA:CPU
    executable keeps its code mapped; kept for the whole session they pushed the process past the
    kernel's 65,530 memory-map limit and XLA crashed while compiling (SIGSEGV / abort)."""
    yield
    import gc

    import jax

    fixture_engine.cache_clear()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    if not FIXTURES.exists():
        pytest.skip(f"reference fixtures directory {FIXTURES} is absent")
    return FIXTURES
