"""The mutation list (`tests/mutations.py`) still applies to this tree: every original snippet occurs exactly
once and every named test file exists, so code moving elsewhere makes a mutation fail here, loudly,
instead of silently passing in `python -m tests.mutation_check`."""

from __future__ import annotations

import pytest

from tests.conftest import REPO_ROOT
from tests.mutation_check import stale_reason
from tests.mutations import MUTATIONS


def test_names_are_unique():
    assert len({m.name for m in MUTATIONS}) == len(MUTATIONS)


@pytest.mark.parametrize("m", MUTATIONS, ids=lambda m: m.name)
def test_mutation_still_applies(m):
    assert stale_reason(m) is None, f"{m.name}: {stale_reason(m)} -- update tests/mutations.py"
    for arg in m.tests + m.wider:
        if arg.startswith("tests/"):
            assert (REPO_ROOT / arg.split("::")[0]).exists(), arg
