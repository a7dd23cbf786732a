"""The `sharpi` console command and what the wheel installs.

`sharpi COMMAND` runs the checkout's `python -m experiments.COMMAND` (`sharpi bench NAME`:
experiments.bench_NAME) with the same flags; only `sharpi_jax` goes to the top of site-packages.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from sharpi_jax import cli
from tests.conftest import REPO_ROOT

EXPERIMENTS = REPO_ROOT / "experiments"


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(list(args), cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_every_entry_point_is_a_command():
    """Each module of experiments/ that runs absl's app is listed under its command name, and only those."""
    points = cli.entry_points(EXPERIMENTS)
    runnable = {p.stem for p in EXPERIMENTS.glob("*.py") if "if __name__ == \"__main__\"" in p.read_text()}
    assert set(points) == runnable
    assert {"generate", "info", "bench_decode", "bench_verify", "perplexity", "twin"} <= set(points)
    assert all(p.summary for p in points.values()), "every command has a one-line summary"
    assert points["generate"].absl and not points["bandwidth"].absl  # bandwidth is a plain main(argv)


@pytest.mark.parametrize("argv, module, rest", [
    (["generate", "--max_new_tokens=4"], "generate", ["--max_new_tokens=4"]),
    (["bench", "decode", "--threads=2"], "bench_decode", ["--threads=2"]),
    (["bench", "expert-parallel"], "bench_expert_parallel", []),
    (["info"], "info", []),
])
def test_commands_name_their_entry_point(argv, module, rest):
    assert cli.resolve(argv, cli.entry_points(EXPERIMENTS)) == (module, rest)


@pytest.mark.parametrize("argv, message", [
    ([], "no command given"),
    (["nope"], "unknown command 'nope'"),
    (["bench"], "sharpi bench needs a benchmark name"),
    (["bench", "--threads=2"], "sharpi bench needs a benchmark name"),
    (["bench", "nope"], "unknown command 'bench nope'"),
])
def test_bad_commands_are_one_line(argv, message):
    with pytest.raises(ValueError, match=message):
        cli.resolve(argv, cli.entry_points(EXPERIMENTS))


def test_console_script_is_installed():
    """The install puts `sharpi` beside the interpreter (pyproject's [project.scripts]); --help lists the
    commands and exits 0; a bad command exits 2 with its one line."""
    script = Path(sys.executable).parent / "sharpi"
    assert script.exists(), f"no sharpi console script in {script.parent}: reinstall with pip install -e ."
    ok = _run(str(script), "--help", timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert "bench decode" in ok.stdout and "generate" in ok.stdout
    bad = _run(str(script), "nope", timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("sharpi: unknown command 'nope'")


def test_sharpi_info_is_python_m_experiments_info():
    """Same flags, same output: the command runs the entry point itself."""
    via_cli = _run(sys.executable, "-m", "sharpi_jax.cli", "info")
    via_module = _run(sys.executable, "-m", "experiments.info")
    assert via_cli.returncode == 0 and via_module.returncode == 0, via_cli.stderr[-800:] + via_module.stderr[-800:]
    assert via_cli.stdout == via_module.stdout and "routed experts" in via_cli.stdout


def test_wheel_installs_only_sharpi_jax():
    """Every package the wheel carries lands under sharpi_jax/ (no generic top-level `experiments` or
    `pallas_kernels` in site-packages); the kernels ship as sharpi_jax.pallas_kernels."""
    packages = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["scikit-build"]["wheel"]["packages"]
    assert all(dest == "sharpi_jax" or dest.startswith("sharpi_jax/") for dest in packages), packages
    assert packages.get("sharpi_jax/pallas_kernels") == "pallas_kernels"


@pytest.mark.slow
def test_built_wheel_top_level(tmp_path):
    """Build the wheel (compiles the native extension) and list what sits at the top of it."""
    p = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), ".",
             timeout=1800)
    assert p.returncode == 0, p.stderr[-2000:]
    (wheel,) = tmp_path.glob("sharpi_jax-*.whl")
    top = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}
    assert top == {"sharpi_jax", next(t for t in top if t.endswith(".dist-info"))}, top
    names = zipfile.ZipFile(wheel).namelist()
    assert "sharpi_jax/pallas_kernels/grouped_matmul/pallas_triton.py" in names
    assert any(n.startswith("sharpi_jax/assets/") and n.endswith(".gguf") for n in names)


def test_plain_entry_point_help_and_bad_argument(capsys):
    """A command outside absl (bandwidth) answers --help with its usage and a bad argument with one line."""
    assert cli.main(["bandwidth", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: bandwidth")
    assert cli.main(["bandwidth", "lots"]) == 2
    assert capsys.readouterr().err.startswith("error: 'lots' is not a buffer size in MiB")
