"""Mutation check: apply each named mutation of `tests.mutations` to a scratch copy of the repo and run
the fast tests expected to kill it.

    python -m tests.mutation_check [--only NAME[,NAME]] [--list] [--wider] [--json PATH] [--timeout S]

Per mutation: the repo (without .git, .venv, caches) is copied to a temporary directory, the edits are
applied (each original snippet must occur exactly once, else the mutation is STALE: reported loudly,
never counted as killed or survived), and `python -m pytest -x -q` runs the mutation's tests with the
copy as cwd (so the copy's package is imported; checked) and SHARPI_FIXTURES pointing at the real
fixtures. A mutation of csrc/ or CMakeLists.txt first builds the copy's native extension (cmake) and points
$SHARPI_GGML_EXTENSION at it (checked: the copy's build is the one imported). Killed = pytest exits 1 (a test failed); the failing tests are recorded. Exit status: 0 when
every mutation was killed, 1 otherwise (a survivor, a stale snippet, or a run that errored).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.conftest import FIXTURES, REPO_ROOT
from tests.mutations import MUTATIONS, Mutation, by_name

IGNORE = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.pyc", ".pytest_cache", "results", "*.egg-info",
                                "build")
NATIVE = ("csrc/", "CMakeLists.txt")  # a mutation of these must run the mutated extension: built in the copy


@dataclasses.dataclass
class Result:
    name: str
    status: str  # killed | survived | stale | error
    failed: list[str]
    seconds: float
    detail: str = ""


def apply(root: Path, m: Mutation) -> str | None:
    """Apply m's edits under root. Returns None, or why the mutation is stale."""
    path = root / m.file
    if not path.is_file():
        return f"{m.file} does not exist"
    text = path.read_text()
    for orig, repl in m.edits:
        n = text.count(orig)
        if n != 1:
            return f"snippet found {n} times in {m.file} (expected once): {orig.strip()[:70]!r}"
        text = text.replace(orig, repl)
    path.write_text(text)
    return None


def stale_reason(m: Mutation, root: Path = REPO_ROOT) -> str | None:
    """Why m no longer applies to the tree at root (None: every snippet occurs exactly once)."""
    path = root / m.file
    if not path.is_file():
        return f"{m.file} does not exist"
    text = path.read_text()
    for orig, _ in m.edits:
        if text.count(orig) != 1:
            return f"snippet found {text.count(orig)} times in {m.file}: {orig.strip()[:70]!r}"
    return None


def _copy_import_env(extension: str | None) -> dict[str, str]:
    """Environment under which the copy's package is imported, not the checkout's: an editable install's
    finder (scikit-build-core's, first on sys.meta_path) is told to step aside for this tree
    (SKBUILD_EDITABLE_SKIP), and the native extension it would have supplied is named explicitly (the
    mutated build, or the installed one)."""
    env = {}
    skip = [str(f.path) for f in sys.meta_path
            if type(f).__name__ == "ScikitBuildRedirectingFinder" and getattr(f, "path", None)]
    if skip:
        env["SKBUILD_EDITABLE_SKIP"] = os.pathsep.join(filter(None, [os.environ.get("SKBUILD_EDITABLE_SKIP"), *skip]))
    if extension is None:
        from sharpi_jax.quant import ggml

        extension = ggml._ext().__file__ if ggml.available() else None
    if extension:
        env["SHARPI_GGML_EXTENSION"] = extension
    return env


