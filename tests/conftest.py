"""Shared pytest fixtures: where the reference data in ../shared/fixtures lives."""

from __future__ import annotations

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


def load_references(model_dir: str) -> dict:
    return json.loads(fixture_path(model_dir, "references.json").read_text())


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    if not FIXTURES.exists():
        pytest.skip(f"reference fixtures directory {FIXTURES} is absent")
    return FIXTURES
