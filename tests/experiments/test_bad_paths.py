"""A GGUF path that is a directory, an empty file, an unreadable file or not a regular file gives a
one-line GGUFError naming it, from the API and from the command line (never an OSError traceback)."""

from __future__ import annotations

import os
import re

import pytest

import sharpi_jax as sj
from sharpi_jax.errors import GGUFError
from sharpi_jax.gguf import GGUFFile
from tests.experiments.entry_point import own_lines, run_entry_point

MESSAGES = {
    "directory": "is a directory, not a GGUF file",
    "empty": r"empty file \(0 bytes\), not a GGUF file",
    "unreadable": r"cannot read the file \(permission denied\)",
    "fifo": "not a regular file",
    "missing": r"cannot open \(No such file or directory\)",
}


def _bad_path(tmp_path, kind: str):
    if kind == "directory":
        return tmp_path
    p = tmp_path / "model.gguf"
    if kind == "empty":
        p.write_bytes(b"")
    elif kind == "unreadable":
        p.write_bytes(b"GGUF" + bytes(60))
        p.chmod(0)
    elif kind == "fifo":
        os.mkfifo(p)
    return p


def _deny_open_prelude(path) -> str:
    """Python run before the entry point: opening `path` fails with EACCES (root reads any file)."""
    return (f"import os\n_real_open = os.open\n"
            f"def _open(p, *a, **k):\n"
            f"    if os.fspath(p) == {str(path)!r}:\n"
            f"        raise PermissionError(13, 'Permission denied', os.fspath(p))\n"
            f"    return _real_open(p, *a, **k)\n"
            f"os.open = _open\n")


def _readable(path) -> bool:
    return os.access(path, os.R_OK)


@pytest.mark.parametrize("kind", list(MESSAGES))
def test_load_bad_path_raises_one_line_gguf_error(tmp_path, monkeypatch, kind):
    path = _bad_path(tmp_path, kind)
    if kind == "unreadable" and _readable(path):  # running as root: simulate the permission error
        real_open = os.open

        def deny(p, *args, **kw):
            if os.fspath(p) == str(path):
                raise PermissionError(13, "Permission denied", os.fspath(p))
            return real_open(p, *args, **kw)

        monkeypatch.setattr(os, "open", deny)
    for call in (lambda: sj.load(path), lambda: GGUFFile(path)):
        with pytest.raises(GGUFError, match=MESSAGES[kind]) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(str(path))


@pytest.mark.parametrize("kind", ["directory", "empty", "unreadable"])
def test_generate_bad_path_prints_one_error_line(tmp_path, kind):
    path = _bad_path(tmp_path, kind)
    prelude = _deny_open_prelude(path) if kind == "unreadable" and _readable(path) else None
    res = run_entry_point("generate", f"--gguf={path}", "--max_new_tokens=4", cache=tmp_path / "cache",
                          python_prelude=prelude)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stdout == ""
    lines = own_lines(res.stderr)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: {path}: ")
    assert re.search(MESSAGES[kind], lines[0])
    assert "Traceback" not in res.stderr
