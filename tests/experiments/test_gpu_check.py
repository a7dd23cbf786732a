"""`python -m experiments.gpu_check` on a machine without a GPU: one line saying so, exit 0."""

from __future__ import annotations

from tests.experiments.entry_point import ok, run_entry_point


def test_gpu_check_without_a_gpu_says_so_in_one_line(tmp_path):
    res = ok(run_entry_point("gpu_check", cache=tmp_path, timeout=300))
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert lines == [lines[0]] and lines[0].startswith("gpu_check: no GPU here (JAX backend 'cpu')")
    assert not any(tmp_path.iterdir())  # nothing written: no slice without a GPU