def build_native(root: Path) -> tuple[str | None, str | None]:
    """Compiles the copy's native extension (cmake, a C++17 compiler and nanobind: the test extra).
    (path of the built module, None) or (None, why not)."""
    build = root / "build"
    cfg = ["cmake", "-S", str(root), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
           f"-DPython_EXECUTABLE={sys.executable}"] + (["-G", "Ninja"] if shutil.which("ninja") else [])
    for cmd in (cfg, ["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2)]):
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            return None, f"native build failed: {' '.join(cmd[:2])}: {(p.stdout + p.stderr)[-500:]}"
    built = sorted(build.glob("_ggml*.so"))
    if not built:
        return None, "native build made no _ggml*.so"
    return str(built[0]), None


def run_one(m: Mutation, wider: bool, timeout: float) -> Result:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"mutation-{m.name}-") as tmp:
        root = Path(tmp) / "repo"
        shutil.copytree(REPO_ROOT, root, ignore=IGNORE)
        # pallas_kernels/ installs as sharpi_jax.pallas_kernels (pyproject's wheel.packages); the copy is
        # imported from its tree, not installed, so a link puts the copy's kernels in that place.
        (root / "sharpi_jax" / "pallas_kernels").symlink_to(root / "pallas_kernels", target_is_directory=True)
        why = apply(root, m)
        if why:
            return Result(m.name, "stale", [], time.perf_counter() - t0, why)
        native = m.file.startswith(NATIVE)
        extension = None
        if native:
            extension, why = build_native(root)
            if why:
                return Result(m.name, "error", [], time.perf_counter() - t0, why)
        env = dict(os.environ, SHARPI_FIXTURES=str(FIXTURES), JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
                   PYTHONDONTWRITEBYTECODE="1")
        env.pop("PYTHONPATH", None)
        env.update(_copy_import_env(extension))
        probe = subprocess.run([sys.executable, "-c", "import sharpi_jax, sharpi_jax.pallas_kernels as pk; "
                                "print(sharpi_jax.__file__); print(pk.__file__)"
                                + ("; from sharpi_jax.quant import ggml; ggml._ext(); print(ggml._ext().__file__)"
                                   if native else "")],
                               cwd=root, env=env, capture_output=True, text=True)
        if probe.returncode != 0 or any(not Path(p).resolve().is_relative_to(root.resolve())
                                        for p in probe.stdout.split()):
            return Result(m.name, "error", [], time.perf_counter() - t0,
                          f"the copy's package is not the one imported: {probe.stdout.strip()} {probe.stderr[-300:]}")
        args = list(m.tests) + (list(m.wider) if wider else [])
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rf", "-p", "no:cacheprovider", *args]
        try:
            p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return Result(m.name, "error", [], time.perf_counter() - t0, f"timed out after {timeout:.0f} s")
        out = p.stdout + p.stderr
        failed = re.findall(r"^FAILED (\S+)", out, re.M)
        tail = out.strip().splitlines()[-1] if out.strip() else ""
        if p.returncode == 1:
            status = "killed"
        elif p.returncode == 0:
            status = "survived"
        else:
            status = "error"  # collection error, usage error, no tests collected (5): not a kill
            tail = out[-600:]
        return Result(m.name, status, failed, time.perf_counter() - t0, tail)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", default=[], help="mutation name(s), comma-separated; repeatable")
    ap.add_argument("--list", action="store_true", help="list the mutations (and whether they still apply)")
    ap.add_argument("--wider", action="store_true", help="also run each mutation's wider test selection")
    ap.add_argument("--json", default=str(Path(tempfile.gettempdir()) / "mutation_check.json"),
                    help="where to write the JSON report")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per mutation's test run")
    a = ap.parse_args(argv)
    names = [n for o in a.only for n in o.split(",") if n]
    muts = [by_name(n) for n in names] if names else list(MUTATIONS)
    if a.list:
        for m in muts:
            why = stale_reason(m)
            print(f"{m.name:34s} {'STALE: ' + why if why else 'ok':10s}  {m.file}\n    promise: {m.promise}\n"
                  f"    tests: {' '.join(m.tests)}")
        return 0
    results = []
    for m in muts:
        print(f"[mutation_check] {m.name} ...", flush=True)
        r = run_one(m, a.wider, a.timeout)
        if r.status == "stale":
            print(f"[mutation_check] !!! STALE MUTATION {m.name}: {r.detail} -- update tests/mutations.py", flush=True)
        print(f"[mutation_check] {m.name}: {r.status.upper()} in {r.seconds:.0f} s {' '.join(r.failed)}", flush=True)
        results.append(r)
    print(f"\n{'mutation':34s} {'status':9s} {'s':>5s}  killed by")
    for r in results:
        print(f"{r.name:34s} {r.status:9s} {r.seconds:5.0f}  {', '.join(r.failed) or r.detail[-100:]}")
    Path(a.json).write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
    print(f"\nJSON: {a.json}")
    bad = [r.name for r in results if r.status != "killed"]
    if bad:
        print(f"NOT KILLED: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
