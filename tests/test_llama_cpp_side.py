"""The llama.cpp side-by-side runner reads llama.cpp's own logs correctly (experiments/llama_cpp_side.py).

The reference is llama.cpp itself: the fixtures record llama-speculative-simple's log tail beside the
stats the fixture generator parsed from it, for every architecture, variant and draft length.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from experiments import llama_cpp_side
from tests.conftest import load_references

MODELS = ("tiny-qwen35moe", "tiny-qwen35", "tiny-qwen3next")


@pytest.mark.parametrize("model", MODELS)
def test_parse_recorded_speculative_logs(model):
    refs = load_references(model)
    checked = 0
    for variant, v in refs["variants"].items():
        for k, run in v.get("mtp", {}).items():
            got = llama_cpp_side.parse_speculative_log(run["log_tail"])
            want = run["stats"]
            assert got["drafted"] == want["n_drafted"], (variant, k)
            assert got["accepted"] == want["n_accept"], (variant, k)
            assert got["n_predict"] == want["n_predict"], (variant, k)
            assert got["acceptance_rate"] == pytest.approx(want["accept_pct"] / 100, abs=1e-5)
            assert got["generated_tokens"] == want["n_predict"] and got["decode_tok_s"] > 0
            checked += 1
    assert checked >= 2


def test_parse_log_without_summary_has_no_figures():
    assert llama_cpp_side.parse_speculative_log("load_model: error loading model\n") == {}


def test_find_tool(tmp_path):
    tool = tmp_path / llama_cpp_side.MTP_TOOL
    tool.write_text("#!/bin/sh\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    other = tmp_path / "llama-cli"
    other.write_text("")
    assert llama_cpp_side.find_tool(str(tmp_path), llama_cpp_side.MTP_TOOL) == tool
    assert llama_cpp_side.find_tool(str(other), llama_cpp_side.MTP_TOOL) == tool  # a sibling binary
    assert llama_cpp_side.find_tool(str(tmp_path), llama_cpp_side.BENCH_TOOL) is None
    assert llama_cpp_side.find_tool(None, llama_cpp_side.MTP_TOOL) is None
    nope = os.fspath(tmp_path / "nope")
    assert llama_cpp_side.mtp_speculative(tmp_path / "m.gguf", "x", 4, 1, llama_bin=nope) is None


def test_failing_tool_reports_an_error(tmp_path):
    tool = tmp_path / llama_cpp_side.MTP_TOOL
    tool.write_text("#!/bin/sh\necho 'decoded nothing' >&2\nexit 0\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    out = llama_cpp_side.mtp_speculative(tmp_path / "m.gguf", "x", 4, 1, llama_bin=str(tmp_path), repeats=1)
    assert "error" in out and "no summary" in out["error"]


def test_find_tool_mirrors_flattened_library_links(tmp_path):
    """A bin directory whose soname links were flattened into text files naming their targets (as
    ../shared/llama.cpp/bin is here) is mirrored with real links, so the loader finds the libraries."""
    tool = tmp_path / llama_cpp_side.BENCH_TOOL
    tool.write_text("#!/bin/sh\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "libllama.so.0.5.0").write_bytes(b"\x7fELF" + bytes(300))
    (tmp_path / "libllama.so.0").write_text("libllama.so.0.5.0")
    got = llama_cpp_side.find_tool(str(tmp_path), llama_cpp_side.BENCH_TOOL)
    assert got.parent != tmp_path and got.read_text() == "#!/bin/sh\n" and os.access(got, os.X_OK)
    link = got.parent / "libllama.so.0"
    assert link.is_symlink() and os.readlink(link) == "libllama.so.0.5.0"
    assert link.read_bytes()[:4] == b"\x7fELF"


def test_cpu_variant_bin_loads_one_variant_only(tmp_path):
    """--llama_cpu_variants=haswell: a mirror of the bin directory without the other libggml-cpu-*.so, so
    llama.cpp's loader can only pick the variant named (its AVX2 build beside its own pick)."""
    tool = tmp_path / llama_cpp_side.BENCH_TOOL
    tool.write_text("#!/bin/sh\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    for lib in ("libggml-cpu-haswell.so", "libggml-cpu-zen4.so", "libggml-base.so.0.25.3"):
        (tmp_path / lib).write_bytes(b"\x7fELF" + bytes(300))
    os.symlink("libggml-base.so.0.25.3", tmp_path / "libggml-base.so.0")
    assert llama_cpp_side.cpu_variant_bin(str(tmp_path), "auto") == str(tmp_path)
    assert llama_cpp_side.cpu_variant_bin(str(tmp_path), "skylakex") is None
    d = Path(llama_cpp_side.cpu_variant_bin(str(tmp_path), "haswell"))
    assert d != tmp_path and (d / llama_cpp_side.BENCH_TOOL).read_text() == "#!/bin/sh\n"
    assert sorted(p.name for p in d.glob("libggml-cpu-*")) == ["libggml-cpu-haswell.so"]
    assert os.readlink(d / "libggml-base.so.0") == "libggml-base.so.0.25.3"
    assert (d / "libggml-base.so.0").read_bytes()[:4] == b"\x7fELF"
    assert llama_cpp_side.cpu_variant_bin(str(tmp_path), "haswell") == str(d)  # made once
