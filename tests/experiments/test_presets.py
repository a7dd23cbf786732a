"""The routing experiments' held-out texts (`experiments.presets.HELD_OUT_SOURCES`) are frozen copies:
their bytes are pinned here, so a refactor of the live sources (or of the copies) cannot move the
routing_stats / residency_sim / residency_lookahead figures unnoticed."""

from __future__ import annotations

import hashlib

from experiments.presets import HELD_OUT_SOURCES, REPO_ROOT

# sha256 (first 16 hex digits) of each copy, taken at commit 5e6cbc9
PINNED = {"api.py.txt": "de9f3d76d5fe4b83", "plan.py.txt": "1caab8d1bdad34d1",
          "speculative.py.txt": "2270ec9f77c4cc23", "reader.py.txt": "7cbe0f27568e63d5",
          "gated_delta_net.py.txt": "e6a6b99a3d44fa8a", "qtensor.py.txt": "311949efd3b53273"}


def test_held_out_texts_are_the_pinned_copies():
    assert [s.rsplit("/", 1)[1] for s in HELD_OUT_SOURCES] == list(PINNED)  # order: calibration first
    for s in HELD_OUT_SOURCES:
        assert s.startswith("experiments/data/held_out/"), s
        digest = hashlib.sha256((REPO_ROOT / s).read_bytes()).hexdigest()[:16]
        assert digest == PINNED[s.rsplit("/", 1)[1]], s
