"""Shared pytest fixtures: where the reference data in ../shared/fixtures lives.

Outside CI a missing fixture skips the tests that need it, with its path as the reason. Under CI
(environment CI=true, as .ci/run and hosted runners set it) the reference comparisons are the point of
the run: a missing fixtures directory stops the session before any test runs, and a missing fixture
file fails its test. SHARPI_FIXTURES=DIR points the tests at another fixtures directory.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("SHARPI_FIXTURES") or REPO_ROOT.parent / "shared" / "fixtures").resolve()
# The fixture sets the tests read (see FIXTURES/README.md).
FIXTURE_SETS = ("tiny-qwen35moe", "tiny-qwen35", "tiny-qwen3next", "quant-zoo")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def missing_fixtures_message() -> str | None:
    """None when every fixture set is present, else what is missing and where it was looked for."""
    if not FIXTURES.is_dir():
        missing = f"the directory {FIXTURES} does not exist"
    else:
        absent = [s for s in FIXTURE_SETS if not (FIXTURES / s).is_dir()]
        if not absent:
            return None
        missing = f"{FIXTURES} lacks {', '.join(absent)}"
    return (f"reference fixtures missing: {missing}. They are required under CI=true (every comparison with "
            f"transformers and llama.cpp needs them): put the shared fixtures at ../shared/fixtures beside "
            f"the repo, or point SHARPI_FIXTURES at them.")


_COMPILATION_CACHE: str | None = None


def pytest_configure(config):
    """One JAX compilation cache for the session, in a fresh temporary directory removed at its end,
    shared by the tests and the entry-point subprocesses they start (through the environment): a
    program compiled again (another engine of the same model, another test module after
    `_release_compiled_code`, another process) is loaded instead of compiled, which is most of a
    test's set-up time. The cache key is the program, the compile options, the backend and the jax
    version, so a hit is the executable a compile would give. A JAX_COMPILATION_CACHE_DIR already set
    is used as it is (and kept)."""
    global _COMPILATION_CACHE
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        _COMPILATION_CACHE = tempfile.mkdtemp(prefix="sharpi-jax-tests-xla-")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = _COMPILATION_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
    import jax

    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


# Modules whose tests check subprocess runs started in the background when collection ends (their
# `start_background(session, items)`, `tests.background`), in the order their runs start (longest
# first). Their tests run last, so that the main process runs every other test meanwhile.
BACKGROUND_MODULES = ("tests/experts/test_expert_parallel.py", "tests/experiments/test_entry_points.py")


def _module_of(item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: _module_of(item) in BACKGROUND_MODULES)  # stable: the rest keep their order


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    for module in BACKGROUND_MODULES:
        items = [item for item in session.items if _module_of(item) == module]
        if items:
            items[0].module.start_background(session, items)


def pytest_unconfigure(config):
    from tests import background

    background.shutdown()
    if _COMPILATION_CACHE is not None:
        shutil.rmtree(_COMPILATION_CACHE, ignore_errors=True)


def pytest_sessionstart(session):
    """Under CI, no fixtures is a failed run with a clear message, not a run of skips."""
    msg = missing_fixtures_message() if in_ci() else None
    if msg:
        pytest.exit(msg, returncode=pytest.ExitCode.USAGE_ERROR)


def fixture_path(*parts: str) -> Path:
    """Path under the fixtures directory. If it is absent: fails the calling test under CI, else skips
    it with a clear reason."""
    p = FIXTURES.joinpath(*parts)
    if not p.exists():
        msg = f"reference fixture {p} is absent (expected ../shared/fixtures beside the repo)"
        if in_ci():
            pytest.fail(msg + "; required under CI=true", pytrace=False)
        pytest.skip(msg)
    return p


@functools.lru_cache(maxsize=None)
def load_references(model_dir: str) -> dict:
    return json.loads(fixture_path(model_dir, "references.json").read_text())


@functools.lru_cache(maxsize=None)
def fixture_engine(name: str, variant: str, max_context: int, prefill_buckets: tuple[int, ...] | None = None,
                   kernels: str | None = None, gdn_step: str | None = None):
    """`sj.load` of fixture `<name>/<name>-<variant>.gguf`, cached so a module's tests share compiled
    engines (released after each module, see `_release_compiled_code`). kernels, gdn_step: None = the
    default."""
    import sharpi_jax as sj

    options = {} if prefill_buckets is None else {"prefill_buckets": prefill_buckets}
    if kernels is not None:
        options["kernels"] = kernels
    if gdn_step is not None:
        options["gdn_step"] = gdn_step
    return sj.load(fixture_path(name, f"{name}-{variant}.gguf"), max_context=max_context, **options)


def release_compiled_code() -> None:
    """Drop the cached engines and JAX's compiled executables. Each XLA:CPU executable keeps its code
    mapped; kept too long they pushed the process past the kernel's 65,530 memory-map limit and XLA
    crashed while compiling (SIGSEGV / abort)."""
    import gc

    import jax

    fixture_engine.cache_clear()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """After each test module, `release_compiled_code`."""
    yield
    release_compiled_code()
