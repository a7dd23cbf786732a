"""Imports run one way: each part of sharpi_jax imports only the parts below it, kernels import no model code.

Every `import` / `from ... import` statement of every module is read (function-level ones included),
resolved to the part of the package it names, and checked against LAYERS. A new subpackage must be
placed in LAYERS before it can import or be imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

# Bottom first: a part may import the parts before it, never one after it. `pallas_kernels` (the
# repository's pallas_kernels/, installed as sharpi_jax.pallas_kernels) imports nothing of sharpi_jax;
# `paths` knows where files go. `config` is a leaf (ModelConfig and RunConfig depend only on errors), so
# the GGUF layer may build a ModelConfig from a file's metadata; `quant` is the quantized-tensor layer;
# `model` declares the contracts it calls (the expert provider), `experts` implements them; `training`
# builds on model and experts; `cli` runs the checkout's entry points.
LAYERS = ("pallas_kernels", "errors", "paths", "assets", "config", "gguf", "quant", "model", "experts", "runtime",
          "training", "testing", "api", "cli", "sharpi_jax")
PACKAGE = REPO_ROOT / "sharpi_jax"
KERNELS = REPO_ROOT / "pallas_kernels"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _part(module: str) -> str | None:
    """The LAYERS entry a sharpi_jax module belongs to (None outside sharpi_jax)."""
    parts = module.split(".")
    if parts[0] != "sharpi_jax":
        return None
    return parts[1] if len(parts) > 1 else "sharpi_jax"


def _is_module(name: str) -> bool:
    p = REPO_ROOT.joinpath(*name.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def _imports(path: Path):
    """(line, imported module, imported names) of every import statement in a file."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = package.split(".")
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            names = tuple(a.name for a in node.names)
            # `from sharpi_jax import model` imports the submodule: count it as one.
            subs = [f"{base}.{n}" for n in names if _is_module(f"{base}.{n}")]
            if subs:
                for s in subs:
                    yield node.lineno, s, ()
                rest = tuple(n for n in names if not _is_module(f"{base}.{n}"))
                if rest:
                    yield node.lineno, base, rest
            else:
                yield node.lineno, base, names


def _private_attributes(path: Path, foreign: set[str]):
    """(line, alias.attr) for `alias._name` where alias is a module imported from another part."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in foreign
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            yield node.lineno, f"{node.value.id}.{node.attr}"


def _edges():
    """[(source part, target part, where)] for every import between two different parts of sharpi_jax,
    and the private names used across parts."""
    edges, private = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        src = _part(_module_name(path))
        foreign_aliases: set[str] = set()
        rel = path.relative_to(REPO_ROOT)
        for line, target, names in _imports(path):
            dst = _part(target)
            if dst is None or dst == src:
                continue
            edges.append((src, dst, f"{rel}:{line} imports {target}"))
            private += [f"{rel}:{line} imports {target}.{n}" for n in names if n.startswith("_")]
            if not names:  # a module import: remember its local name for attribute checks
                foreign_aliases.add(target.rpartition(".")[2])
        private += [f"{rel}:{line} uses {a}" for line, a in _private_attributes(path, foreign_aliases)]
    return edges, private


def test_every_part_is_placed():
    parts = {_part(_module_name(p)) for p in PACKAGE.rglob("*.py")}
    unplaced = sorted(parts - set(LAYERS))
    assert not unplaced, f"place these parts of sharpi_jax in tests/test_imports.py LAYERS: {unplaced}"


def test_imports_flow_one_way():
    """No part imports a part above it (which also rules out every cycle between parts)."""
    edges, _ = _edges()
    rank = {p: i for i, p in enumerate(LAYERS)}
    upward = [f"{s} -> {d}: {where}" for s, d, where in edges if s in rank and d in rank and rank[d] > rank[s]]
    assert not upward, "imports against the layer order " + " < ".join(LAYERS) + ":\n" + "\n".join(upward)


def test_no_import_cycle_between_parts():
    edges, _ = _edges()
    graph: dict[str, set[str]] = {}
    for s, d, _ in edges:
        graph.setdefault(s, set()).add(d)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                cycle = stack[stack.index(m):] + [m]
                where = [w for s, d, w in edges if (s, d) in zip(cycle, cycle[1:])]
                pytest.fail("import cycle " + " -> ".join(cycle) + ":\n" + "\n".join(where))
            if not state.get(m):
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if not state.get(n):
            visit(n)


def test_no_private_names_across_parts():
    _, private = _edges()
    assert not private, "private names used across parts of sharpi_jax:\n" + "\n".join(private)


def test_kernels_import_no_model_code():
    bad = [f"{p.relative_to(REPO_ROOT)}:{line} imports {t}" for p in sorted(KERNELS.rglob("*.py"))
           for line, t, _ in _imports(p) if t.split(".")[0] == "sharpi_jax"]
    assert not bad, "pallas_kernels must not import sharpi_jax:\n" + "\n".join(bad)


def _engine_parameters(path: Path):
    """(line, function, parameter) for each parameter named `engine` or annotated with `Engine`."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                if arg is None:
                    continue
                note = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                if arg.arg == "engine" or "Engine" in note:
                    yield node.lineno, getattr(node, "name", "<lambda>"), arg.arg


def test_nothing_below_api_takes_an_engine():
    """Calls run one way too: a module below `api` is given arrays, callables or runtimes, never the
    Engine to call back up into (calibration lives on the Engine; the layers below hold its parts)."""
    rank = {p: i for i, p in enumerate(LAYERS)}
    bad = [f"{p.relative_to(REPO_ROOT)}:{line} {fn}({arg})" for p in sorted(PACKAGE.rglob("*.py"))
           if rank.get(_part(_module_name(p)), len(LAYERS)) < rank["api"]
           for line, fn, arg in _engine_parameters(p)]
    assert not bad, "functions below api that take an Engine:\n" + "\n".join(bad)
