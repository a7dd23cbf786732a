"""`sharpi`: the command line, one command per entry point of the checkout's `experiments/`.

    sharpi generate --prompt="def fib(n):" --speculative=mtp     # python -m experiments.generate ...
    sharpi info --gguf=model.gguf                                # python -m experiments.info ...
    sharpi bench decode --llama_bin=../shared/llama.cpp/bin      # python -m experiments.bench_decode ...
    sharpi --help                                                # the commands, one line each

Each command keeps its flags (absl's: `sharpi generate --help`). The entry points read the repository's
`configs/` and files, so they live in the source checkout, not in the wheel: `pip install -e .` in a
clone installs `sharpi` pointing at that clone. A wheel alone says so in one line.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import NamedTuple

BENCH_PREFIX = "bench_"


def _checkout_experiments() -> Path | None:
    """The checkout's experiments/ folder: the importable `experiments` package if it sits beside a
    sharpi_jax/ (so another project's `experiments` is never run), else the folder beside this package."""
    spec = importlib.util.find_spec("experiments")
    if spec is not None and spec.submodule_search_locations:
        folder = Path(list(spec.submodule_search_locations)[0])
        if (folder.parent / "sharpi_jax").is_dir():
            return folder
    folder = Path(__file__).resolve().parents[1] / "experiments"
    if (folder / "__init__.py").is_file():
        sys.path.insert(0, str(folder.parent))
        return folder
    return None


class EntryPoint(NamedTuple):
    """One command: the first sentence of its module's docstring, and whether it runs under absl's app."""

    summary: str
    absl: bool


def entry_points(folder: Path) -> dict[str, EntryPoint]:
    """{module name: `EntryPoint`} for every module of `folder` that runs as a script (absl's
    `app.run(main)`, or a plain `main(sys.argv)`); each file is read once, here."""
    found = {}
    for path in sorted(folder.glob("*.py")):
        text = path.read_text()
        if '__name__ == "__main__"' in text:
            doc = (ast.get_docstring(ast.parse(text)) or "").split("\n\n")[0]
            first = " ".join(doc.split()).split(". ")[0].rstrip(".")
            found[path.stem] = EntryPoint(first if len(first) <= 100 else first[:99] + "…", "app.run(" in text)
    return found


def _usage(points: dict[str, EntryPoint]) -> str:
    width = max(len(c) for c in _command_names(points))
    lines = ["usage: sharpi COMMAND [--flags]   (sharpi COMMAND --help: its flags)", "", "commands:"]
    for name, point in points.items():
        lines.append(f"  {_command_name(name):<{width}}  {point.summary}")
    return "\n".join(lines)


def _command_name(module: str) -> str:
    return f"bench {module[len(BENCH_PREFIX):]}" if module.startswith(BENCH_PREFIX) else module


def _command_names(points: dict[str, EntryPoint]) -> list[str]:
    return [_command_name(m) for m in points]


def resolve(argv: list[str], points: dict[str, EntryPoint]) -> tuple[str, list[str]]:
    """(module name, the flags after the command) for `sharpi` arguments; a ValueError names a bad command."""
    if not argv:
        raise ValueError("no command given")
    command, rest = argv[0], argv[1:]
    if command == "bench":
        if not rest or rest[0].startswith("-"):
            names = ", ".join(m[len(BENCH_PREFIX):] for m in points if m.startswith(BENCH_PREFIX))
            raise ValueError(f"sharpi bench needs a benchmark name: one of {names}")
        command, rest = BENCH_PREFIX + rest[0], rest[1:]
    module = command.replace("-", "_")
    if module not in points:
        raise ValueError(f"unknown command {' '.join(argv[: len(argv) - len(rest)])!r}")
    return module, rest


def main(argv: list[str] | None = None) -> int:
    """The `sharpi` console command."""
    argv = sys.argv[1:] if argv is None else list(argv)
    folder = _checkout_experiments()
    if folder is None:
        print("sharpi: the experiments/ entry points were not found: they live in the source checkout; clone "
              "the repository and run `pip install -e .` there (the wheel carries only the library)",
              file=sys.stderr)
        return 2
    points = entry_points(folder)
    if not argv or argv[0] in ("-h", "--help", "help"):
        try:
            print(_usage(points), flush=True)
        except BrokenPipeError:  # `sharpi --help | head -1`: the reader left; no traceback
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    try:
        module, rest = resolve(argv, points)
    except ValueError as e:
        print(f"sharpi: {e}\n\n{_usage(points)}", file=sys.stderr)
        return 2
    entry = importlib.import_module(f"experiments.{module}")
    argv = [f"sharpi {_command_name(module)}", *rest]
    if not points[module].absl:
        return entry.main(argv) or 0
    from absl import app  # pylint: disable=import-outside-toplevel

    app.run(entry.main, argv=argv)  # exits with main's status
    return 0


if __name__ == "__main__":
    sys.exit(main())
