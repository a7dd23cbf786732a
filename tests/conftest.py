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
    """`sj.load` of fixture `<name>/<name>-<variant>.gguf`, cached so test modules share compiled engines."""
    import sharpi_jax as sj

    options = {} if prefill_buckets is None else {"prefill_buckets": prefill_buckets}
    return sj.load(fixture_path(name, f"{name}-{variant}.gguf"), max_context=max_context, **options)


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    if not FIXTURES.exists():
        pytest.skip(f"reference fixtures directory {FIXTURES} is absent")
    return FIXTURES
