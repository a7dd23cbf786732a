"""Under CI=true, missing reference fixtures fail the run (tests/conftest.py), they do not skip it.

Each case runs pytest in a subprocess with SHARPI_FIXTURES pointing at a directory without them.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import FIXTURE_SETS, REPO_ROOT


def _pytest(fixtures, *args: str, ci: str = "true") -> subprocess.CompletedProcess:
    env = dict(os.environ, CI=ci, SHARPI_FIXTURES=str(fixtures), PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *args],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_missing_directory_stops_the_session_under_ci(tmp_path):
    missing = tmp_path / "no-fixtures"
    run = _pytest(missing, "tests/test_bitwise.py")
    assert run.returncode == 4, run.stdout + run.stderr  # pytest's usage-error code: no test ran
    out = run.stdout + run.stderr
    assert f"reference fixtures missing: the directory {missing} does not exist" in out
    assert "required under CI=true" in out and "passed" not in out


def test_missing_fixture_set_stops_the_session_under_ci(tmp_path):
    (tmp_path / "tiny-qwen35moe").mkdir()
    run = _pytest(tmp_path, "tests/test_bitwise.py")
    assert run.returncode == 4
    assert f"{tmp_path} lacks {', '.join(s for s in FIXTURE_SETS if s != 'tiny-qwen35moe')}" in run.stdout + run.stderr


def test_missing_file_fails_under_ci_and_skips_outside(tmp_path):
    for s in FIXTURE_SETS:  # every set present, but empty
        (tmp_path / s).mkdir()
    test = "tests/test_llama_cpp_side.py::test_parse_recorded_speculative_logs"
    ci = _pytest(tmp_path, test)
    want = f"reference fixture {tmp_path}/tiny-qwen35moe/references.json is absent"
    assert ci.returncode == 1 and "3 failed" in ci.stdout and want in ci.stdout, ci.stdout
    assert "required under CI=true" in ci.stdout
    local = _pytest(tmp_path, test, ci="")
    assert local.returncode == 0 and "3 skipped" in local.stdout and want in local.stdout, local.stdout
