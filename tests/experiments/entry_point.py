"""Run `python -m experiments.<name> ...` as a user would, in a subprocess.

A subprocess, not main() in-process: the entry points define absl flags with the same names (--gguf,
--model, --repeats, --out, ...) on the one global FLAGS, so two of them cannot be imported into one
process. PYTHONPATH puts this checkout first, so the code under test is this tree's even where
another checkout is editable-installed; SHARPI_CACHE is the test's own, so nothing is written into
the user's cache.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_entry_point(name: str, *args: str, cache: Path, timeout: float = 600, python_prelude: str | None = None
                    ) -> subprocess.CompletedProcess:
    """`python -m experiments.<name> *args` from the repo root; python_prelude (code) runs first in the
    same process (e.g. to simulate a permission error where the tests run as root)."""
    env = dict(os.environ, SHARPI_CACHE=str(cache), PYTHONPATH=os.pathsep.join(
        [str(REPO_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.setdefault("JAX_PLATFORMS", "cpu")
    if python_prelude is None:
        cmd = [sys.executable, "-m", f"experiments.{name}", *args]
    else:
        runner = (f"{python_prelude}\nimport runpy, sys\nsys.argv = {[f'experiments/{name}.py', *args]!r}\n"
                  f"runpy.run_module('experiments.{name}', run_name='__main__', alter_sys=True)")
        cmd = [sys.executable, "-c", runner]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def ok(res: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """res, after checking it exited 0 (else fail showing the tail of its output)."""
    assert res.returncode == 0, f"exit {res.returncode}\n--- stdout\n{res.stdout[-3000:]}\n--- stderr\n{res.stderr[-3000:]}"
    return res


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


_LOG_LINE = re.compile(r"^[IWEF]\d{4} ")  # absl / XLA log lines ("I1123 09:27:19.507 ...")


def own_lines(stderr: str) -> list[str]:
    """The stderr lines an entry point printed itself (absl / XLA log lines left out)."""
    return [ln for ln in stderr.splitlines() if ln.strip() and not _LOG_LINE.match(ln)]
