"""The README and docs/ say only what runs and link only to what exists.

- Every ```python block of README.md runs, in a fresh namespace, in this process (the embedded default
  model loads with `sharpi_jax.load()` in a few seconds).
- Every shell block (```bash / ```sh / ```console) of README.md holds only known commands: the two of
  "Two commands on a fresh machine" (the first is run by tests/experiments/test_entry_points.py, the
  second is the test suite itself), or a cheap one that runs here.
- Every relative link in README.md, docs/*.md and WORKSPACE.md (its pointers to where how-to moved)
  points to an existing file or folder, and every anchor to a heading of its target.
- Every mutation of tests/mutations.py is listed in docs/promises.md, beside the promise it attacks.
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
LOG = REPO_ROOT / "WORKSPACE.md"  # its pointers into docs/ are links too

INSTALL_AND_RUN = ('python3 -m pip install -e ".[test]" && python -m experiments.generate --speculative=mtp '
                   '--draft_tokens=3 --max_new_tokens=48 --compare')
RUN_TESTS = "python -m pytest -q"
# Commands a README shell block may hold without running them here: the two of "Two commands on a
# fresh machine" (the first one's generation runs in tests/experiments/test_entry_points.py).
KNOWN = (INSTALL_AND_RUN, RUN_TESTS)
# Cheap commands a README shell block may hold: this test runs each (seconds: no compilation).
CHEAP = ("python -m experiments.info", "sharpi info")
CHEAP_TIMEOUT_S = 180

FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                   re.M | re.S)
SHELL = ("bash", "sh", "shell", "console")


def blocks(text: str) -> list[tuple[str, str, int]]:
    """(language, body, first line number) of every fenced code block."""
    return [(m["lang"], m["body"], text.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(text)]


def shell_commands(body: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments and blank lines dropped,
    a leading `$ ` prompt removed."""
    out, cur = [], ""
    for line in body.splitlines():
        line = line.rstrip()
        if line.endswith("\\"):
            cur += line[:-1].strip() + " "
            continue
        line = (cur + line.strip()).strip()
        cur = ""
        if line.startswith("$ "):
            line = line[2:]
        if line and not line.startswith("#"):
            out.append(line)
    return out


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 250


def test_two_commands_on_a_fresh_machine():
    """The section holds exactly the two commands, in order (test_entry_points parses the first)."""
    text = README.read_text()
    section = text.split("## Two commands on a fresh machine", 1)[1].split("\n## ", 1)[0]
    found = [c for lang, body, _ in blocks(section) if lang in SHELL for c in shell_commands(body)]
    assert found == [INSTALL_AND_RUN, RUN_TESTS]


def _python_blocks():
    text = README.read_text()
    return [pytest.param(body, id=f"README.md:{line}") for lang, body, line in blocks(text) if lang == "python"]


@pytest.mark.parametrize("code", _python_blocks())
def test_readme_python_block_runs(code):
    from sharpi_jax.api import Engine

    namespace = {"__name__": "__readme__"}
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - the README's own example
    finally:
        for value in list(namespace.values()):
            if isinstance(value, Engine):
                value.close()
    assert len(out.getvalue().splitlines()) <= 10, "keep the README examples' output short"


def _shell_commands():
    text = README.read_text()
    return [pytest.param(c, id=f"README.md:{line}:{c[:40]}") for lang, body, line in blocks(text) if lang in SHELL
            for c in shell_commands(body)]


@pytest.mark.parametrize("command", _shell_commands())
def test_readme_shell_command_is_known_or_runs(command):
    if command in KNOWN:
        return
    assert command in CHEAP, (f"README shell command {command!r} is neither one of the two commands of 'Two "
                              f"commands on a fresh machine' nor a cheap one this test runs ({CHEAP}): make it "
                              "a python block, or add it to CHEAP if it runs in seconds")
    argv = command.split()
    assert argv[0] in ("python", "sharpi")
    # python: this interpreter; sharpi: the console script the install put beside it
    exe = [sys.executable] if argv[0] == "python" else [str(Path(sys.executable).parent / "sharpi")]
    proc = subprocess.run([*exe, *argv[1:]], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=CHEAP_TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), "the command printed nothing"


# ----- links -----

LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\((?P<target>[^)\s]+)\)")


def _prose(text: str) -> str:
    """The text without fenced blocks and inline code (whose brackets are not links)."""
    text = FENCE.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markdown markup dropped, lower case, punctuation removed, spaces
    to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a markdown page (duplicates numbered as GitHub does)."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        s = slug(m[1])
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def _links():
    out = []
    for page in [*PAGES, LOG]:
        for m in LINK.finditer(_prose(page.read_text())):
            target = m["target"]
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                continue
            out.append(pytest.param(page, target, id=f"{page.relative_to(REPO_ROOT)}->{target}"))
    return out


@pytest.mark.parametrize("page, target", _links())
def test_local_link_resolves(page, target):
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    assert dest.exists(), f"{page.relative_to(REPO_ROOT)}: link to {target!r}: {dest} does not exist"
    assert REPO_ROOT in dest.parents or dest == REPO_ROOT, f"{target!r} points outside the repository"
    if anchor:
        assert dest.suffix == ".md", f"{target!r}: an anchor into a file that is not markdown"
        assert anchor in anchors(dest), (f"{page.relative_to(REPO_ROOT)}: link to {target!r}: no heading "
                                         f"with the anchor #{anchor} in {dest.relative_to(REPO_ROOT)}")


def test_pages_have_links_to_check():
    assert len(_links()) > 50


# ----- wording and cross-references -----

def test_no_issue_or_session_references():
    """The README and docs/ describe the project as it is, not the tickets or sessions it came from."""
    pattern = re.compile(r"\bissues?[ -]\d+|(?<![\w&])#\d+\b|\bsession \d+|\b(this|last|previous) session\b",
                         re.I)
    for page in PAGES:
        hits = pattern.findall(page.read_text())
        assert not hits, f"{page.relative_to(REPO_ROOT)}: {hits}"


def test_every_mutation_names_a_listed_promise():
    """docs/promises.md lists every mutation of tests/mutations.py beside the promise it attacks."""
    from tests.mutations import MUTATIONS

    text = (DOCS / "promises.md").read_text()
    missing = [m.name for m in MUTATIONS if f"`{m.name}`" not in text]
    assert not missing, f"add these mutations to docs/promises.md (Mutations: which promise each one attacks): {missing}"
